"""Every error a user can fix is one line on stderr and a non-zero exit, naming the value and
the fix; no traceback. Runs the real command line in a child process, as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import uccl_ep_megatron


def cli(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_EP_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-P", "-m", "uccl_ep_megatron.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=120,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """The child failed with exactly one line on stderr containing every needle."""
    err = proc.stderr.strip()
    assert proc.returncode != 0, (proc.returncode, proc.stdout, err)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def _metrics(run, *records, raw: bytes | None = None):
    run.mkdir(parents=True, exist_ok=True)
    path = run / "metrics.jsonl"
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


# ---- report (items 7, 9, 10) ---------------------------------------------------------------
def test_report_on_a_binary_metrics_file(tmp_path):
    run = _metrics(tmp_path / "run", raw=bytes(range(256)) * 4)
    assert_one_line_error(cli("report", str(run)), "metrics.jsonl is not a text file")


def test_report_on_a_record_without_step(tmp_path):
    run = _metrics(tmp_path / "run", {"step": 1, "loss": 1.0}, {"loss": 0.5})
    assert_one_line_error(cli("report", str(run)), "record 2 has step=None", '"step"')


def test_report_out_naming_an_existing_file(tmp_path):
    run = _metrics(tmp_path / "run", {"step": 1, "loss": 1.0})
    out = tmp_path / "taken"
    out.write_text("x")
    assert_one_line_error(cli("report", str(run), "--out", str(out)), f"--out {out} is a file")


def test_report_on_an_empty_metrics_file(tmp_path):
    run = _metrics(tmp_path / "run")
    assert_one_line_error(cli("report", str(run)), "holds no records")


def test_report_on_a_loss_that_is_not_a_number(tmp_path):
    run = _metrics(tmp_path / "run", {"step": 1, "loss": "abc"})
    assert_one_line_error(cli("report", str(run)), "loss='abc' is not a number")


@pytest.mark.parametrize("value", ["-5", "-1"])
def test_report_warmup_steps_must_not_be_negative(tmp_path, value):
    run = _metrics(tmp_path / "run", *({"step": s, "loss": 1.0} for s in range(1, 8)))
    assert_one_line_error(
        cli("report", str(run), "--warmup-steps", value), f"--warmup-steps {value}"
    )


def test_report_shows_a_loss_that_went_nan():
    """A loss that went NaN (logged as null) is the final loss, with a warning: never the last
    finite value; all-NaN losses are reported, not dropped."""
    pytest.importorskip("matplotlib")
    from pathlib import Path
    from tempfile import TemporaryDirectory

    from uccl_ep_megatron.telemetry.report import comparison_table, summarize

    with TemporaryDirectory() as tmp:
        late = _metrics(
            Path(tmp) / "late",
            *({"step": s, "loss": 1.0 / s, "tokens_per_s": 10.0} for s in range(1, 6)),
            {"step": 6, "loss": None, "tokens_per_s": 10.0},
            {"step": 7, "loss": None, "tokens_per_s": 10.0},
        )
        never = _metrics(
            Path(tmp) / "never",
            *({"step": s, "loss": None, "tokens_per_s": 9.0} for s in (1, 2, 3)),
        )
        table = comparison_table([late, never], warmup_steps=0)
    row = next(line for line in table.splitlines() if line.startswith("| final loss"))
    assert row.split("|")[2].strip() == "nan" and row.split("|")[3].strip() == "nan", row
    assert "late: the loss is NaN or infinite at 2 of 7 steps (first at step 6)" in table
    assert "never: the loss is NaN or infinite at 3 of 3 steps (first at step 1)" in table
    assert "the loss plot is empty" in table
    assert summarize([{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}])["loss"] != 2.0


# ---- doctor ---------------------------------------------------------------------------------
def test_doctor_json_into_a_missing_directory(tmp_path):
    target = tmp_path / "nope" / "doctor.json"
    assert_one_line_error(
        cli("doctor", "--json", str(target)), f"--json {target}", "does not exist"
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("UCCL_EP_TIMEOUT_MS", "0"),
        ("UCCL_EP_TIMEOUT_MS", "-1"),
        ("UCCL_EP_BACKEND", "foo"),
        ("UCCL_EP_RANKS_PER_NODE", "-1"),
        ("UCCL_EP_FIFO_CAPACITY", "1000"),
        ("UCCL_EP_LOG_LEVEL", "foo"),
        ("UCCL_EP_TRANSPORT", "foo"),
        ("UCCL_EP_PROXY_ORDERING", "foo"),
        ("UCCL_EP_NUM_PROXY_THREADS", "0"),
        ("UCCL_EP_RECV_ARENA_BYTES", "-1"),
    ],
)
def test_doctor_flags_what_the_library_rejects(name, value):
    proc = cli("doctor", env={name: value})
    assert f"{name}={value!r}  INVALID" in proc.stdout
    assert_one_line_error(proc, "invalid environment", f"{name}={value!r}")


def test_log_level_spelling_is_the_same_for_doctor_and_the_cli():
    proc = cli("--log-level", "WARN", "doctor", env={"UCCL_EP_LOG_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr
    assert "UCCL_EP_LOG_LEVEL=WARN" in proc.stdout
    assert cli("--log-level", "warning", "doctor").returncode == 0
    assert_one_line_error(cli("--log-level", "LOUD", "doctor"), "--log-level", "WARN (or WARNING)")


# ---- train, launch, bench -------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0", "-1"])
def test_train_gpus_must_be_positive(value):
    assert_one_line_error(cli("train", "--gpus", value), f"--gpus {value}: give 1 or more")


def test_train_recipe_file_not_found():
    assert_one_line_error(
        cli("train", "--recipe", "/missing.yaml"), "/missing.yaml: file not found"
    )


def test_train_run_dir_naming_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("")
    assert_one_line_error(
        cli("train", "--run-dir", str(f), "--cpu-smoke"), f"--run-dir {f} is a file"
    )


def test_train_with_an_invalid_timeout_env_names_it_before_spawning():
    line = assert_one_line_error(
        cli("train", "--cpu-smoke", "--iters", "1", env={"UCCL_EP_TIMEOUT_MS": "abc"}),
        "UCCL_EP_TIMEOUT_MS='abc' is not an integer",
    )
    assert line.startswith("uccl-ep-megatron train: error:")


def test_train_timeout_below_a_second_is_reported_as_given(tmp_path):
    proc = cli(
        "train", "--cpu-smoke", "--iters", "1", "--timeout", "0.5", "--run-dir", str(tmp_path / "r")
    )
    assert_one_line_error(proc, "still running after 0.5 s")


def test_launch_container_mount_needs_src_and_dst():
    assert_one_line_error(
        cli("launch", "--dry-run", "--container-mount", "nocolon"),
        "--container-mount",
        "'nocolon' is not SRC:DST",
    )


@pytest.mark.parametrize("bench", ["layer", "fifo", "nvlink"])
def test_bench_without_a_gpu_is_one_line(bench):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert_one_line_error(cli("bench", bench), f"uccl-ep-megatron bench: error: bench {bench}")


@pytest.mark.parametrize("flags", [["--pipeline", "4"], ["--pipeline", "-1", "--sync-free"]])
def test_bench_internode_pipeline_needs_sync_free_pairs(flags):
    assert_one_line_error(
        cli("bench", "internode", *flags), f"--pipeline={flags[1]}", "--sync-free"
    )


def test_bench_internode_names_a_bad_delivery():
    assert_one_line_error(
        cli("bench", "internode", "--delivery", "store,dma"), "--delivery='store,dma'", "store,copy"
    )


# ---- plugin options (item 8) ----------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"metrics": "no"}, "install(metrics='no'): must be True or False"),
        ({"metrics": 1}, "install(metrics=1): must be True or False"),
        ({"deep_ep_compat": "x"}, "install(deep_ep_compat='x'): must be True or False"),
        ({"deep_ep_compat": None}, "install(deep_ep_compat=None): must be True or False"),
    ],
)
def test_plugin_options_take_booleans_only(kwargs, needle):
    from uccl_ep_megatron.core.errors import InvalidInputError
    from uccl_ep_megatron.megatron_plugin import get_options, install, is_installed

    before = (get_options(), is_installed())
    with pytest.raises(InvalidInputError) as exc:
        install(**kwargs)
    assert needle in str(exc.value)
    assert (get_options(), is_installed()) == before


def test_the_package_under_test_is_the_installed_one():
    assert (
        "site-packages" in uccl_ep_megatron.__file__ or "dist-packages" in uccl_ep_megatron.__file__
    )


def test_bench_internode_names_a_negative_kernel_call_count():
    assert_one_line_error(
        cli("bench", "internode", "--kernel-calls", "-3"), "--kernel-calls=-3", "0 (off)"
    )

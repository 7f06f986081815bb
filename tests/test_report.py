"""`uccl-ep-megatron report`: PNG plots and the side-by-side table, from JSONL runs."""

from __future__ import annotations

import json
import struct

import pytest

from uccl_ep_megatron.cli import main
from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.telemetry.metrics import MetricsLogger, expert_load_imbalance, read_jsonl
from uccl_ep_megatron.telemetry.report import comparison_table, summarize

pytest.importorskip("matplotlib")


def _run(tmp_path, name: str, dispatcher: str, tok: float, steps: int = 6):
    run = tmp_path / name
    with MetricsLogger(
        run, {"recipe": "deepseek-v3/proxy", "dispatcher": dispatcher}, use_wandb=False
    ) as m:
        for step in range(1, steps + 1):
            # Warm-up steps are slow; the table must leave them out.
            scale = 0.1 if step <= 2 else 1.0
            m.log(
                step,
                {
                    "loss": 10.0 / step,
                    "tokens_per_s": tok * scale,
                    "tokens_per_s_per_gpu": tok * scale / 2,
                    "tflops_per_gpu": tok * scale * 1e-3,
                    "dispatch_time_ms": 2.0,
                    "combine_time_ms": 3.0,
                },
            )
    return run


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_two_runs(tmp_path, capsys):
    a = _run(tmp_path, "a2a", "alltoall", 1000.0)
    b = _run(tmp_path, "uccl", "uccl_ep", 1500.0)
    out = tmp_path / "rep"
    assert main(["report", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for stem in ("loss", "tokens_per_s", "tflops_per_gpu", "dispatch_combine_time"):
        png = out / f"{stem}.png"
        assert png.stat().st_size > 1000
        w, h = _png_size(png)
        assert w > 100 and h > 100
    # Steady-state means skip the 2 warm-up steps: exactly 1000 and 1500, ratio 1.5.
    assert "| tokens/s | 1000.0 | 1500.0 | 1.500 |" in printed
    assert "| final loss | 1.6667 | 1.6667 | 1.000 |" in printed
    assert "alltoall" in printed and "uccl_ep" in printed
    assert (out / "report.md").read_text().strip() == comparison_table([a, b]).strip()


def test_summarize_and_imbalance():
    recs = [
        {"step": 1, "x": 100.0},
        {"step": 2, "x": 1.0},
        {"step": 3, "x": 3.0},
        {"step": 4, "loss": 2.0},
    ]
    s = summarize(recs, warmup_steps=1)
    assert s["x"] == 2.0 and s["loss"] == 2.0
    assert expert_load_imbalance([1, 1, 4, 2]) == 2.0
    assert expert_load_imbalance([0, 0]) == 0.0


def test_bad_run_dir(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(InvalidInputError, match="not a number"):
        with MetricsLogger(tmp_path / "r", {}, use_wandb=False) as m:
            m.log(1, {"loss": "high"})


def test_jsonl_roundtrip_keeps_non_finite_as_null(tmp_path):
    with MetricsLogger(tmp_path, {"k": 1}, use_wandb=False) as m:
        m.log(3, {"loss": float("nan"), "tokens_per_s": 5.0})
    (rec,) = read_jsonl(tmp_path)
    assert rec["step"] == 3 and rec["loss"] is None and rec["tokens_per_s"] == 5.0
    assert json.loads((tmp_path / "config.json").read_text()) == {"k": 1}


def test_megatron_lm_training_log_hook_logs_dispatch_metrics_at_the_iteration(capsys):
    import torch

    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics
    from uccl_ep_megatron.telemetry.megatron_lm import PREFIX, wrap_training_log

    # Megatron-LM's training_log signature (core_r0.13+); the hook finds `iteration` by name.
    calls = []

    def training_log(
        loss_dict,
        total_loss_dict,
        learning_rate,
        decoupled_learning_rate,
        iteration,
        loss_scale,
        report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
    ):
        calls.append(iteration)
        return "report_memory_flag"

    class Writer:  # the wandb module's interface: log(dict, step)
        def __init__(self):
            self.logged = []

        def log(self, values, step):
            self.logged.append((step, values))

    class Board:  # tensorboard SummaryWriter's interface
        def __init__(self):
            self.scalars = []

        def add_scalar(self, key, value, step):
            self.scalars.append((key, value, step))

    rec = dispatch_metrics.DispatchMetricsRecorder()
    rec.enabled = True
    writer, board = Writer(), Board()
    hooked = wrap_training_log(
        training_log, lambda: [writer, board], lambda: rec.collect().summary()
    )
    cpu = torch.device("cpu")
    rec.record(rec.start(cpu), 0, "dispatch", 4_000_000, [30, 10])
    rec.record(rec.start(cpu), 0, "combine", 4_000_000)
    out = hooked({}, {}, 1e-4, None, 7, 1.0, False, 0, 1.0, None, None)
    assert out == "report_memory_flag" and calls == [7]
    ((step, values),) = writer.logged
    assert step == 7
    assert values[PREFIX + "local_expert_load_imbalance"] == pytest.approx(30 / 20)
    assert PREFIX + "expert_load_imbalance" not in values  # the global quantity has that name
    assert values[PREFIX + "dispatch_bytes"] == 4_000_000
    assert values[PREFIX + "dispatch_time_ms"] >= 0
    assert {k for k, _, s in board.scalars if s == 7} == set(values)
    # The last rank (here: no process group) prints the same values as one line for scripts.
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("uccl_ep metrics")]
    assert len(printed) == 1 and printed[0].startswith("uccl_ep metrics | iteration 7 | ")
    fields = dict(f.rsplit(" ", 1) for f in printed[0].split(" | ")[2:])
    assert set(fields) == {k[len(PREFIX) :] for k in values}
    assert float(fields["dispatch_bytes"]) == 4_000_000
    # keyword call, nothing recorded since: nothing logged
    hooked(
        {},
        {},
        1e-4,
        None,
        iteration=8,
        loss_scale=1.0,
        report_memory_flag=False,
        skipped_iter=0,
        grad_norm=1.0,
        params_norm=None,
        num_zeros_in_grad=None,
    )
    assert calls == [7, 8] and len(writer.logged) == 1


def test_megatron_lm_hook_rejects_an_unknown_signature():
    from uccl_ep_megatron.core.errors import UnsupportedError
    from uccl_ep_megatron.telemetry.megatron_lm import wrap_training_log

    with pytest.raises(UnsupportedError, match="no 'iteration' parameter"):
        wrap_training_log(lambda step: None, list, dict)


def test_table_keeps_global_and_local_imbalance_apart(tmp_path):
    # Two different quantities (global experts, mean of layers vs. one rank's experts, worst
    # layer) under two names: the table gives each its own row and never divides one by the
    # other.
    runs = []
    for name, key, value in (
        ("a", "expert_load_imbalance", 1.5),
        ("b", "local_expert_load_imbalance", 3.0),
    ):
        d = tmp_path / name
        with MetricsLogger(d, {"dispatcher": name}, use_wandb=False) as log:
            for step in range(1, 5):
                log.log(step, {key: value, "tokens_per_s": 100.0})
        runs.append(d)
    table = comparison_table(runs, warmup_steps=0)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    glob = rows["expert load max/mean (global, mean of layers)"]
    local = rows["expert load max/mean (local, worst layer)"]
    assert glob.endswith("| 1.500 | - | - |"), glob
    assert local.endswith("| - | 3.000 | - |"), local


def test_report_reads_a_run_killed_mid_write(tmp_path, caplog):
    run = tmp_path / "killed"
    with MetricsLogger(run, {"dispatcher": "uccl_ep"}, use_wandb=False) as log:
        for step in range(1, 4):
            log.log(step, {"loss": 5.0 - step, "tokens_per_s": 100.0})
    path = run / "metrics.jsonl"
    text = path.read_text()
    path.write_text(text + '{"step": 4, "loss": 1.2, "tokens_p')  # the write the kill cut short
    assert [r["step"] for r in read_jsonl(run)] == [1, 2, 3]
    assert "cut short" in caplog.text
    assert "| final loss | 2.0000 |" in comparison_table([run], warmup_steps=0)
    # Damage before the last line is not a killed run: say where it is.
    path.write_text('{"step": 1}\n{"step": \n' + text)
    with pytest.raises(InvalidInputError, match="line 2 is not a JSON object"):
        read_jsonl(run)

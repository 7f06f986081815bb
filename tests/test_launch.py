"""`uccl-ep-megatron launch`: rendered jobs carry the exact env, torchrun args and sizes."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess

import pytest

from uccl_ep_megatron.cli import main
from uccl_ep_megatron.cluster.launch import nic_presets, plan_launch, render
from uccl_ep_megatron.training.recipes import load_recipe


def _dry_run(capsys, *args: str) -> str:
    assert main(["launch", *args, "--dry-run"]) == 0
    return capsys.readouterr().out


def _check_shell(tmp_path, text: str) -> None:
    path = tmp_path / "job.sh"
    path.write_text(text)
    subprocess.run(["bash", "-n", str(path)], check=True)
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        if os.environ.get("CI"):
            pytest.fail("shellcheck is not installed: apt-get install -y shellcheck")
        pytest.skip("shellcheck not installed")
    proc = subprocess.run([shellcheck, str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _exports(text: str) -> dict[str, str]:
    """NAME -> default value of every `export NAME="${NAME:-value}"` line."""
    out = {}
    for line in text.splitlines():
        if line.startswith("export ") and ":-" in line and line.count("${") == 1:
            name = line.split("=", 1)[0][len("export ") :]
            out[name] = line.split(":-", 1)[1].rsplit("}", 1)[0]
    return out


def _torchrun_block(text: str) -> str:
    start = text.index("torchrun \\\n")  # the command, not the comment above it
    return text[start:]


@pytest.mark.parametrize(
    "recipe, nodes, preset, env",
    [
        (
            "deepseek-v3/h200-efa",
            32,
            "efa",
            {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_MAX_NCHANNELS": "8"},
        ),
        (
            "deepseek-v3/mi300x-thor2",
            16,
            "thor2",
            {
                "UCCL_IB_MAX_INFLIGHT_BYTES": "1572864",
                "UCCL_IB_MAX_INFLIGHT_NORMAL": "1",
                "NCCL_IB_HCA": "bnxt_re",
                "NCCL_IB_GID_INDEX": "3",
                "RCCL_MSCCL_ENABLE": "0",
            },
        ),
        ("deepseek-v3/h100-cx7", 64, "cx7-ib", {"NCCL_IB_HCA": "mlx5"}),
        ("deepseek-v3/h200-cx7", 32, "cx7-ib", {"NCCL_IB_HCA": "mlx5"}),
    ],
)
def test_platform_dry_run(capsys, tmp_path, recipe, nodes, preset, env):
    text = _dry_run(capsys, "--recipe", recipe)
    _check_shell(tmp_path, text)
    assert f"#SBATCH --nodes={nodes}\n" in text
    assert "#SBATCH --gpus-per-node=8\n" in text
    exports = _exports(text)
    for key, value in env.items():
        assert exports[key] == value, key
    assert exports["UCCL_EP_TRANSPORT"] == "verbs"
    # UCCL-EP's own names default to the NCCL values the cluster already sets.
    assert 'UCCL_IB_GID_INDEX="${UCCL_IB_GID_INDEX:-${NCCL_IB_GID_INDEX}}"' in text
    assert "UCCL_SOCKET_IFNAME" not in text  # nothing reads it: the bootstrap is torch.distributed
    words = shlex.split(_torchrun_block(text).replace("\\\n", " "), comments=False)
    assert words[:6] == [
        "torchrun",
        f"--nnodes={nodes}",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT}",
        "--rdzv-id=${SLURM_JOB_ID}",
    ]
    assert words[6:13] == [
        "-m",
        "uccl_ep_megatron.cli",
        "train",
        "--recipe",
        recipe,
        "--dispatcher",
        "uccl_ep",
    ]
    assert 'MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)"' in text


def test_every_preset_renders_clean_shell(tmp_path):
    recipe = load_recipe("deepseek-v3/proxy")
    for name in nic_presets():
        plan = plan_launch(recipe, nic_preset=name, scheduler="none", gpus_per_node=2)
        _check_shell(tmp_path, render(plan))
        plan = plan_launch(recipe, nic_preset=name, gpus_per_node=8)
        _check_shell(tmp_path, render(plan))


def test_megatron_target_runs_pretrain_gpt_through_the_plugin_runner(capsys, tmp_path):
    text = _dry_run(
        capsys,
        "--recipe",
        "deepseek-v3/h200-efa",
        "--target",
        "megatron",
        "--megatron-path",
        "/opt/Megatron-LM",
        "--nodes",
        "64",
        "--dispatcher",
        "alltoall",
    )
    _check_shell(tmp_path, text)
    assert "#SBATCH --nodes=64\n" in text
    assert '-m uccl_ep_megatron.run /opt/Megatron-LM/pretrain_gpt.py "${MEGATRON_ARGS[@]}"' in text
    array = text[text.index("MEGATRON_ARGS=(") : text.index("\n)\n")]
    assert "  --moe-token-dispatcher-type alltoall\n" in array
    assert "  --expert-model-parallel-size 16\n" in array
    assert "  --pipeline-model-parallel-size 16\n" in array
    assert "  --mock-data" in array and "  --num-layers 61\n" in array


def test_primus_target_with_docker(capsys, tmp_path):
    text = _dry_run(
        capsys,
        "--recipe",
        "deepseek-v3/mi300x-thor2",
        "--target",
        "primus",
        "--primus-path",
        "/opt/Primus",
        "--primus-config",
        "exp.yaml",
        "--container",
        "docker",
        "--container-image",
        "rocm/primus:latest",
        "--container-mount",
        "/data:/data",
    )
    _check_shell(tmp_path, text)
    assert "/opt/Primus/primus/cli/main.py train pretrain --config exp.yaml" in text
    assert "  --moe_token_dispatcher_type uccl_ep\n" in text
    assert "  --num_layers 32\n" in text
    assert "--device=/dev/kfd" in text and "--gpus=all" not in text  # MI300X: ROCm devices
    assert "--env=UCCL_IB_MAX_INFLIGHT_BYTES" in text and "rocm/primus:latest" in text


def test_pyxis_and_sbatch_options(capsys, tmp_path):
    text = _dry_run(
        capsys,
        "--recipe",
        "deepseek-v3/h100-cx7",
        "--container",
        "pyxis",
        "--container-image",
        "nvcr.io/nvidia/pytorch:25.01-py3",
        "--partition",
        "gpu",
        "--time",
        "02:00:00",
        "--env",
        "NCCL_DEBUG=INFO",
        "--set",
        "training.train_iters=5",
    )
    _check_shell(tmp_path, text)
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3" in text
    assert "#SBATCH --partition=gpu\n" in text and "#SBATCH --time=02:00:00\n" in text
    assert _exports(text)["NCCL_DEBUG"] == "INFO"
    assert "--set training.train_iters=5" in text


def test_scheduler_none_node_script(capsys, tmp_path):
    text = _dry_run(
        capsys, "--recipe", "deepseek-v3/proxy", "--scheduler", "none", "--gpus-per-node", "2"
    )
    _check_shell(tmp_path, text)
    words = shlex.split(_torchrun_block(text).replace("\\\n", " "))
    assert words[:6] == [
        "torchrun",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--node-rank=${NODE_RANK}",
        "--master-addr=${MASTER_ADDR}",
        "--master-port=${MASTER_PORT}",
    ]


def test_write_without_dry_run(tmp_path, capsys):
    assert main(["launch", "--recipe", "deepseek-v3/h200-efa", "--output-dir", str(tmp_path)]) == 0
    script = tmp_path / "job.sbatch"
    assert script.is_file() and os.access(script, os.X_OK)
    assert "sbatch" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "deepseek-v3/nope"], "unknown recipe"),
        (["--recipe", "deepseek-v3/h200-efa", "--nodes", "3"], "not divisible by"),
        (["--recipe", "deepseek-v3/h200-efa", "--nic-preset", "ethernet"], "unknown NIC preset"),
        (["--recipe", "deepseek-v3/h200-efa", "--target", "megatron"], "--megatron-path"),
        (["--recipe", "deepseek-v3/mi300x-thor2", "--target", "primus"], "--primus-config"),
        (["--recipe", "deepseek-v3/h200-efa", "--container", "docker"], "needs an image"),
        (
            [
                "--recipe",
                "deepseek-v3/h200-efa",
                "--set",
                "parallelism.expert_model_parallel_size=7",
            ],
            "does not divide num_experts 256",
        ),
    ],
)
def test_bad_launch_input_fails_before_rendering(capsys, args, message):
    assert main(["launch", *args, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert message in captured.err


def test_submit_without_sbatch_is_a_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "launch",
                "--recipe",
                "deepseek-v3/h200-efa",
                "--submit",
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "sbatch is not on PATH" in capsys.readouterr().err


def test_rendered_node_script_runs_the_train_job(tmp_path):
    """The script launch writes really starts torchrun and the train job (here: its CPU smoke)."""
    import socket
    import sys

    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    run_dir = tmp_path / "run"
    plan = plan_launch(
        load_recipe("deepseek-v3/proxy"),
        scheduler="none",
        gpus_per_node=1,
        run_dir=str(run_dir),
    )
    script = tmp_path / "node.sh"
    script.write_text(render(plan))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NODE_RANK="0",
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
        WANDB_MODE="disabled",
    )
    proc = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "training the recipe needs a GPU" in proc.stdout
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 12


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--time", "04:00:00\n#SBATCH --wrap=rm -rf ~"),
        ("--time", "4 hours"),
        ("--time", "$(reboot)"),
        ("--partition", 'gpu"; reboot; echo "'),
        ("--partition", "gpu batch"),
        ("--account", "team\n"),
    ],
)
def test_sbatch_values_are_checked_before_they_reach_the_script(capsys, flag, value):
    # These land in `#SBATCH --key=value` lines verbatim: a newline or shell text would change
    # the job script.
    assert main(["launch", "--recipe", "deepseek-v3/h200-efa", flag, value, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{flag}={value!r} must be" in err


@pytest.mark.parametrize("value", ["30", "04:00:00", "2-12", "1-00:30:00", "UNLIMITED"])
def test_sbatch_time_forms_slurm_accepts(capsys, value):
    text = _dry_run(
        capsys, "--recipe", "deepseek-v3/h200-efa", "--time", value, "--partition", "gpu,hpc"
    )
    assert f"#SBATCH --time={value}\n" in text and "#SBATCH --partition=gpu,hpc\n" in text

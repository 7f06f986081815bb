"""``uccl-ep-megatron train``: the built-in pretraining job, and its CPU fallback.

With GPUs: pretraining of the recipe's model on megatron-core (``training.gpu``), synthetic data
by default or a Megatron indexed dataset (``--data-path PREFIX`` of ``PREFIX.bin/.idx``), the
``uccl_ep`` dispatcher (or ``--dispatcher alltoall``), checkpoints through Megatron's
distributed checkpointing, metrics to JSONL and wandb, a progress bar and a closing table
(tokens/s, TFLOP/s per GPU, MFU, loss). When started outside torchrun it relaunches itself with
``torch.distributed.run`` on all local GPUs (``--gpus``); ``--compare`` then runs the same job
again on ``alltoall`` and/or ``flex`` (DeepEP, where it imports) and prints all side by side.

Without a GPU: Megatron-Core's MoE layer cannot run (it needs CUDA), so the job says so and
runs the CPU smoke (``training.cpu``): the recipe's MoE routing through this package's ``Buffer``
on the ``reference`` backend in 2 gloo processes, with the same metrics.

Every input is validated before anything starts: recipe, overrides, dataset files, world size.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.proxy.loading import eager_loading_env
from uccl_ep_megatron.training.results import default_run_dir, print_results, results_table

log = logging.getLogger(__name__)

DISPATCHERS = ("uccl_ep", "alltoall", "flex")
#: What ``--compare`` runs the job again on (``flex`` = megatron-core's flex dispatcher on DeepEP).
BASELINES = ("alltoall", "flex")
NO_GPU_MESSAGE = (
    "No GPU found: training the recipe needs a GPU (megatron-core's MoE layer runs on CUDA). "
    "Running the CPU smoke instead: the recipe's MoE routing through uccl_ep_megatron.Buffer "
    "(reference backend) in 2 gloo processes, with scaled-down widths."
)


@dataclass
class TrainOptions:
    """What ``train`` was asked to do (the CLI flags, validated)."""

    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    dispatcher: str | None = None
    iters: int | None = None
    data_path: str | None = None
    run_dir: str | None = None
    checkpoint_dir: str | None = None
    save_interval: int | None = None
    resume: bool = True
    wandb_project: str | None = None
    use_wandb: bool = True
    gpus: int | None = None
    cpu_smoke: bool = False
    timeout_s: float = 300.0
    compare: tuple[str, ...] = ()
    peak_tflops: float | None = None


def check_data_path(prefix: str | None) -> None:
    """A Megatron indexed dataset is a ``PREFIX.bin`` + ``PREFIX.idx`` pair; both must exist.

    Raises:
        InvalidInputError: naming the missing file.
    """
    if prefix is None:
        return
    for suffix in (".bin", ".idx"):
        path = Path(prefix + suffix)
        if not path.is_file():
            raise InvalidInputError(
                f"--data-path {prefix!r}: {path} does not exist. Pass the prefix of a Megatron "
                "indexed dataset (PREFIX.bin and PREFIX.idx, as written by Megatron-LM's "
                "tools/preprocess_data.py), or leave --data-path out for synthetic data."
            )


def load(opts: TrainOptions):
    """The validated recipe with ``--set`` overrides and ``--iters`` applied."""
    from uccl_ep_megatron.training.recipes import load_recipe, parse_override

    if opts.dispatcher is not None and opts.dispatcher not in DISPATCHERS:
        raise InvalidInputError(f"--dispatcher {opts.dispatcher!r}: use one of {list(DISPATCHERS)}")
    overrides: dict[str, dict[str, Any]] = {}
    for text in opts.overrides:
        for section, values in parse_override(text).items():
            overrides.setdefault(section, {}).update(values)
    if opts.iters is not None:
        if opts.iters < 1:
            raise InvalidInputError(f"--iters {opts.iters}: must be >= 1")
        overrides.setdefault("training", {})["train_iters"] = opts.iters
    if opts.save_interval is not None:
        overrides.setdefault("training", {})["save_interval"] = opts.save_interval
    return load_recipe(opts.recipe, overrides)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _relaunch_args(opts: TrainOptions, run_dir: Path) -> list[str]:
    args = ["-m", "uccl_ep_megatron.cli", "train", "--run-dir", str(run_dir)]
    for flag, value in (
        ("--recipe", opts.recipe),
        ("--dispatcher", opts.dispatcher),
        ("--iters", opts.iters),
        ("--data-path", opts.data_path),
        ("--checkpoint-dir", opts.checkpoint_dir),
        ("--save-interval", opts.save_interval),
        ("--wandb-project", opts.wandb_project),
        ("--peak-tflops", opts.peak_tflops),
    ):
        if value is not None:
            args += [flag, str(value)]
    for text in opts.overrides:
        args += ["--set", text]
    if not opts.resume:
        args.append("--no-resume")
    if not opts.use_wandb:
        args.append("--no-wandb")
    return args


def run(opts: TrainOptions) -> int:
    """Run ``train`` as described in the module docstring; returns the exit code."""
    gpus = 0 if opts.cpu_smoke else _cuda_devices()
    if opts.recipe is None and gpus:
        from uccl_ep_megatron.training.recipes import (
            DEFAULT_RECIPE,
            DEFAULT_RECIPE_MIN_GPUS,
            default_recipe,
        )

        # The ranks of this job (under torchrun: its world), not only the GPUs present.
        ranks = int(os.environ["WORLD_SIZE"]) if "LOCAL_RANK" in os.environ else opts.gpus
        ranks = min(ranks or gpus, gpus)
        name = default_recipe(ranks)
        if name != DEFAULT_RECIPE and "LOCAL_RANK" not in os.environ:
            log.warning(
                "%s needs %d GPUs of 80 GB; on %d GPU(s) the default is %s (--recipe chooses)",
                DEFAULT_RECIPE,
                DEFAULT_RECIPE_MIN_GPUS,
                ranks,
                name,
            )
        opts = dataclasses.replace(opts, recipe=name)
    recipe = load(opts)
    check_data_path(opts.data_path)
    dispatcher = opts.dispatcher or recipe.dispatcher["type"]
    if dispatcher not in DISPATCHERS:
        raise InvalidInputError(
            f"recipe {recipe.name!r} asks for dispatcher {dispatcher!r}; the built-in train job "
            f"runs {list(DISPATCHERS)} (pass --dispatcher)"
        )
    if opts.peak_tflops is not None and not opts.peak_tflops > 0:
        raise InvalidInputError(f"--peak-tflops {opts.peak_tflops}: must be > 0")
    baselines = parse_compare(opts.compare, dispatcher)
    if gpus == 0:
        return _run_cpu(recipe, opts)
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        raise UnsupportedError(
            f"{gpus} GPU(s) found, but training needs megatron-core, which is not installed: "
            "pip install 'uccl-ep-megatron[megatron]' (or --cpu-smoke for the CPU run)"
        )
    if "LOCAL_RANK" not in os.environ:
        # Not under torchrun: start one process per local GPU, with one shared run directory.
        nproc = opts.gpus or gpus
        if nproc > gpus:
            raise InvalidInputError(f"--gpus {nproc}: this machine has {gpus} GPU(s)")
        recipe.resolved_parallelism(nproc)
        return _launch(recipe, opts, dispatcher, _runnable(baselines), nproc)
    if opts.compare:
        raise InvalidInputError(
            "--compare starts its own torchrun jobs: run it outside torchrun (or launch the "
            "two dispatchers yourself with --dispatcher)"
        )
    from uccl_ep_megatron.training.gpu.loop import train_megatron

    return train_megatron(recipe, opts, dispatcher)


def parse_compare(compare: tuple[str, ...] | str | None, dispatcher: str) -> tuple[str, ...]:
    """The baselines ``--compare`` asks for (``"alltoall,flex"`` or a tuple), validated."""
    if not compare:
        return ()
    names = compare.split(",") if isinstance(compare, str) else list(compare)
    names = [n.strip() for n in names if n.strip()]
    bad = [n for n in names if n not in BASELINES]
    if bad or not names:
        raise InvalidInputError(
            f"--compare {','.join(names) or compare!r}: compare with one or more of "
            f"{', '.join(BASELINES)} (comma-separated)"
        )
    if dispatcher in names:
        raise InvalidInputError(
            f"--compare {','.join(names)} includes the dispatcher of the run itself "
            f"({dispatcher}); drop it from --compare or pass another --dispatcher"
        )
    return tuple(dict.fromkeys(names))


def _runnable(baselines: tuple[str, ...]) -> tuple[str, ...]:
    """The baselines that can run here; a skipped one is said out loud."""
    from uccl_ep_megatron.training.gpu.loop import check_flex_available

    keep = []
    for name in baselines:
        if name == "flex":
            try:
                check_flex_available()
            except UnsupportedError as exc:
                print(f"--compare: skipping flex: {exc}", flush=True)
                continue
        keep.append(name)
    return tuple(keep)


def _rank_env(recipe, dispatcher: str, nproc: int) -> dict[str, str]:
    """What the ranks' environment needs besides ours: eager CUDA module loading where
    ``uccl_ep`` may run the ipc transport (virtual nodes; ``proxy/loading.py`` says why)."""
    if dispatcher != "uccl_ep":
        return {}
    transport = recipe.dispatcher.get("transport")
    return eager_loading_env(os.environ, nproc, None if transport == "auto" else transport)


def _launch(recipe, opts: TrainOptions, dispatcher: str, baselines, nproc: int) -> int:
    """One torchrun job per dispatcher (the run, then each baseline), then the table."""
    started = time.perf_counter()
    runs = [(dispatcher, opts.run_dir)]
    if opts.compare:
        base = Path(opts.run_dir or default_run_dir(recipe.name, "compare", "gpu"))
        runs = [(d, str(base / d)) for d in (dispatcher, *baselines)]
    run_dirs = []
    for run_dispatcher, run_dir_text in runs:
        run_dir = Path(run_dir_text or default_run_dir(recipe.name, run_dispatcher, "gpu"))
        run_opts = dataclasses.replace(opts, dispatcher=run_dispatcher, compare=())
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            *_relaunch_args(run_opts, run_dir),
        ]
        log.info("launching %s", " ".join(cmd))
        rc = subprocess.call(cmd, env={**os.environ, **_rank_env(recipe, run_dispatcher, nproc)})
        if rc != 0:
            return rc
        run_dirs.append(run_dir)
    if opts.compare:
        print_results(run_dirs)
    print(f"train finished in {time.perf_counter() - started:.1f} s (from the torchrun launch)")
    return 0


def _run_cpu(recipe, opts: TrainOptions) -> int:
    from uccl_ep_megatron.telemetry.flops import param_counts, training_flops_per_token
    from uccl_ep_megatron.telemetry.metrics import read_jsonl
    from uccl_ep_megatron.training.cpu import run_cpu_smoke

    print(NO_GPU_MESSAGE, flush=True)
    if opts.dispatcher == "alltoall" or opts.compare:
        print("(alltoall needs megatron-core's MoE layer on a GPU: the CPU smoke runs Buffer)")
    counts = param_counts(recipe.model)
    run_dir = Path(opts.run_dir or default_run_dir(recipe.name, "uccl_ep", "cpu-smoke"))
    steps = opts.iters if opts.iters is not None else 12
    run_cpu_smoke(
        recipe,
        run_dir,
        steps=steps,
        wandb_project=opts.wandb_project,
        use_wandb=opts.use_wandb,
        timeout_s=opts.timeout_s,
        extra_config={
            "recipe_params_total": counts.total,
            "recipe_params_active": counts.active,
            "recipe_training_flops_per_token": training_flops_per_token(recipe.model),
        },
    )
    records = read_jsonl(run_dir)
    last = records[-1]
    print(
        f"CPU smoke of {recipe.name}: {len(records)} steps, loss {records[0]['loss']:.4f} -> "
        f"{last['loss']:.4f}, {last['tokens_per_s']:.0f} tokens/s, dispatch "
        f"{last['dispatch_time_ms']:.2f} ms, combine {last['combine_time_ms']:.2f} ms, expert "
        f"load max/mean {last['expert_load_imbalance']:.2f}"
    )
    print(
        f"Recipe model: {counts.total / 1e9:.2f}B parameters ({counts.active / 1e9:.2f}B active, "
        f"MTP {counts.mtp_params / 1e9:.2f}B). Metrics: {run_dir / 'metrics.jsonl'}"
    )
    print("Training itself needs a GPU: run this command on a machine with CUDA GPUs.")
    return 0


__all__ = [
    "BASELINES",
    "DISPATCHERS",
    "NO_GPU_MESSAGE",
    "TrainOptions",
    "check_data_path",
    "load",
    "parse_compare",
    "print_results",
    "results_table",
    "run",
]

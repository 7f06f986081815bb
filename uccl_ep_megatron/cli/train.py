"""``uccl-ep-megatron train``: the built-in pretraining job (CPU smoke without a GPU)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from uccl_ep_megatron.core.errors import InvalidInputError


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type of --timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive, finite number of seconds")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="pretrain a recipe on megatron-core with the uccl_ep dispatcher",
        description=(
            "Pretrain the recipe's model on megatron-core (synthetic data unless --data-path) "
            "on all local GPUs, or under torchrun on the ranks it starts. Without a GPU, runs "
            "the CPU smoke: the recipe's MoE routing through uccl_ep_megatron.Buffer "
            "(reference backend) in 2 gloo processes."
        ),
    )
    p.add_argument("--recipe", help="recipe name or YAML path (default: deepseek-v3/quick)")
    p.add_argument("--list-recipes", action="store_true", help="list recipes and exit")
    p.add_argument(
        "--dispatcher",
        choices=["uccl_ep", "alltoall", "flex"],
        help="MoE token dispatcher (default: the recipe's, uccl_ep; flex = megatron-core's flex "
        "dispatcher on DeepEP)",
    )
    p.add_argument("--iters", type=int, help="training iterations (default: the recipe's)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe value, e.g. training.micro_batch_size=1 (repeatable)",
    )
    p.add_argument("--data-path", help="Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    p.add_argument("--run-dir", help="run directory (default: runs/<recipe>-<dispatcher>-...)")
    p.add_argument("--checkpoint-dir", help="checkpoint directory (default: RUN_DIR/checkpoints)")
    p.add_argument("--save-interval", type=int, help="iterations between checkpoints")
    p.add_argument(
        "--no-resume", dest="resume", action="store_false", help="ignore existing checkpoints"
    )
    p.add_argument("--wandb-project", help="wandb project (turns wandb online)")
    p.add_argument("--no-wandb", dest="use_wandb", action="store_false", help="JSONL only")
    p.add_argument("--gpus", type=int, help="local GPUs to use (default: all)")
    p.add_argument(
        "--cpu-smoke", action="store_true", help="run the CPU smoke even when GPUs are present"
    )
    p.add_argument(
        "--compare",
        nargs="?",
        const="alltoall",
        default=None,
        metavar="alltoall|flex|alltoall,flex",
        help="after the run, the same run on these dispatchers (default alltoall; flex needs "
        "DeepEP), all side by side (GPUs)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        help="the GPU's dense BF16 peak TFLOP/s for MFU (default: known GPUs' datasheet value)",
    )
    p.add_argument(
        "--timeout",
        dest="timeout_s",
        type=_seconds,
        default=300.0,
        help="seconds the CPU smoke may take before its ranks are reported stalled (default 300)",
    )
    p.set_defaults(func=handle)


def _list_recipes() -> int:
    from uccl_ep_megatron.telemetry.flops import param_counts
    from uccl_ep_megatron.training.recipes import DEFAULT_RECIPE, list_recipes, load_recipe

    print(f"{'recipe':<28} {'params':>9} {'active':>8} {'GPUs':>5}  description")
    for name in list_recipes():
        r = load_recipe(name)
        c = param_counts(r.model)
        mark = " (default)" if name == DEFAULT_RECIPE else ""
        print(
            f"{name:<28} {c.total / 1e9:>8.2f}B {c.active / 1e9:>7.2f}B {r.world_size():>5}  "
            f"{r.description}{mark}"
        )
    return 0


def check_args(args: argparse.Namespace) -> None:
    """What can be checked before anything starts (and before ranks are spawned, whose
    tracebacks would bury the reason)."""
    from uccl_ep_megatron.core.config import effective_env

    effective_env()  # a UCCL_EP_* value the library rejects, named once here
    if args.gpus is not None and args.gpus < 1:
        raise InvalidInputError(f"--gpus {args.gpus}: give 1 or more (default: every local GPU)")
    recipe = args.recipe
    if recipe and recipe.endswith((".yaml", ".yml")) and not Path(recipe).is_file():
        raise InvalidInputError(
            f"--recipe {recipe}: file not found; pass an existing YAML file or a recipe name "
            "(uccl-ep-megatron train --list-recipes)"
        )
    for flag, value in (("--run-dir", args.run_dir), ("--checkpoint-dir", args.checkpoint_dir)):
        if value and Path(value).exists() and not Path(value).is_dir():
            raise InvalidInputError(f"{flag} {value} is a file; give a directory")


def handle(args: argparse.Namespace) -> int:
    from uccl_ep_megatron.training.job import TrainOptions, run

    if args.list_recipes:
        return _list_recipes()
    check_args(args)
    opts = TrainOptions(
        recipe=args.recipe,
        overrides=args.overrides,
        dispatcher=args.dispatcher,
        iters=args.iters,
        data_path=args.data_path,
        run_dir=args.run_dir,
        checkpoint_dir=args.checkpoint_dir,
        save_interval=args.save_interval,
        resume=args.resume,
        wandb_project=args.wandb_project,
        use_wandb=args.use_wandb,
        gpus=args.gpus,
        cpu_smoke=args.cpu_smoke,
        timeout_s=args.timeout_s,
        compare=args.compare,
        peak_tflops=args.peak_tflops,
    )
    return run(opts)

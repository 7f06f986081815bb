"""``uccl-ep-megatron launch``: render and optionally submit a multi-node job for a recipe."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from uccl_ep_megatron.cli.app import positive_int
from uccl_ep_megatron.core.errors import InvalidInputError


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} must look like NAME=VALUE")
    key, value = text.split("=", 1)
    return key, value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch",
        help="render (and submit) a slurm/torchrun job for a recipe",
        description=(
            "Render the sbatch script (or, with --scheduler none, a per-node script) that runs "
            "a recipe on N nodes with its NIC environment preset. --dry-run prints the script; "
            "--submit writes it and runs sbatch; neither writes it to --output-dir."
        ),
    )
    p.add_argument("--recipe", required=True, help="recipe name (see `train --list-recipes`)")
    p.add_argument("--nodes", type=positive_int, help="number of nodes (default: the recipe's)")
    p.add_argument(
        "--gpus-per-node", type=positive_int, help="GPUs per node (default: the recipe's)"
    )
    p.add_argument(
        "--target",
        choices=["train", "megatron", "primus"],
        default="train",
        help="what torchrun starts: the built-in train job, Megatron-LM pretrain_gpt.py or "
        "Primus (default: train)",
    )
    p.add_argument("--scheduler", choices=["slurm", "none"], default="slurm")
    p.add_argument("--nic-preset", help="override the recipe's cluster.nic_preset")
    p.add_argument(
        "--dispatcher",
        choices=["uccl_ep", "alltoall", "flex"],
        help="token dispatcher (default: the recipe's)",
    )
    p.add_argument("--data-path", help="Megatron indexed dataset prefix (default: synthetic data)")
    p.add_argument("--checkpoint-dir", help="--save/--load directory (megatron/primus targets)")
    p.add_argument("--megatron-path", help="Megatron-LM checkout (megatron target; Primus backend)")
    p.add_argument("--primus-path", help="Primus checkout (primus target)")
    p.add_argument("--primus-config", help="Primus experiment YAML (primus target)")
    p.add_argument("--run-dir", help="run directory of the train target")
    p.add_argument("--wandb-project", help="wandb project (turns wandb online)")
    p.add_argument("--container", choices=["pyxis", "docker"], help="run inside a container")
    p.add_argument(
        "--container-image", help="image (default: the recipe's cluster.container_image)"
    )
    p.add_argument(
        "--container-mount",
        action="append",
        type=_mount,
        default=[],
        help="SRC:DST mount (repeatable)",
    )
    p.add_argument("--partition", help="#SBATCH --partition")
    p.add_argument("--account", help="#SBATCH --account")
    p.add_argument("--time", help="#SBATCH --time (e.g. 04:00:00)")
    p.add_argument(
        "--env",
        action="append",
        type=_key_value,
        default=[],
        help="NAME=VALUE to export (repeatable)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe value, e.g. training.train_iters=100 (repeatable)",
    )
    p.add_argument("--log-dir", default="logs", help="slurm output directory (default: logs)")
    p.add_argument("--output-dir", default=".", help="where the script is written (default: .)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the script, write nothing")
    mode.add_argument("--submit", action="store_true", help="write the script and run sbatch")
    p.set_defaults(func=handle)


def _mount(text: str) -> str:
    """argparse type of --container-mount: SRC:DST[:FLAGS] with both paths given."""
    parts = text.split(":")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not SRC:DST; give the host path and the container path, e.g. /data:/data"
        )
    return text


def handle(args: argparse.Namespace) -> int:
    from uccl_ep_megatron.cluster import launch
    from uccl_ep_megatron.training import recipes

    overrides: dict = {}
    for text in args.set:
        for section, values in recipes.parse_override(text).items():
            overrides.setdefault(section, {}).update(values)
    recipe = recipes.load_recipe(args.recipe, overrides)
    sbatch_options = {
        k: v
        for k, v in (("partition", args.partition), ("account", args.account), ("time", args.time))
        if v
    }
    if args.submit and args.scheduler != "slurm":
        raise InvalidInputError(
            "--submit needs --scheduler slurm; run node.sh on each node instead"
        )
    plan = launch.plan_launch(
        recipe,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        target=args.target,
        scheduler=args.scheduler,
        nic_preset=args.nic_preset,
        extra_env=dict(args.env),
        container_runtime=args.container,
        container_image=args.container_image,
        container_mounts=args.container_mount,
        sbatch_options=sbatch_options,
        log_dir=args.log_dir,
        dispatcher=args.dispatcher,
        data_path=args.data_path,
        checkpoint_dir=args.checkpoint_dir,
        megatron_path=args.megatron_path,
        primus_path=args.primus_path,
        primus_config=args.primus_config,
        run_dir=args.run_dir,
        wandb_project=args.wandb_project,
        overrides_text=args.set,
    )
    if args.dry_run:
        sys.stdout.write(launch.render(plan))
        return 0
    path = launch.write_script(plan, Path(args.output_dir))
    print(
        f"wrote {path} ({plan.nodes} node(s) x {plan.gpus_per_node} GPU(s), target {plan.target})"
    )
    if args.submit:
        Path(plan.log_dir).mkdir(parents=True, exist_ok=True)
        print(launch.submit(path))
    elif plan.scheduler == "slurm":
        print(f"submit with: sbatch {path}")
    return 0

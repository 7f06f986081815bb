"""``uccl-ep-megatron bench layer``: one Megatron MoE layer, forward + backward, at EP = the GPUs
present (one rank per GPU), under every dispatcher in the same run, with each expert module.

Dispatchers (``--dispatchers``): ``alltoall`` (megatron-core's), ``exact`` and ``sync-free``
(``uccl_ep``'s two modes; sync-free without a capacity by default, which drops nothing and runs
only with experts that take GPU counts, ``--capacity-factor F`` for a per-expert capacity) and
``flex`` (megatron-core's flex dispatcher on DeepEP V1; only where
``deep_ep`` imports and is DeepEP itself, else skipped with the reason). Experts
(``--expert-modules``): megatron-core's ``SequentialMLP`` and ``TorchGroupedMLP`` (PyTorch's
grouped_mm; skipped with the reason where it cannot run). One ``MoELayer`` per expert module
(the same weights: copied from the ``SequentialMLP`` one); the dispatchers are swapped into it
in turn, so every variant runs the same router, experts, input and output gradient.

Timing: after ``--warmup`` untimed iterations, the variants take turns, one iteration each, for
``--iters`` rounds (clock and allocator drift land on all alike). An iteration is timed with
CUDA events around forward + backward on every rank (the time includes the GPU idling while the
host waits); its time is the slowest rank's, and the table shows the median. Then, per variant:
host syncs per layer (``torch.profiler``: synchronize calls and device-to-host copies, rank 0),
dispatch and combine device time (CUDA events around ``token_dispatch`` / ``token_combine``,
mean over ranks) and, in sync-free mode, the pairs its capacity dropped.

Default shape: DeepSeek-V3's MoE block (hidden 7168, 256 routed experts of FFN 2048, one shared
expert, top-8 of 8 groups / 4, sigmoid router) on 4096 tokens per rank; scale it down with
flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from uccl_ep_megatron.bench.common import add_json_argument, bench_main, register_bench, write_json

DISPATCHERS = ("alltoall", "exact", "sync-free", "flex")
EXPERT_MODULES = ("SequentialMLP", "TorchGroupedMLP")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench layer`` (see docs/cli.md)."""
    parser.add_argument("--gpus", type=int, default=0, help="ranks = EP size (default: all GPUs)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--experts", type=int, default=256, help="routed experts (all ranks)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--ffn", type=int, default=2048, help="FFN width of one expert (SwiGLU)")
    parser.add_argument("--shared-ffn", type=int, default=2048, help="shared expert FFN; 0: none")
    parser.add_argument(
        "--router",
        default="deepseek",
        choices=("deepseek", "softmax"),
        help="DeepSeek-V3's router (sigmoid, 8 groups / top-4, scaling 2.5) or softmax top-k",
    )
    parser.add_argument("--iters", type=int, default=20, help="timed rounds (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=0.0,
        help="sync-free mode's per-expert capacity factor (UcclEpOptions.capacity_factor; pairs "
        "past it dropped); 0 (default): no capacity, dropless sync-free mode (its experts must "
        "take GPU counts: TorchGroupedMLP)",
    )
    parser.add_argument(
        "--backend",
        default="kernels",
        choices=("auto", "kernels", "reference"),
        help="uccl_ep Buffer backend",
    )
    parser.add_argument(
        "--dispatchers",
        default=",".join(DISPATCHERS),
        help=f"comma-separated subset of {', '.join(DISPATCHERS)} (alltoall is the ratio's base)",
    )
    parser.add_argument(
        "--expert-modules",
        default=",".join(EXPERT_MODULES),
        help=f"comma-separated subset of {', '.join(EXPERT_MODULES)}",
    )
    parser.add_argument(
        "--profile-iters", type=int, default=3, help="iterations profiled for host syncs"
    )
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``layer`` to the ``bench`` subcommands."""
    register_bench(
        subparsers,
        "layer",
        "Megatron MoE layer fwd+bwd at EP = GPUs: alltoall, uccl_ep exact/sync-free, flex",
        add_arguments,
        run,
    )


def _subset(flag: str, text: str, known: tuple[str, ...]) -> list[str]:
    from uccl_ep_megatron.core.errors import InvalidInputError

    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise InvalidInputError(
            f"{flag} {text!r}: choose from {', '.join(known)} (got {unknown or 'none'})"
        )
    return list(dict.fromkeys(names))


def check_args(args: argparse.Namespace) -> None:
    """Reject flags that cannot make a layer, naming the flag (before any rank starts)."""
    from uccl_ep_megatron.core.errors import InvalidInputError

    _subset("--dispatchers", args.dispatchers, DISPATCHERS)
    _subset("--expert-modules", args.expert_modules, EXPERT_MODULES)
    for flag in ("tokens", "hidden", "experts", "topk", "ffn", "iters"):
        if getattr(args, flag) < 1:
            raise InvalidInputError(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.topk > args.experts:
        raise InvalidInputError(f"--topk {args.topk} exceeds --experts {args.experts}")
    if not args.capacity_factor >= 0:  # also NaN
        raise InvalidInputError(
            f"--capacity-factor {args.capacity_factor}: must be >= 0 (0 = dropless sync-free)"
        )
    if args.router == "deepseek" and args.experts % 8:
        raise InvalidInputError(
            f"--experts {args.experts}: DeepSeek-V3's router takes 8 groups; use a multiple of "
            "8 or --router softmax"
        )


def run(args: argparse.Namespace) -> int:
    """Measure on every GPU, print the table, optionally write JSON."""
    from uccl_ep_megatron.cluster.local import RankPool, visible_gpus
    from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError

    check_args(args)
    gpus = visible_gpus()
    if gpus < 1:
        raise UnsupportedError("bench layer needs a CUDA GPU")
    world = args.gpus or gpus
    if world > gpus or args.experts % world:
        raise InvalidInputError(
            f"--gpus {world}: needs at most {gpus} (GPUs here) and to divide --experts "
            f"{args.experts}"
        )
    with RankPool(world, num_gpus=gpus, task_timeout_s=3600) as pool:
        per_rank = pool.run(_rank_worker, vars(args) | {"func": None})
    result = merge(per_rank, world)
    print_table(result, args)
    write_json(args.json, {"bench": "layer", "args": vars(args) | {"func": None}, **result})
    return 0


# ---- per rank --------------------------------------------------------------------------------
def _rank_worker(rank: int, world: int, a: dict[str, Any]) -> dict[str, Any]:
    from uccl_ep_megatron.bench.layer_worker import measure_rank

    return measure_rank(rank, world, a)


# ---- results ---------------------------------------------------------------------------------
def merge(per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Rows of the table from every rank's measurements: per iteration the slowest rank,
    the median over iterations; host syncs from rank 0; dispatch/combine means over ranks."""
    first = per_rank[0]
    rows = []
    for name in first["times"]:
        per_iter = [
            max(r["times"][name][i] for r in per_rank) for i in range(len(first["times"][name]))
        ]
        extra = [r["extra"][name] for r in per_rank]
        rows.append(
            dict(
                variant=name,
                dispatcher=name.split("/")[0],
                experts=name.split("/")[1],
                median_ms=statistics.median(per_iter),
                min_ms=min(per_iter),
                host_syncs_per_layer=extra[0]["sync_calls"],
                dtoh_copies_per_layer=extra[0]["dtoh_copies"],
                dispatch_ms=statistics.fmean(e["dispatch_ms"] for e in extra),
                combine_ms=statistics.fmean(e["combine_ms"] for e in extra),
                dropped_pairs_per_layer=sum(e["dropped"] for e in extra),
                capacity=extra[0]["capacity"],
                bounded_rows=extra[0].get("bounded_rows"),
            )
        )
    for r in rows:
        base = next(
            (b for b in rows if b["dispatcher"] == "alltoall" and b["experts"] == r["experts"]),
            None,
        )
        r["speed_vs_alltoall"] = base["median_ms"] / r["median_ms"] if base else None
    return {"world": world, "gpu": first["gpu"], "skipped": first["skipped"], "rows": rows}


def print_table(result: dict[str, Any], args: argparse.Namespace) -> None:
    shared = f", shared FFN {args.shared_ffn}" if args.shared_ffn else ""
    print(
        f"MoE layer fwd+bwd, EP{result['world']} on {result['gpu']}: {args.tokens} tokens/rank, "
        f"hidden {args.hidden}, {args.experts} experts, top-{args.topk}, FFN {args.ffn}{shared}, "
        f"{args.router} router; median of {args.iters}"
    )
    for what, why in result["skipped"].items():
        print(f"skipped {what}: {why}")
    print(
        f"{'dispatcher':<10} {'experts':<16} {'ms':>8} {'min ms':>8} {'speed':>6} {'syncs':>6} "
        f"{'DtoH':>5} {'disp ms':>8} {'comb ms':>8} {'dropped':>8}"
    )
    for r in result["rows"]:
        speed = "-" if r["speed_vs_alltoall"] is None else f"{r['speed_vs_alltoall']:.3f}"
        print(
            f"{r['dispatcher']:<10} {r['experts']:<16} {r['median_ms']:>8.2f} {r['min_ms']:>8.2f} "
            f"{speed:>6} {r['host_syncs_per_layer']:>6.1f} {r['dtoh_copies_per_layer']:>5.1f} "
            f"{r['dispatch_ms']:>8.2f} {r['combine_ms']:>8.2f} {r['dropped_pairs_per_layer']:>8.0f}"
        )
    print("speed = alltoall's ms / this row's ms (same experts); syncs, DtoH: per layer, rank 0")


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.layer")


if __name__ == "__main__":
    sys.exit(main())

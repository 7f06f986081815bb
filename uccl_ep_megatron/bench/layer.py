"""``uccl-ep-megatron bench layer``: one Megatron MoE layer, forward + backward, at EP1 on one GPU,
under ``alltoall`` and ``uccl_ep`` (exact and sync-free mode) in the same run.

The three layers share one config apart from the dispatcher (``bench.moe_layer``), the same
weights (copied from the ``alltoall`` layer) and the same input and output gradient. Each is
warmed up, then timed per iteration with CUDA events around forward + backward (so the time
includes the GPU idling while the host catches up or waits); the variants take turns, one
iteration each, and the median is reported with its ratio to ``alltoall``. Host syncs per layer
come from ``torch.profiler`` over a few more iterations: runtime synchronize calls and
device-to-host copies. Sync-free mode also reports the (token, expert) pairs its capacity
dropped per iteration.

Default workload: issue 14's (8192 tokens, hidden 2048, 64 experts, top-8, SequentialMLP).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
from typing import Any

from uccl_ep_megatron.bench.common import add_json_argument, bench_main, register_bench, write_json

VARIANTS = ("alltoall", "exact", "sync-free")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench layer`` (see README, cli-bench)."""
    parser.add_argument("--device", type=int, default=0, help="CUDA device")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per iteration")
    parser.add_argument("--hidden", type=int, default=2048, help="hidden size")
    parser.add_argument("--experts", type=int, default=64, help="routed experts")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--ffn", type=int, default=2048, help="FFN width of one expert (SwiGLU)")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations first")
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=1.25,
        help="sync-free mode's per-expert capacity factor (UcclEpOptions.capacity_factor)",
    )
    parser.add_argument(
        "--backend",
        default="kernels",
        choices=("auto", "kernels", "reference"),
        help="uccl_ep Buffer backend",
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated subset of {', '.join(VARIANTS)} (alltoall is the ratio's base)",
    )
    parser.add_argument(
        "--profile-iters", type=int, default=3, help="iterations profiled for host syncs"
    )
    parser.add_argument(
        "--breakdown",
        type=int,
        default=0,
        help="print the N ops with the most self CPU and device time of one profiled iteration "
        "per variant (0: off)",
    )
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``layer`` to the ``bench`` subcommands."""
    register_bench(
        subparsers,
        "layer",
        "Megatron MoE layer fwd+bwd: alltoall vs uccl_ep exact/sync-free",
        add_arguments,
        run,
    )


def _variants(text: str) -> list[str]:
    from uccl_ep_megatron.core.errors import InvalidInputError

    names = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        raise InvalidInputError(
            f"--variants {text!r}: choose from {', '.join(VARIANTS)} (got {unknown or 'none'})"
        )
    return names


def _init_single_rank(device: int) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free local port for the one-rank rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Build the layers, time them; one row per variant."""
    import torch

    # Before megatron-core's import, whose warnings would bury the one line saying why.
    variants = _variants(args.variants)
    if not torch.cuda.is_available():
        from uccl_ep_megatron.core.errors import UnsupportedError

        raise UnsupportedError("bench layer needs a CUDA GPU")
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.bench.moe_layer import (
        LayerShape,
        build_layer,
        copy_weights,
        count_host_syncs,
        fwd_bwd,
    )
    from uccl_ep_megatron.token_dispatcher.options import get_options, restore_options, set_options

    _init_single_rank(args.device)
    megatron_plugin.install(backend=args.backend)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1234)
    shape = LayerShape(args.hidden, args.experts, args.topk, args.ffn)
    saved = get_options()
    layers: dict[str, Any] = {}
    try:
        base = build_layer(shape, "alltoall", 1)
        for name in variants:
            if name == "alltoall":
                layers[name] = base
                continue
            factor = args.capacity_factor if name == "sync-free" else None
            # Dispatchers read the options when built; the log interval outlasts the run.
            set_options(capacity_factor=factor, drop_log_interval=0)
            layers[name] = build_layer(shape, "uccl_ep", 1)
            copy_weights(base, layers[name])
            assert layers[name].token_dispatcher.mode == name, layers[name].token_dispatcher.mode
    finally:
        restore_options(saved)

    g = torch.Generator(device="cuda").manual_seed(42)
    x = torch.randn(args.tokens, 1, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    grad = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-2

    def step(layer: Any) -> None:
        fwd_bwd(layer, x, grad)
        layer.zero_grad(set_to_none=True)

    rows = []
    try:
        for name in variants:
            for _ in range(args.warmup):
                step(layers[name])
        # Round robin: every iteration times each variant once, so clock and allocator drift
        # over the run lands on all of them alike.
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.iters):
            for name in variants:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                torch.cuda.synchronize()
                start.record()
                step(layers[name])
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
        for name in variants:
            layer = layers[name]
            if args.breakdown:
                _print_breakdown(name, lambda layer=layer: step(layer), args.breakdown)
            dispatcher = layer.token_dispatcher
            dropped_before = dispatcher.dropped_pairs() if name == "sync-free" else 0
            syncs = count_host_syncs(lambda layer=layer: step(layer), args.profile_iters)
            dropped = (
                (dispatcher.dropped_pairs() - dropped_before) / args.profile_iters
                if name == "sync-free"
                else 0.0
            )
            rows.append(
                dict(
                    variant=name if name == "alltoall" else f"uccl_ep {name}",
                    median_ms=statistics.median(times[name]),
                    min_ms=min(times[name]),
                    host_syncs_per_layer=syncs["sync_calls"],
                    dtoh_copies_per_layer=syncs["dtoh_copies"],
                    dropped_pairs_per_layer=dropped,
                    capacity=dispatcher.capacity(args.tokens) if name == "sync-free" else None,
                )
            )
    finally:
        megatron_plugin.buffer_cache().clear()
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()
    base_ms = next((r["median_ms"] for r in rows if r["variant"] == "alltoall"), None)
    for r in rows:
        r["vs_alltoall"] = r["median_ms"] / base_ms if base_ms else None
    return rows


def _print_breakdown(name: str, fn: Any, limit: int) -> None:
    """One profiled iteration of ``fn``: the ``limit`` ops with the most self CPU time and the
    most self device time (where a variant's time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print(f"---- {name}: top {limit} by {key}")
        print(averages.table(sort_by=key, row_limit=limit, max_name_column_width=60))


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"MoE layer fwd+bwd, EP1: {args.tokens} tokens, hidden {args.hidden}, {args.experts} "
        f"experts, top-{args.topk}, FFN {args.ffn} (SequentialMLP); median of {args.iters}"
    )
    print(
        f"{'variant':<18} {'ms':>8} {'min ms':>8} {'vs a2a':>7} {'syncs':>6} {'DtoH':>5} "
        f"{'dropped':>8} {'capacity':>8}"
    )
    for r in rows:
        ratio = "-" if r["vs_alltoall"] is None else f"{r['vs_alltoall']:.3f}"
        cap = "-" if r["capacity"] is None else str(r["capacity"])
        print(
            f"{r['variant']:<18} {r['median_ms']:>8.2f} {r['min_ms']:>8.2f} {ratio:>7} "
            f"{r['host_syncs_per_layer']:>6.1f} {r['dtoh_copies_per_layer']:>5.1f} "
            f"{r['dropped_pairs_per_layer']:>8.1f} {cap:>8}"
        )


def run(args: argparse.Namespace) -> int:
    """Measure, print, optionally write JSON."""
    rows = measure(args)
    print_table(rows, args)
    write_json(args.json, {"bench": "layer", "args": vars(args) | {"func": None}, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.layer")


if __name__ == "__main__":
    sys.exit(main())

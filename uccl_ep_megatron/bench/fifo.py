"""``uccl-ep-megatron bench fifo``: GPU->CPU command rate and push->pop latency of the FIFO.

Throughput: a kernel of ``--blocks x --warps-per-block`` warps; lane 0 of each warp pushes
``--cmds-per-warp`` 16-byte TransferCmds into channel ``warp % channels``; ``threads`` CPU
threads (the proxy's FIFO consumers, pinned to the GPU's NUMA node; channel c -> thread
c % threads) poll and pop them (up to 32 per channel visit, head published once per visit, as
the proxy does) and check exactly-once, per-producer order. Rate = commands / (host time from
launch to the last pop). A consumer that drained a channel leaves it alone for
``--poll-backoff-ns`` (0: polls at once): each re-read of the line the GPU is still writing makes
the GPU's next write to that line snoop the CPU, which stalls the GPU's ordered posted writes.

Latency: one GPU thread pushes a command and spins until it observes the pop (re-reading the
host-resident head over PCIe); the GPU's %globaltimer measures push -> pop visible on the GPU, a
round trip and so an upper bound of push -> poll. p50/p99 over ``--latency-iters``. ``push us``
is the p50 of the push alone (until its release store was issued). ``read us``
is the p50 of one GPU read of that head with nothing changing it: the floor of the return leg.
The read that sees the pop reached host memory after the pop, about half a read before it
returned, so push -> poll is about ``p50 us - read us / 2`` or less.

One-way push -> poll, on the host clock alone: while it polls, the consumer keeps writing its
clock into a mapped host word; the GPU reads that word just before each push, and the consumer
stamps the poll that finds the command. The value read was written before the push began, so
``poll - value`` is an upper bound of push -> poll (``poll hi us``, p50), too large by the read's
return leg; minus the read's round trip (GPU clock) it is a lower bound (``poll lo us``, p50).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from uccl_ep_megatron.bench.common import add_json_argument, bench_main, register_bench, write_json
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench fifo`` (see docs/cli.md)."""
    parser.add_argument("--device", type=int, default=0, help="CUDA device")
    parser.add_argument(
        "--threads", default="1,2,4,8", help="comma-separated proxy thread counts to time"
    )
    parser.add_argument(
        "--channels", type=int, default=0, help="FIFO channels; 0 = 2 x the largest thread count"
    )
    parser.add_argument("--blocks", type=int, default=66, help="pushing thread blocks")
    parser.add_argument("--warps-per-block", type=int, default=8, help="pushing warps per block")
    parser.add_argument("--cmds-per-warp", type=int, default=2000, help="commands per warp")
    parser.add_argument(
        "--capacity", type=int, default=1024, help="slots per channel (kMaxInflight)"
    )
    parser.add_argument("--latency-iters", type=int, default=2000, help="ping-pong samples")
    parser.add_argument(
        "--poll-backoff-ns",
        type=int,
        default=1000,
        help="throughput consumers skip a channel this long after finding it drained (0: never)",
    )
    parser.add_argument("--timeout-ms", type=int, default=60000, help="bound of every wait")
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``fifo`` to the ``bench`` subcommands."""
    register_bench(subparsers, "fifo", "GPU->CPU FIFO command rate and latency", add_arguments, run)


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs every thread count; returns one row per count."""
    from uccl_ep_megatron.bench import kernels as bench_kernels
    from uccl_ep_megatron.core import _c

    _C = _c.load()

    # Arguments first, so a typo is reported the same way with or without a GPU.
    try:
        threads = [int(t) for t in args.threads.split(",") if t.strip()]
    except ValueError:
        raise InvalidInputError(
            f"--threads={args.threads!r} must be comma-separated integers"
        ) from None
    if not 0 <= args.poll_backoff_ns < 2**32:
        raise InvalidInputError(f"--poll-backoff-ns={args.poll_backoff_ns} must be in [0, 2^32)")
    if not threads or min(threads) < 1:
        raise InvalidInputError(f"--threads={args.threads!r} must list positive counts")
    channels = args.channels or 2 * max(threads)
    if channels < max(threads):
        raise InvalidInputError(f"--channels={channels} must be >= every thread count {threads}")
    if not hasattr(_C, "gpu_device_count"):
        raise UnsupportedError("bench fifo needs a GPU build of uccl_ep_megatron (nvcc at install)")
    if _C.gpu_device_count() <= args.device:
        raise UnsupportedError(f"bench fifo: no CUDA device {args.device} on this machine")
    nan = float("nan")
    rows = []
    for t in threads:
        r = bench_kernels.load().fifo_bench(
            args.device,
            channels,
            t,
            args.blocks,
            args.warps_per_block,
            args.cmds_per_warp,
            args.capacity,
            args.latency_iters,
            args.timeout_ms,
            args.poll_backoff_ns,
        )
        lat_us = [x / 1e3 for x in r["latency_ns"]]
        read_us = [x / 1e3 for x in r.get("host_read_ns", [])]
        push_us = [x / 1e3 for x in r.get("push_ns", [])]
        hi_ns, read_ns = r["push_to_poll_max_ns"], r["clock_read_ns"]
        poll_hi_us = [x / 1e3 for x in hi_ns]
        poll_lo_us = [(hi - rd) / 1e3 for hi, rd in zip(hi_ns, read_ns, strict=True)]
        rows.append(
            {
                "threads": t,
                "channels": channels,
                "warps": args.blocks * args.warps_per_block,
                "commands": r["commands"],
                "mcmds_per_s": r["commands"] / r["seconds"] / 1e6,
                "kernel_mcmds_per_s": r["commands"] / r["kernel_seconds"] / 1e6,
                "order_errors": r["order_errors"],
                "latency_p50_us": _percentile(lat_us, 0.5) if lat_us else float("nan"),
                "latency_p99_us": _percentile(lat_us, 0.99) if lat_us else float("nan"),
                "latency_mean_us": statistics.fmean(lat_us) if lat_us else float("nan"),
                "host_read_p50_us": _percentile(read_us, 0.5) if read_us else float("nan"),
                "push_p50_us": _percentile(push_us, 0.5) if push_us else float("nan"),
                "push_to_poll_hi_p50_us": _percentile(poll_hi_us, 0.5) if poll_hi_us else nan,
                "push_to_poll_hi_p99_us": _percentile(poll_hi_us, 0.99) if poll_hi_us else nan,
                "push_to_poll_lo_p50_us": _percentile(poll_lo_us, 0.5) if poll_lo_us else nan,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per thread count."""
    print(
        f"{'threads':>7} {'channels':>8} {'warps':>6} {'Mcmd/s':>8} {'kernel Mcmd/s':>13} "
        f"{'p50 us':>7} {'p99 us':>7} {'push us':>7} {'read us':>7} {'poll hi us':>10} "
        f"{'poll lo us':>10} {'order errs':>10}"
    )
    for r in rows:
        print(
            f"{r['threads']:>7} {r['channels']:>8} {r['warps']:>6} {r['mcmds_per_s']:>8.2f} "
            f"{r['kernel_mcmds_per_s']:>13.2f} {r['latency_p50_us']:>7.2f} "
            f"{r['latency_p99_us']:>7.2f} {r['push_p50_us']:>7.2f} {r['host_read_p50_us']:>7.2f} "
            f"{r['push_to_poll_hi_p50_us']:>10.2f} {r['push_to_poll_lo_p50_us']:>10.2f} "
            f"{r['order_errors']:>10}"
        )


def run(args: argparse.Namespace) -> int:
    """Measure, print, optionally write JSON; non-zero exit when commands were lost/reordered."""
    rows = measure(args)
    print_table(rows)
    write_json(args.json, {"bench": "fifo", "args": vars(args) | {"func": None}, "rows": rows})
    return 1 if any(r["order_errors"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.fifo")


if __name__ == "__main__":
    sys.exit(main())

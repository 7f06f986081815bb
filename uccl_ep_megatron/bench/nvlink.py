"""``uccl-ep-megatron bench nvlink``: the NVLink copy floor in a dispatch's all-to-all pattern.

Every visible GPU (or ``--gpus``) at once, one process: each GPU holds ``--tokens`` rows of
``--hidden`` BF16 values and sends every row to ``--fanout`` peers (row t to the peers after it
in a rotation, as a token goes to the ranks of its experts), written at its row in a slot of the
peer's region. Modes:

- ``ldst``: the intranode kernels' warp row copy (16-byte loads once, 16-byte stores to each
  destination; ``copy_row_multi``), ``--sms`` blocks of 512 threads;
- ``tma``: their bulk-copy pipeline (rows staged in shared memory, bulk stores to each peer;
  ``TmaPipe``), same grid;
- ``ce``: copy engines, one stream per (GPU, peer), one peer copy per peer slot.

A GPU's round time is its events' span over ``--iters`` rounds issued back to back, divided by
them. GB/s is a GPU's bytes written into its peers per round over its round time: the slowest
GPU's (and the fastest's beside it). The fastest row is the link floor the dispatch and combine
kernels are judged against (docs/performance.md).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from uccl_ep_megatron.bench.common import (
    add_json_argument,
    bench_main,
    flag_list,
    register_bench,
    write_json,
)
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError

MODES = ("ldst", "tma", "ce")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench nvlink`` (see docs/cli.md)."""
    parser.add_argument("--gpus", default="", help="comma-separated CUDA devices; default: all")
    parser.add_argument("--modes", default="ldst,tma,ce", help="copies to time: ldst, tma, ce")
    parser.add_argument("--sms", default="12,24", help="comma-separated SM budgets (ldst, tma)")
    parser.add_argument(
        "--fanout", default="1", help="comma-separated peers per row (1 .. GPUs - 1)"
    )
    parser.add_argument("--tokens", type=int, default=4096, help="rows per GPU")
    parser.add_argument("--hidden", type=int, default=7168, help="BF16 values per row")
    parser.add_argument("--iters", type=int, default=20, help="timed rounds per row")
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``nvlink`` to the ``bench`` subcommands."""
    register_bench(
        subparsers,
        "nvlink",
        "NVLink copy floor: kernel and copy-engine all-to-all",
        add_arguments,
        run,
    )


def plan(args: argparse.Namespace, num_gpus: int) -> tuple[list[int], list[tuple[str, int, int]]]:
    """The devices and the (mode, sms, fanout) rows to time. Raises ``InvalidInputError`` for a
    bad flag (checked first, so a typo reads the same on any machine) and ``UnsupportedError``
    when this machine lacks the GPUs."""
    # A value given twice is timed once (e.g. --fanout 1,$((GPUs - 1)) on two GPUs).
    modes = list(dict.fromkeys(flag_list(args.modes, "--modes", str, MODES)))
    sms = list(dict.fromkeys(flag_list(args.sms, "--sms", int)))
    fanouts = list(dict.fromkeys(flag_list(args.fanout, "--fanout", int)))
    if min(sms) < 1:
        raise InvalidInputError(f"--sms={args.sms!r}: give positive SM budgets")
    for flag, v in (("--tokens", args.tokens), ("--hidden", args.hidden), ("--iters", args.iters)):
        if v < 1:
            raise InvalidInputError(f"{flag}={v} must be positive")
    if args.hidden % 8:
        raise InvalidInputError(f"--hidden={args.hidden} must be a multiple of 8 (16-byte rows)")
    chosen = str(args.gpus).strip()
    devices = flag_list(args.gpus, "--gpus", int) if chosen else list(range(num_gpus))
    if chosen and (len(devices) < 2 or len(set(devices)) != len(devices)):
        raise InvalidInputError(f"--gpus={args.gpus!r}: give two or more distinct devices")
    if not chosen and num_gpus < 2:
        raise UnsupportedError(f"bench nvlink needs two or more GPUs; this machine has {num_gpus}")
    if max(devices) >= num_gpus or min(devices) < 0:
        raise UnsupportedError(
            f"--gpus={args.gpus!r}: this machine has {num_gpus} CUDA devices (0..{num_gpus - 1})"
        )
    bad = [f for f in fanouts if not 1 <= f < len(devices)]
    if bad:
        raise InvalidInputError(
            f"--fanout={args.fanout!r}: each must be in 1..{len(devices) - 1} "
            f"with {len(devices)} GPUs"
        )
    rows = []
    for f in fanouts:
        for m in modes:
            for s in sms if m != "ce" else [0]:
                rows.append((m, s, f))
    return devices, rows


def measure(args: argparse.Namespace, on_row: Any = None) -> list[dict[str, Any]]:
    """Times every (mode, sms, fanout); one result row each, also handed to ``on_row`` as it
    is measured."""
    from uccl_ep_megatron.bench import kernels as bench_kernels
    from uccl_ep_megatron.core import _c

    _C = _c.load()
    if not hasattr(_C, "gpu_device_count"):
        raise UnsupportedError(
            "bench nvlink needs a GPU build of uccl_ep_megatron (nvcc at install)"
        )
    devices, todo = plan(args, _C.gpu_device_count())
    bk = bench_kernels.load()
    out = []
    for mode, sms, fanout in todo:
        r = bk.nvlink_bench(devices, mode, sms, args.tokens, args.hidden * 2, fanout, args.iters)
        secs = r["seconds"]
        nbytes = r["bytes_per_device"]
        out.append(
            {
                "mode": mode,
                "sms": sms,
                "fanout": fanout,
                "gpus": len(devices),
                "bytes_per_gpu": nbytes,
                "us": max(secs) * 1e6,
                "us_per_gpu": [s * 1e6 for s in secs],
                "GBps": nbytes / max(secs) / 1e9,
                "GBps_best_gpu": nbytes / min(secs) / 1e9,
            }
        )
        if on_row is not None:
            on_row(out[-1])
    return out


def print_header() -> None:
    print(
        "| GPUs | fanout | copy | SMs | MB per GPU | us (slowest GPU) | GB/s per GPU "
        "| fastest GPU GB/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)


def print_row(r: dict[str, Any]) -> None:
    print(
        f"| {r['gpus']} | {r['fanout']} | {r['mode']} | {r['sms'] or '-'} | "
        f"{r['bytes_per_gpu'] / 1e6:.1f} | {r['us']:.0f} | {r['GBps']:.1f} | "
        f"{r['GBps_best_gpu']:.1f} |",
        flush=True,
    )


def run(args: argparse.Namespace) -> int:
    print_header()
    rows = measure(args, on_row=print_row)
    write_json(args.json, {"bench": "nvlink", "args": vars(args) | {"func": None}, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.nvlink")


if __name__ == "__main__":
    sys.exit(main())

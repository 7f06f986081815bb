"""``uccl-ep-megatron bench <name>``: dispatches to ``uccl_ep_megatron.bench.<name>``.

Adding a benchmark = adding its module name to ``BENCH_MODULES`` (one line); the module provides
``register(subparsers)``.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# Order is the order of `uccl-ep-megatron bench --help`.
BENCH_MODULES: tuple[str, ...] = (
    "fifo",
    "intranode",
    "nvlink",
    "internode",
    "proxy",
    "ordering",
    "layer",
    "scale",
)


def register(subparsers: Any) -> None:
    """Adds ``bench`` with one sub-subcommand per module of ``BENCH_MODULES``."""
    p = subparsers.add_parser(
        "bench",
        help="microbenchmarks (fifo, intranode, ..., layer) and the scale model",
        description="Microbenchmarks; each prints one table and can write JSON (--json).",
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for name in BENCH_MODULES:
        importlib.import_module(f"uccl_ep_megatron.bench.{name}").register(sub)
    p.set_defaults(func=_missing)


def _missing(args: argparse.Namespace) -> int:
    raise SystemExit("choose a benchmark: " + ", ".join(BENCH_MODULES))

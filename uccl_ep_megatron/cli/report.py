"""``uccl-ep-megatron report``: PNG plots of runs and a side-by-side table of two runs."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="plot loss, tokens/s, TFLOP/s, dispatch/combine time; compare runs",
        description=(
            "Plot the metrics.jsonl of one or more `train` run directories (PNG files) and "
            "print a Markdown table of their steady-state means side by side (with a ratio "
            "column for two runs, e.g. alltoall vs uccl_ep)."
        ),
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories")
    p.add_argument("--out", help="output directory (default: FIRST_RUN_DIR/report)")
    p.add_argument(
        "--warmup-steps", type=int, default=2, help="steps left out of the means (default: 2)"
    )
    p.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from uccl_ep_megatron.telemetry.report import report

    pngs, table = report(args.run_dirs, args.out, args.warmup_steps)
    for path in pngs:
        print(f"wrote {path}")
    print(table)
    return 0

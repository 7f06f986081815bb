"""The ``uccl-ep-megatron`` command line.

Each subcommand lives in its own module of this package (``uccl_ep_megatron.cli``) and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to its handler. Modules are
imported only when the CLI starts, so heavy imports (megatron-core, wandb) stay inside the
handlers that need them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Order is the order of `uccl-ep-megatron --help`.
COMMAND_MODULES: tuple[str, ...] = ("train", "launch", "report", "bench", "doctor")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uccl-ep-megatron",
        description="Portable GPU-initiated expert-parallel communication for Megatron-Core MoE.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Python logging level (the C++ core uses UCCL_EP_LOG_LEVEL).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"uccl_ep_megatron.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

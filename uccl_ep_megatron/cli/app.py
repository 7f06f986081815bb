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

from uccl_ep_megatron.core.errors import UcclEpError

# Order is the order of `uccl-ep-megatron --help`.
COMMAND_MODULES: tuple[str, ...] = ("train", "launch", "report", "bench", "doctor")


class Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit 2), naming the command, like every other
    error of the CLI; subcommand parsers are made of this class too."""

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 or more")
    return value


def _log_level(text: str) -> str:
    """--log-level: Python's names, plus WARN (UCCL_EP_LOG_LEVEL's spelling), any case."""
    level = text.upper()
    level = "WARNING" if level == "WARN" else level
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise argparse.ArgumentTypeError(f"{text!r}: use DEBUG, INFO, WARN (or WARNING) or ERROR")
    return level


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="uccl-ep-megatron",
        description="Portable GPU-initiated expert-parallel communication for Megatron-Core MoE.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=_log_level,
        help="Python logging level: DEBUG, INFO, WARN (or WARNING), ERROR; the C++ core uses "
        "UCCL_EP_LOG_LEVEL, which takes the same names.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"uccl_ep_megatron.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a command. Every error a user can fix (a bad value, a missing file, an environment
    variable the library rejects) is one line on stderr naming it, and exit status 2; only
    bugs show a traceback."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    prog = f"uccl-ep-megatron {args.command}"
    try:
        return int(args.func(args) or 0)
    except UcclEpError as exc:
        print(f"{prog}: error: {_one_line(str(exc))}", file=sys.stderr)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"{prog}: error: {exc.strerror or exc}{where}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 2


def _one_line(text: str) -> str:
    """The message on one line (a child's error may quote several)."""
    return " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())

"""What every benchmark module shares: its ``bench`` subcommand, its ``python -m`` entry, and
the ``--json`` results file."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default="", help="also write the results to this JSON file")


def write_json(path: str, results: Any) -> None:
    """``results`` into the ``--json`` file, when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


def register_bench(
    subparsers: Any, name: str, help: str, add_arguments: AddArguments, run: Run
) -> None:
    """Adds ``name`` to the ``bench`` subcommands."""
    p = subparsers.add_parser(name, help=help)
    add_arguments(p)
    p.set_defaults(func=run)


def bench_main(
    add_arguments: AddArguments,
    run: Run,
    argv: list[str] | None,
    prog: str | None = None,
    description: str | None = None,
) -> int:
    """``python -m uccl_ep_megatron.bench.<name> [flags]``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return run(parser.parse_args(argv))

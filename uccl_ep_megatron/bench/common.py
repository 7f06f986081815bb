"""What every benchmark module shares: its ``bench`` subcommand, its ``python -m`` entry, and
the ``--json`` results file."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError

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


def flag_list(text: str, flag: str, kind: type, choices: tuple = ()) -> list:
    """The comma-separated values of ``flag`` as ``kind``; raises ``InvalidInputError`` naming
    the flag when one does not parse, none is given, or one is not among ``choices``."""
    try:
        values = [kind(v.strip()) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise InvalidInputError(f"{flag}={text!r}: give comma-separated {kind.__name__}s") from None
    bad = [v for v in values if choices and v not in choices]
    if bad or (not values and choices):
        raise InvalidInputError(f"{flag}={text!r}: choose from {', '.join(map(str, choices))}")
    if not values:
        raise InvalidInputError(f"{flag}={text!r}: give at least one value")
    return values


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread exited, or the kernel does not keep this file
        return None


def cpu_seconds(prefix: str) -> float:
    """CPU seconds of this process's threads whose name starts with ``prefix`` (``ueproxy``: the
    proxy threads; ``uenic``: the NIC model's): time on a CPU in nanoseconds from
    ``/proc/self/task/*/schedstat``, or user + system clock ticks (10 ms) where it is absent."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        task = f"/proc/self/task/{tid}"
        if not (_read(f"{task}/comm") or "").startswith(prefix):
            continue
        sched = _read(f"{task}/schedstat")
        if sched is not None:
            total += int(sched.split()[0]) / 1e9
            continue
        stat = _read(f"{task}/stat")
        if stat is not None:
            fields = stat.rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15)
    return total


def cpu_probe_ms(repeats: int = 5) -> float:
    """How fast this process's CPU runs Python now: the best of ``repeats`` runs of a fixed loop
    (a sum over 200,000 integers), in ms. Host microseconds per call grow with it. On a virtual
    machine whose vCPUs share physical cores with other work it changes from process to process
    and within a run, so the benches record it beside their host times."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        sum(range(200_000))
        best = min(best, (time.perf_counter_ns() - t0) / 1e6)
    return best


def cpu_map_ms() -> dict[str, list]:
    """``cpu_probe_ms`` on each CPU this process may run on, the calling thread pinned to each
    in turn (its affinity restored after): which vCPUs run slower than the others right now.
    ``{"cpus": [...], "ms": [...]}``, in CPU order."""
    allowed = sorted(os.sched_getaffinity(0))
    ms = []
    try:
        for cpu in allowed:
            os.sched_setaffinity(0, {cpu})
            ms.append(cpu_probe_ms())
    finally:
        os.sched_setaffinity(0, allowed)
    return {"cpus": allowed, "ms": ms}


# A CPU is slow when its probe takes over this many times the fastest CPU's.
SLOW_CPU_FACTOR = 1.25


def slow_cpus(cpu_map: dict[str, list], factor: float = SLOW_CPU_FACTOR) -> list[int]:
    """The CPUs of a ``cpu_map_ms`` result whose probe took over ``factor`` times the
    fastest one's."""
    limit = factor * min(cpu_map["ms"])
    return [c for c, ms in zip(cpu_map["cpus"], cpu_map["ms"], strict=True) if ms > limit]


def cpu_map_line(before: dict[str, list], after: dict[str, list]) -> str:
    """One line on how many CPUs ran the probe slowly before and after a run (benches whose
    CPU threads, such as the proxies, set their speed)."""
    n = len(before["cpus"])
    return (
        f"# CPUs slower than {SLOW_CPU_FACTOR}x the fastest at the probe loop: "
        f"{len(slow_cpus(before))} of {n} before the run, {len(slow_cpus(after))} of {n} after "
        f"(fastest {min(before['ms']):.2f} / {min(after['ms']):.2f} ms; a virtual machine's "
        "vCPUs can share physical cores)"
    )

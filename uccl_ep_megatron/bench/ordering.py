"""``uccl-ep-megatron bench ordering``: receiver- vs sender-side ordering (paper Figure 7), CPU.

Two ranks in one process over the ipc transport with the reorder/delay injector imitating an
unordered network with per-message latency up to ``--delay-us``. On every channel, a CPU producer
(standing in for the GPU) pushes ``--msgs`` Writes of ``--bytes`` bytes, each carrying a software
atomic (+1 on the peer's counter of that channel), as the HT kernels do per chunk. The time runs
until every counter on both ranks reached ``--msgs``. With receiver-side ordering the sender
streams writes and atomics back to back and the receiver holds early atomics; with sender-side
ordering each atomic waits for the completion of the writes before it (one more network round
trip per chunk), which is the cost the paper measures.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from uccl_ep_megatron.bench.common import add_json_argument, bench_main, register_bench, write_json
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench ordering`` (see docs/cli.md)."""
    parser.add_argument("--channels", type=int, default=2, help="FIFO channels per rank")
    parser.add_argument("--threads", type=int, default=1, help="proxy threads per rank")
    parser.add_argument("--msgs", type=int, default=2000, help="write+atomic per channel")
    parser.add_argument("--bytes", type=int, default=4096, help="bytes per write")
    parser.add_argument(
        "--delay-us",
        default="0,20,100",
        help="comma-separated injected max latencies; 0 = no injector",
    )
    parser.add_argument("--seed", type=int, default=1, help="injector seed")
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``ordering`` to the ``bench`` subcommands."""
    register_bench(
        subparsers, "ordering", "receiver- vs sender-side ordering (CPU, ipc)", add_arguments, run
    )


def _one(args: argparse.Namespace, ordering: str, delay_us: int) -> dict[str, Any]:
    from uccl_ep_megatron.core import _c
    from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint, cmd_write_atomic

    _C = _c.load()

    world, ch, n, nbytes = 2, args.channels, args.msgs, args.bytes
    slot = (nbytes + 15) // 16 * 16
    size = 2 * ch * slot  # one send and one receive slot per channel (content is not checked)
    regions = [_C.HostRegion(size) for _ in range(world)]
    cfg = ProxyConfig(
        num_channels=ch,
        num_threads=args.threads,
        transport="ipc",
        ordering=ordering,
        ipc_reorder=delay_us > 0,
        ipc_seed=args.seed,
        ipc_max_delay_us=max(delay_us, 1),
        num_counters=world * ch,
        timeout_ms=60000,
    )
    # Built here, so a command the limits reject fails now, not inside a producer thread.
    cmds = {
        (r, c): cmd_write_atomic(1 - r, c * slot, (ch + c) * slot, nbytes, r * ch + c, 1)
        for r in range(world)
        for c in range(ch)
    }
    eps = [
        ProxyEndpoint(regions[r].ptr, size, rank=r, world_size=world, config=cfg)
        for r in range(world)
    ]
    infos = [e.local_info for e in eps]
    for e in eps:
        e.connect(infos)
    errors: list[BaseException] = []
    try:

        def produce(r: int, c: int) -> None:
            try:
                for _ in range(n):
                    eps[r].push(c, cmds[r, c])
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting thread
                errors.append(exc)

        t0 = time.perf_counter()
        producers = [
            threading.Thread(target=produce, args=(r, c)) for r in range(world) for c in range(ch)
        ]
        for t in producers:
            t.start()
        deadline = t0 + 120
        while True:
            # Rank r's counters (1 - r) * ch + c count the chunks its peer sent on channel c.
            got = [eps[r].counter_values()[(1 - r) * ch : (2 - r) * ch] for r in range(world)]
            if all(v >= n for g in got for v in g):
                break
            if errors:
                raise errors[0]
            for e in eps:
                e.check()
            if time.perf_counter() > deadline:
                raise CommTimeoutError(
                    f"bench ordering: counters stuck at {got} after 120 s (want {n} each) with "
                    f"proxy stats {[e.stats() for e in eps]}"
                )
            time.sleep(0.0002)
        dt = time.perf_counter() - t0
        for t in producers:
            t.join()
        held = sum(e.stats()["held_out_of_order"] for e in eps)
    finally:
        for e in eps:
            e.close()
    total = world * ch * n
    return {
        "ordering": ordering,
        "delay_us": delay_us,
        "chunks": total,
        "seconds": dt,
        "kchunks_per_s": total / dt / 1e3,
        "us_per_chunk_per_channel": dt / n * 1e6,
        "held_out_of_order": held,
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (delay, ordering) pair."""
    from uccl_ep_megatron.core import _c

    _C = _c.load()

    try:
        delays = [int(d) for d in args.delay_us.split(",") if d.strip()]
    except ValueError:
        raise InvalidInputError(f"--delay-us={args.delay_us!r} must be integers") from None
    if not delays or min(delays) < 0 or args.msgs < 1 or args.bytes < 1:
        raise InvalidInputError("--delay-us must be >= 0, --msgs and --bytes >= 1")
    max_len = _C.cmd_limits["max_length"]
    if args.bytes > max_len:
        raise InvalidInputError(
            f"--bytes={args.bytes} exceeds what one write command carries ({max_len} bytes)"
        )
    if args.channels < 1 or not 1 <= args.threads <= args.channels:
        raise InvalidInputError(
            f"--channels={args.channels} must be >= 1 and --threads={args.threads} in [1, channels]"
        )
    return [_one(args, o, d) for d in delays for o in ("receiver", "sender")]


def print_table(rows: list[dict[str, Any]]) -> None:
    """One line per (delay, ordering)."""
    print(f"{'delay us':>8} {'ordering':>9} {'Kchunks/s':>10} {'us/chunk/ch':>12} {'held':>7}")
    for r in rows:
        print(
            f"{r['delay_us']:>8} {r['ordering']:>9} {r['kchunks_per_s']:>10.1f} "
            f"{r['us_per_chunk_per_channel']:>12.2f} {r['held_out_of_order']:>7}"
        )


def run(args: argparse.Namespace) -> int:
    """Measure, print, optionally write JSON."""
    rows = measure(args)
    print_table(rows)
    write_json(args.json, {"bench": "ordering", "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.ordering")


if __name__ == "__main__":
    sys.exit(main())

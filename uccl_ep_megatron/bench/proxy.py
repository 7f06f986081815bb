"""``uccl-ep-megatron bench proxy``: what one GPU's CPU proxy sustains, measured on the CPU alone.

The question it answers: are the proxies or the NIC model the limit of the internode path? Two
ranks live in this process, each a ``ProxyEndpoint`` (FIFO channels, proxy threads, the ``ipc``
NIC model) on host memory. CPU threads stand in for rank 0's kernels, one per channel: each pushes
``--writes`` Writes of ``--bytes`` to rank 1 as fast as its ring takes them, every
``--atomic-every``-th carrying +1 on rank 1's counter of that channel (1: every write carries
its chunk's tail, as the internode kernels' chunks do), then Drain(all) and waits for it. Rank 1's
proxy receives: it applies the counters, which must end at the count the producers sent.

Per (proxy threads, write size): commands/s in all and per sender thread, GB/s, the CPU cores the
sender's and the receiver's proxy threads and the two NIC threads used (proxy threads spin while
polling, so their cores are an upper bound of what the work needs), CPU µs per command of the
sender's proxy, and the NIC model alone at the same write size (``ipc_copy_test``: writes posted
straight to the transport, no FIFO, no proxy). ``vs NIC`` = the proxy path's write rate over the
NIC model's alone: near 1, the NIC model is the limit; well below, the proxies are.

What it cannot show: the GPU side (FIFO pushes from kernels, PCIe polling: ``bench fifo``) and
GPU copies (the NIC model on GPU memory: ``bench internode --copy-only``). The producers share
the host's cores with the proxies: on a host with fewer cores than producers + both ranks' proxy
threads + 2 NIC threads the numbers measure that contention, and the table says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from uccl_ep_megatron.bench.common import (
    add_json_argument,
    bench_main,
    cpu_seconds,
    flag_list,
    register_bench,
    write_json,
)
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError

SLOTS = 8  # writes of one channel cycle over this many slots of its span


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench proxy`` (see docs/cli.md)."""
    parser.add_argument("--threads", default="1,2,4", help="proxy threads per rank, e.g. 1,2,4")
    parser.add_argument(
        "--channels", type=int, default=12, help="FIFO channels (12 = the kernels' at 24 SMs)"
    )
    parser.add_argument(
        "--bytes",
        default="4096,73728",
        help="bytes per write: 4096 (small: the per-command cost shows) and 73728 (the mean write "
        "of a DeepSeek-V3 BF16 dispatch on 2x2 virtual nodes: 58.8 MB in ~790 commands)",
    )
    parser.add_argument("--writes", type=int, default=4000, help="writes per channel and run")
    parser.add_argument(
        "--atomic-every",
        type=int,
        default=1,
        help="every N-th write carries +1 on the peer's counter (0: none)",
    )
    parser.add_argument(
        "--link-gbps", type=float, default=0.0, help="NIC model line rate, GB/s; 0 = unthrottled"
    )
    parser.add_argument("--latency-us", type=float, default=0.0, help="NIC model one-way µs")
    parser.add_argument("--repeats", type=int, default=3, help="runs per row (the median is kept)")
    parser.add_argument("--timeout-ms", type=int, default=30000, help="bound of every wait")
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``proxy`` to the ``bench`` subcommands."""
    register_bench(
        subparsers, "proxy", "CPU proxy command rate on the CPU alone", add_arguments, run
    )


def _positive(text: str, flag: str) -> list[int]:
    values = flag_list(text, flag, int)
    if min(values) < 1:
        raise InvalidInputError(f"{flag}={text!r}: give positive integers, e.g. 1,2,4")
    return values


def check_args(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The thread counts and write sizes; each bad flag is named with its fix."""
    from uccl_ep_megatron.core import _c

    limits = _c.load().cmd_limits
    threads, sizes = _positive(args.threads, "--threads"), _positive(args.bytes, "--bytes")
    if not 1 <= args.channels <= limits["num_atomic_counters"]:
        raise InvalidInputError(
            f"--channels={args.channels}: give 1..{limits['num_atomic_counters']}"
        )
    if max(threads) > min(64, args.channels):
        raise InvalidInputError(
            f"--threads={args.threads}: a rank has at most min(64, --channels={args.channels}) "
            "proxy threads"
        )
    align = limits["offset_align"]
    bad = [s for s in sizes if s > limits["max_length"] or s % align]
    if bad:
        raise InvalidInputError(
            f"--bytes={args.bytes}: {bad} not a multiple of {align} up to {limits['max_length']}"
        )
    if 2 * args.channels * SLOTS * max(sizes) > limits["max_dst_offset"]:
        raise InvalidInputError(
            f"--channels={args.channels} x --bytes={max(sizes)}: the region would exceed the "
            f"commands' {limits['max_dst_offset']}-byte offsets; give fewer channels or bytes"
        )
    if args.writes < 1 or args.atomic_every < 0 or args.repeats < 1 or args.timeout_ms < 1:
        raise InvalidInputError(
            f"--writes={args.writes} --atomic-every={args.atomic_every} --repeats={args.repeats}"
            f" --timeout-ms={args.timeout_ms}: need writes, repeats, timeout >= 1, atomic-every"
            " >= 0"
        )
    if args.link_gbps < 0 or args.latency_us < 0:
        raise InvalidInputError(
            f"--link-gbps={args.link_gbps} --latency-us={args.latency_us}: give values >= 0"
        )
    return threads, sizes


class _Pair:
    """Ranks 0 and 1 of this process, connected over the ipc NIC model on host memory."""

    def __init__(
        self, args: argparse.Namespace, threads: int, channels: int, span: int, proxy: bool
    ) -> None:
        from uccl_ep_megatron.core import _c
        from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint

        c = _c.load()
        cfg = ProxyConfig(
            num_channels=channels,
            num_threads=threads,
            timeout_ms=args.timeout_ms,
            transport="ipc",
            ranks_per_node=1,
            num_counters=channels,
            ipc_reorder=False,
            ipc_link_gbps=args.link_gbps,
            ipc_latency_us=args.latency_us,
            ipc_fault="",
            pin_cpus=[],
        )
        self.regions = [c.HostRegion(2 * channels * span) for _ in range(2)]
        self.eps = [
            ProxyEndpoint(reg.ptr, reg.bytes, config=cfg, rank=r, world_size=2)
            for r, reg in enumerate(self.regions)
        ]
        infos = [ep.local_info for ep in self.eps]
        for ep in self.eps:
            ep.connect(infos, start_proxy=proxy)

    def close(self) -> None:
        for ep in self.eps:
            ep.close()


def _proxy_run(args: argparse.Namespace, threads: int, size: int) -> dict[str, Any]:
    """One timed run of the proxy path; checks that every counter arrived."""
    from uccl_ep_megatron.core import _c

    c, channels, span = _c.load(), args.channels, SLOTS * size
    pair = _Pair(args, threads, channels, span, proxy=True)
    try:
        sender, receiver = pair.eps
        p0, p1, k0 = cpu_seconds("ueproxy0t"), cpu_seconds("ueproxy1t"), _nic_cpu(pair)
        try:
            secs, commands = c.proxy_push_test(
                sender.channels, 1, 0, channels * span, span, size, args.writes, args.atomic_every
            )
        except Exception:
            for ep in pair.eps:  # a proxy's own failure names more than a producer's timeout
                ep.check()
            raise
        p0, p1, k0 = (
            cpu_seconds("ueproxy0t") - p0,
            cpu_seconds("ueproxy1t") - p1,
            _nic_cpu(pair) - k0,
        )
        # Drain(all) completes once the writes completed; their counters may still be applying.
        want = args.writes // args.atomic_every if args.atomic_every else 0
        deadline = time.monotonic() + args.timeout_ms / 1e3
        while receiver.counter_values() != [want] * channels:
            receiver.check()
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"bench proxy: rank 1's counters are {receiver.counter_values()}, expected "
                    f"{want} each: updates were lost"
                )
            time.sleep(0.001)
        sender.check()
        stats = sender.stats()
    finally:
        pair.close()
    writes = args.writes * channels
    return {
        "threads": threads,
        "channels": channels,
        "write_bytes": size,
        "writes": writes,
        "commands": commands,
        "seconds": secs,
        "mcmds_per_s": commands / secs / 1e6,
        "kcmds_per_s_per_thread": commands / secs / threads / 1e3,
        "gbps": writes * size / secs / 1e9,
        "writes_posted": stats.get("writes_posted", 0),
        "sender_proxy_cores": p0 / secs,
        "receiver_proxy_cores": p1 / secs,
        "nic_cores": k0 / secs,
        "sender_proxy_cpu_us_per_cmd": p0 / commands * 1e6,
    }


def _nic_cpu(pair: _Pair) -> float:
    """CPU seconds of both ranks' NIC threads so far."""
    return sum(float(ep.nic_stats().get("cpu_seconds", 0.0)) for ep in pair.eps)


def _nic_alone(args: argparse.Namespace, size: int, writes: int) -> dict[str, Any]:
    """The NIC model alone: rank 0 posts ``writes`` writes of ``size`` straight to its transport
    (256 in flight) while rank 1 polls for them."""
    from uccl_ep_megatron.core import _c

    c, span = _c.load(), SLOTS * size
    pair = _Pair(args, 1, 1, span, proxy=False)
    out: dict[int, Any] = {}
    timeout_s = args.timeout_ms / 1e3

    def receive() -> None:
        try:
            out[1] = c.ipc_copy_test(
                pair.eps[1].transport, 0, 0, span, span, size, 0, 1, writes, timeout_s
            )
        except Exception as exc:  # raised below, in the calling thread
            out[1] = exc

    try:
        t = threading.Thread(target=receive, daemon=True)
        t.start()
        k0 = _nic_cpu(pair)
        secs, _ = c.ipc_copy_test(
            pair.eps[0].transport, 1, 0, span, span, size, writes, 256, 0, timeout_s
        )
        k0 = _nic_cpu(pair) - k0
        t.join(timeout_s)
        if isinstance(out.get(1), Exception):
            raise out[1]
    finally:
        pair.close()
    return {
        "nic_alone_mwrites_per_s": writes / secs / 1e6,
        "nic_alone_gbps": writes * size / secs / 1e9,
        "nic_alone_cores": k0 / secs,
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per (proxy threads, write size): the median run of ``--repeats``."""
    threads, sizes = check_args(args)
    rows = []
    for size in sizes:
        alone = _nic_alone(args, size, args.writes * args.channels)
        for t in threads:
            runs = sorted(
                (_proxy_run(args, t, size) for _ in range(args.repeats)),
                key=lambda r: r["seconds"],
            )
            row = runs[len(runs) // 2]
            row.update(alone)
            row["vs_nic"] = row["writes"] / row["seconds"] / 1e6 / alone["nic_alone_mwrites_per_s"]
            row["spread"] = runs[-1]["seconds"] / runs[0]["seconds"]
            rows.append(row)
    return rows


def busy_threads(channels: int, threads: int) -> int:
    """Threads that poll or push at once in a run: a producer per channel, both ranks' proxy
    threads and both NIC threads."""
    return channels + 2 * threads + 2


def print_table(rows: list[dict[str, Any]], host_cpus: int) -> None:
    """One line per row, then what the columns mean."""
    print(f"host: {host_cpus} CPUs; both ranks, their proxies, NIC threads and producers on them")
    busy = max((busy_threads(r["channels"], r["threads"]) for r in rows), default=0)
    if busy > host_cpus:
        print(
            f"WARNING: up to {busy} busy threads on {host_cpus} CPUs: the rates below measure "
            "that contention, not the proxies (run on a host with more cores, or give fewer "
            "--channels and --threads)"
        )
    print(
        f"{'thr':>3} {'ch':>3} {'bytes':>6} {'Mcmd/s':>7} {'Kcmd/s/thr':>10} {'GB/s':>6} "
        f"{'cores snd/rcv/nic':>17} {'us/cmd':>6} {'NIC alone Mw/s':>14} {'vs NIC':>6} "
        f"{'spread':>6}"
    )
    for r in rows:
        cores = (
            f"{r['sender_proxy_cores']:.2f}/{r['receiver_proxy_cores']:.2f}/{r['nic_cores']:.2f}"
        )
        print(
            f"{r['threads']:>3} {r['channels']:>3} {r['write_bytes']:>6} {r['mcmds_per_s']:>7.3f} "
            f"{r['kcmds_per_s_per_thread']:>10.0f} {r['gbps']:>6.1f} {cores:>17} "
            f"{r['sender_proxy_cpu_us_per_cmd']:>6.2f} {r['nic_alone_mwrites_per_s']:>14.3f} "
            f"{r['vs_nic']:>6.2f} {r['spread']:>6.2f}"
        )
    print(
        "us/cmd: CPU of the sender's proxy threads per command (they spin while polling: an "
        "upper bound); vs NIC: writes/s through the proxies over the NIC model's alone; spread: "
        "slowest over fastest run"
    )


def run(args: argparse.Namespace) -> int:
    """Measure, print, optionally write JSON."""
    rows = measure(args)
    host_cpus = os.cpu_count() or 0
    print_table(rows, host_cpus)
    meta = {k: v for k, v in vars(args).items() if k != "func"} | {"host_cpus": host_cpus}
    busy = max((busy_threads(r["channels"], r["threads"]) for r in rows), default=0)
    meta["oversubscribed"] = busy > host_cpus
    write_json(args.json, {"bench": "proxy", "meta": meta, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.proxy")


if __name__ == "__main__":
    sys.exit(main())

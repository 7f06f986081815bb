"""``uccl-ep-megatron bench internode``: internode HT dispatch/combine on virtual nodes, over the
``ipc`` NIC model.

Spawns ``--ranks`` ranks (default: one per visible GPU; ranks beyond the GPU count share GPUs
under CUDA MPS), splits them into virtual nodes of ``--ranks-per-node`` (default: half the
ranks, so 2 nodes), gives each rank a virtual NIC of ``--link-gbps`` GB/s and ``--latency-us``
(``0`` = as fast as the copy engines go) and times, on the DeepSeek-V3 HT setting (4096
tokens/rank, hidden 7168, top-8 of 256 experts), ``Buffer.dispatch`` (BF16, and FP8 with
``--fp8``) and ``Buffer.combine`` for each line rate, proxy thread count and RDMA chunk size.
Per op it reports:

- ``us``: median device time of the call on the caller's stream (a dispatch includes its notify
  and the host sync for output sizes), the max over ranks of each iteration;
- ``rdma_MB``: bytes the proxy posted per call and rank (token slots with their metadata: what
  crosses the NIC); ``GB/s``: those bytes over ``us`` (inter-node bytes per GPU) and ``line``:
  that as a fraction of the line rate;
- ``cmds/s``: commands the proxy consumed per second of the timed calls; ``proxy_cpu`` and
  ``nic_cpu``: CPU cores busy in the proxy threads and in the NIC model's thread;
- ``copies``: copy-engine copies per call after the NIC coalesced contiguous writes;
- the same tokens through the intranode kernels with all ranks in one node (``--intranode-ref``).

``--pipeline K`` (with ``--sync-free``) adds ``pipelined``: K sync-free dispatch + combine pairs
enqueued back to back with no host wait, as a training step issues them; ``us`` and ``rdma_MB``
are per pair (both directions' bytes), so the host path of one call overlaps the kernels of the
previous one, which a single timed call cannot show. Its ``us`` is the steady state: from the
end of the first pair to the end of the last, over K - 1 pairs (``us_with_first`` in the JSON
counts all K from the first call's start, its host path included).

``transfer`` (``--kernel-calls``, on by default) times the call the way DeepEP's benchmark
(and UCCL-EP's port of it) does for its published internode GB/s: the device time of the
kernels that move the rows (``_TRANSFER_KERNELS``: no call header, index tables, checks or
host path), over calls made back to back under the torch profiler; per call the median launch,
the max over ranks. ``xfer_gbps`` divides the same NIC bytes by it (DeepEP also counts the
bytes a token sends to its own node). A call's kernel waits inside for the slowest rank's
launch, so where a call's host path is longer than its kernels, back-to-back calls measure the
ranks' host speeds too; DeepEP's calls have host paths shorter than their kernels. So the
sync-free ops (no host wait) are also timed ``queued`` (``xq``): the same calls issued while the
GPU is held by a sleep kernel long enough for all of them to be enqueued, so they run back to
back with no host path between them (``xq_held`` in the JSON: the host finished enqueueing
before the hold ended).

``--copy-only`` times the NIC model alone: every rank writes to its same-rail peer on the
other node through one endpoint, no proxy, no kernels (``_C.ipc_copy_test``).

No NIC is involved: the model stands for one, with the semantics of the verbs transport (see
docs/architecture.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import os
import re
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.common import (
    add_json_argument,
    bench_main,
    cpu_map_line,
    cpu_map_ms,
    cpu_seconds,
    register_bench,
    write_json,
)
from uccl_ep_megatron.bench.inputs import add_shape_arguments, dispatch_kwargs, routed_inputs
from uccl_ep_megatron.bench.timing import kernel_name, per_call_kernel_us
from uccl_ep_megatron.cluster.local import RankPool, visible_gpus


def _floats(text: str) -> list[float]:
    return [float(t) for t in str(text).split(",") if t.strip()]


def _ints(text: str) -> list[int]:
    return [int(t) for t in str(text).split(",") if t.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench internode`` (see docs/cli.md)."""
    parser.add_argument(
        "--ranks", type=int, default=0, help="ranks; 0 = one per visible GPU (at least 2)"
    )
    parser.add_argument(
        "--ranks-per-node", type=int, default=0, help="ranks per virtual node; 0 = half the ranks"
    )
    parser.add_argument(
        "--num-gpus", type=int, default=0, help="GPUs to place the ranks on; 0 = all visible"
    )
    add_shape_arguments(parser)
    parser.add_argument("--sms", type=int, default=24, help="SM budget (2 per channel)")
    parser.add_argument("--threads", default="4", help="proxy thread counts, comma-separated")
    parser.add_argument(
        "--link-gbps",
        default="50",
        help="NIC line rates in GB/s per GPU, comma-separated; 0 = none",
    )
    parser.add_argument(
        "--latency-us", default="3", help="one-way NIC latencies in us, comma-separated"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also report each op's GPU kernels (one call)"
    )
    parser.add_argument(
        "--profile-dir",
        default="",
        help="with --profile: also write each rank's profiled calls here as Chrome traces",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also report where each kernel role's time goes (one traced call per op; "
        "pipelined: its last combine) and where the modelled wire's time went",
    )
    parser.add_argument(
        "--chunk",
        default="0",
        help="dispatch tokens per RDMA write (Config.num_max_rdma_chunked_send_tokens), "
        "comma-separated; 0 = the library's default",
    )
    parser.add_argument(
        "--combine-chunk", type=int, default=0, help="combine tokens per RDMA write; 0 = default"
    )
    parser.add_argument("--ring", type=int, default=0, help="ring slots per channel; 0 = default")
    parser.add_argument("--fp8", action="store_true", help="also time FP8 dispatch")
    parser.add_argument(
        "--sync-free", action="store_true", help="also time sync-free dispatch and combine"
    )
    parser.add_argument(
        "--pipeline",
        type=int,
        default=0,
        help="with --sync-free: also time this many sync-free dispatch + combine pairs back to "
        "back (per pair, after the first); 0 = off",
    )
    parser.add_argument(
        "--kernel-calls",
        type=int,
        default=20,
        help="calls per op timed back to back under the profiler for the transfer time (the "
        "row-moving kernels alone, as DeepEP's benchmark times them); 0 = off",
    )
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per op")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per op")
    parser.add_argument("--reorder", action="store_true", help="SRD: unordered delivery")
    parser.add_argument(
        "--delivery",
        default="store",
        help="how the NIC model gets write bytes to GPUs (UCCL_EP_IPC_DELIVERY), comma-separated: "
        "store (the kernels store them in the receiver's ring) and/or copy (copy engines)",
    )
    parser.add_argument(
        "--intranode-ref", action="store_true", help="also time the tokens intranode (one node)"
    )
    parser.add_argument(
        "--copy-only",
        default="",
        help="time the NIC model alone with writes of these sizes in bytes, comma-separated",
    )
    parser.add_argument(
        "--window", type=int, default=256, help="--copy-only: writes in flight (1 = latency)"
    )
    parser.add_argument("--rdma-bytes", type=int, default=1 << 30, help="Buffer num_rdma_bytes")
    parser.add_argument("--nvl-bytes", type=int, default=1 << 30, help="Buffer num_nvl_bytes")
    parser.add_argument(
        "--arena-bytes",
        type=int,
        default=4 << 30,
        help="receive arena of the internode Buffer (ranks per node > 1): room for the outputs "
        "of every op the bench keeps at once",
    )
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``internode`` to a ``bench`` subparser set (for cli/bench.py)."""
    register_bench(
        subparsers,
        "internode",
        "internode HT dispatch/combine over virtual nodes (ipc NIC model)",
        add_arguments,
        run,
    )


def run(args: argparse.Namespace) -> int:
    """Spawn the ranks, time every configuration, print the table."""
    if args.pipeline < 0 or (args.pipeline and not args.sync_free):
        raise SystemExit(
            f"--pipeline={args.pipeline}: give a count of pairs >= 1 together with --sync-free "
            "(the pairs are sync-free calls), or 0"
        )
    if args.kernel_calls < 0:
        raise SystemExit(f"--kernel-calls={args.kernel_calls}: give a count of calls, or 0 (off)")
    deliveries = [d.strip() for d in args.delivery.split(",") if d.strip()]
    if not deliveries or any(d not in ("store", "copy") for d in deliveries):
        raise SystemExit(f"--delivery={args.delivery!r}: give store, copy or store,copy")
    gpus = args.num_gpus or visible_gpus()
    world = args.ranks or gpus
    local = args.ranks_per_node or world // 2
    if gpus < 1:
        raise SystemExit("bench internode needs a GPU")
    if world < 2 or local < 1 or world % local or world // local < 2:
        raise SystemExit(
            f"--ranks={world} --ranks-per-node={local}: give at least 2 virtual nodes of equal "
            "size, e.g. --ranks 4 --ranks-per-node 2"
        )
    threads, links, chunks = _ints(args.threads), _floats(args.link_gbps), _ints(args.chunk)
    lats = _floats(args.latency_us)
    if not threads or any(t < 1 or t > 8 for t in threads):
        raise SystemExit(f"--threads={args.threads!r}: give counts in 1..8, e.g. 1,2,4")
    if not links or not lats or any(v < 0 for v in links + lats):
        raise SystemExit("--link-gbps and --latency-us must be >= 0 (0 = unthrottled / none)")
    meta = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "sms": args.sms,
        "world": world,
        "ranks_per_node": local,
        "latency_us": lats,
        "delivery": deliveries,
        "reorder": bool(args.reorder),
    }
    # How fast each CPU runs right now, before and after: the proxies' and the NIC model's
    # threads move fewer commands on a slow one.
    cpu_before = cpu_map_ms()
    with RankPool(world, num_gpus=gpus, task_timeout_s=1800) as pool:
        meta["shared_gpu"] = pool.placement.shared
        if args.copy_only:
            rows = pool.run(_copy_worker, vars(args), local, links, _ints(args.copy_only), lats[0])
        else:
            rows = pool.run(_worker, vars(args), local, threads, links, chunks, lats, deliveries)
    meta["cpu_map_ms"] = {"before": cpu_before, "after": cpu_map_ms()}
    results = {"meta": meta, "rows": [r for part in rows for r in part]}
    meta["gpu"] = next((r["gpu"] for r in results["rows"] if "gpu" in r), "")
    _print(results)
    print(cpu_map_line(cpu_before, meta["cpu_map_ms"]["after"]))
    _print_kernels(results)
    write_json(args.json, results)
    return 0


def _time(fn, iters: int, warmup: int) -> tuple[list[float], list[float], list[float]]:
    """Device µs of each call after ``warmup`` untimed ones, the host µs until each call
    returned, and for ``pipelined`` the device µs from the end of its first pair to the end
    of its last (the steady state, no first host path in it; else empty); ranks start each
    call together."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times, host, steady = [], [], []
    marks = getattr(fn, "marks", None)
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
        if marks:
            steady.append(marks[0].elapsed_time(end) * 1e3)
    return times, host, steady


def _slowest(times: list[float]) -> float:
    """Median over iterations of the slowest rank's time."""
    t = torch.tensor(times, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def _ops(buf, a: dict, x, x_fp8, layout, idx, w, cfgs) -> tuple[dict, dict]:
    """The timed calls, name -> function, and the state they share (what combine needs)."""
    state: dict[str, Any] = {}
    dcfg, ccfg = cfgs

    def dispatch(inp, key, worst=0):
        kw = dispatch_kwargs(layout, idx, w)
        state[key] = buf.dispatch(inp, config=dcfg, num_worst_tokens=worst, **kw)

    def combine(key):  # of that BF16 dispatch's rows
        out = state[key]
        buf.combine(out[0], out[4], topk_weights=out[2], config=ccfg)

    ops = {"dispatch": functools.partial(dispatch, x, "bf16")}
    if a["fp8"]:
        ops["dispatch_fp8"] = functools.partial(dispatch, x_fp8, "fp8")
    ops["combine"] = functools.partial(combine, "bf16")
    if a["sync_free"]:
        # num_worst_tokens: no host sync in either call; the GPU alone sizes and checks.
        worst = a["tokens"] * dist.get_world_size()
        ops["dispatch_sync_free"] = functools.partial(dispatch, x, "free", worst)
        if a["fp8"]:
            ops["dispatch_fp8_sync_free"] = functools.partial(dispatch, x_fp8, "fp8free", worst)
        ops["combine_sync_free"] = functools.partial(combine, "free")
        if a.get("pipeline", 0) > 0:
            pairs = a["pipeline"]

            marks: list[torch.cuda.Event] = []

            def pipelined():
                marks.clear()
                for i in range(pairs):
                    dispatch(x, "pipe", worst)
                    combine("pipe")
                    if i == 0 and pairs > 1:  # the steady state starts after the first pair
                        marks.append(torch.cuda.Event(enable_timing=True))
                        marks[0].record()

            pipelined.calls_per_run = pairs  # type: ignore[attr-defined]
            pipelined.marks = marks  # type: ignore[attr-defined]
            ops["pipelined"] = pipelined
    return ops, state


def _configs(world: int, local: int, a: dict, chunk: int):
    """The library's dispatch and combine configs for ``world`` ranks in nodes of ``local`` at
    ``a``'s SM budget, with the chunk sizes and ring capacity the flags override."""
    from uccl_ep_megatron.core.config import default_combine_config, default_dispatch_config

    d: dict[str, int] = {}
    c: dict[str, int] = {}
    if chunk:
        d["num_max_rdma_chunked_send_tokens"] = chunk
    if a["combine_chunk"]:
        c["num_max_rdma_chunked_send_tokens"] = a["combine_chunk"]
    if a["ring"]:
        d["num_max_rdma_chunked_recv_tokens"] = c["num_max_rdma_chunked_recv_tokens"] = a["ring"]
    return (
        dataclasses.replace(default_dispatch_config(world, a["sms"], local), **d),
        dataclasses.replace(default_combine_config(world, a["sms"], local), **c),
    )


# The kernels that move a call's rows and complete it (DeepEP's benchmark times its single
# ``dispatch`` / ``combine`` kernel, whose own barriers are inside it): not the call header's
# row and all-gather, the verdict, the index tables, the routing check or the poison fold.
_TRANSFER_KERNELS = (
    "dispatch_kernel",
    "dispatch_finish_kernel",
    "combine_stage_kernel",
    "combine_kernel",
    "node_barrier_kernel",
)


def transfer_kernels_us(launches: list[tuple[str, float]], calls: int) -> dict[str, float]:
    """Device µs per call of each row-moving kernel (``_TRANSFER_KERNELS``) among the
    ``(kernel name, µs)`` launches of ``calls`` calls (``per_call_kernel_us``); the other
    kernels (call header, tables, checks, NCCL, poison fold) are left out."""
    return per_call_kernel_us([(n, us) for n, us in launches if n in _TRANSFER_KERNELS], calls)


@functools.cache
def _sleep_cycles_per_us() -> float:
    """Clock cycles per µs of ``torch.cuda._sleep`` on this GPU (measured once per process)."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # loads the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def _transfer(fn, calls: int, hold_us: float = 0.0) -> dict:
    """Device µs per call of the row-moving kernels of ``calls`` calls made back to back (no
    barrier between them, as DeepEP's ``bench_kineto``), the max over ranks, and this rank's
    µs per kernel of them. ``hold_us`` > 0 (calls with no host wait): the calls are enqueued
    behind a sleep kernel of that long, so they run back to back whatever their host paths
    (keys ``xq_*``; ``xq_held``: every rank finished enqueueing before its hold ended)."""
    from torch.profiler import ProfilerActivity, profile

    key = "xq" if hold_us > 0 else "xfer"
    cycles = int(hold_us * _sleep_cycles_per_us()) if hold_us > 0 else 0
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        if cycles:
            torch.cuda._sleep(cycles)
        for _ in range(calls):
            fn()
        enqueued_us = (time.perf_counter() - t0) * 1e6
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    launches = [
        (kernel_name(ev.name), ev.device_time) for ev in prof.events() if ev.device_type == cuda
    ]
    kernels = transfer_kernels_us(launches, calls)
    held = float(enqueued_us < hold_us) if cycles else 1.0
    mine = torch.tensor([sum(kernels.values()), -held], dtype=torch.float64, device="cuda")
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    out = {f"{key}_us": float(mine[0].item()), f"{key}_kernels_us": kernels}
    if cycles:
        out["xq_held"] = bool(mine[1].item() < 0)  # every rank's -held was -1
    return out


def _kernel_times(fn, per: int = 1, path: str = "") -> dict[str, float]:
    """GPU time per kernel name of one call (torch profiler; of ``per`` calls: per call), and
    the call's host time; the profile goes to ``path`` as a Chrome trace when given."""
    from torch.profiler import ProfilerActivity, profile

    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0
        torch.cuda.synchronize()
    if path:
        prof.export_chrome_trace(path)
    out = {"host_call": host * 1e6 / per}
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if dev and e.key and not e.key.startswith(("cudaLaunch", "cudaStream", "cudaEvent")):
            if getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
                continue
            key = re.sub(r"\(anonymous namespace\)::|uccl_ep::|void |<.*", "", e.key)[:40]
            out[key] = out.get(key, 0.0) + dev / per
    return out


_ROLES = {"dispatch": ("sender", "forwarder"), "combine": ("forwarder", "receiver")}


def _block_times(fn, backend, channels: int, op: str) -> dict:
    """One traced call: per kernel role (even blocks, odd blocks), the mean over its blocks of
    the time from kernel entry to exit and how it splits into waiting, planning (counter reads
    of rounds that found work), moving rows and pushing commands, in us; rounds with work and
    without. ``entry_skew_us``: the latest block's entry after the first's."""
    backend.set_trace(True)
    try:
        dist.barrier()
        torch.cuda.synchronize()
        fn()
        torch.cuda.synchronize()
        blocks = backend.read_trace(channels)
    finally:
        backend.set_trace(False)
    first = min(b[0] for b in blocks)
    out: dict = {"entry_skew_us": (max(b[0] for b in blocks) - first) / 1e3}
    names = ("span", "rounds", "waits", "wait", "plan", "move", "push")
    for parity, role in enumerate(_ROLES["combine" if "combine" in op else "dispatch"]):
        mine = blocks[parity::2]
        vals = [[b[1] - b[0], b[2], b[3], b[4], b[5], b[6], b[7]] for b in mine]
        mean = [sum(v[i] for v in vals) / len(vals) for i in range(len(names))]
        out[role] = {
            (n if n in ("rounds", "waits") else f"{n}_us"): (
                m if n in ("rounds", "waits") else m / 1e3
            )
            for n, m in zip(names, mean, strict=True)
        }
        out[role]["last_exit_us"] = max(b[1] for b in mine) / 1e3 - first / 1e3
    return out


def _measure(buf, name: str, fn, a: dict, rank: int) -> dict:
    ep = buf._backend.proxy
    s0, n0 = ep.stats(), ep.nic_stats()
    c0, k0, t0 = cpu_seconds("ueproxy"), cpu_seconds("uenic"), time.perf_counter()
    times, host, steady = _time(fn, a["iters"], a["warmup"])
    wall = time.perf_counter() - t0
    s1, n1 = ep.stats(), ep.nic_stats()
    c1, k1 = cpu_seconds("ueproxy"), cpu_seconds("uenic")
    buf._backend.check()
    per = getattr(fn, "calls_per_run", 1)  # ``pipelined``: report per pair
    calls = (a["iters"] + a["warmup"]) * per
    rdma = (s1["bytes_posted"] - s0["bytes_posted"]) / calls
    us_cold = _slowest(times) / per
    if steady:
        # Per pair of the steady state: the pairs after the first one, as a training step's
        # later calls run (their host paths hidden behind the kernels before them).
        us = _slowest(steady) / (per - 1)
        own = statistics.median(steady) / (per - 1)
    else:
        us, own = us_cold, statistics.median(times) / per
    return {
        "rank": rank,
        "op": name,
        "us": us,
        "us_own": own,
        "us_with_first": us_cold,
        "host_us": statistics.median(host) / per,
        "rdma_mb": rdma / 1e6,
        "gbps": rdma / us / 1e3,
        "cmds_per_s": (s1["commands"] - s0["commands"]) / wall,
        "proxy_cpu": (c1 - c0) / wall,
        "nic_cpu": (k1 - k0) / wall,
        "copies": (n1["copies"] - n0["copies"]) / calls,
        "writes": (n1["writes"] - n0["writes"]) / calls,
        "held_out_of_order": s1["held_out_of_order"] - s0["held_out_of_order"],
        "gpu": torch.cuda.get_device_name(),
        **_wire(n0, n1, calls),
    }


def _wire(n0: dict, n1: dict, calls: int) -> dict:
    """Where the modelled egress wire's time went (line-rate model only), per call (per pair
    for ``pipelined``): busy, idle in gaps under 50 us (posts not keeping up within a call) and
    in longer gaps (between calls, the pauses between timed runs included); per message, the
    mean wait for the wire behind earlier messages, the NIC thread's own lag from post to
    pickup, and how long after its modelled arrival it was delivered (copies, the thread); the
    busy passes of the NIC thread and its DMA thread and their time per step."""
    if "wire_gaps_short" not in n1 or not n1.get("wire_busy_ns"):
        return {}
    steps = ("pickup", "submit", "poll", "deliver", "acks")
    keys = ("wire_", "nic_lag", "late", "busy_passes", "dma_passes")
    keys += tuple(f"{x}_ns" for x in steps)
    d = {k: n1[k] - n0.get(k, 0) for k in n1 if k.startswith(keys)}
    writes = max(1, n1["writes"] - n0["writes"])
    pairs = calls  # per call; ``pipelined`` counts its pairs as calls
    return {
        "wire": {
            "busy_us": d["wire_busy_ns"] / 1e3 / pairs,
            "idle_short_us": d["wire_idle_short_ns"] / 1e3 / pairs,
            "gaps_short": d["wire_gaps_short"] / pairs,
            "idle_long_us": d["wire_idle_long_ns"] / 1e3 / pairs,
            "gaps_long": d["wire_gaps_long"] / pairs,
            "queue_us_per_write": d["wire_queue_ns"] / 1e3 / writes,
            "nic_lag_us_per_write": d["nic_lag_ns"] / 1e3 / writes,
            "late_us_per_write": d["late_ns"] / 1e3 / writes,
            "nic_passes": d["busy_passes"] / pairs,
            "dma_passes": d.get("dma_passes", 0) / pairs,
            "nic_step_us": {x: d[f"{x}_ns"] / 1e3 / pairs for x in steps},
        }
    }


def _worker(rank, world, a, local, threads, links, chunks, lats, deliveries) -> list[dict]:
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.core.options import BufferOptions

    E, T, H = a["experts"], a["tokens"], a["hidden"]
    idx, w, x = routed_inputs(a, rank)
    x_fp8 = (
        x.float().clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(T, H // 128, device="cuda") + 0.5,
    )
    rows = []
    sweep = itertools.product(deliveries, links, lats, threads, chunks)
    for delivery, link, lat, nt, chunk in sweep:
        options = BufferOptions(
            backend="kernels",
            ranks_per_node=local,
            transport="ipc",
            ipc_reorder=bool(a["reorder"]),
            num_proxy_threads=nt,
            ipc_link_gbps=link,
            ipc_latency_us=lat,
            ipc_delivery=delivery,
            arena_bytes=a["arena_bytes"],
        )
        buf = Buffer(None, a["nvl_bytes"], a["rdma_bytes"], options=options)
        cfgs = _configs(world, local, a, chunk)
        layout = buf.get_dispatch_layout(idx, E)[:4]
        ops, _ = _ops(buf, a, x, x_fp8, layout, idx, w, cfgs)
        be = buf._backend
        for name, fn in ops.items():
            placed = (be.placed_dispatches, be.placed_combines)
            r = _measure(buf, name, fn, a, rank)
            # Calls whose node peers wrote or read their rows in this rank's receive arena (not
            # through the NVLink staging), of this op's timed and warm-up calls.
            r["placed"] = [be.placed_dispatches - placed[0], be.placed_combines - placed[1]]
            r.update(
                delivery=delivery,
                threads=nt,
                link_gbps=link,
                latency_us=lat,
                chunk=(cfgs[1] if "combine" in name else cfgs[0]).num_max_rdma_chunked_send_tokens,
                line=(r["gbps"] / link) if link else None,
            )
            if a["kernel_calls"] > 0 and name != "pipelined":
                r.update(_transfer(fn, a["kernel_calls"]))
                if "sync_free" in name:
                    # Long enough for every call's host path, with room for a slow spell.
                    hold = 2 * a["kernel_calls"] * r["host_us"] + 5000
                    r.update(_transfer(fn, a["kernel_calls"], hold_us=hold))
                for key in ("xfer", "xq"):
                    us = r.get(f"{key}_us")
                    if us is not None:
                        r[f"{key}_gbps"] = r["rdma_mb"] / us * 1e3 if us else None
                        gbps = r[f"{key}_gbps"]
                        r[f"{key}_line"] = gbps / link if link and gbps else None
            if a["profile"]:
                path = ""
                if a["profile_dir"]:
                    os.makedirs(a["profile_dir"], exist_ok=True)
                    label = f"{name}-link{link:g}-thr{nt}-chunk{chunk}-rank{rank}.json"
                    path = os.path.join(a["profile_dir"], label)
                r["kernels_us"] = _kernel_times(fn, getattr(fn, "calls_per_run", 1), path)
            if a["trace"]:
                # ``pipelined``: the blocks of its last launch, the last pair's combine.
                op = "combine" if name == "pipelined" else name
                cfg = cfgs[1] if "combine" in op else cfgs[0]
                r["trace"] = _block_times(fn, buf._backend, cfg.num_channels, op)
            rows.append(r)
        buf.destroy()
    if a["intranode_ref"]:
        rows += _intranode_reference(rank, world, a, x, x_fp8, idx, w)
    dist.barrier()
    return rows


def _intranode_reference(rank, world, a, x, x_fp8, idx, w) -> list[dict]:
    """The same tokens through the intranode kernels, every rank in one node."""
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.core.options import BufferOptions

    options = BufferOptions(backend="kernels", ranks_per_node=world)
    buf = Buffer(None, a["nvl_bytes"], 0, options=options)
    layout = buf.get_dispatch_layout(idx, a["experts"])[:4]
    cfgs = _configs(world, world, a, 0)
    ops, _ = _ops(buf, a, x, x_fp8, layout, idx, w, cfgs)
    rows = []
    for name, fn in ops.items():
        times, _, steady = _time(fn, a["iters"], a["warmup"])
        per = getattr(fn, "calls_per_run", 1)
        us = _slowest(steady) / (per - 1) if steady else _slowest(times) / per
        rows.append({"rank": rank, "op": name, "us": us, "intranode_ref": True})
    buf.destroy()
    return rows


def _copy_worker(rank, world, a, local, links, sizes, latency) -> list[dict]:
    from uccl_ep_megatron.core import _c
    from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint

    c = _c.load()
    span = 256 << 20
    region = torch.empty(2 * span, dtype=torch.uint8, device="cuda")
    peer = (rank + local) % world  # same rail, next virtual node
    rows = []
    for link in links:
        cfg = ProxyConfig(
            num_channels=1,
            num_threads=1,
            transport="ipc",
            ipc_link_gbps=link,
            ipc_latency_us=latency,
        )
        ep = ProxyEndpoint(
            region.data_ptr(), region.numel(), device=torch.cuda.current_device(), config=cfg
        )
        ep.connect(start_proxy=False)
        for size in sizes:
            # ~2 GiB per rank and size; with one write in flight, 2000 round trips.
            writes = max(64, int((2 << 30) // size)) if a["window"] > 1 else 2000
            dist.barrier()
            n0, k0 = ep.nic_stats(), cpu_seconds("uenic")
            secs, _ = c.ipc_copy_test(
                ep.transport, peer, 0, span, span, size, writes, a["window"], writes, 120.0
            )
            n1, k1 = ep.nic_stats(), cpu_seconds("uenic")
            rows.append(
                {
                    "rank": rank,
                    "op": "copy_only",
                    "link_gbps": link,
                    "write_bytes": size,
                    "gbps": writes * size / secs / 1e9,
                    "line": (writes * size / secs / 1e9 / link) if link else None,
                    "copies": n1["copies"] - n0["copies"],
                    "batches": n1["batches"] - n0["batches"],
                    "nic_cpu": (k1 - k0) / secs,
                    "window": a["window"],
                    "us_per_write": secs / writes * 1e6,
                    "gpu": torch.cuda.get_device_name(),
                }
            )
        dist.barrier()
        ep.close()
        del ep
    return rows


def _avg(rs: list[dict], k: str) -> float:
    vals = [r[k] for r in rs if r.get(k) is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _num(v: float, width: int, digits: int) -> str:
    """``v`` right-aligned in ``width``, blank where there is none (NaN)."""
    return " " * width if math.isnan(v) else f"{v:>{width}.{digits}f}"


def _print(results: dict) -> None:
    meta = results["meta"]
    where = "ranks sharing GPUs under MPS" if meta["shared_gpu"] else "one rank per GPU"
    nodes = meta["world"] // meta["ranks_per_node"]
    print(
        f"internode HT, {meta['world']} ranks ({where}) as {nodes} virtual nodes x "
        f"{meta['ranks_per_node']}, ipc NIC model, latency {meta['latency_us']} us"
        f"{', SRD' if meta['reorder'] else ''}: {meta['tokens']} tokens/rank, hidden "
        f"{meta['hidden']}, top-{meta['topk']} of {meta['experts']}, {meta['sms']} SMs"
    )
    groups: dict[tuple, list[dict]] = {}
    for r in results["rows"]:
        key = (
            r.get("delivery", ""),
            r["op"],
            r.get("link_gbps"),
            r.get("latency_us"),
            r.get("threads"),
            r.get("chunk"),
            r.get("write_bytes"),
            r.get("intranode_ref", False),
        )
        groups.setdefault(key, []).append(r)
    print(
        f"{'bytes':<6}{'op':<13}{'link':>6}{'lat':>5}{'thr':>4}{'chunk':>6}{'us':>9}{'rdma_MB':>9}"
        f"{'GB/s':>7}{'line':>6}{'cmds/s':>9}{'proxy':>7}{'nic':>6}{'copies':>8}{'host':>7}"
        f"{'xfer':>7}{'xline':>6}{'xq':>7}{'xqline':>7}"
    )
    for (delivery, op, link, lat, nt, chunk, size, ref), rs in groups.items():
        if ref:
            print(f"{'':<6}{op:<13}{'intranode reference (one node)':>39}{_avg(rs, 'us'):>9.0f}")
            continue
        if op == "copy_only":
            print(
                f"{'copy':<6}{op:<13}{link:>6g}{'':>5}{'':>4}{size:>6}"
                f"{_avg(rs, 'us_per_write'):>9.1f}{'':>9}"
                f"{_avg(rs, 'gbps'):>7.1f}"
                f"{_avg(rs, 'line'):>6.2f}{'':>9}{'':>7}{_avg(rs, 'nic_cpu'):>6.2f}"
                f"{_avg(rs, 'copies'):>8.0f}"
            )
            continue
        print(
            f"{delivery:<6}{op:<13}{link:>6g}{lat:>5g}{nt:>4}{chunk:>6}{_avg(rs, 'us'):>9.0f}"
            f"{_avg(rs, 'rdma_mb'):>9.1f}{_avg(rs, 'gbps'):>7.1f}{_avg(rs, 'line'):>6.2f}"
            f"{_avg(rs, 'cmds_per_s'):>9.0f}"
            f"{_avg(rs, 'proxy_cpu'):>7.2f}{_avg(rs, 'nic_cpu'):>6.2f}{_avg(rs, 'copies'):>8.0f}"
            f"{_avg(rs, 'host_us'):>7.0f}{_num(_avg(rs, 'xfer_us'), 7, 0)}"
            f"{_num(_avg(rs, 'xfer_line'), 6, 2)}{_num(_avg(rs, 'xq_us'), 7, 0)}"
            f"{_num(_avg(rs, 'xq_line'), 7, 2)}"
        )


def _print_trace(results: dict) -> None:
    """Per rank and op, where each kernel role's time went (``--trace``)."""
    for r in results["rows"]:
        t = r.get("trace")
        if not t:
            continue
        parts = []
        for role, v in t.items():
            if not isinstance(v, dict):
                continue
            parts.append(
                f"{role} span {v['span_us']:.0f} (wait {v['wait_us']:.0f}, plan {v['plan_us']:.0f},"
                f" move {v['move_us']:.0f}, push {v['push_us']:.0f}; {v['rounds']:.0f} rounds,"
                f" {v['waits']:.0f} waits, last exit {v['last_exit_us']:.0f})"
            )
        print(
            f"  rank{r['rank']} {r.get('delivery', '')} {r['op']} link {r['link_gbps']:g} "
            f"thr {r['threads']}: "
            f"entry skew {t['entry_skew_us']:.0f}; " + "; ".join(parts)
        )
        w = r.get("wire")
        if w:
            print(
                f"    wire per call: busy {w['busy_us']:.0f} us, idle {w['idle_short_us']:.0f} in "
                f"{w['gaps_short']:.0f} gaps < 50 us and {w['idle_long_us']:.0f} in "
                f"{w['gaps_long']:.1f} longer; per write: {w['queue_us_per_write']:.1f} us "
                f"behind earlier writes, NIC lag {w['nic_lag_us_per_write']:.1f} us, delivered "
                f"{w['late_us_per_write']:.1f} us after its modelled arrival"
            )
            st = ", ".join(f"{k} {v:.0f}" for k, v in w["nic_step_us"].items())
            print(
                f"    NIC threads per call: {w['nic_passes']:.0f} busy passes, DMA thread "
                f"{w['dma_passes']:.0f}; us: {st}"
            )


def _print_kernels(results: dict) -> None:
    """Rank 0's GPU kernels per op (``--profile``)."""
    _print_trace(results)
    for r in results["rows"]:
        if r.get("rank") != 0 or "kernels_us" not in r:
            continue
        ks = sorted(r["kernels_us"].items(), key=lambda kv: -kv[1])[:6]
        print(
            f"  rank0 {r['op']} link {r['link_gbps']:g} lat {r['latency_us']:g} thr {r['threads']}"
            f" chunk {r['chunk']}: " + ", ".join(f"{k} {v:.0f}" for k, v in ks)
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m uccl_ep_megatron.bench.internode [flags]``."""
    return bench_main(add_arguments, run, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())

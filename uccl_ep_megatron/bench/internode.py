"""``uccl-ep-megatron bench internode``: internode HT dispatch/combine on virtual nodes.

Spawns ``--ranks`` ranks (default: one per visible GPU; ranks beyond the GPU count share GPUs
under CUDA MPS in a gloo group, see ``uccl_ep_megatron.cluster.local``), splits them into
virtual nodes of ``--ranks-per-node`` (default: half the ranks, so 2 nodes) and times, on the
DeepSeek-V3 HT setting (default 4096 tokens/rank, hidden 7168, top-8 of 256 experts, BF16),
``Buffer.dispatch`` and ``Buffer.combine`` of the ``kernels_internode`` backend for each proxy
thread count (``UCCL_EP_NUM_PROXY_THREADS`` 1, 2, 4, 8 by default). Per op it reports:

- ``us``: median device time of the call on the caller's stream (events; a dispatch includes
  its notify and the one host sync for output sizes);
- ``GB/s``: DeepEP's metric, bytes of ``recv_x`` over the time;
- ``rdma_MB``: bytes the proxy posted through the transport per call (token slots incl. their
  metadata; what would cross the NICs), ``nvl_MB``: bytes that reached this rank over NVLink
  from a node peer (0 with one GPU per virtual node);
- ``cmds/s``: TransferCmds the proxy consumed per second of the timed calls;
- ``proxy_cpu``: CPU time of the proxy threads over the wall time (1.0 = one core busy).

What the numbers mean: the transport is ``ipc`` (each "RDMA write" is an asynchronous GPU copy
into the peer's IPC mapping, issued by a CPU proxy thread on its copy queue), not a NIC, so the
times measure the GPU-initiated protocol end to end (FIFO, proxy, ordering, flow control,
forwarding) on this host, not network performance; there is no speed target on ``ipc``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.common import add_json_argument, bench_main, register_bench, write_json
from uccl_ep_megatron.bench.inputs import dispatch_kwargs, routed_inputs
from uccl_ep_megatron.cluster.local import RankPool, visible_gpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench internode`` (see README, internode section)."""
    parser.add_argument(
        "--ranks", type=int, default=0, help="ranks; 0 = one per visible GPU (at least 2)"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=0,
        help="ranks per virtual node (UCCL_EP_RANKS_PER_NODE); 0 = half the ranks",
    )
    parser.add_argument(
        "--num-gpus", type=int, default=0, help="GPUs to place the ranks on; 0 = all visible"
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--experts", type=int, default=256, help="routed experts in total")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--sms", type=int, default=24, help="SM budget (2 per channel)")
    parser.add_argument(
        "--threads", default="1,2,4,8", help="comma-separated proxy thread counts to time"
    )
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per op")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per op")
    parser.add_argument("--reorder", action="store_true", help="ipc reorder/delay injector on")
    parser.add_argument("--rdma-bytes", type=int, default=1 << 30, help="Buffer num_rdma_bytes")
    parser.add_argument("--nvl-bytes", type=int, default=1 << 30, help="Buffer num_nvl_bytes")
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``internode`` to a ``bench`` subparser set (for cli/bench.py)."""
    register_bench(
        subparsers,
        "internode",
        "internode HT dispatch/combine over virtual nodes (ipc proxy)",
        add_arguments,
        run,
    )


def run(args: argparse.Namespace) -> int:
    """Spawn the ranks, time every thread count, print the table."""
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
    threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    if not threads or any(t < 1 or t > 8 for t in threads):
        raise SystemExit(f"--threads={args.threads!r}: give counts in 1..8, e.g. 1,2,4,8")
    with RankPool(world, num_gpus=gpus, task_timeout_s=1800) as pool:
        rows = pool.run(_worker, vars(args), local, threads)
    meta = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "experts": args.experts,
        "topk": args.topk,
        "sms": args.sms,
        "world": world,
        "ranks_per_node": local,
        "shared_gpu": pool.placement.shared,
    }
    results = {"meta": meta, "rows": [r for part in rows for r in part]}
    _print(results)
    write_json(args.json, results)
    return 0


def proxy_cpu_seconds() -> float:
    """CPU seconds (user + system) of this process's proxy threads (named ``ueproxy*``)."""
    total = 0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("ueproxy"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except OSError:
            continue  # the thread exited between listdir and open
    return total / tick


def _dispatch(buf, layout, x, idx, w, config, state: dict) -> None:
    out = buf.dispatch(x, config=config, **dispatch_kwargs(layout, idx, w))
    state["recv_x"], state["handle"], state["w"] = out[0], out[4], out[2]


def _combine(buf, config, state: dict) -> None:
    buf.combine(state["recv_x"], state["handle"], topk_weights=state["w"], config=config)


def _worker(rank: int, world: int, a: dict, local: int, threads: list[int]) -> list[dict]:
    os.environ["UCCL_EP_RANKS_PER_NODE"] = str(local)
    os.environ["UCCL_EP_TRANSPORT"] = "ipc"
    os.environ["UCCL_EP_IPC_REORDER"] = "1" if a["reorder"] else "0"
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.core.config import Config

    H, E = a["hidden"], a["experts"]
    idx, w, x = routed_inputs(a, rank)
    config = Config(a["sms"])
    rows = []
    for nt in threads:
        os.environ["UCCL_EP_NUM_PROXY_THREADS"] = str(nt)
        buf = Buffer(None, a["nvl_bytes"], a["rdma_bytes"], backend="kernels")
        ep = buf._backend.proxy
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
        state: dict[str, Any] = {}

        layout = (per_rank, per_rdma, per_expert, in_rank)
        do_dispatch = functools.partial(_dispatch, buf, layout, x, idx, w, config, state)
        do_combine = functools.partial(_combine, buf, config, state)

        for name, fn in (("dispatch", do_dispatch), ("combine", do_combine)):
            for _ in range(a["warmup"]):
                fn()
            torch.cuda.synchronize()
            buf._backend.check()
            s0, c0, t0 = ep.stats(), proxy_cpu_seconds(), time.perf_counter()
            times = []
            for _ in range(a["iters"]):
                dist.barrier()
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            wall = time.perf_counter() - t0
            s1, c1 = ep.stats(), proxy_cpu_seconds()
            buf._backend.check()
            h = state["handle"]
            num_recv = h.num_recv_tokens
            recv_bytes = num_recv * H * x.element_size()
            prefix = h.rank_prefix_matrix[:, rank].tolist()
            col = [prefix[0]] + [prefix[s] - prefix[s - 1] for s in range(1, world)]
            nvl_rows = sum(col[s] for s in range(world) if s % local != rank % local)
            us = statistics.median(times)
            rows.append(
                {
                    "rank": rank,
                    "threads": nt,
                    "op": name,
                    "us": us,
                    "gbps": recv_bytes / us / 1e3,
                    "rdma_mb": (s1["bytes_posted"] - s0["bytes_posted"]) / a["iters"] / 1e6,
                    "nvl_mb": nvl_rows * H * x.element_size() / 1e6,
                    "cmds_per_s": (s1["commands"] - s0["commands"]) / wall,
                    "proxy_cpu": (c1 - c0) / wall,
                    "held_out_of_order": s1["held_out_of_order"] - s0["held_out_of_order"],
                }
            )
        buf.destroy()
    dist.barrier()
    return rows


def _print(results: dict) -> None:
    meta = results["meta"]
    where = "ranks sharing GPUs under MPS" if meta["shared_gpu"] else "one rank per GPU"
    nodes = meta["world"] // meta["ranks_per_node"]
    print(
        f"internode HT, {meta['world']} ranks ({where}) as {nodes} virtual nodes x "
        f"{meta['ranks_per_node']} (ipc transport): "
        f"{meta['tokens']} tokens/rank, hidden {meta['hidden']}, top-{meta['topk']} of "
        f"{meta['experts']}, {meta['sms']} SMs; rank-averaged"
    )
    hdr = (
        f"{'op':<9}{'threads':>8}{'us':>10}{'GB/s':>8}{'rdma_MB':>9}{'nvl_MB':>8}"
        f"{'cmds/s':>10}{'proxy_cpu':>10}"
    )
    print(hdr)
    keys: dict[tuple[str, int], list[dict]] = {}
    for r in results["rows"]:
        keys.setdefault((r["op"], r["threads"]), []).append(r)
    for (op, nt), rs in sorted(keys.items(), key=lambda kv: (kv[0][0] != "dispatch", kv[0][1])):

        def avg(k: str, rs=rs) -> float:
            return sum(r[k] for r in rs) / len(rs)

        print(
            f"{op:<9}{nt:>8}{avg('us'):>10.0f}{avg('gbps'):>8.1f}{avg('rdma_mb'):>9.1f}"
            f"{avg('nvl_mb'):>8.1f}{avg('cmds_per_s'):>10.0f}{avg('proxy_cpu'):>10.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    """``python -m uccl_ep_megatron.bench.internode [flags]``."""
    return bench_main(add_arguments, run, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())

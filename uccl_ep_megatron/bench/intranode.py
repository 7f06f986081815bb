"""``uccl-ep-megatron bench intranode``: intranode dispatch/combine vs NCCL and the NVLink floor.

Spawns one process per GPU (NCCL) and, in one run, times on the DeepSeek-V3 HT setting
(default 4096 tokens/rank, hidden 7168, top-8 of 256 experts):

- ``Buffer.dispatch`` BF16 and FP8 and ``Buffer.combine`` BF16 on the ``kernels`` backend;
- NCCL ``all_to_all_single`` of the rank-deduplicated rows (the gather is not timed);
- a peer copy (copy engine, every rank to its right neighbour at once): the NVLink bandwidth,
  from which the floor = bytes that must cross the link / that bandwidth.

Two times per op: ``e2e`` (device events around the call on the caller's stream: includes the
dispatch's one host sync for output sizes) and ``kernel`` (sum of our kernels' device time from
the profiler: DeepEP's metric). GB/s is DeepEP's: bytes of ``recv_x`` (BF16 equivalent for
FP8: (1 + 4/128) / 2 of it) over the time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.spawn import init_rank, routed_inputs, spawn_ranks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench intranode`` (see README, cli-bench)."""
    parser.add_argument("--num-gpus", type=int, default=0, help="ranks (GPUs); 0 = all visible")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--experts", type=int, default=256, help="routed experts in total")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--sms", default="24", help="comma-separated SM budgets to time (even)")
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per op")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per op")
    parser.add_argument("--nvl-bytes", type=int, default=2 << 30, help="Buffer num_nvl_bytes")
    parser.add_argument(
        "--copy",
        choices=["both", "tma", "ldst"],
        default="both",
        help="row copy of the kernels: Hopper bulk copies (tma), 16-byte loads/stores, or both",
    )
    parser.add_argument("--json", default="", help="also write the results to this JSON file")


def register(subparsers: Any) -> None:
    """Adds ``intranode`` to a ``bench`` subparser set (for commands/bench.py)."""
    p = subparsers.add_parser("intranode", help="intranode dispatch/combine vs NCCL all-to-all")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Spawn one rank per GPU, time everything, print the table (rank 0)."""
    world = args.num_gpus or torch.cuda.device_count()
    if world < 2:
        raise SystemExit(f"bench intranode needs >= 2 GPUs, found {torch.cuda.device_count()}")
    results = spawn_ranks(_worker, world, vars(args))
    _print(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


# ---- per-rank work ----------------------------------------------------------------------
def _kernel_us(prof, needle: tuple[str, ...], iters: int) -> tuple[float, dict[str, float]]:
    """Device time per iteration of kernels whose name contains a needle, and per kernel."""
    total = 0.0
    parts: dict[str, float] = {}
    for e in prof.key_averages():
        if any(n in e.key for n in needle):
            dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            us = dev_us / iters
            total += us
            m = re.search(r"(\w+_kernel)", e.key)
            name = m.group(1) if m else e.key[:24]
            parts[name] = parts.get(name, 0.0) + us
    return total, parts


def _time(fn, iters: int, warmup: int, kernel_names: tuple[str, ...]) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            dist.barrier()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    kernel_us, parts = _kernel_us(prof, kernel_names, iters)
    return {"e2e_us": statistics.median(times), "kernel_us": kernel_us, "parts": parts}


def _peer_copy_us(src: torch.Tensor, dst: torch.Tensor, rank: int, peer: int) -> float:
    """Median host-timed copy-engine copy to the peer GPU (both devices synchronized)."""
    times = []
    for i in range(13):
        dist.barrier()
        torch.cuda.synchronize(rank)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(rank)
        torch.cuda.synchronize(peer)
        if i >= 3:
            times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _worker(rank: int, world: int, init_file: str, a: dict, out_path: str) -> None:
    init_rank(rank, world, init_file)
    from uccl_ep_megatron import Buffer, Config

    T, H, E, K = a["tokens"], a["hidden"], a["experts"], a["topk"]
    idx, w, x = routed_inputs(a, rank)
    x_fp8 = (
        x.float().clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(T, H // 128, device="cuda"),
    )
    variants = {"tma": "1", "ldst": "0"}
    if a["copy"] != "both":
        variants = {a["copy"]: variants[a["copy"]]}
    bufs = {}
    for name, flag in variants.items():
        os.environ["UCCL_EP_INTRANODE_TMA"] = flag  # read once, when the backend is created
        bufs[name] = Buffer(None, a["nvl_bytes"], 0, backend="kernels")
    buf = next(iter(bufs.values()))
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    layout = dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=idx,
        topk_weights=w,
    )
    res: dict[str, Any] = {
        "world": world,
        "tokens": T,
        "hidden": H,
        "experts": E,
        "topk": K,
        "device": torch.cuda.get_device_name(),
        "rows": [],
    }

    # NCCL all-to-all of the deduplicated rows (gather done once, untimed).
    order = in_rank.t().nonzero(as_tuple=True)[1]
    send = x[order].contiguous()
    send_counts = in_rank.sum(0).tolist()
    counts = [torch.zeros(world, dtype=torch.int64, device="cuda") for _ in range(world)]
    dist.all_gather(counts, torch.tensor(send_counts, device="cuda"))
    recv_counts = [int(c[rank]) for c in counts]
    recv = torch.empty(sum(recv_counts), H, dtype=x.dtype, device="cuda")

    def a2a():
        dist.all_to_all_single(recv, send, recv_counts, send_counts)

    nccl = _time(a2a, a["iters"], a["warmup"], ("SendRecv", "AllToAll"))
    recv_bytes = sum(recv_counts) * H * 2
    cross_bytes = (sum(recv_counts) - recv_counts[rank]) * H * 2

    # NVLink bandwidth: every rank copies 256 MiB to its right neighbour at the same time.
    peer = (rank + 1) % world
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{peer}")
    bw = n / (_peer_copy_us(src, dst, rank, peer) * 1e-6)
    res.update(
        recv_bytes=recv_bytes,
        cross_bytes=cross_bytes,
        nvlink_GBps=bw / 1e9,
        floor_us=cross_bytes / bw * 1e6,
        nccl=nccl,
    )

    for sms in [int(s) for s in a["sms"].split(",") if s]:
        for name, b in bufs.items():
            rows = _bench_ops(b, Config(sms), x, x_fp8, layout, a, recv_bytes)
            for row in rows:
                row["copy"] = name
            res["rows"].extend(rows)

    # Rank 0 reports; the slowest rank's numbers are what a training step waits for.
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        merged = gathered[0]
        for i, row in enumerate(merged["rows"]):
            for key in ("e2e_us", "kernel_us"):
                row[key] = max(g["rows"][i][key] for g in gathered)
            byts = merged["recv_bytes"] * ((1 + 4 / 128) / 2 if "fp8" in row["op"] else 1.0)
            row["GBps"] = byts / (row["kernel_us"] * 1e-6) / 1e9
            row["e2e_GBps"] = byts / (row["e2e_us"] * 1e-6) / 1e9
        merged["nccl"] = {k: max(g["nccl"][k] for g in gathered) for k in ("e2e_us", "kernel_us")}
        with open(out_path, "w") as f:
            json.dump(merged, f)
    for b in bufs.values():
        b.destroy()
    dist.barrier()
    dist.destroy_process_group()


def _bench_ops(buf, cfg, x, x_fp8, layout: dict, a: dict, recv_bytes: int) -> list[dict]:
    """Times BF16/FP8/cached dispatch and BF16 combine with one SM budget."""
    ours = ("uccl_ep::kernels",)
    state: dict[str, Any] = {}

    def disp_bf16():
        state["out"] = buf.dispatch(x, config=cfg, **layout)

    def disp_fp8():
        buf.dispatch(x_fp8, config=cfg, **layout)

    def comb():
        buf.combine(state["out"][0], state["out"][4], config=cfg)

    def disp_cached():
        buf.dispatch(x, handle=state["out"][4], config=cfg)

    rows = {"dispatch_bf16": _time(disp_bf16, a["iters"], a["warmup"], ours)}
    rows["dispatch_fp8"] = _time(disp_fp8, a["iters"], a["warmup"], ours)
    rows["combine_bf16"] = _time(comb, a["iters"], a["warmup"], ours)
    rows["dispatch_bf16_cached"] = _time(disp_cached, a["iters"], a["warmup"], ours)
    out = []
    for op, t in rows.items():
        byts = recv_bytes * ((1 + 4 / 128) / 2 if "fp8" in op else 1.0)
        t.update(
            op=op,
            sms=cfg.num_sms,
            GBps=byts / (t["kernel_us"] * 1e-6) / 1e9,
            e2e_GBps=byts / (t["e2e_us"] * 1e-6) / 1e9,
        )
        out.append(t)
    return out


def _print(r: dict) -> None:
    nccl = r["nccl"]["e2e_us"]
    nccl_kernel = r["nccl"]["kernel_us"]  # NCCL/op compares like with like: kernel time
    print(
        f"# bench intranode: {r['world']} x {r['device']}, {r['tokens']} tok/rank, hidden "
        f"{r['hidden']}, top-{r['topk']} of {r['experts']} experts (max over ranks)"
    )
    print(
        f"# NVLink peer copy {r['nvlink_GBps']:.0f} GB/s; BF16 dispatch moves "
        f"{r['cross_bytes'] / 1e6:.1f} MB across the link -> floor {r['floor_us']:.1f} us; "
        f"recv_x {r['recv_bytes'] / 1e6:.1f} MB"
    )
    print(f"# NCCL all_to_all_single of dedup rows: {nccl:.1f} us e2e, {nccl_kernel:.1f} us kernel")
    print(
        f"{'op':<22}{'copy':>5}{'SMs':>4}{'kernel us':>10}{'GB/s':>7}{'e2e us':>8}"
        f"{'e2e GB/s':>9}{'NCCL/op':>8}{'op/floor':>9}  per kernel (us)"
    )
    for row in r["rows"]:
        parts = " ".join(f"{k.replace('_kernel', '')}={v:.0f}" for k, v in row["parts"].items())
        print(
            f"{row['op']:<22}{row['copy']:>5}{row['sms']:>4}{row['kernel_us']:>10.1f}"
            f"{row['GBps']:>7.1f}{row['e2e_us']:>8.1f}{row['e2e_GBps']:>9.1f}"
            f"{nccl_kernel / row['kernel_us']:>8.2f}"
            f"{row['kernel_us'] / r['floor_us']:>9.2f}  {parts}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m uccl_ep_megatron.bench.intranode")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

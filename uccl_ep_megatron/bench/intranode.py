"""``uccl-ep-megatron bench intranode``: intranode dispatch/combine, ours beside DeepEP V1.

For each rank count of ``--ranks`` (default: every visible GPU, or 2,4,8 ranks on a one-GPU
machine) the launcher places the ranks round-robin on the GPUs: one rank per GPU over NCCL, or
ranks sharing GPUs under CUDA MPS in a gloo group (peer traffic then crosses the GPU's own HBM,
not NVLink: per-call overhead and kernel efficiency, not link bandwidth). On the DeepSeek-V3 HT
setting (4096 tokens/rank, hidden 7168, top-8 of 256 experts) it times, with the same inputs
and the same SM budget:

- ``Buffer.dispatch`` BF16, FP8, cached BF16 and ``Buffer.combine`` BF16 of our ``kernels``
  backend (bulk-copy and/or load/store row paths), and BF16 dispatch + combine in sync-free
  mode (``num_worst_tokens`` = tokens x ranks: no host sync; the ``_worst`` rows);
- the same calls of DeepEP V1's ``deep_ep.Buffer`` when ``deep_ep`` is importable
  (``--deepep off`` to skip), after checking that both give the same received rows, ids,
  weights, counts and combined output;
- NCCL ``all_to_all_single`` of the rank-deduplicated rows where NCCL can run (own GPUs);
- the floor: bytes that must move over the measured bandwidth (peer copy over NVLink with own
  GPUs; one read plus one write of every received row through HBM when ranks share a GPU).

Per call and rank, ``device us`` is the time between CUDA events recorded on the caller's
stream around the call (it includes any host sync inside the call) and ``host us`` the CPU time
spent inside the call; each iteration takes the maximum over ranks, and the table shows the
median over ``--iters`` iterations with min and max. GB/s is DeepEP's: bytes of ``recv_x``
(BF16-equivalent for FP8: (1 + 4/128) / 2 of it) over the device time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.common import add_json_argument, bench_main, register_bench, write_json
from uccl_ep_megatron.bench.inputs import dispatch_kwargs, routed_inputs
from uccl_ep_megatron.cluster.local import RankPool, visible_gpus

OPS = (
    "dispatch_bf16",
    "dispatch_fp8",
    "dispatch_bf16_cached",
    "combine_bf16",
    "dispatch_bf16_worst",
    "combine_bf16_worst",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench intranode`` (see README, cli-bench)."""
    parser.add_argument(
        "--ranks",
        default="",
        help="comma-separated rank counts, e.g. 2,4,8; default: all visible GPUs (2,4,8 on one)",
    )
    parser.add_argument(
        "--num-gpus", type=int, default=0, help="GPUs to place the ranks on; 0 = all visible"
    )
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--experts", type=int, default=256, help="routed experts in total")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument("--sms", default="24", help="comma-separated SM budgets to time (even)")
    parser.add_argument("--iters", type=int, default=30, help="timed iterations per op (>= 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per op")
    parser.add_argument("--nvl-bytes", type=int, default=2 << 30, help="Buffer num_nvl_bytes")
    parser.add_argument(
        "--copy",
        choices=["both", "tma", "ldst"],
        default="ldst",
        help="row copy of our kernels: 16-byte loads/stores (ldst, the library's default), "
        "Hopper bulk copies (tma), or both",
    )
    parser.add_argument(
        "--deepep",
        choices=["auto", "on", "off"],
        default="auto",
        help="time DeepEP V1 beside ours: auto = when deep_ep imports; on = fail without it",
    )
    parser.add_argument(
        "--deepep-sms",
        type=int,
        default=0,
        help="time DeepEP at this one SM budget (capped like ours) and compare every --sms row "
        "of ours with it; 0 = DeepEP at each --sms budget",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="after timing, profile N more calls per op on rank 0 and print the mean device "
        "time per kernel (torch.profiler); 0 = off",
    )
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``intranode`` to a ``bench`` subparser set (for commands/bench.py)."""
    register_bench(
        subparsers,
        "intranode",
        "intranode dispatch/combine vs DeepEP V1 and NCCL all-to-all",
        add_arguments,
        run,
    )


def rank_counts(spec: str, num_gpus: int) -> list[int]:
    """``--ranks`` as a list; the default is every GPU, or 2,4,8 ranks sharing one GPU."""
    if not spec:
        return [num_gpus] if num_gpus >= 2 else [2, 4, 8]
    try:
        counts = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--ranks={spec!r}: give comma-separated integers, e.g. 2,4,8") from None
    if not counts or any(c not in (2, 4, 8) for c in counts):
        raise SystemExit(f"--ranks={spec!r}: intranode runs at 2, 4 or 8 ranks")
    return counts


def run(args: argparse.Namespace) -> int:
    """Time every rank count, print one table per count, optionally write JSON."""
    gpus = args.num_gpus or visible_gpus()
    if gpus < 1:
        raise SystemExit("bench intranode needs a GPU")
    if args.iters < 20:
        raise SystemExit(f"--iters={args.iters}: take at least 20 timed iterations")
    sms = [int(s) for s in str(args.sms).split(",") if s.strip()]
    if not sms or any(s <= 0 or s % 2 for s in sms):
        raise SystemExit(f"--sms={args.sms!r}: give positive even SM counts, e.g. 12,24")
    if args.deepep_sms < 0 or args.deepep_sms % 2:
        raise SystemExit(f"--deepep-sms={args.deepep_sms}: give a positive even SM count or 0")
    if args.kernels < 0:
        raise SystemExit(f"--kernels={args.kernels}: give a call count >= 0")
    if args.deepep == "on":
        _import_deepep(required=True)
    results = []
    for world in rank_counts(args.ranks, gpus):
        with RankPool(world, num_gpus=gpus, task_timeout_s=1800) as pool:
            per_rank = pool.run(_worker, vars(args), sms)
            results.append(merge(per_rank, pool.placement.shared))
        print_table(results[-1])
        print_kernels(results[-1])
    write_json(args.json, results)
    return 0


# ---- per-rank work ----------------------------------------------------------------------
def _import_deepep(required: bool = False):
    try:
        import deep_ep
    except ImportError as exc:
        if required:
            raise SystemExit(f"--deepep on but deep_ep does not import ({exc})") from None
        return None
    return deep_ep


def time_call(fn, iters: int, warmup: int) -> dict[str, list[float]]:
    """Per-iteration device (events) and host (CPU inside ``fn``) microseconds on this rank;
    every iteration starts together on all ranks (barrier after a device sync)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end) * 1e3)
        host.append((t1 - t0) * 1e6)
    return {"device_us": dev, "host_us": host}


def _kernel_name(full: str) -> str:
    """``void ns::(anonymous namespace)::dispatch_kernel<int4, 8, true>(Params)`` ->
    ``dispatch_kernel``: the kernel's own name, without namespaces, templates or arguments."""
    name = full.replace("(anonymous namespace)::", "")
    name = re.sub(r"<.*", "", name.split("(")[0])
    return name.split("::")[-1].split()[-1] if name.strip() else full[:40]


def profile_kernels(fn, calls: int, rank: int) -> dict[str, float]:
    """Mean device microseconds per call of each kernel ``fn`` launches, on rank 0 (every rank
    makes the calls: they are collective); empty on the other ranks."""
    torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = _kernel_name(ev.name)
            per_kernel[name] = per_kernel.get(name, 0.0) + ev.device_time / calls
    return per_kernel


def _calls(buf, cfgs: tuple[Any, Any], x, x_fp8, layout: dict, state: dict, worst: int) -> dict:
    """The timed calls on one Buffer (ours or DeepEP's: same API); ``worst`` is the
    ``num_worst_tokens`` of the sync-free pair."""
    dcfg, ccfg = cfgs

    # Each call's previous result dies first, as between a layer's calls: a zero-copy output
    # block is then reused instead of the arena filling with results the bench drops anyway
    # (a cached result keeps its handle's block: it returns the handle's source indices).
    def disp_bf16():
        state.pop("cached", None)
        state.pop("out", None)
        state["out"] = buf.dispatch(x, config=dcfg, **layout)

    def disp_fp8():
        state.pop("fp8", None)
        state["fp8"] = buf.dispatch(x_fp8, config=dcfg, **layout)

    def disp_cached():
        state.pop("cached", None)
        state["cached"] = buf.dispatch(x, handle=state["out"][4], config=dcfg)

    def comb():
        state["comb"] = buf.combine(state["out"][0], state["out"][4], config=ccfg)

    def disp_worst():
        state.pop("worst", None)
        state["worst"] = buf.dispatch(x, config=dcfg, num_worst_tokens=worst, **layout)

    def comb_worst():
        state["comb_worst"] = buf.combine(state["worst"][0], state["worst"][4], config=ccfg)

    fns = (disp_bf16, disp_fp8, disp_cached, comb, disp_worst, comb_worst)
    return dict(zip(OPS, fns, strict=True))


def _compare(ours: dict, theirs: dict) -> dict[str, Any]:
    """Ours vs DeepEP on the same inputs: received rows, ids, weights, counts exactly; FP8 bytes
    and scales; the combined output (both sum in fp32; reported as max |diff|)."""
    o, d = ours["out"], theirs["out"]
    same = {
        "recv_x": torch.equal(o[0], d[0]),
        "recv_topk_idx": torch.equal(o[1].long(), d[1].long()),
        "recv_topk_weights": torch.equal(o[2], d[2]),
        "num_recv_tokens_per_expert": list(o[3]) == list(d[3]),
        "recv_x_fp8": torch.equal(
            ours["fp8"][0][0].view(torch.uint8), theirs["fp8"][0][0].view(torch.uint8)
        ),
        "recv_scales_fp8": torch.equal(ours["fp8"][0][1], theirs["fp8"][0][1]),
        "cached_recv_x": torch.equal(ours["cached"][0], theirs["cached"][0]),
        # Sync-free: the received rows (padding past them is each library's own).
        "worst_recv_x": torch.equal(
            ours["worst"][0][: o[0].shape[0]], theirs["worst"][0][: o[0].shape[0]]
        ),
    }
    diff = (ours["comb"][0].float() - theirs["comb"][0].float()).abs()
    same["combine_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    diff = (ours["comb_worst"][0].float() - theirs["comb_worst"][0].float()).abs()
    same["combine_worst_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    return same


def _floor_bandwidth(rank: int, world: int, shared: bool) -> float:
    """Bytes/s for the floor: NVLink peer copy (own GPUs, every rank to its right neighbour at
    once) or HBM device-to-device copy counting read + write (shared GPU, rank 0 alone)."""
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    if shared:
        dst = torch.empty_like(src)
        scale = 2.0  # read + write
        if rank != 0:
            dist.barrier()
            dist.barrier()
            return 0.0
    else:
        dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{(rank + 1) % world}")
        scale = 1.0
    times = []
    for i in range(13):
        if not shared:
            dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    if shared:
        dist.barrier()
        dist.barrier()
    return scale * n / statistics.median(times)


def _worker(rank: int, world: int, a: dict, sms_list: list[int]) -> dict:
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.core.config import Config

    shared = dist.get_backend() == "gloo"
    T, H, E, K = a["tokens"], a["hidden"], a["experts"], a["topk"]
    idx, w, x = routed_inputs(a, rank)
    x_fp8 = (
        x.float().clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(T, H // 128, device="cuda") + 0.5,
    )
    copies = {"tma": "1", "ldst": "0"}
    if a["copy"] != "both":
        copies = {a["copy"]: copies[a["copy"]]}
    ours = {}
    # The receive arena holds the four dispatch results the bench keeps (plain, FP8, cached,
    # sync-free: each at most tokens x ranks rows) unless the caller set its size.
    arena_env = "UCCL_EP_RECV_ARENA_BYTES"
    arena_set = arena_env in os.environ
    if not arena_set:
        os.environ[arena_env] = str(4 * T * world * (H * x.element_size() + 256))
    for name, flag in copies.items():
        os.environ["UCCL_EP_INTRANODE_TMA"] = flag  # read once, when the backend is created
        ours[name] = Buffer(None, a["nvl_bytes"], 0, backend="kernels", explicitly_destroy=True)
    os.environ.pop("UCCL_EP_INTRANODE_TMA", None)
    if not arena_set:
        os.environ.pop(arena_env)
    deep_ep = None if a["deepep"] == "off" else _import_deepep(a["deepep"] == "on")
    # Every rank must agree on whether DeepEP runs (an import may fail on one rank only).
    flags: list[Any] = [None] * world
    dist.all_gather_object(flags, deep_ep is not None)
    if not all(flags):
        deep_ep = None
    theirs = None
    if deep_ep is not None:
        theirs = deep_ep.Buffer(dist.group.WORLD, a["nvl_bytes"], 0, explicitly_destroy=True)

    buf = next(iter(ours.values()))
    ours_layout = buf.get_dispatch_layout(idx, E)[:4]
    per_rank, per_rdma, per_expert, in_rank = ours_layout
    layout = dispatch_kwargs(ours_layout, idx, w)
    res: dict[str, Any] = {
        "world": world,
        "shared_gpu": shared,
        "tokens": T,
        "hidden": H,
        "experts": E,
        "topk": K,
        "device": torch.cuda.get_device_name(),
        "timings": [],
        "deepep": theirs is not None,
        "deepep_sms": a["deepep_sms"],
        "agreement": {},
        "kernels": [],
    }
    if theirs is not None:
        d_layout = theirs.get_dispatch_layout(idx, E)[:4]
        for i, name in ((0, "per_rank"), (2, "per_expert"), (3, "in_rank")):
            res["agreement"][f"layout_{name}"] = torch.equal(
                (per_rank, per_rdma, per_expert, in_rank)[i], d_layout[i]
            )

    # Counts and bytes for GB/s and the floor.
    recv_counts: list[Any] = [None] * world
    dist.all_gather_object(recv_counts, in_rank.sum(0).tolist())
    recv_rows = sum(c[rank] for c in recv_counts)
    res["recv_bytes"] = recv_rows * H * 2
    res["cross_bytes"] = (recv_rows - recv_counts[rank][rank]) * H * 2

    if not shared:  # NCCL all-to-all of the deduplicated rows (gather done once, untimed)
        order = in_rank.t().nonzero(as_tuple=True)[1]
        send = x[order].contiguous()
        send_counts = recv_counts[rank]
        recv_split = [c[rank] for c in recv_counts]
        recv = torch.empty(sum(recv_split), H, dtype=x.dtype, device="cuda")
        res["nccl"] = time_call(
            lambda: dist.all_to_all_single(recv, send, recv_split, send_counts),
            a["iters"],
            a["warmup"],
        )
    res["floor_Bps"] = _floor_bandwidth(rank, world, shared)

    for asked in sms_list:
        # Ranks sharing a GPU must fit side by side (Buffer.max_num_sms); DeepEP gets the same.
        sms = min(asked, buf.max_num_sms or asked)
        mine = (Config(sms), Config(sms))
        timed = {}
        for name, b in ours.items():
            state: dict[str, Any] = {}
            for op, fn in _calls(b, mine, x, x_fp8, layout, state, T * world).items():
                timed[(op, "ours", name, sms)] = time_call(fn, a["iters"], a["warmup"])
                if a["kernels"]:
                    res["kernels"].append(
                        {
                            "op": op,
                            "impl": f"ours-{name}",
                            "sms": sms,
                            "us": profile_kernels(fn, a["kernels"], rank),
                        }
                    )
            if name == next(iter(ours)):
                ours_state = state
        if theirs is not None and (not a["deepep_sms"] or asked == sms_list[0]):
            d_sms = min(a["deepep_sms"] or asked, buf.max_num_sms or asked)
            deep_ep.Buffer.set_num_sms(d_sms)
            cfgs = (
                deep_ep.Buffer.get_dispatch_config(world),
                deep_ep.Buffer.get_combine_config(world),
            )
            d_layout = theirs.get_dispatch_layout(idx, E)[:4]
            d_kw = dispatch_kwargs(d_layout, idx, w)
            dstate: dict[str, Any] = {}
            for op, fn in _calls(theirs, cfgs, x, x_fp8, d_kw, dstate, T * world).items():
                timed[(op, "deepep", "-", d_sms)] = time_call(fn, a["iters"], a["warmup"])
                if a["kernels"]:
                    res["kernels"].append(
                        {
                            "op": op,
                            "impl": "deepep",
                            "sms": d_sms,
                            "us": profile_kernels(fn, a["kernels"], rank),
                        }
                    )
            torch.cuda.synchronize()
            res["agreement"][f"sms{d_sms}"] = _compare(ours_state, dstate)
        for (op, impl, copy, at), t in timed.items():
            res["timings"].append({"op": op, "impl": impl, "copy": copy, "sms": at, **t})

    torch.cuda.synchronize()
    # Dispatches of ours whose outputs did not fit the receive arena (staged, not zero-copy).
    res["arena_fallbacks"] = sum(b._backend.recv_arena.fallbacks for b in ours.values())
    dist.barrier()
    for b in ours.values():
        b.destroy()
    if theirs is not None:
        theirs.destroy()
    dist.barrier()
    return res


# ---- merging and printing (launching process) -------------------------------------------
def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def merge(per_rank: list[dict], shared: bool) -> dict:
    """One result for the rank count: per-iteration max over ranks, then median/min/max."""
    r0 = per_rank[0]
    world = r0["world"]
    out = {k: r0[k] for k in ("world", "tokens", "hidden", "experts", "topk", "device", "deepep")}
    out["shared_gpu"] = shared
    out["arena_fallbacks"] = [r.get("arena_fallbacks", 0) for r in per_rank]
    out["recv_bytes"] = max(r["recv_bytes"] for r in per_rank)
    if shared:
        moved = 2 * sum(r["recv_bytes"] for r in per_rank)  # every row read once, written once
        bw = r0["floor_Bps"]
        out["floor"] = {"what": "HBM read+write of all ranks' rows", "GBps": bw / 1e9}
    else:
        moved = max(r["cross_bytes"] for r in per_rank)
        bw = min(r["floor_Bps"] for r in per_rank)
        out["floor"] = {"what": "peer copy of the rows crossing the link", "GBps": bw / 1e9}
    out["floor"]["us"] = moved / bw * 1e6
    out["agreement"] = [r["agreement"] for r in per_rank]
    if "nccl" in r0:
        out["nccl"] = _max_over_ranks([r["nccl"] for r in per_rank])
    rows = []
    for i, t0 in enumerate(r0["timings"]):
        row = {k: t0[k] for k in ("op", "impl", "copy", "sms")}
        row.update(_max_over_ranks([r["timings"][i] for r in per_rank]))
        byts = out["recv_bytes"] * ((1 + 4 / 128) / 2 if "fp8" in row["op"] else 1.0)
        row["GBps"] = byts / (row["device_us"]["median"] * 1e-6) / 1e9
        rows.append(row)
    out["rows"] = rows
    for row in rows:
        if row["impl"] != "ours":
            continue
        same = [
            q
            for q in rows
            if q["impl"] == "deepep"
            and q["op"] == row["op"]
            and (q["sms"] == row["sms"] or per_rank[0]["deepep_sms"])
        ]
        peer = same[0] if same else None
        if peer is not None:
            row["vs_deepep"] = row["device_us"]["median"] / peer["device_us"]["median"]
    out["kernels"] = r0["kernels"]
    out["world"] = world
    return out


def _max_over_ranks(timings: list[dict]) -> dict[str, dict[str, float]]:
    res = {}
    for key in ("device_us", "host_us"):
        per_iter = [max(vals) for vals in zip(*(t[key] for t in timings), strict=True)]
        res[key] = _stats(per_iter)
    return res


def print_table(r: dict) -> None:
    mode = "ranks sharing GPUs under MPS (gloo)" if r["shared_gpu"] else "one rank per GPU (NCCL)"
    print(
        f"# bench intranode: {r['world']} ranks, {mode}, {r['device']}; {r['tokens']} tok/rank, "
        f"hidden {r['hidden']}, top-{r['topk']} of {r['experts']} (max over ranks per iteration)"
    )
    f = r["floor"]
    print(f"# floor: {f['what']} at {f['GBps']:.0f} GB/s -> {f['us']:.1f} us")
    if "nccl" in r:
        print(f"# NCCL all_to_all_single of dedup rows: {r['nccl']['device_us']['median']:.1f} us")
    if r["deepep"]:
        bad = [
            (i, k, v)
            for i, ag in enumerate(r["agreement"])
            for k, v in _flat(ag)
            if v is False or (k.endswith("max_abs_diff") and v > 0.05)
        ]
        print("# ours vs DeepEP V1 outputs: " + ("identical" if not bad else f"DIFFER {bad[:4]}"))
    print(
        f"{'op':<22}{'impl':>7}{'copy':>5}{'SMs':>4}{'device us':>10}{'(min-max)':>16}"
        f"{'host us':>9}{'GB/s':>7}{'/floor':>7}{'/DeepEP':>8}"
    )
    for row in r["rows"]:
        d, h = row["device_us"], row["host_us"]
        ratio = f"{row['vs_deepep']:.2f}" if "vs_deepep" in row else "-"
        spread = f"({d['min']:.0f}-{d['max']:.0f})"
        print(
            f"{row['op']:<22}{row['impl']:>7}{row['copy']:>5}{row['sms']:>4}{d['median']:>10.1f}"
            f"{spread:>16}{h['median']:>9.1f}{row['GBps']:>7.1f}"
            f"{d['median'] / r['floor']['us']:>7.2f}{ratio:>8}"
        )


def print_kernels(r: dict) -> None:
    """Rank 0's mean device us per kernel per call (``--kernels``), largest first."""
    for k in r.get("kernels", []):
        parts = sorted(k["us"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in parts)
        shown = ", ".join(f"{n} {v:.1f}" for n, v in parts[:5])
        print(f"# kernels {k['op']} {k['impl']} {k['sms']} SMs: {total:.1f} us = {shown}")


def _flat(ag: dict, prefix: str = ""):
    for k, v in ag.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.intranode")


if __name__ == "__main__":
    raise SystemExit(main())

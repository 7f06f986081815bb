"""``uccl-ep-megatron bench intranode``: intranode dispatch/combine, ours beside DeepEP V1.

For each rank count of ``--ranks`` (default: every visible GPU, or 2,4,8 ranks on a one-GPU
machine) the launcher places the ranks round-robin on the GPUs: one rank per GPU over NCCL, or
ranks sharing GPUs under CUDA MPS in a gloo group (peer traffic then crosses the GPU's own HBM,
not NVLink: per-call overhead and kernel efficiency, not link bandwidth). On the DeepSeek-V3 HT
setting (4096 tokens/rank, hidden 7168, top-8 of 256 experts) it times, with the same inputs
and the same SM budget:

- ``Buffer.dispatch`` BF16, FP8, cached BF16 and ``Buffer.combine`` BF16 of our ``kernels``
  backend (bulk-copy and/or load/store row paths), and BF16 dispatch + combine in sync-free
  mode (``num_worst_tokens`` = tokens x ranks: no host sync; the ``_worst`` rows). Combine
  takes dispatch's ``recv_x`` (ours: in the receive arena, combined in place) and, in the
  ``combine_bf16_copied`` row, a copy of it in memory of torch's (ours: pushed back);
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
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.common import (
    add_json_argument,
    bench_main,
    cpu_probe_ms,
    register_bench,
    write_json,
)
from uccl_ep_megatron.bench.inputs import add_shape_arguments, dispatch_kwargs, routed_inputs
from uccl_ep_megatron.bench.intranode_report import (
    merge,
    print_kernels,
    print_repeats,
    print_table,
    ratio_medians,
)
from uccl_ep_megatron.bench.timing import floor_bandwidth, profile_kernels, time_call
from uccl_ep_megatron.cluster.local import RankPool, visible_gpus

OPS = (
    "dispatch_bf16",
    "dispatch_fp8",
    "dispatch_bf16_cached",
    "combine_bf16",
    "combine_bf16_copied",
    "dispatch_bf16_worst",
    "combine_bf16_worst",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench intranode`` (see docs/cli.md)."""
    parser.add_argument(
        "--ranks",
        default="",
        help="comma-separated rank counts, e.g. 2,4,8; default: all visible GPUs (2,4,8 on one)",
    )
    parser.add_argument(
        "--num-gpus", type=int, default=0, help="GPUs to place the ranks on; 0 = all visible"
    )
    add_shape_arguments(parser)
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
        "--launch-ahead",
        choices=["on", "off", "both"],
        default="on",
        help="exact dispatches of ours launched ahead of their counts (UCCL_EP_LAUNCH_AHEAD, "
        "the default) or waiting for them (copy column '<copy>/w'), or both in the same run",
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
        help="after timing, profile N more calls per op on rank 0 and print each kernel's "
        "device time per call (median launch, torch.profiler); 0 = off",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time every rank count N times, each in fresh rank processes, and end with each "
        "op's ratio to DeepEP per run and their median",
    )
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``intranode`` to a ``bench`` subparser set (for cli/bench.py)."""
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
    if args.repeat < 1:
        raise SystemExit(f"--repeat={args.repeat}: give a run count >= 1")
    if args.deepep == "on":
        _import_deepep(required=True)
    results = []
    for run_index in range(args.repeat):
        for world in rank_counts(args.ranks, gpus):
            # Fresh rank processes per run: where the OS places them moves the host time.
            with RankPool(world, num_gpus=gpus, task_timeout_s=1800) as pool:
                per_rank = pool.run(_worker, vars(args), sms)
                results.append({**merge(per_rank, pool.placement.shared), "run": run_index})
            print_table(results[-1])
            print_kernels(results[-1])
    summary = ratio_medians(results) if args.repeat > 1 else []
    print_repeats(summary)
    write_json(args.json, results + ([{"ratio_medians": summary}] if summary else []))
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


def fp8_input(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 form of ``x`` the FP8 rows time: e4m3 values and one float32 scale per 128
    channels (random in [0.5, 1.5): the kernels move them, they do not interpret them)."""
    T, H = x.shape
    return (
        x.float().clamp(-448, 448).to(torch.float8_e4m3fn),
        torch.rand(T, H // 128, device=x.device) + 0.5,
    )


def _calls(buf, cfgs: tuple[Any, Any], x, x_fp8, layout: dict, state: dict, worst: int) -> dict:
    """The timed calls on one Buffer (ours or DeepEP's: same API); ``worst`` is the
    ``num_worst_tokens`` of the sync-free pair."""
    dcfg, ccfg = cfgs

    # Each call's previous result dies first, as between a layer's calls: a zero-copy output
    # block is then reused instead of the arena filling with results the bench drops anyway
    # (a cached result keeps its handle's block: it returns the handle's source indices).
    def disp_bf16():
        state.pop("cached", None)
        state.pop("copied", None)
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

    # The same rows in memory of torch's, copied by the first (untimed warm-up) call.
    def comb_copied():
        if "copied" not in state:
            state["copied"] = state["out"][0].clone()
        state["comb_copied"] = buf.combine(state["copied"], state["out"][4], config=ccfg)

    def disp_worst():
        state.pop("worst", None)
        state["worst"] = buf.dispatch(x, config=dcfg, num_worst_tokens=worst, **layout)

    def comb_worst():
        state["comb_worst"] = buf.combine(state["worst"][0], state["worst"][4], config=ccfg)

    fns = (disp_bf16, disp_fp8, disp_cached, comb, comb_copied, disp_worst, comb_worst)
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
    diff = (ours["comb_copied"][0].float() - theirs["comb_copied"][0].float()).abs()
    same["combine_copied_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    diff = (ours["comb_worst"][0].float() - theirs["comb_worst"][0].float()).abs()
    same["combine_worst_max_abs_diff"] = float(diff.max()) if diff.numel() else 0.0
    return same


def _worker(rank: int, world: int, a: dict, sms_list: list[int]) -> dict:
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.core.config import Config
    from uccl_ep_megatron.core.options import BufferOptions

    shared = dist.get_backend() == "gloo"
    T, H, E, K = a["tokens"], a["hidden"], a["experts"], a["topk"]
    idx, w, x = routed_inputs(a, rank)
    x_fp8 = fp8_input(x)
    copies = {"tma": True, "ldst": False}
    if a["copy"] != "both":
        copies = {a["copy"]: copies[a["copy"]]}
    # The receive arena holds the four dispatch results the bench keeps (plain, FP8, cached,
    # sync-free: each at most tokens x ranks rows, a launch-ahead block up to 1/16 and 127
    # rows more) and the copied-in combine's input, unless the caller set its size (None:
    # UCCL_EP_RECV_ARENA_BYTES).
    arena_bytes = None
    if "UCCL_EP_RECV_ARENA_BYTES" not in os.environ:
        arena_bytes = 6 * T * world * (H * x.element_size() + 256)
    aheads = {"on": (True,), "off": (False,), "both": (True, False)}[a["launch_ahead"]]
    ours = {}
    for name, tma in copies.items():
        for ahead in aheads:
            label = name if ahead else f"{name}/w"
            opts = BufferOptions(tma=tma, launch_ahead=ahead, arena_bytes=arena_bytes)
            ours[label] = Buffer(
                None, a["nvl_bytes"], 0, backend="kernels", explicitly_destroy=True, options=opts
            )
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
        "cpu_probe_ms": [cpu_probe_ms()],  # and again after the timed calls
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
    res["floor_Bps"] = floor_bandwidth(rank, world, shared)

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
            d_sms = a["deepep_sms"] or asked
            if buf.max_num_sms:  # ranks sharing a GPU: DeepEP fits in the same budget
                d_sms = min(d_sms, buf.max_num_sms)
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
            dstate.clear()
        # This SM count's results die before the next one's calls: kept, their receive-arena
        # blocks would push the next calls to the staged path.
        ours_state.clear()
        for (op, impl, copy, at), t in timed.items():
            res["timings"].append({"op": op, "impl": impl, "copy": copy, "sms": at, **t})

    torch.cuda.synchronize()
    res["cpu_probe_ms"].append(cpu_probe_ms())
    # Dispatches of ours whose outputs did not fit the receive arena (staged, not zero-copy).
    res["arena_fallbacks"] = sum(b._backend.recv_arena.fallbacks for b in ours.values())
    # Combines read in place, those of them whose x was copied into the arena first, and
    # those whose rows went back by the copy engine.
    res["combine_paths"] = {
        k: [
            b._backend.combine_in_place_calls,
            b._backend.combine_copied_in_calls,
            b._backend.combine_copy_engine_calls,
        ]
        for k, b in ours.items()
    }
    # Exact dispatches served by launch-ahead, and those that ran again with exact sizes.
    res["launch_ahead"] = {
        k: [b._backend.ahead_calls, b._backend.ahead_reruns] for k, b in ours.items()
    }
    dist.barrier()
    for b in ours.values():
        b.destroy()
    if theirs is not None:
        theirs.destroy()
    dist.barrier()
    return res


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.intranode")


if __name__ == "__main__":
    raise SystemExit(main())

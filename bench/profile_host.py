"""Where a dispatch/combine call spends its CPU time, on 1 to 8 ranks (shared GPU: under MPS).

The ranks come from the one launcher (``uccl_ep_megatron.cluster.local``); the calls are
``bench intranode``'s (same inputs, same closures, our ``kernels`` backend at ``--sms`` SMs,
DeepEP V1 beside it when ``deep_ep`` imports). For each call kind it prints, per rank count:

- host and device microseconds per call (median over ``--iters``, each iteration the maximum
  over ranks; device = events around the call on the caller's stream), ours and DeepEP's, and
  with ``--general`` ours again through the Buffer's general path (its direct lane and the
  lane's binding off, ``api/direct.py``), each op timed by every implementation in turn, ours
  without stamps;
- ours split at the ``_C`` entry points and the lane binding's launch (rank 0, median), from
  a second pass with stamps (its
  host time, which the stamps add to, printed beside): Python before notify is launched,
  the notify launch, the wait for the counts (exact dispatch), Python between the counts and
  the kernel launch, the kernel launch, Python after it; with ``--fine`` at the Python steps
  too (argument checks, status read, receive-arena outputs, torch.empty, the result);
- with ``--top N``, the N functions of rank 0 with the most own time under cProfile;
- with ``--protocol``, what the host time of our exact BF16 dispatch moves with (rank 0's,
  each condition in turn per iteration; meant for 1 rank): the release of the previous result
  timed apart from the call, and the call after a device sync alone, after the process-group
  barrier that the timed loop above (``time_call``) puts before every call, and after 1 ms of
  idle spinning;
- with ``--floor``, what the host operations a call is made of cost on this CPU (rank 0, one
  at a time, median of batches): reading a tensor's pointer, shape and dtype (what ``_C``
  does per argument), making a tensor (``torch.empty``, a view, a DLPack import as the receive
  arena makes its outputs), a kernel launch, a ``_C`` call, a dataclass of a result. A call's
  host time is at least the sum of the operations it needs.

With ``--json PATH`` the same numbers also go to a JSON file, one entry per rank count (with
the device, the command and the shape).

Run on a GPU machine:

    python bench/profile_host.py [--ranks 1,2,4] [--iters 100] [--top 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.common import add_json_argument, cpu_probe_ms, write_json
from uccl_ep_megatron.bench.inputs import add_shape_arguments

OPS = (
    "dispatch_bf16",
    "dispatch_fp8",
    "dispatch_bf16_worst",
    "dispatch_bf16_cached",
    "combine_bf16",
    "combine_bf16_copied",
)
# The _C entry points that launch a call's first kernel (notify, or the one-call dispatch;
# "lane_launch": the direct lane's binding up to its launch, _TimedLane).
LAUNCHES = (
    "intranode_dispatch_begin",
    "intranode_notify_call",
    "intranode_combine_call",
    "lane_launch",
)
# The _C entry points a call's host time is split at.
MARKS = (
    "intranode_dispatch_begin",
    "intranode_notify_call",
    "intranode_read_counts",
    "intranode_ahead_finish",
    "intranode_dispatch_call",
    "intranode_combine_call",
)


class _Timed:
    """``_C`` with its per-call entry points stamped (perf_counter_ns on entry and exit)."""

    def __init__(self, c: Any, log: list[tuple[str, int, int]]) -> None:
        self._c, self._log = c, log

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._c, name)
        if name not in MARKS:
            return real
        log = self._log

        def stamped(*args: Any) -> Any:
            t0 = time.perf_counter_ns()
            out = real(*args)
            log.append((name, t0, time.perf_counter_ns()))
            return out

        return stamped


class _TimedLane:
    """A Buffer's ``_C.IntranodeLane`` with its calls stamped: "lane_launch" from entry to its
    launch (the binding's ``launched_ns``, on the same monotonic clock), "lane_finish" from
    there to its exit (a call it leaves to the Python lane is stamped whole as "lane_none")."""

    def __init__(self, lane: Any, log: list[tuple[str, int, int]]) -> None:
        self._lane, self._log = lane, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lane, name)

    def dispatch(self, *args: Any) -> Any:
        return self._stamped(self._lane.dispatch, args)

    def combine(self, *args: Any) -> Any:
        return self._stamped(self._lane.combine, args)

    def _stamped(self, fn: Any, args: tuple[Any, ...]) -> Any:
        lane = self._lane
        calls = lane.calls
        t0 = time.perf_counter_ns()
        out = fn(*args)
        t1 = time.perf_counter_ns()
        if lane.calls == calls:
            self._log.append(("lane_none", t0, t1))
        else:
            self._log.append(("lane_launch", t0, lane.launched_ns))
            self._log.append(("lane_finish", lane.launched_ns, t1))
        return out


# With --fine, these Python steps are stamped too (each runs between the _C entry points,
# never inside one of them or of each other), and torch.empty and RecvOutputs.made.
FINE_BUFFER = ("_prepare_dispatch", "_prepare_combine")
FINE_BACKEND = ("_check_status", "_capturing", "_outputs", "_dispatch_result", "_read_counts")


def _stamped(real: Any, name: str, log: list[tuple[str, int, int]]) -> Any:
    """``real`` with its calls stamped into ``log`` as ``name``."""

    def stamped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = real(*args, **kwargs)
        log.append((name, t0, time.perf_counter_ns()))
        return out

    return stamped


def _segments(t0: int, t1: int, log: list[tuple[str, int, int]]) -> dict[str, float]:
    """One call's host time between its stamps, in microseconds (a step stamped twice: the
    sum of both)."""
    seg: dict[str, float] = {}
    at = t0
    for name, a, b in log:
        short = name.replace("intranode_", "").replace("_call", "").lstrip("_")
        seg[f"py->{short}"] = seg.get(f"py->{short}", 0.0) + (a - at) / 1e3
        seg[short] = seg.get(short, 0.0) + (b - a) / 1e3
        at = b
    seg["py->return"] = (t1 - at) / 1e3
    return seg


def _per_call(prof: cProfile.Profile, calls: int, top: int) -> str:
    """The ``top`` functions by own time, in microseconds per profiled call."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"{'own us':>8} {'cum us':>8} {'n':>5}  function"]
    for (file, line, name), (_, nc, tt, ct, _) in rows:
        where = f"{os.path.basename(file)}:{line}({name})" if line else name
        lines.append(f"{tt / calls * 1e6:8.1f} {ct / calls * 1e6:8.1f} {nc / calls:5.1f}  {where}")
    return "\n".join(lines)


def _no_lane(*args: Any) -> None:
    """A Buffer's direct lane that never serves a call (``--general``)."""
    return None


def _floor(buf: Any, x: torch.Tensor, batches: int = 21, n: int = 200) -> dict[str, float]:
    """Microseconds per host operation on this CPU (see the module docstring): the median over
    ``batches`` of ``n`` back-to-back calls each. ``x`` is a dispatch's [T, H] input."""
    from uccl_ep_megatron.backends.base import DispatchResult

    c, status = buf._backend._c, buf._backend._status
    info = torch.zeros(64, dtype=torch.int32, device=x.device)
    small = torch.zeros(16, dtype=torch.int32, device=x.device)
    T, H = x.shape
    arena = buf._backend.recv_arena.core

    stream = torch.cuda.current_stream().cuda_stream

    def dlpack() -> None:
        # One receive-arena block of a row and its tensors: rows, ids, weights, sources.
        arena.reserve(1, H, 4, 16, 0, 8, 64, True, stream, stream).tensors(-1)

    ops = {
        "x.data_ptr()": lambda: x.data_ptr(),
        "x.shape": lambda: x.shape,
        "x.dtype": lambda: x.dtype,
        "torch.empty [T, H] cuda": lambda: torch.empty(T, H, dtype=x.dtype, device=x.device),
        "as_strided view": lambda: info.as_strided((4,), (1,), 4),
        "arena block + 4 DLPack tensors": dlpack,
        "kernel launch (fill_)": lambda: small.fill_(1),
        "_C call (host_status_read)": lambda: c.host_status_read(status),
        "DispatchResult (12 fields)": lambda: DispatchResult(
            x, None, None, None, [], info, info, 0, None, info, info, True
        ),
    }
    out = {}
    for name, fn in ops.items():
        per = []
        for _ in range(batches):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                fn()
            per.append((time.perf_counter_ns() - t0) / n / 1e3)
        out[name] = statistics.median(per)
        torch.cuda.synchronize()
    return out


def _spin(us: float) -> None:
    """Keep this CPU busy for ``us`` microseconds (the GPU idles meanwhile)."""
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


# --protocol: what runs between the device sync and the timed call, per condition.
PROTOCOL = {
    "sync": lambda: None,
    "sync+barrier": dist.barrier,
    "sync+idle 1 ms": lambda: _spin(1000),
}


def _protocol(state: dict, call: Any, iters: int) -> dict[str, float]:
    """Median host µs of ``call`` (an exact dispatch storing its result in ``state["out"]``)
    under each ``PROTOCOL`` condition, in turn per iteration, and of releasing the previous
    result (``release``), timed apart. Only the barrier's condition lines the ranks up before
    the call: with more than one rank the others' host time includes waiting for the peers."""
    times: dict[str, list[float]] = {"release": [], **{name: [] for name in PROTOCOL}}
    for _ in range(iters):
        for name, before in PROTOCOL.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            state.pop("out", None)
            times["release"].append((time.perf_counter_ns() - t0) / 1e3)
            before()
            t0 = time.perf_counter_ns()
            state["out"] = call()
            times[name].append((time.perf_counter_ns() - t0) / 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def _rank(rank: int, world: int, a: dict) -> dict:
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs, routed_inputs
    from uccl_ep_megatron.bench.intranode import _calls, _import_deepep, fp8_input
    from uccl_ep_megatron.bench.timing import time_call
    from uccl_ep_megatron.core.config import Config
    from uccl_ep_megatron.core.options import BufferOptions

    if a["bind"]:  # this rank's share of the CPUs the launcher gave, split in rank order
        cpus = sorted(os.sched_getaffinity(0))
        per = max(1, len(cpus) // world)
        os.sched_setaffinity(0, cpus[rank * per : (rank + 1) * per] or cpus)
    probe = [cpu_probe_ms()]  # this CPU's speed, and again after the timed calls
    T, E = a["tokens"], a["experts"]
    idx, w, x = routed_inputs(a, rank)
    x_fp8 = fp8_input(x)
    # Room for the results kept at once (as bench intranode sizes it): every call zero-copy.
    arena = None  # the caller's UCCL_EP_RECV_ARENA_BYTES when set
    if "UCCL_EP_RECV_ARENA_BYTES" not in os.environ:
        arena = 5 * T * world * (a["hidden"] * 2 + 256) * (2 if a["general"] else 1)
    opts = BufferOptions(arena_bytes=arena)
    buf = Buffer(None, 2 << 30, 0, backend="kernels", explicitly_destroy=True, options=opts)
    log: list[tuple[str, int, int]] = []
    # (object, attribute, plain, stamped): the stamps are on only for the split's pass.
    patches = [(buf._backend, "_c", buf._backend._c, _Timed(buf._backend._c, log))]
    if buf._lane is not None:
        patches.append((buf, "_lane", buf._lane, _TimedLane(buf._lane, log)))
    if a["fine"]:
        from uccl_ep_megatron.backends.intranode.arena import RecvOutputs

        for obj, names in ((buf, FINE_BUFFER), (buf._backend, FINE_BACKEND)):
            for name in names:
                real = getattr(obj, name)
                patches.append((obj, name, real, _stamped(real, name, log)))
        made = RecvOutputs.__dict__["made"]
        patches.append((RecvOutputs, "made", made, _stamped(RecvOutputs.made, "made", log)))
        patches.append((torch, "empty", torch.empty, _stamped(torch.empty, "empty", log)))

    def stamping(on: bool) -> None:
        for obj, name, plain, stamped in patches:
            if name == "_lane" and obj._lane is None:
                continue  # --general's pass: the lane is off
            setattr(obj, name, stamped if on else plain)

    kw = dispatch_kwargs(buf.get_dispatch_layout(idx, E)[:4], idx, w)
    sms = min(a["sms"], buf.max_num_sms or a["sms"])
    impls = {"ours": (buf, (Config(sms), Config(sms)), kw)}
    deep_ep = _import_deepep()
    flags: list[Any] = [None] * world
    dist.all_gather_object(flags, deep_ep is not None)
    theirs = None
    if all(flags) and world > 1:  # DeepEP V1's intranode kernels take 2, 4 or 8 ranks
        theirs = deep_ep.Buffer(dist.group.WORLD, 2 << 30, 0, explicitly_destroy=True)
        deep_ep.Buffer.set_num_sms(min(a["deepep_sms"], buf.max_num_sms or a["deepep_sms"]))
        cfgs = (
            deep_ep.Buffer.get_dispatch_config(world),
            deep_ep.Buffer.get_combine_config(world),
        )
        impls["deepep"] = (
            theirs,
            cfgs,
            dispatch_kwargs(theirs.get_dispatch_layout(idx, E), idx, w),
        )
    if a["general"]:  # the same Buffer, every call through the general path
        impls["general"] = impls["ours"]
    out: dict[str, Any] = {"floor": _floor(buf, x) if a["floor"] and rank == 0 else {}}
    states: dict[str, dict[str, Any]] = {impl: {} for impl in impls}
    calls = {
        impl: _calls(b, cfgs, x, x_fp8, layout, states[impl], T * world)
        for impl, (b, cfgs, layout) in impls.items()
    }
    for op in OPS:  # each op by every impl in turn (machine drift falls on all alike)
        for impl, fns in calls.items():
            fn = fns[op]
            segs: list[dict[str, float]] = []
            stamps: list[tuple[int, int]] = []  # (call start, first launch done), host clock

            def split(
                t0: int, t1: int, impl: str = impl, segs: list = segs, stamps: list = stamps
            ) -> None:
                if impl != "deepep":
                    segs.append(_segments(t0, t1, list(log)))
                    launched = [b for name, _, b in log if name in LAUNCHES]
                    stamps.append((t0, launched[0] if launched else t1))

            if impl == "general":  # api/direct.py: None takes the general path
                buf._dispatch_direct = buf._combine_direct = _no_lane
                lane, buf._lane = buf._lane, None
            stamped_host: list[float] = []
            try:
                timed = time_call(fn, a["iters"], a["warmup"])
                if impl != "deepep":  # the split, in a second pass with the stamps on
                    stamping(True)
                    stamped_host = time_call(fn, a["iters"], 0, before=log.clear, after=split)[
                        "host_us"
                    ]
            finally:
                stamping(False)
                if impl == "general":
                    del buf._dispatch_direct, buf._combine_direct
                    buf._lane = lane
            host, dev = timed["host_us"], timed["device_us"]
            prof_text = ""
            if a["top"] and impl == "ours":
                prof = cProfile.Profile()
                for _ in range(a["iters"]):
                    torch.cuda.synchronize()
                    dist.barrier()
                    prof.enable()
                    fn()
                    prof.disable()
                prof_text = _per_call(prof, a["iters"], a["top"])
            seg_med = {}
            if segs:
                for k in segs[0]:
                    seg_med[k] = statistics.median(s.get(k, 0.0) for s in segs)
            out[f"{op}/{impl}"] = {
                "host": host,
                "host_stamped": stamped_host,
                "dev": dev,
                "seg": seg_med,
                "prof": prof_text,
                "stamps": stamps,
            }
    if a["protocol"]:
        ours_buf, (dcfg, _), layout = impls["ours"]
        out["protocol"] = _protocol(
            states["ours"], lambda: ours_buf.dispatch(x, config=dcfg, **layout), a["iters"]
        )
    for state in states.values():
        state.clear()
    torch.cuda.synchronize()
    out["fallbacks"] = buf._backend.recv_arena.fallbacks  # staged (not zero-copy) dispatches
    out["cpus"] = sorted(os.sched_getaffinity(0))
    out["cpu_probe_ms"] = probe + [cpu_probe_ms()]
    dist.barrier()
    buf.destroy()
    if theirs is not None:
        theirs.destroy()
    return out


def _summary(world: int, per_rank: list[dict], iters: int) -> dict[str, Any]:
    """What ``_report`` prints and ``--json`` writes for one rank count: per op and
    implementation the medians over iterations of the maximum over ranks (host and device us),
    rank 0's split, how far apart the ranks' calls start and when the last rank's first kernel
    is queued (ours and the general path), every rank's own medians, the arena fallbacks, each
    rank's CPUs and CPU probe (before and after) and rank 0's host operation floor."""
    general = f"{OPS[0]}/general" in per_rank[0]
    impls = ("ours", "general", "deepep") if general else ("ours", "deepep")
    ops: dict[str, Any] = {}
    for op in OPS:
        entry: dict[str, Any] = {}
        for impl in impls:
            key = f"{op}/{impl}"
            if key not in per_rank[0]:
                continue
            h = [max(r[key]["host"][i] for r in per_rank) for i in range(iters)]
            d = [max(r[key]["dev"][i] for r in per_rank) for i in range(iters)]
            row: dict[str, Any] = {"host_us": statistics.median(h), "dev_us": statistics.median(d)}
            if impl != "deepep":  # the split's pass: the same calls with the stamps on
                hs = [max(r[key]["host_stamped"][i] for r in per_rank) for i in range(iters)]
                row["host_stamped_us"] = statistics.median(hs)
            # The ranks share one host clock (CLOCK_MONOTONIC): how far apart the calls start,
            # and when the last rank's first kernel is queued after the first rank's call started.
            st = [r[key].get("stamps", []) for r in per_rank]
            if impl != "deepep" and all(len(x) == iters for x in st):
                skew = [max(x[i][0] for x in st) - min(x[i][0] for x in st) for i in range(iters)]
                last = [max(x[i][1] for x in st) - min(x[i][0] for x in st) for i in range(iters)]
                row["start_spread_us"] = statistics.median(skew) / 1e3
                row["last_first_launch_us"] = statistics.median(last) / 1e3
            entry[impl] = row
        ours = [r[f"{op}/ours"] for r in per_rank]
        entry["split_rank0_us"] = ours[0]["seg"]
        # Every rank's own medians: which rank the maximum over ranks comes from, and where.
        entry["per_rank"] = [
            {
                "host_us": statistics.median(m["host"]),
                "dev_us": statistics.median(m["dev"]),
                "split_us": m["seg"],
            }
            for m in ours
        ]
        ops[op] = entry
    return {
        "world": world,
        "iters": iters,
        "impls": list(impls),
        "ops": ops,
        "arena_fallbacks": [r["fallbacks"] for r in per_rank],
        "cpus": [r["cpus"] for r in per_rank],
        "cpu_probe_ms": [r["cpu_probe_ms"] for r in per_rank],
        "floor_us": per_rank[0]["floor"],
        "protocol_rank0_us": per_rank[0].get("protocol", {}),
        "cprofile": {op: per_rank[0][f"{op}/ours"]["prof"] for op in OPS},
    }


def _report(summary: dict[str, Any]) -> None:
    world, iters, impls = summary["world"], summary["iters"], summary["impls"]
    general = "general" in impls
    print(f"\n# {world} rank(s): host / device us per call (median over {iters} of max over ranks)")
    names = {"ours": "ours", "general": "general", "deepep": "DeepEP"}
    print(
        f"{'op':24} "
        + " ".join(f"{names[i] + ' host':>12} {'dev':>7}" for i in impls)
        + "  ours again with stamps: host (max over ranks), rank 0's split (us)"
    )
    for op, entry in summary["ops"].items():
        row = []
        for impl in impls:
            if impl not in entry:
                row += [f"{'-':>12}", f"{'-':>7}"]
                continue
            row += [f"{entry[impl]['host_us']:12.1f}", f"{entry[impl]['dev_us']:7.1f}"]
        split = " ".join(f"{k}={v:.1f}" for k, v in entry["split_rank0_us"].items())
        stamped = entry["ours"]["host_stamped_us"]
        print(f"{op:24} {' '.join(row)}  {stamped:.1f}: {split}")
        for impl in impls[:-1] if general else ("ours",):
            if "start_spread_us" in entry[impl]:
                print(
                    f"{'':24}   {impl}: call starts spread {entry[impl]['start_spread_us']:.1f} "
                    f"us; last rank's first launch {entry[impl]['last_first_launch_us']:.1f} us "
                    "after the first start"
                )
        for r, mine in enumerate(entry["per_rank"]):
            text = " ".join(f"{k}={v:.1f}" for k, v in mine["split_us"].items())
            host, dev = mine["host_us"], mine["dev_us"]
            print(f"{'':24}   rank {r}: host {host:.1f} dev {dev:.1f}  {text}")
    print(f"arena fallbacks per rank: {summary['arena_fallbacks']}")
    for r, cpus in enumerate(summary["cpus"]):
        probe = " -> ".join(f"{v:.2f}" for v in summary["cpu_probe_ms"][r])
        print(f"rank {r} CPUs: {len(cpus)} ({cpus[0]}-{cpus[-1]}); CPU probe {probe} ms")
    if summary["protocol_rank0_us"]:
        print(f"\n# {world} rank(s): our exact BF16 dispatch, rank 0's host us (median)")
        for name, us in summary["protocol_rank0_us"].items():
            what = "releasing the previous result" if name == "release" else f"call after {name}"
            print(f"{what:34} {us:8.1f}")
    if summary["floor_us"]:
        print(f"\n# {world} rank(s): host operations on rank 0's CPU (us each)")
        for name, us in summary["floor_us"].items():
            print(f"{name:34} {us:8.2f}")
    for op, text in summary["cprofile"].items():
        if text:
            print(f"\n==== {world} rank(s), {op}, rank 0, cProfile by own time\n{text}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--top", type=int, default=0, help="cProfile rows per call (0: none)")
    ap.add_argument("--sms", type=int, default=12, help="our SM budget")
    ap.add_argument("--deepep-sms", type=int, default=24)
    ap.add_argument("--fine", action="store_true", help="stamp the Python steps too (FINE_* below)")
    ap.add_argument("--floor", action="store_true", help="time single host operations too")
    ap.add_argument(
        "--protocol",
        action="store_true",
        help="time our exact dispatch under each PROTOCOL condition, and its result's release",
    )
    ap.add_argument(
        "--general",
        action="store_true",
        help="also time our calls through the general path (the direct lane off), in turn",
    )
    add_shape_arguments(ap)
    ap.add_argument(
        "--bind", action="store_true", help="pin each rank to its own equal share of the CPUs"
    )
    add_json_argument(ap)
    args = ap.parse_args()
    from uccl_ep_megatron.cluster.local import RankPool, visible_gpus

    results = []
    for world in [int(s) for s in args.ranks.split(",") if s.strip()]:
        with RankPool(world, num_gpus=visible_gpus(), task_timeout_s=900) as pool:
            per_rank = pool.run((os.path.abspath(__file__), "_rank"), vars(args))
        summary = _summary(world, per_rank, args.iters)
        _report(summary)
        results.append(
            {
                "device": torch.cuda.get_device_name(0),
                "command": "python bench/profile_host.py " + " ".join(sys.argv[1:]),
                **{k: getattr(args, k) for k in ("tokens", "hidden", "experts", "topk", "sms")},
                **summary,
            }
        )
        write_json(args.json, results)  # after every rank count: a later failure keeps these


if __name__ == "__main__":
    main()

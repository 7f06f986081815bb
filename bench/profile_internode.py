"""Where an internode dispatch/combine call spends its host time, step by step, on every rank.

2 or more virtual nodes over the ipc NIC model (the ranks come from
``uccl_ep_megatron.cluster.local``); the calls are ``bench internode``'s (same inputs and
configs). Each step of the call (``Buffer`` and ``InternodeBackend`` methods, the ``_C``
entry points, the header all-gather) is stamped with perf_counter around every call; a step's
time includes the steps it calls. For each mode (sync-free, exact) and op it prints the host µs
of the whole call (median over ``--iters`` calls that start together, per rank) and rank 0's
median µs per step, largest first. Synchronous calls run on the caller's stream; with
``--comm-stream`` every call is also timed on the Buffer's communication stream (the path of an
asynchronous call, joined back), and with ``--full-checks`` with every argument check run (the
Buffer skips the checks of argument shapes that passed them before), in turn.

Run on a GPU machine:

    python bench/profile_internode.py [--ranks 4] [--ranks-per-node 2] [--link-gbps 50] \
        [--threads 4] [--iters 30]
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

from uccl_ep_megatron.bench.inputs import add_shape_arguments

# The stamped steps: Buffer methods, InternodeBackend methods, functions of the backend's module.
BUFFER_STEPS = ("_prepare_dispatch", "_prepare_combine", "_dispatch_args", "_agree", "_run")
BACKEND_STEPS = (
    "check",
    "encode_row",
    "exchange_header",
    "exchange_header_async",
    "_gather_rows",
    "_read",
    "_read_header",
    "routing_check",
    "dispatch",
    "combine",
    "_new_state",
    "_dispatch_tensors",
    "_fit_staging",
    "_int32",
)
MODULE_STEPS = ("received_expert_counts", "dispatch_outputs", "prepare_combine", "recorded_error")


def _stamp(real: Any, name: str, acc: dict[str, float]) -> Any:
    """``real`` with its time added to ``acc[name]`` (µs) on every call."""

    @functools.wraps(real)
    def stamped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + (time.perf_counter() - t0) * 1e6

    return stamped


class _TimedC:
    """``_C.internode`` with every function stamped as ``C.<name>``."""

    def __init__(self, inner: Any, acc: dict[str, float]) -> None:
        self._inner, self._acc = inner, acc

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._inner, name)
        if callable(real) and not isinstance(real, type):
            return _stamp(real, f"C.{name}", self._acc)
        return real


def _rank(rank: int, world: int, a: dict) -> dict:
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.backends.internode import backend as backend_module
    from uccl_ep_megatron.backends.internode.backend import InternodeBackend
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs, routed_inputs
    from uccl_ep_megatron.bench.internode import _configs
    from uccl_ep_megatron.core.options import BufferOptions

    a = dict(a, combine_chunk=0, ring=0)  # the library's combine chunk and ring (_configs)
    idx, w, x = routed_inputs(a, rank)
    opts = BufferOptions(
        backend="kernels",
        ranks_per_node=a["ranks_per_node"],
        transport="ipc",
        num_proxy_threads=a["threads"],
        ipc_link_gbps=a["link_gbps"],
        ipc_latency_us=a["latency_us"],
    )
    buf = Buffer(None, 1 << 30, 1 << 30, options=opts, explicitly_destroy=True)
    dcfg, ccfg = _configs(world, a["ranks_per_node"], a, a["chunk"])
    kw = dispatch_kwargs(buf.get_dispatch_layout(idx, a["experts"])[:4], idx, w)
    acc: dict[str, float] = {}
    for name in BUFFER_STEPS:
        setattr(buf, name, _stamp(getattr(buf, name), f"Buffer.{name}", acc))
    be = buf._backend
    for name in BACKEND_STEPS:
        if hasattr(InternodeBackend, name):
            setattr(be, name, _stamp(getattr(be, name), name, acc))
    for name in MODULE_STEPS:
        setattr(backend_module, name, _stamp(getattr(backend_module, name), name, acc))
    be._in = _TimedC(be._in, acc)
    out: dict[str, Any] = {}
    # (tag, on the caller's stream, argument checks in full) of each timed path, in turn:
    # --comm-stream adds each call on the Buffer's communication stream (joined to the caller's
    # both ways, its tensors recorded), --full-checks each call with the Buffer's memory of
    # checked argument shapes cleared first (every check runs, as on a shape's first call).
    direct = buf._direct
    paths = [("", direct, False)]
    if a["comm_stream"]:
        paths.append((" (comm stream)", False, False))
    if a["full_checks"]:
        paths.append((" (full checks)", direct, True))
    for mode, worst in (("sync-free", a["tokens"] * world), ("exact", 0)):
        for _ in range(a["warmup"]):
            r = buf.dispatch(x, config=dcfg, num_worst_tokens=worst, **kw)
            buf.combine(r[0], r[4], topk_weights=r[2], config=ccfg)
        torch.cuda.synchronize()
        calls: dict[str, list[tuple[float, dict[str, float]]]] = {}
        for _ in range(a["iters"]):
            for tag, on_caller, full_checks in paths:
                buf._direct = on_caller
                for op in ("dispatch", "combine"):
                    dist.barrier()
                    torch.cuda.synchronize()
                    acc.clear()
                    kept = buf._checked  # the other paths' memory, back after this call
                    if full_checks:
                        buf._checked = {}
                    t0 = time.perf_counter()
                    if op == "dispatch":
                        r = buf.dispatch(x, config=dcfg, num_worst_tokens=worst, **kw)
                    else:
                        buf.combine(r[0], r[4], topk_weights=r[2], config=ccfg)
                    row = ((time.perf_counter() - t0) * 1e6, dict(acc))
                    buf._checked = kept
                    calls.setdefault(op + tag, []).append(row)
                    torch.cuda.synchronize()
            buf._direct = direct
        for op, rows in calls.items():
            steps = {k for _, s in rows for k in s}
            out[f"{mode} {op}"] = {
                "host": statistics.median(h for h, _ in rows),
                "steps": {k: statistics.median(s.get(k, 0.0) for _, s in rows) for k in steps},
            }
    buf._backend.check()
    dist.barrier()
    buf.destroy()
    return out


def _report(per_rank: list[dict], a: dict) -> None:
    print(
        f"# {len(per_rank)} ranks, {a['ranks_per_node']} per virtual node, ipc NIC model at "
        f"{a['link_gbps']} GB/s, {a['threads']} proxy threads; host µs per call (median of "
        f"{a['iters']})"
    )
    for key in per_rank[0]:
        hosts = " ".join(f"{r[key]['host']:.0f}" for r in per_rank)
        print(f"\n{key}: host µs per rank {hosts}; rank 0's steps (a step includes what it calls):")
        steps = per_rank[0][key]["steps"]
        for name, us in sorted(steps.items(), key=lambda kv: -kv[1]):
            print(f"    {name:<28} {us:8.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--link-gbps", type=float, default=50.0)
    ap.add_argument("--latency-us", type=float, default=3.0)
    ap.add_argument("--threads", type=int, default=4, help="proxy threads per GPU")
    ap.add_argument("--chunk", type=int, default=20, help="dispatch tokens per RDMA write")
    ap.add_argument("--sms", type=int, default=24)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    add_shape_arguments(ap)
    ap.add_argument(
        "--comm-stream",
        action="store_true",
        help="also time each call on the Buffer's communication stream, in turn",
    )
    ap.add_argument(
        "--full-checks",
        action="store_true",
        help="also time each call with every argument check run (as on a shape's first call)",
    )
    args = ap.parse_args()
    from uccl_ep_megatron.cluster.local import RankPool, visible_gpus

    with RankPool(args.ranks, num_gpus=visible_gpus(), task_timeout_s=900) as pool:
        per_rank = pool.run((os.path.abspath(__file__), "_rank"), vars(args))
    _report(per_rank, vars(args))


if __name__ == "__main__":
    main()

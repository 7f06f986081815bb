"""Host time of an exact (launch-ahead) dispatch ended by one binding call, against the same
call ended through the words path, in one process on one rank.

``intranode_ahead_finish`` reads the counts and every rank's checks, tests the status word and
the launch-ahead bound, and makes the outputs and the handle's tensors in one binding call. The
words path is what a call takes when any of that fails (and what every launch-ahead call took
before): ``intranode_read_counts``, the status read, ``check_all_ranks``, the exact rows, the
outputs and the handle's tensors, each its own call from Python. Both serve the same Buffer and
inputs, taken in turn call by call so that machine drift falls on both alike, each in two
protocols:

- ``loop``: calls back to back after a device sync;
- ``bench``: ``bench intranode``'s protocol (device sync, barrier, events around the call).

Prints the median host µs per call of each path and their ratio, BF16 and FP8 (DeepSeek-V3's
shape: 4096 tokens, hidden 7168, top-8 of 256). Run on a GPU machine:

    python bench/profile_finish.py [--iters 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.bench.inputs import add_shape_arguments


def _rank(rank: int, world: int, a: dict) -> dict:
    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs, routed_inputs
    from uccl_ep_megatron.bench.intranode import fp8_input
    from uccl_ep_megatron.core.config import Config
    from uccl_ep_megatron.core.options import BufferOptions

    T, E = a["tokens"], a["experts"]
    idx, w, x = routed_inputs(a, rank)
    arena = 5 * T * world * (a["hidden"] * 2 + 256)  # every output zero-copy
    buf = Buffer(
        None,
        2 << 30,
        0,
        backend="kernels",
        explicitly_destroy=True,
        options=BufferOptions(arena_bytes=arena),
    )
    kw = dispatch_kwargs(buf.get_dispatch_layout(idx, E)[:4], idx, w)
    cfg = Config(a["sms"])
    be = buf._backend
    one_call = be._ahead_result

    def words_path(call: Any, outs: Any, bound: int, reserved: Any = None) -> Any:
        if reserved is not None:  # the handle's tensors, as the one-call path makes them
            call.send_pos, *views = reserved.aux(be.topology.rank)
            call.views = tuple(views)
        return one_call(call, outs, bound, None)

    out: dict[str, Any] = {}
    for label, xin in (("bf16", x), ("fp8", fp8_input(x))):
        for proto in ("loop", "bench"):
            per: dict[str, list[float]] = {"one call": [], "words": []}
            kept: dict[str, Any] = {}
            for i in range(2 * a["iters"] + 2 * a["warmup"]):
                path = "words" if i % 2 else "one call"
                be._ahead_result = words_path if i % 2 else one_call
                kept.pop("out", None)  # the previous result dies first, as in bench intranode
                torch.cuda.synchronize()
                if proto == "bench":
                    dist.barrier()
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter_ns()
                kept["out"] = buf.dispatch(xin, config=cfg, **kw)
                t1 = time.perf_counter_ns()
                if proto == "bench":
                    end.record()
                    end.synchronize()
                if i >= 2 * a["warmup"]:
                    per[path].append((t1 - t0) / 1e3)
            out[f"{label} {proto}"] = {p: statistics.median(v) for p, v in per.items()}
    be._ahead_result = one_call
    out["one-call finishes"] = be.ahead_finishes
    torch.cuda.synchronize()
    buf.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200, help="calls per path and protocol")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sms", type=int, default=12)
    add_shape_arguments(ap)
    args = ap.parse_args()
    from uccl_ep_megatron.cluster.local import RankPool, visible_gpus

    with RankPool(1, num_gpus=visible_gpus(), task_timeout_s=600) as pool:
        res = pool.run((os.path.abspath(__file__), "_rank"), vars(args))[0]
    print(f"one-call finishes: {res.pop('one-call finishes')}")
    print(f"{'op protocol':14} {'one call us':>12} {'words us':>10} {'ratio':>7}")
    for k, v in res.items():
        one, words = v["one call"], v["words"]
        print(f"{k:14} {one:12.1f} {words:10.1f} {one / words:7.3f}")


if __name__ == "__main__":
    main()

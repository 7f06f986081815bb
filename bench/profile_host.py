"""Where a dispatch/combine call spends its CPU time: cProfile of N calls on one rank.

One process, a one-rank gloo group, the ``kernels`` backend, the DeepSeek-V3 HT shape. For each
call kind (exact dispatch, sync-free dispatch, cached dispatch, combine) it prints the median
host microseconds per call (perf_counter around the call, after warm-up) and the functions with
the most own time under cProfile. Run on a GPU machine:

    python bench/profile_host.py [--iters 200] [--top 25]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=7168)
    args = ap.parse_args()
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from uccl_ep_megatron import Buffer

    T, H, E, K = args.tokens, args.hidden, 256, 8
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda", generator=g)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    buf = Buffer(None, 1 << 30, 0, backend="kernels")
    lay = buf.get_dispatch_layout(idx, E)
    kw = dict(
        num_tokens_per_rank=lay[0],
        num_tokens_per_rdma_rank=lay[1],
        num_tokens_per_expert=lay[2],
        is_token_in_rank=lay[3],
        topk_idx=idx,
        topk_weights=w,
    )
    state = {}

    def exact():
        state["exact"] = buf.dispatch(x, **kw)

    def worst():
        state["worst"] = buf.dispatch(x, num_worst_tokens=T, **kw)

    def cached():
        buf.dispatch(x, handle=state["worst"][4])

    def combine():
        buf.combine(state["worst"][0], state["worst"][4])

    def layout():
        buf.get_dispatch_layout(idx, E)

    for name, fn in (
        ("layout", layout),
        ("dispatch exact", exact),
        ("dispatch sync-free", worst),
        ("cached dispatch", cached),
        ("combine", combine),
    ):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.iters):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print(f"==== {name}: host {statistics.median(times):.1f} us/call (median of {args.iters})")
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
    buf.destroy()
    dist.destroy_process_group()
    os.unlink(store)


if __name__ == "__main__":
    main()

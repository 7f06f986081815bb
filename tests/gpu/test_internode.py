"""Internode HT kernels (FIFO -> proxy -> ipc transport) against the reference backend.

The ranks are split into 2 virtual nodes (``UCCL_EP_RANKS_PER_NODE``): 2 x 1, 2 x 2 and 2 x 4 by
default (``UCCL_EP_TEST_RANKS_PER_NODE=1,2,4``), one rank per GPU where there are enough GPUs,
else ranks sharing GPUs under CUDA MPS in a gloo group. Every token bound to the other node
crosses the "network": a kernel pushes TransferCmds, the CPU proxy executes them over the
``ipc`` transport and the receiving proxy orders the software atomics. Each case runs with the
ipc reorder/delay injector off and on (EFA-like: writes and immediates land out of order).

Checks, per case and seed: layout (incl. ``num_tokens_per_rdma_rank``), dispatch outputs and
handle exactly equal to the reference (BF16 and FP8 bytes, local ids, weights, counts, prefix
matrix, source indices), cached dispatch, combine (exact on 2 ranks, within bf16 tolerance
otherwise) with top-k weights and biases, and the self-verifying property that combining the
dispatched rows unchanged gives x times the number of ranks each token reached. Outputs come
from poisoned memory, so an unwritten element is a mismatch. Small-ring cases make every
(channel, node) ring wrap many times, so flow control (head/tail software atomics) is exercised.

The transport is the ipc NIC model at 50 GB/s per GPU and 3 us (``UCCL_EP_TEST_IPC_LINK_GBPS``,
``UCCL_EP_TEST_IPC_LATENCY_US``); ``-k nic_fault`` injects completion errors and a dead peer
(``UCCL_EP_IPC_FAULT``) and checks that every rank ends in an error naming what failed.

Sync-free mode (``-k sync_free``, num_worst_tokens = W): outputs equal the reference oracle's,
the handle's device counts equal exact mode's list, and a profiler count finds no host sync on
the calling thread after a warm-up; a bad expert id on one rank is raised on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import (  # noqa: E402
    assert_combine_close,
    assert_combined_is_x_times_reached,
    assert_layout_same,
    assert_recv_same,
    assert_same,
    combine_inputs,
    dispatch,
    inputs,
    poison,
    pool_fixture,
    rank_counts,
    routing,
)

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

RANKS_PER_NODE = rank_counts("UCCL_EP_TEST_RANKS_PER_NODE", "1,2,4")
NVL_BYTES = 1 << 30
RDMA_BYTES = 1 << 30

_buffers: dict[tuple, object] = {}
_keep: list[object] = []


def _env(pool, reorder: bool, seed: int) -> dict[str, str]:
    return {
        "UCCL_EP_RANKS_PER_NODE": str(pool.world_size // 2),
        "UCCL_EP_TRANSPORT": "ipc",
        "UCCL_EP_IPC_REORDER": "1" if reorder else "0",
        "UCCL_EP_IPC_REORDER_SEED": str(seed),
        "UCCL_EP_IPC_MAX_DELAY_US": "20",
        "UCCL_EP_TIMEOUT_MS": os.environ.get("UCCL_EP_TEST_KERNEL_TIMEOUT_MS", "20000"),
        # The NIC model at a 400 Gb/s line rate (50 GB/s per GPU) and 3 us, as the bench runs it.
        "UCCL_EP_IPC_LINK_GBPS": os.environ.get("UCCL_EP_TEST_IPC_LINK_GBPS", "50"),
        "UCCL_EP_IPC_LATENCY_US": os.environ.get("UCCL_EP_TEST_IPC_LATENCY_US", "3"),
        "UCCL_EP_IPC_DELIVERY": DELIVERY,
    }


# How the NIC model gets ring bytes to the peer GPU (UCCL_EP_IPC_DELIVERY): the suite runs with
# UCCL_EP_TEST_IPC_DELIVERY=store (default) and again with copy (tests/gpu/run_internode.sh).
DELIVERY = os.environ.get("UCCL_EP_TEST_IPC_DELIVERY", "store")


# Receive arena of the node's ranks (2 x 2 and more): "on" (the default size on every rank),
# "off" (every call staged) or "mixed" (rank 0's arena holds no large call's outputs: it takes
# the staged path while its node peer writes and reads in place).
_ARENA_BYTES = {"on": None, "off": 0, "mixed": 1 << 20}


def _small_arena():
    """Options of the Buffers the failure cases keep (unusable, still mapped by peers): a
    64 MiB receive arena, enough for their small calls (8 ranks share one GPU at 2 x 4)."""
    from uccl_ep_megatron import BufferOptions

    return BufferOptions(arena_bytes=64 << 20)


def _get_buffers(reorder: bool, arena: str = "on", rank: int = 0):
    """One internode and one reference Buffer per (process, injector setting, arena)."""
    from uccl_ep_megatron import Buffer, BufferOptions
    from uccl_ep_megatron.cluster.local import reference_oracle

    key = ("reorder" if reorder else "plain", arena)
    if key not in _buffers:
        # One arena setting's Buffers at a time (each holds ~3 GiB per rank: 8 ranks share one
        # GPU at 2 x 4); every rank makes the same calls, so the collective teardowns match.
        for other in [k for k in _buffers if k[1] != arena]:
            _buffers.pop(other)[0].destroy()
        # The Buffer's memory comes from cudaMalloc, not torch's cache: hand back what earlier
        # cases' tensors left cached (GiBs per rank when 8 ranks share one GPU).
        torch.cuda.empty_cache()
        size = _ARENA_BYTES[arena]
        if arena == "mixed" and rank != 0:
            size = None
        opts = BufferOptions(arena_bytes=size) if size is not None else None
        kb = Buffer(None, NVL_BYTES, RDMA_BYTES, backend="kernels", options=opts)
        rb = reference_oracle(None, NVL_BYTES, RDMA_BYTES)
        _buffers[key] = (kb, rb)
    return _buffers[key]


def _one(kb, rb, rank: int, world: int, params: dict, seed: int) -> dict:
    from uccl_ep_megatron import Config

    num_tokens, hidden = params["tokens"], params["hidden"]
    gen = torch.Generator(device="cuda").manual_seed(1000 * seed + rank)
    x_in, x, idx, w, num_experts = inputs(rank, world, params, gen)
    sms, *chunks = params.get("config", (24,))
    config = Config(min(sms, kb.max_num_sms or sms), *chunks)
    kw = dict(
        expert_alignment=params.get("align", 1),
        num_worst_tokens=params.get("worst", 0) and params["worst"] * num_tokens * world,
        config=config,
    )

    klay = kb.get_dispatch_layout(idx, num_experts)[:4]
    rlay = rb.get_dispatch_layout(idx, num_experts)[:4]
    assert_layout_same(klay, rlay)

    poison(kb)
    kout = dispatch(kb, x_in, klay, idx, w, **kw)
    # The reference's kernels may be launched for the first time in this process: under lazy
    # loading that must not happen while an internode kernel waits for the ipc proxies
    # (docs/architecture.md, "Internode path"), so each reference call starts after the kernels
    # finished.
    torch.cuda.synchronize()
    rout = dispatch(rb, x_in, rlay, idx, w, **kw)
    krx, kidx, kw_, kcounts, kh, _ = kout
    rrx, ridx, rw_, rcounts, rh, _ = rout
    torch.cuda.synchronize()
    kb._backend.check()
    received = int(rh.rank_prefix_matrix[-1, rank])
    # Sync-free padding rows of recv_x (and FP8 scales) are unspecified: compare the received.
    count = received if kw["num_worst_tokens"] else None
    assert_recv_same(kout, rout, params.get("fp8", False), count=count)
    assert_same("num_recv_tokens_per_expert", kcounts, rcounts)
    assert_same("rank_prefix_matrix", kh.rank_prefix_matrix, rh.rank_prefix_matrix)
    _check_src_idx(kh, rh, received, kw["num_worst_tokens"])
    assert kh.recv_count.tolist() == [received]
    if not kw["num_worst_tokens"]:
        # The device counts of the handle are the host list's (both from one header read, or,
        # past the row's per-expert block, from the second exchange).
        assert kh.recv_tokens_per_expert.tolist() == kcounts

    # Cached dispatch of a new x with the same layout.
    x2 = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    poison(kb)
    kc = kb.dispatch(x2, handle=kh, config=config)[0]
    torch.cuda.synchronize()
    rc = rb.dispatch(x2, handle=rh, config=config)[0]
    torch.cuda.synchronize()
    kb._backend.check()
    assert_same("cached recv_x", kc[:count], rc[:count])

    stats = {"recv": received}
    if params.get("fp8"):
        return stats
    padded = received if kw["num_worst_tokens"] else None
    y, bias = combine_inputs(krx, padded, params.get("bias", 0), num_tokens, gen)
    poison(kb)
    kcx, kcw, _ = kb.combine(y, kh, topk_weights=kw_, bias=bias or None, config=config)
    torch.cuda.synchronize()
    rcx, rcw, _ = rb.combine(y, rh, topk_weights=rw_, bias=bias or None, config=config)
    torch.cuda.synchronize()
    kb._backend.check()
    # Two summands (plus bias in the same order): fp32 accumulation is exact, so are we.
    # More: within the bf16 roundings of the partials, bounded by the summands' magnitude.
    mag, _, _ = rb.combine(
        y.abs(), rh, topk_weights=rw_, bias=tuple(b.abs() for b in bias) or None, config=config
    )
    torch.cuda.synchronize()
    assert_combine_close(kcx, kcw, rcx, rcw, exact=world == 2, magnitude=mag)
    # The same input written into Buffer.get_combine_input's tensor: with node peers it lies in
    # the receive arena and they read it in place instead of from the staging; the same sums in
    # the same order.
    y_in = kb.get_combine_input(y.shape[0], y.shape[1], y.dtype)
    y_in.copy_(y)
    placed = kb._backend.placed_combines
    pcx, pcw, _ = kb.combine(y_in, kh, topk_weights=kw_, bias=bias or None, config=config)
    torch.cuda.synchronize()
    kb._backend.check()
    assert_same("combine of get_combine_input's x", pcx, kcx)
    assert_same("combine of get_combine_input's x: weights", pcw, kcw)
    arena = kb._backend.recv_arena
    if world > 2 and arena is not None:
        # Read in place exactly when x and its weights lie in the arena (it may be full).
        in_arena = y.shape[0] > 0 and arena.holds(y_in) and arena.holds(kw_)
        assert kb._backend.placed_combines == placed + int(in_arena), (in_arena, placed)
    plain, _, _ = kb.combine(krx, kh, config=config)
    torch.cuda.synchronize()
    kb._backend.check()
    assert_combined_is_x_times_reached(plain, x, klay[3])
    return stats


def _check_src_idx(kh, rh, received: int, worst: int) -> None:
    """Source indices equal the reference's; with num_worst_tokens W the handle's are [W] with
    -1 on the padding rows (the host does not know the received count)."""
    if worst:
        assert kh.num_recv_tokens == worst and kh.recv_src_idx.shape == (worst,)
        assert_same("recv_src_idx", kh.recv_src_idx[:received], rh.recv_src_idx[:received])
        assert bool((kh.recv_src_idx[received:] == -1).all()), "padding rows of recv_src_idx"
    else:
        assert kh.num_recv_tokens == rh.num_recv_tokens == received
        assert_same("recv_src_idx", kh.recv_src_idx, rh.recv_src_idx)


def case(rank: int, world: int, params: dict, reorder: bool) -> dict:
    kb, rb = _get_buffers(reorder, params.get("arena", "on"), rank)
    assert kb.backend == "kernels_internode", kb.backend
    assert rb.backend == "reference"
    assert kb.num_rdma_ranks == 2
    out = {}
    for seed in params.get("seeds", [params.get("seed", 1)]):
        out = _one(kb, rb, rank, world, params, seed)
    stats = kb._backend.proxy.stats()
    out["proxy_writes"] = stats.get("writes_posted", 0)
    out["held_out_of_order"] = stats.get("held_out_of_order", 0)
    out["transport"] = kb._backend.proxy.transport_kind
    out["in_place"] = kb._backend.proxy.bytes_in_place
    out["placed"] = (kb._backend.placed_dispatches, kb._backend.placed_combines)
    return out


# Config(num_sms, nvl send, nvl ring, rdma chunk, rdma ring): the "small" ones make every ring
# wrap hundreds of times and chunks split at the wrap.
CASES = {
    "t1_h7168_random": dict(tokens=1, hidden=7168, routing="random", seed=1),
    "t127_h2048_random_i32": dict(
        tokens=127, hidden=2048, routing="random", seed=2, idx_dtype=torch.int32
    ),
    "t4096_h7168_dsv3": dict(
        tokens=4096, hidden=7168, routing="random", experts=256, topk=8, seed=3
    ),
    "t4096_h7168_dsv3_fp8": dict(
        tokens=4096, hidden=7168, routing="random", experts=256, topk=8, seed=4, fp8=True
    ),
    "t3000_h4096_skewed_bias": dict(tokens=3000, hidden=4096, routing="skewed", seed=5, bias=2),
    "t777_h2048_remote": dict(tokens=777, hidden=2048, routing="remote", seed=6, bias=1),
    "t513_h7168_holes_align": dict(tokens=513, hidden=7168, routing="holes", seed=7, align=128),
    "t300_h2048_worst": dict(tokens=300, hidden=2048, routing="holes", seed=8, worst=1),
    "t2000_h2048_small_rings": dict(
        tokens=2000, hidden=2048, routing="random", config=(4, 6, 256, 3, 8), seeds=[11, 12, 13]
    ),
    "t1500_h1024_skewed_tiny_rings": dict(
        tokens=1500, hidden=1024, routing="skewed", config=(6, 6, 256, 2, 5), seeds=[21, 22]
    ),
    "t0_h2048": dict(tokens=0, hidden=2048, routing="random", seed=9),
    # More experts than a call-header row carries (agreement.EXPERT_SLOTS = 512): the counts
    # are gathered by a second exchange; the same numbers.
    "t513_h2048_1024_experts_align": dict(
        tokens=513, hidden=2048, routing="random", experts=1024, topk=8, seed=10, align=4
    ),
}


# Two virtual nodes of m ranks each.
gpu_pool = pool_fixture([2 * m for m in RANKS_PER_NODE], ids=lambda n: f"2x{n // 2}")


@pytest.mark.parametrize("reorder", [False, True], ids=["ordered", "reorder"])
@pytest.mark.parametrize("name", list(CASES))
def test_internode_matches_reference(gpu_pool, name, reorder):
    out = gpu_pool.run(__file__, "case", CASES[name], reorder, env=_env(gpu_pool, reorder, 7))
    assert len(out) == gpu_pool.world_size
    assert all(o["transport"] == "ipc" for o in out)
    assert all(o["in_place"] == (DELIVERY == "store") for o in out), (DELIVERY, out)
    if CASES[name]["tokens"] > 0:
        # Tokens crossed the virtual network through the proxies.
        assert sum(o["proxy_writes"] for o in out) > 0
    if reorder and CASES[name]["tokens"] >= 1000:
        # The injector really delivered out of order, and the receivers re-ordered it.
        assert sum(o["held_out_of_order"] for o in out) > 0
    if gpu_pool.world_size > 2 and CASES[name]["tokens"] > 0:
        # Node peers wrote every dispatch's rows into the outputs in the receive arena, and
        # read the combine of those outputs (``krx``) where it lies.
        assert all(o["placed"][0] > 0 and o["placed"][1] > 0 for o in out), out


# The node's staging instead of the receive arena, on every rank or on one (mixed placements in
# one call); the same outputs.
@pytest.mark.parametrize("arena", ["off", "mixed"])
@pytest.mark.parametrize(
    "name", ["t4096_h7168_dsv3", "t300_h2048_worst", "t2000_h2048_small_rings"]
)
def test_internode_staged_placement_matches_reference(gpu_pool, name, arena):
    if gpu_pool.world_size <= 2:
        pytest.skip("one rank per node: no node peer, no staging")
    params = {**CASES[name], "arena": arena}
    out = gpu_pool.run(__file__, "case", params, False, env=_env(gpu_pool, False, 7))
    placed = [o["placed"] for o in out]
    if arena == "off":
        assert all(p == (0, 0) for p in placed), placed
    else:
        # Rank 0's 1 MiB arena holds none of these calls' outputs; its node peer's does.
        assert placed[0] == (0, 0) and placed[1][0] > 0, placed


# ---- sync-free mode (num_worst_tokens = W > 0) ---------------------------------------------
# Host syncs a call may not make, counted on the calling thread (the CPU proxies, and gloo's
# worker threads under the shared-GPU harness, make their own CUDA calls on their own threads).
_SYNC_CALLS = {
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
}


def _host_syncs(calls) -> dict:
    """Run ``calls()`` under torch.profiler and count, on the calling thread, the CUDA runtime
    calls that wait for the GPU and the device-to-host (or pageable host-to-device) copies.

    torch.profiler records the runtime calls of every thread. The raw kineto events are used:
    their runtime calls all name their thread the same way (the CUPTI record's thread, in
    ``device_resource_id``; FunctionEvent instead gives calls made inside a torch op the op's
    own thread id). The calling thread is found from a marker: after ``calls()``, a
    ``.cpu()`` of a device tensor (a device-to-host copy and a stream sync) runs on this thread;
    the last runtime copy whose device activity (same correlation id) goes device-to-host names
    the thread, and only its calls before the marker count. Finding the marker also proves the
    profiler reports what is counted."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    probe = torch.ones(4, device="cuda")
    marker = torch.cuda.Stream()
    torch.cuda.synchronize()  # probe is ready on every stream
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        calls()
        # The marker copy runs on a stream of its own, so it never waits for the calls'
        # kernels. Issued on the calls' stream, this copy to pageable memory waited for the
        # last combine while that combine still waited for the ipc proxies, and the proxies'
        # CUDA copies made no progress until the combine timed out: on one H200 under MPS the
        # counters of the first run showed every earlier call complete and exactly that
        # combine stalled, while the same calls followed by torch.cuda.synchronize() completed.
        # Synchronizing after the marker is not counted (only calls before it are).
        with torch.cuda.stream(marker):
            probe.cpu()
        torch.cuda.synchronize()
    events = list(prof.profiler.kineto_results.events())
    device_op = {e.correlation_id(): e.name() for e in events if e.device_type() == DeviceType.CUDA}
    runtime = [
        e for e in events if e.device_type() == DeviceType.CPU and e.name().startswith("cuda")
    ]

    def copy_kind(e) -> str:
        return device_op.get(e.correlation_id(), "") if e.name().startswith("cudaMemcpy") else ""

    marks = [e for e in runtime if "DtoH" in copy_kind(e)]
    assert marks, "the profiler reported no device-to-host copy for the marker"
    mark = max(marks, key=lambda e: e.start_ns())

    def thread(e) -> tuple[int, int]:
        return e.start_thread_id(), e.device_resource_id()

    mine = [e for e in runtime if thread(e) == thread(mark) and e.start_ns() < mark.start_ns()]
    # Name the torch op a call was made in (if any), for the failure message.
    ops = {
        e.correlation_id(): e.name()
        for e in events
        if e.device_type() == DeviceType.CPU and not e.name().startswith("cuda")
    }

    def where(e) -> str:
        return f"{e.name()} in {ops.get(e.linked_correlation_id(), 'no torch op')}"

    syncs = [where(e) for e in mine if e.name() in _SYNC_CALLS]
    copies = [
        f"{copy_kind(e)}: {where(e)}"
        for e in mine
        if any(k in copy_kind(e) for k in ("DtoH", "Pageable"))
    ]
    return {"syncs": syncs, "copies": copies, "runtime_calls": len(mine)}


def sync_free_case(rank: int, world: int, params: dict, reorder: bool) -> dict:
    """num_worst_tokens = W: outputs equal the reference oracle's (padded to W), the handle's
    device counts equal exact mode's host list, cached dispatch and combine of the handle equal
    the reference's, and after a warm-up a whole layout + dispatch + cached dispatch + combine
    makes no host sync on the calling thread."""
    from uccl_ep_megatron import Config

    kb, rb = _get_buffers(reorder)
    assert kb.backend == "kernels_internode", kb.backend
    num_tokens, hidden = params["tokens"], params["hidden"]
    num_experts, topk = params.get("experts", 8 * world), params.get("topk", 4)
    align = params.get("align", 1)
    worst = num_tokens * world
    gen = torch.Generator(device="cuda").manual_seed(500 + rank)
    idx = routing(params["routing"], rank, world, num_tokens, num_experts, topk, gen)
    w = torch.rand(num_tokens, topk, generator=gen, device="cuda")
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    config = Config(min(24, kb.max_num_sms or 24))
    kw = dict(expert_alignment=align, config=config)

    lay = kb.get_dispatch_layout(idx, num_experts)[:4]
    exact = dispatch(kb, x, lay, idx, w, **kw)
    torch.cuda.synchronize()
    kb._backend.check()
    poison(kb)
    kx, kidx, kwts, kcounts, kh, _ = dispatch(kb, x, lay, idx, w, num_worst_tokens=worst, **kw)
    torch.cuda.synchronize()
    kb._backend.check()
    rx, ridx, rwts, rcounts, rh, _ = dispatch(rb, x, lay, idx, w, num_worst_tokens=worst, **kw)
    torch.cuda.synchronize()
    received = int(rh.rank_prefix_matrix[-1, rank])
    assert kx.shape[0] == worst
    # Padding rows of recv_x are unspecified (ids -1, weights 0: compared in full).
    assert_recv_same((kx, kidx, kwts), (rx, ridx, rwts), count=received)
    assert kcounts == rcounts == []
    assert_same("rank_prefix_matrix", kh.rank_prefix_matrix, rh.rank_prefix_matrix)
    _check_src_idx(kh, rh, received, worst)
    # The counts stay on the GPU, and are the numbers exact mode returns on the host.
    exact_h = exact[4]
    assert kh.recv_count.is_cuda and kh.recv_count.dtype == torch.int32
    assert kh.recv_count.tolist() == exact_h.recv_count.tolist() == [received]
    assert kh.recv_tokens_per_expert.tolist() == exact[3]
    assert exact_h.recv_tokens_per_expert.tolist() == exact[3]

    x2 = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    kc = kb.dispatch(x2, handle=kh, config=config)[0]
    torch.cuda.synchronize()
    kb._backend.check()
    rc = rb.dispatch(x2, handle=rh, config=config)[0]
    assert_same("cached recv_x", kc[:received], rc[:received])

    y, _ = combine_inputs(kx, received)
    kcx, kcw, _ = kb.combine(y, kh, topk_weights=kwts, config=config)
    torch.cuda.synchronize()
    kb._backend.check()
    rcx, rcw, _ = rb.combine(y, rh, topk_weights=rwts, config=config)
    assert_combine_close(kcx, kcw, rcx, rcw)

    def layer() -> tuple:
        """Two rounds issued back to back, no host sync between calls; the last outputs."""
        for _ in range(2):
            lay_ = kb.get_dispatch_layout(idx, num_experts)[:4]
            out = dispatch(kb, x, lay_, idx, w, num_worst_tokens=worst, **kw)
            cached = kb.dispatch(x2, handle=out[4], config=config)[0]
            combined = kb.combine(out[0], out[4], topk_weights=out[2], config=config)[:2]
        return out, cached, combined

    # Back to back without the profiler first (it is also the warm-up of the same sizes:
    # allocator, pinned staging, kernel loading), so that a failure here is the calls' own.
    out, cached, (lcx, lcw) = layer()
    torch.cuda.synchronize()
    kb._backend.check()
    assert_same("back-to-back recv_x", out[0][:received], rx[:received])
    assert_same("back-to-back recv_topk_idx", out[1], ridx)
    assert_same("back-to-back recv_topk_weights", out[2], rwts)
    _check_src_idx(out[4], rh, received, worst)
    assert out[4].recv_count.tolist() == [received]
    assert out[4].recv_tokens_per_expert.tolist() == exact[3]
    assert_same("back-to-back cached recv_x", cached[:received], rc[:received])
    rlx, rlw, _ = rb.combine(rx, rh, topk_weights=rwts, config=config)
    assert_combine_close(lcx, lcw, rlx, rlw)
    del out, cached, lcx, lcw

    # Under the shared-GPU harness the group is gloo, whose all-gather of CUDA tensors stages
    # them through host memory: torch's sync debug mode flags the collective and its wait
    # (seen on the device), although the profiler then records no synchronize on the calling
    # thread. That staging is the group's, not ours: with gloo, the header all-gather (the
    # backend's _gather_rows, which calls the group's own all-gather) runs with the debug mode
    # off and is counted, and anything else that synchronizes raises here with its stack; with
    # NCCL (one rank per GPU) nothing is exempted.
    gloo = torch.distributed.get_backend() == "gloo"
    backend = kb._backend
    real_gather = backend._gather_rows
    gathers: list[int] = []

    def gather_of_the_group(row):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_gather(row)
        finally:
            gathers.append(1)
            torch.cuda.set_sync_debug_mode("error")

    if gloo:
        backend._gather_rows = gather_of_the_group
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        if gloo:
            del backend._gather_rows  # the class's method again
    counted = _host_syncs(layer)
    torch.cuda.synchronize()
    kb._backend.check()
    return {**counted, "gloo": gloo, "received": received, "gathers": len(gathers)}


def sync_free_reject_case(rank: int, world: int) -> str:
    """A bad expert id on the last rank in a sync-free dispatch: no rank raises at the call,
    every rank's outputs are poisoned, and every rank's next host-visible point raises an
    InvalidInputError naming that rank and id."""
    from uccl_ep_megatron import Buffer, Config
    from uccl_ep_megatron.core.errors import InvalidInputError

    torch.cuda.empty_cache()  # see _get_buffers
    buf = Buffer(None, NVL_BYTES, RDMA_BYTES, backend="kernels", options=_small_arena())
    _keep.append(buf)  # unusable after the rejection; peers may still map its memory
    num_tokens, hidden, experts = 256, 2048, 8 * world
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(num_tokens, experts, generator=gen, device="cuda").topk(4, dim=1).indices
    if rank == world - 1:
        idx[5, 1] = experts + 3
    w = torch.rand(num_tokens, 4, generator=gen, device="cuda")
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    lay = buf.get_dispatch_layout(idx, experts)[:4]
    config = Config(min(24, buf.max_num_sms or 24))
    rx, ridx, rw, _, h, _ = dispatch(
        buf, x, lay, idx, w, num_worst_tokens=num_tokens * world, config=config
    )
    torch.cuda.synchronize()
    assert bool(torch.isnan(rx.float()).all()), "recv_x not poisoned"
    assert bool((ridx == -1).all()) and bool((rw == 0).all()), "ids / weights not poisoned"
    assert bool((h.recv_src_idx == -1).all()), "recv_src_idx not poisoned"
    try:
        buf.check_errors() if hasattr(buf, "check_errors") else buf._backend.check()
    except InvalidInputError as exc:
        return str(exc)
    return ""


@pytest.mark.parametrize("reorder", [False, True], ids=["ordered", "reorder"])
@pytest.mark.parametrize(
    "params",
    [
        dict(tokens=1024, hidden=7168, routing="random", experts=256, topk=8),
        dict(tokens=777, hidden=2048, routing="holes", align=128),
        dict(tokens=500, hidden=2048, routing="remote"),
    ],
    ids=["dsv3", "holes_align", "remote"],
)
def test_sync_free_dispatch_combine(gpu_pool, params, reorder):
    out = gpu_pool.run(__file__, "sync_free_case", params, reorder, env=_env(gpu_pool, reorder, 5))
    for r, o in enumerate(out):
        assert o["runtime_calls"] > 0, o  # the calling thread's calls were found and counted
        # No synchronize on the calling thread in the profiled round, on gloo too.
        assert o["syncs"] == [], f"rank {r} synced the host: {o}"
        if o["gloo"]:
            # One header all-gather per sync-free call (3 calls a round, 2 rounds) ran with the
            # debug mode off; nothing else synchronized (the debug-mode round raised otherwise).
            assert o["gathers"] == 6, o
        else:
            assert o["copies"] == [], f"rank {r} copied device-to-host: {o}"


def test_sync_free_bad_id_raises_on_every_rank(gpu_pool):
    out = gpu_pool.run(__file__, "sync_free_reject_case", env=_env(gpu_pool, False, 0))
    bad = gpu_pool.world_size - 1
    for r, text in enumerate(out):
        assert re.search(
            rf"rank {bad}'s topk_idx contains expert id {8 * gpu_pool.world_size + 3}", text
        ), (r, text)


def grow_case(rank: int, world: int) -> dict:
    """With several ranks per node, a Buffer sized by DeepEP's NVLink hint is too small for a
    call whose rows all go to rank 0: the NVLink staging grows on every rank at that call and
    the results still equal the reference backend's."""
    from uccl_ep_megatron import Buffer, BufferOptions

    _, rb = _get_buffers(False)
    num_tokens, hidden, num_experts = 4096, 7168, 8 * world
    hint = max(
        cfg.get_nvl_buffer_size_hint(hidden * 2, world)
        for cfg in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world))
    )
    # No receive arena: every call is staged, so the grown staging is what the kernels use.
    kb = Buffer(None, hint, RDMA_BYTES, backend="kernels", options=BufferOptions(arena_bytes=0))
    _keep.append(kb)
    gen = torch.Generator(device="cuda").manual_seed(99 + rank)
    scores = torch.rand(num_tokens, num_experts, generator=gen, device="cuda")
    scores[:, :8] += 10.0  # rank 0's experts: rank 0 receives world x num_tokens rows
    idx = scores.topk(4, dim=1).indices
    w = torch.rand(num_tokens, 4, generator=gen, device="cuda")
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    lay = kb.get_dispatch_layout(idx, num_experts)[:4]
    poison(kb)
    krx, kidx, _, _, kh, _ = dispatch(kb, x, lay, idx, w)
    torch.cuda.synchronize()
    kb._backend.check()
    rrx, ridx, _, _, rh, _ = dispatch(rb, x, lay, idx, w)
    assert_same("grown recv_x", krx, rrx)
    assert_same("grown recv_topk_idx", kidx, ridx)
    kcx, _, _ = kb.combine(krx, kh)
    torch.cuda.synchronize()
    kb._backend.check()
    rcx, _, _ = rb.combine(rrx, rh)
    torch.testing.assert_close(kcx.float(), rcx.float(), rtol=1e-2, atol=1e-2)
    ipc = kb._backend._ipc
    return {"grows": ipc.grows, "sizes": list(ipc.sizes), "hint": hint}


def test_nvl_staging_grows_collectively(gpu_pool):
    if gpu_pool.world_size < 4:
        pytest.skip("needs 2 ranks per virtual node (NVLink staging)")
    out = gpu_pool.run(__file__, "grow_case", env=_env(gpu_pool, True, 3))
    assert all(o["grows"] >= 1 for o in out), out
    assert len({tuple(o["sizes"]) for o in out}) == 1, out  # every rank knows every size
    assert out[0]["sizes"][0] > out[0]["hint"], out


def _poisoned(*shape: int) -> torch.Tensor:
    return torch.full(shape, -7, dtype=torch.int32, device="cuda")


def _same_streams(what, lists, count, want_lists, want_count, tokens) -> None:
    """Streams equal where they are defined: each (channel, source) run of ``count`` entries
    from its range's start (``channel_range``); beyond that the tables leave memory as is."""
    assert_same(f"{what} list_count", count, want_count)
    C, B = count.shape
    for b in range(B):
        n = int(tokens[b])
        for c in range(C):
            begin, k = min(c * max(1, -(-n // C)), n), int(want_count[c, b])
            got, want = lists[b, begin : begin + k], want_lists[b, begin : begin + k]
            assert_same(f"{what} lists[{b}] channel {c}", got, want)


def _check_dispatch_tables(be, rank, in_rank, rows, C, what) -> None:
    from uccl_ep_megatron.backends.agreement import COUNTS_COLUMN
    from uccl_ep_megatron.backends.internode import tables
    from uccl_ep_megatron.backends.internode.launch import DispatchTablesTensors

    T, R = in_rank.shape
    L = be.topology.ranks_per_node
    N = R // L
    # A sync-free call's padded outputs (W rows, K columns; ids of either width), poisoned.
    W, K = 2 * T + 3, 1 + T % 5
    pad_ids = _poisoned(W, K).to(torch.int64 if T % 2 else torch.int32)
    t = DispatchTablesTensors(
        rows, in_rank, _poisoned(T, R), _poisoned(N, T), _poisoned(C, N), _poisoned(R, R),
        _poisoned(L), _poisoned(R + 1), _poisoned(1), _poisoned(N), _poisoned(N, max(1, T), L),
        pad_ids, torch.full((W, K), float("nan"), device="cuda"), _poisoned(W),
    )  # fmt: skip
    be._in.dispatch_tables(be._context(), be._stream(), C, COUNTS_COLUMN, t)
    assert bool((t.pad_ids == -1).all()), f"{what}: pad_ids ({t.pad_ids.dtype}) not all -1"
    assert bool((t.pad_weights == 0).all()), f"{what}: pad_weights not all 0"
    assert bool((t.pad_src == -1).all()), f"{what}: pad_src not all -1"
    ref = tables.call_tables(rows, rank, L)
    lists, count, _ = tables.stream_tables(in_rank.view(T, N, L).any(2), C)
    assert_same(f"{what} dst_row", t.dst_row, tables.dst_rows(in_rank, ref.first_row))
    _same_streams(what, t.lists, t.list_count, lists, count, [T] * N)
    for name in ("rank_prefix", "recv_rows", "recv_prefix", "recv_count", "src_tokens"):
        want = getattr(ref, "rank_prefix_matrix" if name == "rank_prefix" else name)
        assert_same(f"{what} {name}", getattr(t, name), want)
    assert bool((t.plan == -1).all()), f"{what}: plan not all -1"


def _check_combine_tables(be, in_rank, gen, C, what) -> None:
    from uccl_ep_megatron.backends.internode import tables
    from uccl_ep_megatron.backends.internode.launch import CombineTablesTensors

    T, R = in_rank.shape
    L = be.topology.ranks_per_node
    N, P = R // L, max(1, T)
    plan = torch.randint(-1, 3, (N, P, L), generator=gen, device="cuda", dtype=torch.int32)
    src = torch.randint(0, P + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
    t = CombineTablesTensors(in_rank, plan, src, _poisoned(T, N), _poisoned(N, P), _poisoned(C, N))
    be._in.combine_tables(be._context(), be._stream(), C, t)
    _, _, cum = tables.stream_tables(in_rank.view(T, N, L).any(2), C)
    lists, count, _ = tables.streams((plan >= 0).any(-1), src, C)
    assert_same(f"{what} combine cum", t.cum, cum)
    _same_streams(f"{what} combine", t.lists, t.list_count, lists, count, src.tolist())


def tables_case(rank: int, world: int) -> list[str]:
    """The index tables the kernels build (``_C.internode.dispatch_tables`` / ``combine_tables``)
    against their torch form in ``backends/internode/tables.py``, on random masks, headers and
    plans: empty and odd token counts, channel counts that do not divide them, full and empty
    masks. Outputs start poisoned. Returns the cases checked."""
    from uccl_ep_megatron.backends.agreement import COUNTS_COLUMN

    be = _get_buffers(False)[0]._backend
    gen = torch.Generator(device="cuda").manual_seed(31 + rank)
    done = []
    for T, C, density in [(0, 3, 0.5), (1, 1, 1.0), (7, 12, 0.5), (1000, 12, 0.3), (4097, 32, 0.9)]:
        for fill, p in (("random", density), ("none", 0.0), ("all", 1.0)):
            in_rank = torch.rand(T, world, generator=gen, device="cuda") < p
            rows = torch.randint(
                0, 5000, (world, COUNTS_COLUMN + world + 1), generator=gen, device="cuda"
            )
            rows[:, -1] = torch.randint(0, T + 1, (world,), generator=gen, device="cuda")
            what = f"T={T} C={C} {fill}"
            _check_dispatch_tables(be, rank, in_rank, rows, C, what)
            _check_combine_tables(be, in_rank, gen, C, what)
            done.append(what)
    torch.cuda.synchronize()
    return done


def _layout_variants(be, idx, E):
    """The true layout of ``idx``, then copies with one thing wrong each."""
    from uccl_ep_megatron.backends.base import Layout

    true = be.get_dispatch_layout(idx, E)
    yield "true", true
    T = idx.shape[0]
    if T:
        yield "per_rank", true._replace(num_tokens_per_rank=true.num_tokens_per_rank + 1)
        yield (
            "per_rdma",
            true._replace(num_tokens_per_rdma_rank=true.num_tokens_per_rdma_rank * 2 + 1),
        )
        yield "no_rdma", true._replace(num_tokens_per_rdma_rank=None)
        flipped = true.is_token_in_rank.clone()
        flipped[T // 2, 0] = ~flipped[T // 2, 0]
        yield "in_rank", true._replace(is_token_in_rank=flipped)
    pe = true.num_tokens_per_expert.clone()
    pe[-1] += 3
    yield (
        "per_expert",
        Layout(true.num_tokens_per_rank, true.num_tokens_per_rdma_rank, pe, true.is_token_in_rank),
    )


def _check_routing(be, rank, world, gen) -> list[str]:
    from uccl_ep_megatron.backends.base import Backend

    done = []
    E, K = 8 * world, 4
    for T in (0, 1, 333, 4096):
        for kind in ("random", "holes", "dup", "bad_id", "int32"):
            idx = routing("holes" if kind == "holes" else "random", rank, world, T, E, K, gen)
            if kind == "dup" and T:
                idx[T // 3, 1] = idx[T // 3, 0].clamp(min=0)
            if kind == "bad_id" and T:
                idx[T - 1, 2] = E + 5 if rank % 2 else -3
            if kind == "int32":
                idx = idx.to(torch.int32)
            for name, layout in _layout_variants(be, idx.clamp(max=E - 1), E):
                got = be.routing_check(layout, idx, E)
                want = Backend.routing_check(be, layout, idx, E)
                assert_same(f"routing check T={T} {kind} {name}", got, want)
                done.append(f"{T}/{kind}/{name}")
    # Every launch leaves its scratch as the next one needs it (zeros, word 0 all ones): the
    # launches above shared one, with no memset between them.
    scratch = be._check_scratch
    state = torch.zeros_like(scratch)
    state[0] = -1
    assert torch.equal(scratch, state), "the routing check left its scratch dirty"
    return done


def _check_verdicts(be, world, gen) -> list[str]:
    from uccl_ep_megatron.backends.agreement import (
        COUNTS_COLUMN,
        EXPERTS_COLUMN,
        CallHeader,
        DispatchExperts,
        device_verdict,
        encode_row,
        local_expert_counts,
        verdict_columns,
    )
    from uccl_ep_megatron.core.errors import InvalidInputError

    W = 64
    header = CallHeader(
        kind=1, seq=9, dtype=1, hidden=7168, num_topk=8, num_experts=8 * world, num_sms=24,
        rdma_send=20, rdma_recv=128, num_worst_tokens=W, buffer=3,
    )  # fmt: skip
    counts = torch.randint(0, W // world, (world,), generator=gen, device="cuda")
    checks = torch.tensor([0, 8 * world - 1, 0], device="cuda")
    base = torch.stack(
        [encode_row(header, world, torch.device("cuda"), checks, counts, W // 2)] * world
    )
    cols = verdict_columns()
    edits = {
        "ok": [],
        "error": [(cols.error, 2)],
        "magic": [(cols.magic, 7)],
        "buffer": [(cols.buffer, 4)],
        "seq": [(cols.seq, 10)],
        "field": [(cols.agreed[3], 1)],
        "bad_id": [(cols.checks, -5)],
        "high_id": [(cols.checks + 1, 10_000)],
        "bits": [(cols.checks + 2, 12)],
        "worst": [(cols.num_worst_tokens, W + 1)],
        "received": [(cols.counts, 10 * W)],
        "tokens": [(base.shape[1] - 1, W + 1)],
        "two": [(cols.seq, 11), (cols.checks + 2, 4)],
        "combine_kind": [(cols.kind, 3)],
    }
    done = []
    for name, changes in edits.items():
        for at in range(world):
            rows = base.clone()
            for col, value in changes:
                rows[at, col] = value
            out = torch.empty(3, dtype=torch.int64, device="cuda")
            be._in.call_verdict(be._stream(), rows, out, cols)
            assert_same(f"verdict {name} at rank {at}", out, device_verdict(rows))
            done.append(f"{name}/{at}")
    # The local expert counts the same launch sums from rows that carry per-expert counts
    # (odd and even experts per rank, every rank's view, alignments that round).
    for epr in (8, 3):
        E = epr * world
        rows = torch.stack(
            [
                encode_row(
                    dataclasses.replace(header, num_experts=E),
                    world,
                    torch.device("cuda"),
                    checks,
                    counts,
                    W // 2,
                    DispatchExperts(
                        torch.randint(0, 50, (E,), generator=gen, device="cuda").to(torch.int32), 1
                    ),
                )
                for _ in range(world)
            ]
        )
        for at in range(world):
            for align in (1, 4, 7):
                out = torch.empty(3, dtype=torch.int64, device="cuda")
                local = torch.full((epr + 1,), -7, dtype=torch.int32, device="cuda")
                be._in.call_verdict(be._stream(), rows, out, cols, local[:epr], at, align)
                want = local_expert_counts(rows, at, epr, align).to(torch.int32)
                assert_same(f"local expert counts {epr}/{at}/{align}", local[:epr], want)
                assert local[epr].item() == -7, "the kernel wrote past the local experts"
                assert_same(f"verdict with expert counts {epr}/{at}", out, device_verdict(rows))
                done.append(f"experts/{epr}/{at}/{align}")
                done.append(_check_header_read(be, rows, at, epr, align))
    done.append(_check_header_read(be, base, 0, 0, 1))  # a combine's read: no expert counts
    with pytest.raises(InvalidInputError, match="not pinned host memory"):
        host = torch.empty(base.numel(), dtype=torch.int64)  # pageable
        be._in.header_read(be._stream(), base, host, None, EXPERTS_COLUMN, COUNTS_COLUMN)
    torch.cuda.synchronize()
    return done


def _check_header_read(be, rows, rank: int, epr: int, align: int) -> str:
    """``header_read`` of ``rows`` against its torch form: every row without its per-expert
    block, then ``rank``'s aligned local expert counts (also on the GPU); the words past the
    read and past the counts keep their poison."""
    from uccl_ep_megatron.backends.agreement import (
        COUNTS_COLUMN,
        EXPERTS_COLUMN,
        host_part,
        local_expert_counts,
    )

    want = host_part(rows).view(-1).tolist()
    counts = local_expert_counts(rows, rank, epr, align).tolist() if epr else []
    host = torch.full((len(want) + epr + 3,), -9, dtype=torch.int64, pin_memory=True)
    local = torch.full((epr + 1,), -7, dtype=torch.int32, device="cuda")
    be._in.header_read(
        be._stream(), rows, host, local[:epr] if epr else None,
        EXPERTS_COLUMN, COUNTS_COLUMN, rank, align,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert host.tolist() == want + counts + [-9] * 3, f"header read {epr}/{rank}/{align}"
    assert local.tolist() == counts + [-7] * (epr + 1 - len(counts)), "local counts on the GPU"
    return f"read/{epr}/{rank}/{align}"


def _check_rows(be, world, gen) -> list[str]:
    """The row kernel (``InternodeBackend.encode_row``) against ``encode_row``, its torch
    form: every call kind, int32 and int64 device parts, per-expert counts past the block."""
    from uccl_ep_megatron.backends.agreement import (
        EXPERT_SLOTS,
        CallHeader,
        DispatchExperts,
        encode_row,
    )

    dev = torch.device("cuda")
    dispatch = CallHeader(
        kind=1, seq=12345678901, dtype=1, hidden=7168, num_topk=8, num_experts=8 * world,
        num_sms=24, rdma_send=20, rdma_recv=128, num_worst_tokens=-3, buffer=7,
    )  # fmt: skip
    checks = torch.tensor([-1, 8 * world - 1, 5], device=dev)

    def ints(n: int, dtype: torch.dtype, hi: int = 1 << 20) -> torch.Tensor:
        return torch.randint(-5, hi, (n,), generator=gen, device=dev).to(dtype)

    cases = {
        "combine": (CallHeader(kind=3, seq=2, handle_seq=1, num_bias=2), None, None, 0, None),
        "failed": (CallHeader(kind=1, seq=3, error=2), None, None, 0, None),
        "dispatch32": (dispatch, checks, ints(world, torch.int32), 4096, None),
        "dispatch64": (dispatch, checks, ints(world, torch.int64), 17, None),
        "experts32": (
            dispatch, checks, ints(world, torch.int32), 4096,
            DispatchExperts(ints(8 * world, torch.int32), 1),
        ),
        "experts64_odd": (
            dispatch, None, ints(world, torch.int64), 1,
            DispatchExperts(ints(3 * world + 1, torch.int64), 4),
        ),
        "experts_full": (
            dispatch, checks, None, 2, DispatchExperts(ints(EXPERT_SLOTS, torch.int32), 1)
        ),
        "experts_past_block": (
            dispatch, checks, ints(world, torch.int32), 3,
            DispatchExperts(ints(EXPERT_SLOTS + world, torch.int32), 1),
        ),
    }  # fmt: skip
    done = []
    for name, (header, chk, counts, tokens, experts) in cases.items():
        got = be.encode_row(header, chk, counts, tokens, experts)
        want = encode_row(header, world, dev, chk, counts, tokens, experts)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), f"row {name}: {got.tolist()} != {want.tolist()}"
        done.append(name)
    return done


def checks_case(rank: int, world: int) -> int:
    """The routing check, the header verdict and the row kernels against their torch forms
    (``Backend.routing_check``, ``device_verdict``, ``encode_row``): true and corrupted
    layouts, -1 slots, repeated and out-of-range ids, int32 ids, no tokens; every verdict code
    at every rank; local expert counts; rows of every call kind."""
    be = _get_buffers(False)[0]._backend
    gen = torch.Generator(device="cuda").manual_seed(77 + rank)
    done = _check_routing(be, rank, world, gen) + _check_verdicts(be, world, gen)
    done += _check_rows(be, world, gen)
    torch.cuda.synchronize()
    return len(done)


def test_check_kernels_match_their_torch_form(gpu_pool):
    out = gpu_pool.run(__file__, "checks_case", env=_env(gpu_pool, False, 0))
    assert all(n >= 100 for n in out), out  # 4 token counts x 5 routings x their layouts


def test_tables_kernels_match_their_torch_form(gpu_pool):
    out = gpu_pool.run(__file__, "tables_case", env=_env(gpu_pool, False, 0))
    assert all(len(o) == 15 for o in out), out


def _failure_inputs(rank: int, world: int, num_tokens: int):
    """A kernels Buffer (kept for the session: peers may still address its memory) and inputs
    that reach every rank, for the failure cases."""
    from uccl_ep_megatron import Buffer

    torch.cuda.empty_cache()  # see _get_buffers
    buf = Buffer(None, NVL_BYTES, RDMA_BYTES, backend="kernels", options=_small_arena())
    _keep.append(buf)
    hidden, experts = 2048, 4 * world
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(num_tokens, experts, generator=gen, device="cuda").topk(world, dim=1).indices
    w = torch.rand(num_tokens, world, generator=gen, device="cuda")
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    return buf, x, buf.get_dispatch_layout(idx, experts)[:4], idx, w


def dead_peer_case(rank: int, world: int) -> str:
    """The last rank's proxy is stopped (a dead peer): every rank's dispatch must end in an
    error that names a rank it waited for, instead of hanging."""
    from uccl_ep_megatron import Config
    from uccl_ep_megatron.core.errors import UcclEpError

    buf, x, layout, idx, w = _failure_inputs(rank, world, 4096)
    if rank == world - 1:
        buf._backend.proxy.close()
    try:
        dispatch(buf, x, layout, idx, w, config=Config(min(24, buf.max_num_sms or 24)))
        torch.cuda.synchronize()
        buf._backend.check()
    except UcclEpError as exc:
        return str(exc)
    # With several ranks per node, ranks off the dead rank's rail may finish (their NVLink
    # barrier with it can complete once its kernel gave up); the test checks the rail.
    return ""


def test_dead_peer_times_out_naming_the_rank(gpu_pool):
    env = _env(gpu_pool, False, 0)
    env["UCCL_EP_TIMEOUT_MS"] = "3000"
    out = gpu_pool.run(__file__, "dead_peer_case", env=env)
    world = gpu_pool.world_size
    dead = world - 1
    # The dead rank's rail partner waits for it; the dead rank waits for its partner.
    partner = dead - world // 2
    assert re.search(rf"rank {dead}\b", out[partner]), out[partner]
    assert re.search(r"waiting for rank \d+|rank \d+ has not acknowledged", out[dead]), out[dead]


def nic_fault_case(rank: int, world: int) -> dict:
    """A dispatch + combine loop under an injected NIC fault: returns each rank's error (or
    "" when it finished) and how long it took to get it."""
    import time

    from uccl_ep_megatron import Config
    from uccl_ep_megatron.core.errors import UcclEpError

    buf, x, layout, idx, w = _failure_inputs(rank, world, 2048)
    t0 = time.monotonic()
    try:
        for _ in range(20):
            out = dispatch(buf, x, layout, idx, w, config=Config(min(24, buf.max_num_sms or 24)))
            buf.combine(out[0], out[4], topk_weights=out[2])
            torch.cuda.synchronize()
            buf._backend.check()
    except UcclEpError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - t0}
    return {"error": "", "seconds": time.monotonic() - t0}


@pytest.mark.parametrize("fault", ["retry_exceeded", "dead_peer"])
def test_nic_fault_ends_in_a_clear_error_on_every_rank(gpu_pool, fault):
    world = gpu_pool.world_size
    dead = world - 1
    spec = {
        "retry_exceeded": "retry_exceeded:rank=0,qp=0,after=30,detect_ms=50",
        "dead_peer": f"dead_peer:rank={dead},after=30,detect_ms=50",
    }[fault]
    env = _env(gpu_pool, False, 0)
    env.update(UCCL_EP_TIMEOUT_MS="3000", UCCL_EP_IPC_FAULT=spec)
    out = gpu_pool.run(__file__, "nic_fault_case", env=env)
    # Nothing hangs: every rank is told within a few timeouts.
    assert all(o["seconds"] < 30 for o in out), out
    failing = 0 if fault == "retry_exceeded" else dead
    partner = (failing + world // 2) % world
    err = out[failing]["error"]
    assert "IBV_WC_RETRY_EXC_ERR" in err, err
    if fault == "retry_exceeded":
        assert "ipc rank 0" in err and "proxy thread 0" in err, err
    else:
        assert "stopped answering" in err, err
    # The failing rank's rail partner on the other node names it.
    assert out[partner]["error"], out
    assert re.search(rf"rank {failing}\b", out[partner]["error"]), out[partner]

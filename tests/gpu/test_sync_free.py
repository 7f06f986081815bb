"""Sync-free dispatch/combine (``num_worst_tokens`` > 0) of the ``kernels`` backend at 1, 2, 4
and 8 ranks (``UCCL_EP_TEST_RANKS``), through the one-GPU multi-rank harness of
test_intranode.py.

- Results equal the ``reference`` oracle exactly (dispatch) or within bf16 accumulation
  (combine), over uneven routing, ranks that receive nothing, -1 slots, BF16 and FP8, and
  ``expert_alignment`` > 1; the GPU count tensors of the handle equal the exact-mode host list.
- No host sync: the calls run under ``torch.cuda.set_sync_debug_mode("error")``, and a
  profiler trace holds no synchronize call and no device-to-host copy; exact mode, the positive
  control, holds one of each per dispatch.
- ``get_dispatch_layout`` + dispatch + combine capture in a CUDA graph and replay, with new
  inputs copied into the static ones, equal to eager calls and to the oracle.
- Bad input found on the GPU (more rows than ``num_worst_tokens`` reach a rank; an expert id
  out of range on one rank): the call itself returns, its outputs are poisoned on every rank,
  and every rank raises ``InvalidInputError`` naming the rank and value at ``check_errors()``
  and at the next call; the Buffer stays unusable (every later call raises the same error).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import (  # noqa: E402
    assert_combine_close,
    assert_combined_is_x_times_reached,
    assert_recv_same,
    assert_same,
    combine_inputs,
    dispatch,
    in_arena,
    inputs,
    kernels_buffer,
    nvl_bytes_for,
    poison,
    pool_fixture,
    rank_counts,
    routing,
)

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

RANKS = rank_counts("UCCL_EP_TEST_RANKS", "1,2,4,8")
NVL_BYTES = 1 << 30
# A stalled case fails in 20 s instead of the 100 s default wait. Buffers a case creates for
# itself get a small receive arena (the shared ones: gpu_common.ARENA_BYTES).
ENV = {"UCCL_EP_TIMEOUT_MS": "20000", "UCCL_EP_RECV_ARENA_BYTES": str(64 << 20)}

_buffers: dict[str, object] = {}
_keep: list[object] = []  # Buffers left unusable by an error case: kept, never freed


def _get_buffers(arena: bool = True):
    """A kernels Buffer with the receive arena on (zero-copy dispatch) or off (staged) and a
    reference oracle per process, reused by every case (created on first use)."""
    from uccl_ep_megatron.cluster.local import reference_oracle

    if "reference" not in _buffers:
        _buffers["reference"] = reference_oracle(None, NVL_BYTES)
    key = "kernels" if arena else "staged"
    if key not in _buffers:
        _buffers[key] = kernels_buffer(NVL_BYTES, arena)
    return _buffers[key], _buffers["reference"]


def _inputs(rank: int, world: int, params: dict, salt: int = 0):
    """(x as passed to dispatch, bf16 x, topk_idx, topk_weights, num_experts) of one case."""
    gen = torch.Generator(device="cuda").manual_seed(1000 * params["seed"] + 17 * salt + rank)
    return inputs(rank, world, params, gen)


def _worst(params: dict, world: int) -> int:
    return params["tokens"] * world


def sync_free_case(rank: int, world: int, params: dict) -> int:
    """Sync-free kernels vs the sync-free oracle, and the count tensors vs exact mode."""
    arena = params.get("arena", True)
    kb, rb = _get_buffers(arena)
    x_in, x, idx, w, num_experts = _inputs(rank, world, params)
    worst = _worst(params, world)
    kw = dict(expert_alignment=params.get("align", 1), num_worst_tokens=worst)
    klay = kb.get_dispatch_layout(idx, num_experts)[:4]
    rlay = rb.get_dispatch_layout(idx, num_experts)[:4]

    poison(kb)
    one_call = kb._backend.one_call_dispatches
    kout = dispatch(kb, x_in, klay, idx, w, **kw)
    rout = dispatch(rb, x_in, rlay, idx, w, **kw)
    krx, kidx, kw_, kcounts, kh, _ = kout
    rrx, ridx, rw_, rcounts, rh, _ = rout
    # The path under test was taken: outputs in the arena (zero-copy, launched by one binding
    # call) or torch's (staged, step by step).
    assert in_arena(kb, krx[0] if params.get("fp8") else krx) == arena
    assert kb._backend.one_call_dispatches == one_call + int(arena)
    assert_recv_same(kout, rout, params.get("fp8", False), count=int(kh.recv_count))
    num_recv = int(kh.recv_count)
    assert kcounts == [] and rcounts == []
    assert_same("rank_prefix_matrix", kh.rank_prefix_matrix, rh.rank_prefix_matrix)
    assert_same("recv_src_idx", kh.recv_src_idx, rh.recv_src_idx)
    assert_same("recv_count", kh.recv_count, rh.recv_count)
    assert_same("recv_tokens_per_expert", kh.recv_tokens_per_expert, rh.recv_tokens_per_expert)
    assert kh.num_recv_tokens == rh.num_recv_tokens == worst
    assert (kh.recv_src_idx[num_recv:] == -1).all()
    assert (kidx[num_recv:] == -1).all() and (kw_[num_recv:] == 0).all()

    # The same numbers as exact mode's host list (and its own count tensors).
    ex = dispatch(kb, x_in, klay, idx, w, expert_alignment=kw["expert_alignment"])
    exact_counts, eh = ex[3], ex[4]
    assert kh.recv_tokens_per_expert.tolist() == exact_counts
    assert eh.recv_tokens_per_expert.tolist() == exact_counts
    assert eh.recv_count.tolist() == [eh.num_recv_tokens] == [num_recv]

    # Cached dispatch of a new x with the sync-free handle: the same received rows.
    x2_in = x_in
    if not params.get("fp8"):
        x2_in = (x.float() * 2 - 1).to(torch.bfloat16)
    poison(kb)
    one_call = kb._backend.one_call_dispatches
    kc = kb.dispatch(x2_in, handle=kh)[0]
    assert kb._backend.one_call_dispatches == one_call + int(arena)
    rc = rb.dispatch(x2_in, handle=rh)[0]
    if params.get("fp8"):
        assert_same("cached recv_x", kc[0][:num_recv], rc[0][:num_recv])
        assert_same("cached recv_scales", kc[1][:num_recv], rc[1][:num_recv])
        return num_recv
    assert kc.shape[0] == worst
    assert_same("cached recv_x", kc[:num_recv], rc[:num_recv])

    # Combine: padding rows hold garbage that must be ignored.
    y, _ = combine_inputs(krx, num_recv)
    poison(kb)
    kcx, kcw, _ = kb.combine(y, kh, topk_weights=kw_)
    rcx, rcw, _ = rb.combine(y, rh, topk_weights=rw_)
    assert_combine_close(kcx, kcw, rcx, rcw)
    plain, _, _ = kb.combine(krx, kh)
    assert_combined_is_x_times_reached(plain, x, klay[3])
    kb.check_errors()
    torch.cuda.synchronize()
    return num_recv


def _layer(buf, x, idx, w, num_experts: int, worst: int):
    """get_dispatch_layout + dispatch + combine of the recv rows scaled by their weights."""
    lay = buf.get_dispatch_layout(idx, num_experts)[:4]
    recv_x, recv_idx, recv_w, _, handle, _ = dispatch(buf, x, lay, idx, w, num_worst_tokens=worst)
    y = (recv_x.float() * (recv_w.sum(1, keepdim=True) + 1.0)).to(recv_x.dtype)
    out, out_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    return recv_x, recv_idx, handle.recv_count, out, out_w


def _trace_syncs(fn, calls: int) -> tuple[int, int]:
    """(synchronize calls, device-to-host copies) in a profiler trace of ``calls`` x ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    sync_names = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    syncs = sum(1 for n in names if n in sync_names)
    dtoh = sum(1 for n in names if "DtoH" in n)
    return syncs, dtoh


def _runtime_syncs(fn, calls: int) -> tuple[int, int]:
    """``_trace_syncs`` less what a trace of nothing holds (the profiler's own flushes)."""
    base = _trace_syncs(lambda: None, calls)
    got = _trace_syncs(fn, calls)
    return got[0] - base[0], got[1] - base[1]


def no_sync_case(rank: int, world: int) -> dict:
    """Sync-free calls make no host sync (debug mode, profiler, host waits); exact mode waits
    once per dispatch on mapped memory, which the runtime does not see."""
    from uccl_ep_megatron.backends.intranode.status import host_waits

    kb, _ = _get_buffers()
    params = dict(tokens=512, hidden=2048, routing="random", seed=21)
    _, x, idx, w, num_experts = _inputs(rank, world, params)
    worst = _worst(params, world)

    def sync_free():
        return _layer(kb, x, idx, w, num_experts, worst)

    def exact():
        lay = kb.get_dispatch_layout(idx, num_experts)[:4]
        recv_x, _, _, _, handle, _ = dispatch(kb, x, lay, idx, w)
        kb.combine(recv_x, handle)

    sync_free()  # warm-up: loads kernels, sizes the buffer
    exact()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            sync_free()
        kb.check_errors()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    calls = 3

    def counted(fn) -> tuple[int, int, int]:
        waits = host_waits()
        syncs, dtoh = _runtime_syncs(fn, calls)
        return syncs, dtoh, host_waits() - waits

    return {
        "free": counted(sync_free),
        "exact": counted(exact),
        "control": _runtime_syncs(lambda: x.float().sum().item(), calls),
        "calls": calls,
    }


def graph_case(rank: int, world: int, replays: int) -> int:
    """Layout + dispatch + combine captured once, replayed with new inputs: equal to eager
    sync-free calls and to the oracle each time."""
    from uccl_ep_megatron import Buffer

    _, rb = _get_buffers()
    # A Buffer of its own: once captured, a Buffer can no longer grow (see _fit), which must
    # not constrain the other cases of this process.
    params = dict(tokens=384, hidden=2048, routing="random", seed=31, experts=8 * world)
    kb = Buffer(None, nvl_bytes_for(world, params["hidden"]), 0, backend="kernels")
    _keep.append(kb)
    _, x0, idx0, w0, num_experts = _inputs(rank, world, params)
    worst = _worst(params, world)
    static_x, static_idx, static_w = x0.clone(), idx0.clone(), w0.clone()

    # Warm-up on a side stream (as torch.cuda.graph recommends): loads every kernel and grows
    # the buffer to this call's size, which capture cannot do.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _layer(kb, static_x, static_idx, static_w, num_experts, worst)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        g_rx, g_ridx, g_count, g_out, g_outw = _layer(
            kb, static_x, static_idx, static_w, num_experts, worst
        )
    torch.cuda.synchronize()
    kb.check_errors()

    for n in range(replays):
        _, x, idx, w, _ = _inputs(rank, world, {**params, "seed": 32 + n}, salt=n)
        if n % 2:
            idx[: idx.shape[0] // 3] = -1  # other counts per replay, and unused slots
        static_x.copy_(x)
        static_idx.copy_(idx)
        static_w.copy_(w)
        graph.replay()
        torch.cuda.synchronize()
        kb.check_errors()
        e_rx, e_ridx, e_count, e_out, e_outw = _layer(kb, x, idx, w, num_experts, worst)
        got = int(g_count)  # padding rows of recv_x are unspecified: compare the received ones
        assert_same(f"replay {n}: recv_x", g_rx[:got], e_rx[:got])
        assert_same(f"replay {n}: recv_topk_idx", g_ridx, e_ridx)
        assert_same(f"replay {n}: recv_count", g_count, e_count)
        assert_same(f"replay {n}: combined", g_out, e_out)
        assert_same(f"replay {n}: combined weights", g_outw, e_outw)
        r_rx, r_ridx, r_count, r_out, r_outw = _layer(rb, x, idx, w, num_experts, worst)
        assert_same(f"replay {n}: oracle recv_x", g_rx[:got], r_rx[:got])
        assert_same(f"replay {n}: oracle recv_count", g_count, r_count)
        torch.testing.assert_close(
            g_out.float(), r_out.float().to(g_out.device), rtol=1e-2, atol=1e-2
        )
        torch.testing.assert_close(g_outw, r_outw.to(g_outw.device), rtol=1e-6, atol=1e-6)
    return int(g_count)


def _expect_raise(fn, what: str) -> str:
    from uccl_ep_megatron.core.errors import InvalidInputError

    try:
        fn()
    except InvalidInputError as exc:
        return str(exc)
    raise AssertionError(f"{what} did not raise InvalidInputError")


def error_case(rank: int, world: int, kind: str) -> dict:
    """``kind`` "overflow": every token goes to rank 0, one row more than num_worst_tokens;
    "bad_id": the last rank passes an expert id out of range; "bad_id_large": the same among
    4096 x 8 ids, its last, which the dispatch kernel's data blocks read in slices with notify.
    The call returns, its outputs are poisoned on every rank, and every rank raises at
    check_errors() and the next call."""
    from uccl_ep_megatron import Buffer

    large = kind == "bad_id_large"
    num_tokens, hidden, topk = (4096, 1024, min(8, 4 * world)) if large else (200, 1024, 2)
    kb = Buffer(None, nvl_bytes_for(world, hidden), 0, backend="kernels")
    _keep.append(kb)  # unusable after the error; peers may still map it: never freed
    num_experts = 4 * world
    gen = torch.Generator(device="cuda").manual_seed(41 + rank)
    kind_of_routing = "to_rank0" if kind == "overflow" else "random"
    idx = routing(kind_of_routing, rank, world, num_tokens, num_experts, topk, gen)
    w = torch.rand(num_tokens, topk, generator=gen, device="cuda")
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    worst = num_tokens * world
    if kind == "overflow":
        worst -= 1  # rank 0 receives every rank's tokens, num_tokens * world rows
    elif rank == world - 1:
        idx[(-1, -1) if large else (7, 1)] = num_experts
    lay = kb.get_dispatch_layout(idx, num_experts)[:4]
    torch.cuda.synchronize()
    kb.check_errors()  # nothing recorded yet
    poison(kb, 0x7F)  # neither NaN, -1 nor 0: what the asserts below see is the poison fill
    recv_x, recv_idx, recv_w, counts, handle, _ = dispatch(
        kb, x, lay, idx, w, num_worst_tokens=worst
    )
    torch.cuda.synchronize()
    assert counts == []
    assert recv_x.shape == (worst, hidden) and torch.isnan(recv_x.float()).all()
    assert (recv_idx == -1).all() and (recv_w == 0).all()
    assert (handle.recv_src_idx == -1).all()
    first = _expect_raise(kb.check_errors, "check_errors()")
    again = _expect_raise(
        lambda: dispatch(kb, x, lay, idx, w, num_worst_tokens=worst), "the next dispatch"
    )
    combine = _expect_raise(lambda: kb.combine(recv_x, handle), "a combine")
    return {"first": first, "again": again, "combine": combine}


CASES = {
    "t300_h2048_random": dict(tokens=300, hidden=2048, routing="random", seed=1),
    "t1024_h7168_skewed_align": dict(tokens=1024, hidden=7168, routing="skewed", seed=2, align=64),
    "t777_h2048_to_rank0": dict(tokens=777, hidden=2048, routing="to_rank0", seed=3),
    "t513_h4096_holes_i32": dict(
        tokens=513, hidden=4096, routing="holes", seed=4, align=16, idx_dtype=torch.int32
    ),
    "t2048_h7168_dsv3_fp8": dict(
        tokens=2048, hidden=7168, routing="random", experts=256, topk=8, seed=5, fp8=True
    ),
    "t1_h2048_random": dict(tokens=1, hidden=2048, routing="random", seed=6),
}


gpu_pool = pool_fixture(RANKS)


@pytest.mark.parametrize("arena", ["zero_copy", "staged"])
@pytest.mark.parametrize("name", list(CASES))
def test_sync_free_matches_reference(gpu_pool, name, arena):
    params = {**CASES[name], "arena": arena == "zero_copy"}
    recv = gpu_pool.run(__file__, "sync_free_case", params, env=ENV)
    assert len(recv) == gpu_pool.world_size
    if CASES[name]["routing"] == "to_rank0":
        # Rank 0 receives every token; the others nothing (empty ranks).
        assert recv[0] == CASES[name]["tokens"] * gpu_pool.world_size
        assert all(r == 0 for r in recv[1:]), recv


def test_no_host_sync(gpu_pool):
    out = gpu_pool.run(__file__, "no_sync_case", env=ENV)
    for o in out:
        assert o["free"] == (0, 0, 0), o
        # The positive control: the profiler does see a host read's sync and copy.
        syncs, dtoh = o["control"]
        assert syncs >= o["calls"] and dtoh >= o["calls"], o
        # Exact mode waits once per dispatch, on mapped memory: no runtime sync, no copy.
        assert o["exact"] == (0, 0, o["calls"]), o


@pytest.mark.parametrize("arena", ["zero_copy", "staged"])
def test_cuda_graph_replay(gpu_pool, arena):
    # Captured calls take the staged path either way; the eager calls compared with each
    # replay take the arena's when it is on.
    env = {**ENV, "UCCL_EP_RECV_ARENA_BYTES": str(64 << 20 if arena == "zero_copy" else 0)}
    out = gpu_pool.run(__file__, "graph_case", 4, env=env)
    assert len(out) == gpu_pool.world_size


@pytest.mark.parametrize("kind", ["overflow", "bad_id", "bad_id_large"])
def test_gpu_found_error_raises_on_every_rank(gpu_pool, kind):
    world = gpu_pool.world_size
    out = gpu_pool.run(__file__, "error_case", kind, env=ENV)
    if kind == "overflow":
        want = [f"num_worst_tokens={200 * world - 1}", f"rank 0 receives {200 * world} rows"]
    else:
        want = [f"rank {world - 1}:", f"expert id {4 * world}"]
    for o in out:
        for key in ("first", "again", "combine"):
            assert all(w in o[key] for w in want), (key, o)
            assert "unusable" in o[key], o

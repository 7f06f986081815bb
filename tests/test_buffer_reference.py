"""The Buffer contract on the reference backend, over 2, 3 and 4 gloo ranks.

Functions named ``w_*`` run on every rank of a pool (see dist_utils.py); the ``test_*``
functions send them. Expected values come from oracle.py, never from the backend under test.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from oracle import MODES, expected_combine, expected_for, make_inputs  # noqa: E402

HERE = os.path.abspath(__file__)
NUM_EXPERTS_PER_RANK = 4
TOPK = 3


def make_buffer(world: int, hidden: int, elem: int = 2, **kwargs):
    from uccl_ep_megatron import Buffer

    hidden_bytes = hidden * max(elem, 2)
    nvl = max(
        Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden_bytes, world),
        Buffer.get_combine_config(world).get_nvl_buffer_size_hint(hidden_bytes, world),
    )
    rdma = max(
        Buffer.get_dispatch_config(world).get_rdma_buffer_size_hint(hidden_bytes, world),
        Buffer.get_combine_config(world).get_rdma_buffer_size_hint(hidden_bytes, world),
    )
    return Buffer(None, nvl, rdma, backend="reference", **kwargs)


def all_inputs(seed, world, tokens, hidden, mode, num_experts=None):
    num_experts = num_experts or NUM_EXPERTS_PER_RANK * world
    return [
        make_inputs(seed, r, world, tokens, hidden, num_experts, TOPK, mode) for r in range(world)
    ]


def layout_and_dispatch(buf, x, inp, num_experts, **kwargs):
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, num_experts)
    return buf.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
        **kwargs,
    )


# ---- worker bodies ---------------------------------------------------------------------------
def w_layout(rank, world, seed, mode):
    hidden, num_experts = 32, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(seed, world, 9, hidden, mode)
    exp = expected_for(rank, world, inputs, num_experts)
    buf = make_buffer(world, hidden)
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
        inputs[rank].topk_idx, num_experts
    )
    assert per_rdma is None
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32
    assert per_rank.tolist() == exp.num_tokens_per_rank
    assert per_expert.tolist() == exp.num_tokens_per_expert
    assert torch.equal(in_rank, exp.is_token_in_rank)
    assert event.event is None


def w_dispatch_combine(rank, world, seed, mode, dtype_name):
    dtype = getattr(torch, dtype_name)
    hidden, num_experts = 64, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(seed, world, 11, hidden, mode)
    # The oracle sees the values as the backend does: rounded to the wire dtype.
    for inp in inputs:
        inp.x = inp.x.to(dtype).float()
    exp = expected_for(rank, world, inputs, num_experts)
    buf = make_buffer(world, hidden, torch.empty(0, dtype=dtype).element_size())
    inp = inputs[rank]
    x = inp.x.to(dtype)
    x_before = x.clone()
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(buf, x, inp, num_experts)
    assert torch.equal(x, x_before), "dispatch modified its input"
    assert recv_x.dtype == dtype
    assert torch.equal(recv_x.float(), exp.recv_x), "received rows differ from the oracle"
    assert recv_idx.dtype == torch.int64
    assert torch.equal(recv_idx, exp.recv_topk_idx)
    assert torch.equal(recv_w, exp.recv_topk_weights)
    assert counts == exp.per_expert
    assert torch.equal(handle[0], exp.rank_prefix_matrix)
    assert handle.recv_src_idx.tolist() == exp.recv_src_idx

    # Each rank scales what it received by (rank + 1) and sends it back.
    y = (recv_x.double() * (rank + 1)).to(dtype)
    combined, combined_w, _ = buf.combine(y, handle, topk_weights=recv_w)
    want, want_w = expected_combine(rank, world, inputs, num_experts)
    assert combined.dtype == dtype and combined.shape == inp.x.shape
    tol = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(combined.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(combined_w, want_w, rtol=1e-6, atol=1e-6)


def w_self_verifying(rank, world, seed):
    # x = rank, weights = rank: every received row names its sender.
    hidden, num_experts = 16, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(seed, world, 10, hidden, "random")
    inp = inputs[rank]
    buf = make_buffer(world, hidden)
    x = torch.full_like(inp.x, float(rank), dtype=torch.bfloat16)
    inp.topk_weights = torch.full_like(inp.topk_weights, float(rank))
    recv_x, recv_idx, recv_w, _, handle, _ = layout_and_dispatch(buf, x, inp, num_experts)
    prefix = handle.rank_prefix_matrix[:, rank].tolist()
    start = 0
    for src, end in enumerate(prefix):
        assert (recv_x[start:end] == src).all(), f"rows {start}:{end} should come from rank {src}"
        assert ((recv_w[start:end] == src) | (recv_idx[start:end] < 0)).all()
        start = end
    assert start == recv_x.shape[0]


def w_fp8(rank, world, seed):
    hidden, num_experts = 256, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(seed, world, 8, hidden, "random")
    scales_all = [
        torch.rand(i.x.shape[0], hidden // 128, generator=torch.Generator().manual_seed(r))
        for r, i in enumerate(inputs)
    ]
    for inp in inputs:
        inp.x = inp.x.to(torch.float8_e4m3fn).float()
    exp = expected_for(rank, world, inputs, num_experts)
    exp_scales = []
    epr = num_experts // world
    for s, i in enumerate(inputs):
        for t in range(i.x.shape[0]):
            if any(int(e) >= 0 and int(e) // epr == rank for e in i.topk_idx[t].tolist()):
                exp_scales.append(scales_all[s][t])
    buf = make_buffer(world, hidden, 1)
    inp = inputs[rank]
    x = (inp.x.to(torch.float8_e4m3fn), scales_all[rank])
    (recv_x, recv_scales), recv_idx, _, _, handle, _ = layout_and_dispatch(buf, x, inp, num_experts)
    assert recv_x.dtype == torch.float8_e4m3fn
    assert torch.equal(recv_x.float(), exp.recv_x)
    want_scales = torch.stack(exp_scales) if exp_scales else torch.empty(0, hidden // 128)
    assert torch.equal(recv_scales, want_scales)
    assert torch.equal(recv_idx, exp.recv_topk_idx)
    # Cached dispatch of an FP8 tuple reproduces the layout.
    (cached_x, cached_scales), *rest = buf.dispatch(x, handle=handle)
    assert torch.equal(cached_x.float(), exp.recv_x) and torch.equal(cached_scales, want_scales)
    assert rest[:4] == [None, None, None, None]


def w_worst_tokens_and_alignment(rank, world, seed):
    hidden, num_experts = 32, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(seed, world, 12, hidden, "skewed")
    exp = expected_for(rank, world, inputs, num_experts)
    inp = inputs[rank]
    buf = make_buffer(world, hidden, 4)
    worst = sum(i.x.shape[0] for i in inputs)
    recv_x, recv_idx, recv_w, counts, handle, _ = layout_and_dispatch(
        buf, inp.x, inp, num_experts, num_worst_tokens=worst
    )
    n = exp.recv_x.shape[0]
    assert recv_x.shape[0] == worst and counts == []
    assert torch.equal(recv_x[:n], exp.recv_x) and (recv_x[n:] == 0).all()
    assert torch.equal(recv_idx[:n], exp.recv_topk_idx) and (recv_idx[n:] == -1).all()
    assert (recv_w[n:] == 0).all()
    # Sync-free handle fields: GPU-side counts, source indices padded with -1.
    assert handle.num_recv_tokens == worst
    assert handle.recv_count.dtype == torch.int32 and handle.recv_count.tolist() == [n]
    assert handle.recv_src_idx.shape == (worst,) and handle.recv_src_idx.dtype == torch.int32
    assert handle.recv_src_idx[:n].tolist() == exp.recv_src_idx
    assert (handle.recv_src_idx[n:] == -1).all()
    assert handle.recv_tokens_per_expert.tolist() == exp.per_expert
    buf.check_errors()  # the reference backend raises at the call: nothing is pending
    combined, _, _ = buf.combine(recv_x, handle)
    want, _ = expected_combine(rank, world, inputs, num_experts)
    # expected_combine scales by (dest + 1); undo with an unscaled oracle sum instead.
    epr = num_experts // world
    plain = (
        torch.stack(
            [
                inp.x[t] * len({int(e) // epr for e in inp.topk_idx[t].tolist() if e >= 0})
                for t in range(inp.x.shape[0])
            ]
        )
        if inp.x.shape[0]
        else inp.x
    )
    torch.testing.assert_close(combined, plain, rtol=1e-5, atol=1e-5)
    assert want.shape == combined.shape
    # Cached dispatch keeps the padding of the handle.
    cached, *_ = buf.dispatch(inp.x * 2, handle=handle)
    assert cached.shape[0] == worst and torch.equal(cached[:n], exp.recv_x * 2)

    for align in (1, 4, 16):
        _, _, _, counts, exact, _ = layout_and_dispatch(
            buf, inp.x, inp, num_experts, expert_alignment=align
        )
        assert counts == [(c + align - 1) // align * align for c in exp.per_expert]
        assert exact.recv_tokens_per_expert.dtype == torch.int32
        assert exact.recv_tokens_per_expert.tolist() == counts
        assert exact.recv_count.tolist() == [n] and exact.num_recv_tokens == n
        *_, free, _ = layout_and_dispatch(
            buf, inp.x, inp, num_experts, expert_alignment=align, num_worst_tokens=worst
        )
        assert free.recv_tokens_per_expert.tolist() == counts


def w_round_trip_and_cached(rank, world, seed):
    hidden, num_experts = 48, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(seed, world, 10, hidden, "random")
    inp = inputs[rank]
    buf = make_buffer(world, hidden, 4)
    recv_x, _, _, _, handle, _ = layout_and_dispatch(buf, inp.x, inp, num_experts)
    combined, _, _ = buf.combine(recv_x, handle)
    epr = num_experts // world
    fan_out = torch.tensor(
        [len({int(e) // epr for e in row.tolist() if e >= 0}) for row in inp.topk_idx],
        dtype=torch.float32,
    )
    torch.testing.assert_close(combined, inp.x * fan_out[:, None], rtol=1e-6, atol=1e-6)
    # Cached dispatch of new data follows the same layout.
    x2 = torch.randn_like(inp.x)
    recv2, a, b, c, d, _ = buf.dispatch(x2, handle=handle)
    assert (a, b, c, d) == (None, None, None, None)
    combined2, _, _ = buf.combine(recv2, handle)
    torch.testing.assert_close(combined2, x2 * fan_out[:, None], rtol=1e-6, atol=1e-6)
    # get_combine_input: an ordinary tensor on this backend (no arena), combined as any x.
    xin = buf.get_combine_input(recv2.shape[0], hidden, recv2.dtype)
    assert xin.shape == recv2.shape and xin.dtype == recv2.dtype and xin.device == recv2.device
    xin.copy_(recv2)
    combined3, _, _ = buf.combine(xin, handle)
    torch.testing.assert_close(combined3, x2 * fan_out[:, None], rtol=1e-6, atol=1e-6)


def w_events(rank, world):
    from uccl_ep_megatron import Buffer, EventOverlap

    hidden, num_experts = 16, NUM_EXPERTS_PER_RANK * world
    inp = all_inputs(5, world, 6, hidden, "random")[rank]
    buf = make_buffer(world, hidden, 4)
    prev = Buffer.capture()
    assert isinstance(prev, EventOverlap)
    per_rank, per_rdma, per_expert, in_rank, ev = buf.get_dispatch_layout(
        inp.topk_idx,
        num_experts,
        previous_event=prev,
        async_finish=True,
        allocate_on_comm_stream=True,
    )
    recv_x, _, recv_w, _, handle, ev = buf.dispatch(
        inp.x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
        previous_event=ev,
        async_finish=True,
        allocate_on_comm_stream=True,
    )
    with ev:
        pass
    ev.current_stream_wait()
    combined, _, ev = buf.combine(recv_x, handle, previous_event=ev, async_finish=True)
    ev.current_stream_wait()
    assert buf.get_comm_stream() is None
    assert combined.shape == inp.x.shape


def w_virtual_nodes(rank, world):
    # UCCL_EP_RANKS_PER_NODE=1 makes every rank its own node: internode arguments matter.
    from uccl_ep_megatron import InvalidInputError

    hidden, num_experts = 16, NUM_EXPERTS_PER_RANK * world
    inputs = all_inputs(3, world, 8, hidden, "random")
    exp = expected_for(rank, world, inputs, num_experts)
    inp = inputs[rank]
    buf = make_buffer(world, hidden, 4)
    assert buf.num_rdma_ranks == world and buf.num_rdma_bytes > 0
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx, num_experts)
    assert per_rdma is not None and torch.equal(per_rdma, per_rank)
    try:
        buf.dispatch(
            inp.x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=inp.topk_idx,
            topk_weights=inp.topk_weights,
        )
        raise AssertionError("dispatch without num_tokens_per_rdma_rank accepted on several nodes")
    except InvalidInputError as e:
        assert "num_tokens_per_rdma_rank" in str(e)
    recv_x, *_ = layout_and_dispatch(buf, inp.x, inp, num_experts)
    assert torch.equal(recv_x, exp.recv_x)


def w_bad_inputs(rank, world):
    from uccl_ep_megatron import Buffer, BufferTooSmallError, InvalidInputError, UnsupportedError

    hidden, num_experts = 32, NUM_EXPERTS_PER_RANK * world
    inp = all_inputs(1, world, 6, hidden, "random")[rank]
    buf = make_buffer(world, hidden, 4)
    layout = buf.get_dispatch_layout(inp.topk_idx, num_experts)[:4]
    per_rank, per_rdma, per_expert, in_rank = layout
    kw = dict(
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
    )

    def expect(exc, needle, fn, *a, **k):
        try:
            fn(*a, **k)
        except exc as e:
            assert needle in str(e), f"{needle!r} not in {e!r}"
            return
        raise AssertionError(f"{fn.__name__} accepted bad input ({needle})")

    bad = inp.topk_idx.clone()
    if bad.numel():
        # Layout counts an id outside [0, E) nowhere, as the kernels do; dispatch rejects it.
        dropped = inp.topk_idx.clone()
        dropped[0, 0] = -1
        for wrong in (num_experts, -2):
            bad[0, 0] = wrong
            g_rank, _, g_expert, g_in_rank = buf.get_dispatch_layout(bad, num_experts)[:4]
            w_rank, _, w_expert, w_in_rank = buf.get_dispatch_layout(dropped, num_experts)[:4]
            assert torch.equal(g_rank, w_rank) and torch.equal(g_expert, w_expert)
            assert torch.equal(g_in_rank, w_in_rank)
            bad_kw = dict(
                kw,
                topk_idx=bad,
                num_tokens_per_rank=g_rank,
                num_tokens_per_expert=g_expert,
                is_token_in_rank=g_in_rank,
            )
            expect(InvalidInputError, f"expert id {wrong}", buf.dispatch, inp.x, **bad_kw)
    expect(
        InvalidInputError, "not divisible", buf.get_dispatch_layout, inp.topk_idx, num_experts + 1
    )
    expect(
        InvalidInputError,
        "topk_idx.dtype",
        buf.get_dispatch_layout,
        inp.topk_idx.float(),
        num_experts,
    )
    expect(InvalidInputError, "x.dtype", buf.dispatch, inp.x.to(torch.int32), **kw)
    expect(InvalidInputError, "2-D", buf.dispatch, inp.x.view(-1), **kw)
    expect(InvalidInputError, "rows", buf.dispatch, torch.zeros(inp.x.shape[0] + 1, hidden), **kw)
    expect(
        InvalidInputError,
        "get_dispatch_layout",
        buf.dispatch,
        inp.x,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
    )
    expect(InvalidInputError, "together", buf.dispatch, inp.x, **{**kw, "topk_weights": None})
    expect(
        InvalidInputError,
        "topk_weights.dtype",
        buf.dispatch,
        inp.x,
        **{**kw, "topk_weights": inp.topk_weights.double()},
    )
    expect(InvalidInputError, "FP8", buf.dispatch, (inp.x, torch.ones(inp.x.shape[0], 1)), **kw)
    expect(InvalidInputError, "expert_alignment", buf.dispatch, inp.x, expert_alignment=0, **kw)
    expect(InvalidInputError, "previous_event", buf.dispatch, inp.x, previous_event=object(), **kw)
    small = Buffer(None, 1024, 0, backend="reference")
    expect(BufferTooSmallError, "num_nvl_bytes", small.dispatch, inp.x, **kw)
    expect(UnsupportedError, "low_latency_mode", Buffer, None, 0, 0, low_latency_mode=True)
    expect(InvalidInputError, "backend", Buffer, None, 0, 0, backend="magic")
    if torch.cuda.device_count() == 0:
        expect(UnsupportedError, "kernels", Buffer, None, 0, 0, backend="kernels")

    recv_x, _, recv_w, _, handle, _ = buf.dispatch(inp.x, **kw)
    other = make_buffer(world, hidden, 4)
    expect(InvalidInputError, "another Buffer", other.combine, recv_x, handle)
    expect(InvalidInputError, "rows", buf.combine, torch.zeros(recv_x.shape[0] + 1, hidden), handle)
    expect(
        InvalidInputError,
        "no topk_idx",
        buf.dispatch,
        inp.x,
        handle=handle,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
    )
    expect(InvalidInputError, "bias", buf.combine, recv_x, handle, bias=(inp.x, inp.x, inp.x))
    combined, _, _ = buf.combine(recv_x, handle, bias=(inp.x, inp.x))
    plain, _, _ = buf.combine(recv_x, handle)
    torch.testing.assert_close(combined, plain + 2 * inp.x)
    buf.destroy()
    expect(Exception, "destroyed", buf.combine, recv_x, handle)


def w_checked_key_memo(rank, world, agrees):
    """A Buffer skips the checks of arguments whose checked_key passed once (backends that
    defer their id and routing checks). The reference backend makes those checks itself, so
    the memo is switched on here by hand and only ``_prepare_dispatch`` runs: after a good call
    is remembered, every bad argument set must still raise the error the full checks raise,
    and a good one must build the same DispatchArgs as the full checks. ``agrees``: the
    backend agrees per call (as the internode one does): the memo path must still launch the
    routing checks of the call header, and give the same words."""
    from uccl_ep_megatron import InvalidInputError
    from uccl_ep_megatron.api.validation import DispatchInputs

    hidden, num_experts = 32, NUM_EXPERTS_PER_RANK * world
    inp = all_inputs(3, world, 6, hidden, "random")[rank]
    buf = make_buffer(world, hidden, 4)
    per_rank, per_rdma, per_expert, in_rank = buf.get_dispatch_layout(inp.topk_idx, num_experts)[:4]
    good = dict(
        x=inp.x,
        handle=None,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=inp.topk_idx,
        topk_weights=inp.topk_weights,
        expert_alignment=1,
        num_worst_tokens=0,
        config=None,
        previous_event=None,
    )
    recv_x, _, _, _, handle, _ = buf.dispatch(**{**good, "handle": None, "previous_event": None})
    other = make_buffer(world, hidden, 4)
    other_handle = other.dispatch(**{**good, "handle": None})[4]
    # The memo's condition: ids and routing left to the backend's own checks.
    buf._backend.defers_id_check, buf._backend.agrees_per_call = True, agrees

    def prepare(seq, x, handle, config, previous_event, **given):
        return buf._prepare_dispatch(
            seq, x, handle, DispatchInputs(**given), config, previous_event
        )

    full = prepare(1, **good)
    assert len(buf._checked) == 1
    memo = prepare(2, **good)
    for field in ("x", "topk_idx", "topk_weights", "is_token_in_rank", "num_tokens_per_expert"):
        a, b = getattr(full.args, field), getattr(memo.args, field)
        assert a is b, field  # the same (already contiguous) tensors
    assert memo.args.num_experts == full.args.num_experts == num_experts
    # Agreeing per call, the ids are checked by the routing checks the header carries.
    assert memo.args.check_ids == full.args.check_ids == (inp.topk_idx.numel() > 0 and not agrees)
    assert (memo.checks is None) == (full.checks is None) == (not agrees)
    if agrees:
        assert memo.checks is not full.checks and torch.equal(memo.checks, full.checks)
        assert memo.header is not None and memo.header == dataclasses.replace(full.header, seq=2)
    assert memo.args.config == full.args.config and memo.num_tokens == full.num_tokens
    # Each bad set differs from the good one in one checked property only.
    bad = [
        ("x.dtype", dict(x=inp.x.to(torch.int32))),
        ("2-D", dict(x=inp.x.view(-1))),
        ("rows", dict(x=torch.zeros(inp.x.shape[0] + 1, hidden))),
        ("together", dict(topk_weights=None)),
        ("topk_weights.dtype", dict(topk_weights=inp.topk_weights.double())),
        ("topk_idx.dtype", dict(topk_idx=inp.topk_idx.float())),
        ("FP8", dict(x=(inp.x, torch.ones(inp.x.shape[0], 1)))),
        ("expert_alignment", dict(expert_alignment=0)),
        ("expert_alignment", dict(expert_alignment=True)),
        ("num_worst_tokens", dict(num_worst_tokens=-1)),
        ("is_token_in_rank", dict(is_token_in_rank=in_rank.int())),
        ("not divisible", dict(num_tokens_per_expert=per_expert[:-1])),
        ("previous_event", dict(previous_event=object())),
    ]
    for needle, change in bad:
        with pytest.raises(InvalidInputError, match=needle):
            prepare(3, **{**good, **change})
    # A non-contiguous x of the remembered shape is made contiguous on the memo path too.
    wide = torch.cat([inp.x, inp.x], dim=1)[:, :hidden]
    assert not wide.is_contiguous() or wide.numel() == 0
    twice = prepare(4, **{**good, "x": wide})
    assert twice.args.x.is_contiguous() and torch.equal(twice.args.x, inp.x)

    # Cached dispatch: the handle is checked on every call, the rest once per key.
    cached = dict(good, handle=handle, topk_idx=None, topk_weights=None)
    for name in ("num_tokens_per_rank", "is_token_in_rank", "num_tokens_per_expert"):
        cached[name] = None
    first = prepare(5, **cached)
    again = prepare(6, **cached)
    assert again.args.cached is handle and first.args.cached is handle
    assert again.args.is_token_in_rank is handle.is_token_in_rank
    assert again.args.num_worst_tokens == first.args.num_worst_tokens
    assert sum(k[0] == "cached" for k in buf._checked) == 1  # remembered once, then used
    for needle, change in (
        ("another Buffer", dict(handle=other_handle)),
        ("handle must be", dict(handle=tuple(handle))),
        ("tokens but the handle", dict(x=torch.zeros(inp.x.shape[0] + 1, hidden))),
        ("no topk_idx", dict(topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)),
        ("x.dtype", dict(x=inp.x.to(torch.int32))),
    ):
        with pytest.raises(InvalidInputError, match=needle):
            prepare(7, **{**cached, **change})

    # Combine: once per key as well.
    comb = dict(x=recv_x, handle=handle, topk_weights=None, bias=None, config=None)
    comb["previous_event"] = None
    plain = buf._prepare_combine(8, **comb)
    memo_c = buf._prepare_combine(9, **comb)
    assert memo_c.args[0] is plain.args[0] and memo_c.args[2] == () == plain.args[2]
    assert sum(k[0] == "combine" for k in buf._checked) == 1
    with_bias = buf._prepare_combine(10, **{**comb, "bias": [inp.x, inp.x]})
    assert (
        buf._prepare_combine(11, **{**comb, "bias": [inp.x, inp.x]}).args[2] == (with_bias.args[2])
    )
    rows = recv_x.shape[0]
    for needle, change in (
        ("rows", dict(x=torch.zeros(rows + 1, hidden))),
        ("x.dtype", dict(x=recv_x.to(torch.int32))),
        ("topk_weights.dtype", dict(topk_weights=torch.zeros(rows, TOPK, dtype=torch.float64))),
        ("at most 2", dict(bias=(inp.x, inp.x, inp.x))),
        ("hidden", dict(bias=inp.x[:, : hidden // 2])),
        ("another Buffer", dict(handle=other_handle)),
    ):
        with pytest.raises(InvalidInputError, match=needle):
            buf._prepare_combine(12, **{**comb, **change})
    other.destroy()
    buf.destroy()


def w_gradcheck(rank, world):
    from uccl_ep_megatron.api import ops

    hidden, num_experts = 6, NUM_EXPERTS_PER_RANK * world
    inp = all_inputs(7, world, 5, hidden, "random")[rank]
    buf = make_buffer(world, hidden, 8)
    x = inp.x.double().requires_grad_(True)
    w = inp.topk_weights.double().requires_grad_(True)

    def through(x, w):
        recv_x, recv_idx, recv_w, _, handle = ops.dispatch(buf, x, inp.topk_idx, w, num_experts)
        # A per-rank nonlinearity of the received rows, weighted by the received weights.
        scale = (recv_w.double().sum(1, keepdim=True) + 1.0) * (rank + 1)
        out = ops.combine(buf, torch.tanh(recv_x) * scale, handle)
        return out

    # gradcheck perturbs inputs one at a time and re-runs the collectives on every rank in
    # lockstep, so all ranks must make the same number of calls: they do, as shapes are fixed.
    ok = torch.autograd.gradcheck(
        # Weights travel as float32, so eps must dwarf float32 rounding of the weights.
        lambda x, w: through(x, w.float()).sum(1),
        (x, w),
        eps=1e-3,
        atol=1e-3,
        rtol=1e-3,
        nondet_tol=1e-6,
        fast_mode=True,
    )
    assert ok


# ---- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_layout(pool, mode):
    pool.run(HERE, "w_layout", 11, mode)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
@pytest.mark.parametrize("mode", MODES)
def test_dispatch_combine_matches_oracle(pool, mode, dtype):
    for seed in (0, 1):
        pool.run(HERE, "w_dispatch_combine", seed, mode, dtype)


def test_self_verifying_rows(pool):
    pool.run(HERE, "w_self_verifying", 4)


def test_fp8_tuple_and_cached(pool):
    pool.run(HERE, "w_fp8", 2)


def test_num_worst_tokens_and_alignment(pool):
    pool.run(HERE, "w_worst_tokens_and_alignment", 6)


def test_round_trip_and_cached_dispatch(pool):
    pool.run(HERE, "w_round_trip_and_cached", 9)


def test_async_and_previous_event(pool2):
    pool2.run(HERE, "w_events")


def test_virtual_nodes(pool):
    pool.run(HERE, "w_virtual_nodes", env={"UCCL_EP_RANKS_PER_NODE": "1"})


def test_bad_inputs(pool2):
    pool2.run(HERE, "w_bad_inputs")


@pytest.mark.parametrize("agrees", [False, True], ids=["intranode", "agrees-per-call"])
def test_checked_key_memo(pool2, agrees):
    pool2.run(HERE, "w_checked_key_memo", agrees)


def test_gradcheck_float64(pool2):
    pool2.run(HERE, "w_gradcheck")


def w_deepep_constructor(rank, world):
    import inspect

    from uccl_ep_megatron import Buffer, UnsupportedError

    deepep_v1 = [
        "group",
        "num_nvl_bytes",
        "num_rdma_bytes",
        "low_latency_mode",
        "num_qps_per_rank",
        "allow_nvlink_for_low_latency_mode",
        "allow_mnnvl",
        "use_fabric",
        "explicitly_destroy",
        "enable_shrink",
        "comm",
    ]
    params = list(inspect.signature(Buffer).parameters)
    assert params[: len(deepep_v1)] == deepep_v1, params
    # Every argument positionally, in DeepEP V1's order (explicitly_destroy is the 9th).
    buf = Buffer(
        None, 1 << 20, 0, False, 24, True, True, False, True, False, None, backend="reference"
    )
    assert buf.explicitly_destroy is True
    buf.destroy()
    group = torch.distributed.group.WORLD
    Buffer(group, 1 << 20, comm=object(), backend="reference").destroy()  # comm ignored with group
    for kwargs, needle in (
        ({"use_fabric": True}, "use_fabric=True"),
        ({"enable_shrink": True}, "enable_shrink=True"),
        ({"comm": object()}, "mpi4py"),
    ):
        try:
            Buffer(None, 1 << 20, backend="reference", **kwargs)
        except UnsupportedError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs} was accepted")


def test_deepep_v1_constructor(pool2):
    pool2.run(HERE, "w_deepep_constructor")

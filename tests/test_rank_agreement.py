"""Ranks that disagree, or one rank whose arguments are wrong (reference backend, gloo).

Before the per-call header (``uccl_ep_megatron/backends/agreement.py``) these cases crashed one
process (gloo SIGABRT on mismatched all-to-all sizes), returned garbage on the others (a bf16
1.0 read as fp16 is 1.875), or left every other rank waiting for the process-group timeout.
Now every rank must raise the same clear error, naming the rank, the call and the reason,
quickly, and the Buffer must still work for the next, correct call. A rank that never arrives
must make the others raise ``CommTimeoutError`` within ``UCCL_EP_TIMEOUT_MS``.

Functions named ``w_*`` run on every rank of a pool (see dist_utils.py).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from oracle import expected_for, make_inputs  # noqa: E402

HERE = os.path.abspath(__file__)
EPR, TOPK, HIDDEN = 4, 3, 32
FAST_S = 10.0  # a disagreement is found in one exchange: far below any timeout


def _buffer(world, hidden=HIDDEN, nvl=None):
    from uccl_ep_megatron import Buffer

    if nvl is None:
        nvl = Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 4, world)
    return Buffer(None, nvl, 0, backend="reference")


def _inputs(rank, world, seed=1, hidden=HIDDEN, topk=TOPK, num_experts=None):
    num_experts = num_experts or EPR * world
    return make_inputs(seed, rank, world, 9, hidden, num_experts, topk, "random")


def _dispatch(buf, x, idx, w, num_experts, **kw):
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs

    layout = buf.get_dispatch_layout(idx, num_experts)
    return buf.dispatch(x, **dispatch_kwargs(layout, idx, w), **kw)


def _raises(exc_type, fn):
    """Run ``fn``; return (message, seconds) of the exception it must raise."""
    t0 = time.monotonic()
    try:
        fn()
    except exc_type as e:
        return str(e), time.monotonic() - t0
    raise AssertionError(f"no {exc_type.__name__} was raised")


def _still_works(buf, rank, world, seed=7):
    """A correct round trip after the failed call: nothing of it is left in the group."""
    num_experts = EPR * world
    inputs = [_inputs(r, world, seed) for r in range(world)]
    exp = expected_for(rank, world, inputs, num_experts)
    inp = inputs[rank]
    recv_x, recv_idx, recv_w, counts, handle, _ = _dispatch(
        buf, inp.x, inp.topk_idx, inp.topk_weights, num_experts
    )
    assert torch.equal(recv_x, exp.recv_x) and counts == exp.per_expert
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == inp.x.shape


# ---- ranks that disagree ---------------------------------------------------------------------
def w_disagree(rank, world, case):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world, hidden=256)
    num_experts = EPR * world
    odd = rank == world - 1  # the rank that differs
    hidden = 256 if not (odd and case == "hidden") else 128
    topk = TOPK + 1 if (odd and case == "topk") else TOPK
    experts = 2 * num_experts if (odd and case == "num_experts") else num_experts
    inp = _inputs(rank, world, hidden=hidden, topk=topk, num_experts=num_experts)
    x = inp.x.to(torch.bfloat16)
    if odd and case == "fp16":
        x = inp.x.to(torch.float16)
    if odd and case == "fp32":
        x = inp.x.float()
    if odd and case == "fp8":
        x = (inp.x.to(torch.float8_e4m3fn), torch.ones(inp.x.shape[0], hidden // 128))
    msg, dt = _raises(
        InvalidInputError,
        lambda: _dispatch(buf, x, inp.topk_idx, inp.topk_weights, experts),
    )
    assert dt < FAST_S, dt
    _still_works(buf, rank, world)
    return msg


@pytest.mark.parametrize(
    "case, needle",
    [
        ("hidden", r"the hidden size of x: 256 on ranks? 0.*128 on rank {last}"),
        ("topk", r"the top-k columns \(0 = none passed\): 3 on .*4 on rank {last}"),
        ("num_experts", r"num_experts: {e} on .*{e2} on rank {last}"),
        ("fp16", r"the dtype of x: bfloat16 on .*float16 on rank {last}"),
        ("fp32", r"the dtype of x: bfloat16 on .*float32 on rank {last}"),
        ("fp8", r"the dtype of x: bfloat16 on .*float8_e4m3fn on rank {last}.*FP8 scales"),
    ],
)
def test_ranks_that_disagree_all_raise_the_same_error(pool, case, needle):
    import re

    world = pool.world_size
    msgs = pool.run(HERE, "w_disagree", case)
    assert len(set(msgs)) == 1, msgs  # the same error on every rank
    pattern = needle.format(last=world - 1, e=EPR * world, e2=2 * EPR * world)
    assert msgs[0].startswith("dispatch #1: ranks disagree on "), msgs[0]
    assert re.search(pattern, msgs[0]), msgs[0]


def w_combine_weights_on_one_rank(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world)
    inp = _inputs(rank, world)
    recv_x, _, recv_w, _, handle, _ = _dispatch(
        buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world
    )
    weights = recv_w if rank == 0 else None
    msg, dt = _raises(InvalidInputError, lambda: buf.combine(recv_x, handle, topk_weights=weights))
    assert dt < FAST_S
    _still_works(buf, rank, world)
    return msg


def test_topk_weights_on_one_rank_only(pool2):
    msgs = pool2.run(HERE, "w_combine_weights_on_one_rank")
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("combine #2: ranks disagree on the top-k columns"), msgs[0]
    assert f"{TOPK} on rank 0, 0 on rank 1" in msgs[0], msgs[0]


def w_handle_of_another_dispatch(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world)
    inp = _inputs(rank, world)
    first = _dispatch(buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world)
    second = _dispatch(buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world)
    recv_x, handle = (first if rank == 0 else second)[0], (first if rank == 0 else second)[4]
    msg, _ = _raises(InvalidInputError, lambda: buf.combine(recv_x, handle))
    return msg


def test_combine_with_handles_of_different_dispatches(pool2):
    msgs = pool2.run(HERE, "w_handle_of_another_dispatch")
    assert msgs[0] == msgs[1]
    assert "the handle (number of the dispatch that made it): 1 on rank 0, 2 on rank 1" in msgs[0]


def w_different_calls(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world)
    inp = _inputs(rank, world)
    recv_x, _, _, _, handle, _ = _dispatch(buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world)
    if rank == 0:
        call = lambda: _dispatch(buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world)  # noqa: E731
    else:
        call = lambda: buf.combine(recv_x, handle)  # noqa: E731
    msg, dt = _raises(InvalidInputError, call)
    assert dt < FAST_S
    return msg


def test_rank_in_dispatch_while_another_is_in_combine(pool2):
    msgs = pool2.run(HERE, "w_different_calls")
    assert msgs[0] == msgs[1]
    assert "rank 0 in dispatch #2, rank 1 in combine #2" in msgs[0], msgs[0]


# ---- a validation error on one rank ----------------------------------------------------------
def w_one_rank_rejects(rank, world, case):
    from uccl_ep_megatron.core import errors

    nvl = None
    if case == "undersized" and rank == 1:
        nvl = 1024
    buf = _buffer(world, nvl=nvl)
    inp = _inputs(rank, world)
    idx = inp.topk_idx
    if case == "bad_id" and rank == 1:
        idx = idx.clone()
        idx[0, 0] = 99
    exc = errors.BufferTooSmallError if case == "undersized" else errors.InvalidInputError
    if case == "previous_event":
        ev = object() if rank == 1 else None
        msg, dt = _raises(
            exc,
            lambda: _dispatch(
                buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world, previous_event=ev
            ),
        )
    elif case == "combine_rows":
        recv_x, _, _, _, handle, _ = _dispatch(
            buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world
        )
        x = recv_x[:-1] if rank == 1 else recv_x
        msg, dt = _raises(exc, lambda: buf.combine(x, handle))
    else:
        msg, dt = _raises(exc, lambda: _dispatch(buf, inp.x, idx, inp.topk_weights, EPR * world))
    assert dt < FAST_S, dt
    if case != "undersized":
        _still_works(buf, rank, world)
    return msg


@pytest.mark.parametrize(
    "case, call, needle",
    [
        ("bad_id", "dispatch #1", "topk_idx contains expert id 99"),
        ("combine_rows", "combine #2", "x has"),
        ("undersized", "dispatch #1", "num_nvl_bytes=1024"),
        ("previous_event", "dispatch #1", "pass an EventOverlap"),
    ],
)
def test_an_error_on_one_rank_reaches_every_rank(pool, case, call, needle):
    msgs = pool.run(HERE, "w_one_rank_rejects", case)
    assert len(set(msgs)) == 1, msgs
    assert msgs[0].startswith(f"{call}: rank 1 rejected its arguments ("), msgs[0]
    assert needle in msgs[0], msgs[0]


def w_worst_tokens_on_one_rank(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world)
    inp = _inputs(rank, world)
    nwt = 1 if rank == 1 else 1000
    msg, _ = _raises(
        InvalidInputError,
        lambda: _dispatch(
            buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world, num_worst_tokens=nwt
        ),
    )
    return msg


def test_num_worst_tokens_too_small_on_one_rank(pool2):
    msgs = pool2.run(HERE, "w_worst_tokens_on_one_rank")
    assert msgs[0] == msgs[1]
    assert "rank 1 passed num_worst_tokens=1 but receives" in msgs[0], msgs[0]


# ---- a rank that never arrives: bounded by UCCL_EP_TIMEOUT_MS ------------------------------
_kept = []  # Buffers a rank keeps alive while the others time out


def w_absent_rank(rank, world, case):
    from uccl_ep_megatron.core.errors import CommTimeoutError, UcclEpError

    buf = _buffer(world)
    inp = _inputs(rank, world)
    recv_x, _, _, _, handle, _ = _dispatch(buf, inp.x, inp.topk_idx, inp.topk_weights, EPR * world)
    if rank == 1:  # destroys its Buffer, or skips the backward combine the others run
        if case == "destroy":
            buf.destroy()
        else:
            _kept.append(buf)
        _group_still_works(world)
        return None
    expected = CommTimeoutError if case == "backward_on_some_ranks" else UcclEpError
    msg, dt = _raises(expected, lambda: buf.combine(recv_x, handle))
    _group_still_works(world)
    return msg, dt


def _group_still_works(world):
    """The process group is not affected: a collective on it still works."""
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


def test_a_rank_that_never_arrives_times_out_in_bounded_time():
    from dist_utils import DistPool

    pool = DistPool(2)  # its own ranks: rank 0's abandoned collective must not meet other tests
    try:
        outs = pool.run(
            HERE, "w_absent_rank", "backward_on_some_ranks", env={"UCCL_EP_TIMEOUT_MS": "1500"}
        )
    finally:
        pool.close()
    msg, dt = outs[0]
    assert 1.4 < dt < 10, dt
    assert msg.startswith("rank 0: the call-header exchange of combine #2 (Buffer #"), msg
    assert "did not complete within UCCL_EP_TIMEOUT_MS=1500 ms: rank 1 (not in any call" in msg
    assert "the process group is not affected" in msg


def test_a_rank_that_destroyed_its_buffer_is_named_at_once(pool2):
    """Its Buffer's channel closes; the peer waiting in a call learns why from the store."""
    outs = pool2.run(HERE, "w_absent_rank", "destroy", env={"UCCL_EP_TIMEOUT_MS": "20000"})
    msg, dt = outs[0]
    assert dt < FAST_S, dt
    assert "combine #2 cannot complete: rank 1 destroyed its Buffer #" in msg, msg


# ---- layout tensors are checked against topk_idx --------------------------------------------
def w_bad_layout(rank, world, case):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world)
    num_experts = EPR * world
    inp = _inputs(rank, world)
    idx = inp.topk_idx
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)
    odd = rank == world - 1
    if odd and case == "per_expert_x100":
        per_expert = per_expert * 100
    if odd and case == "per_expert_negative":
        per_expert = per_expert - 1
    if odd and case == "per_expert_2e":
        per_expert = torch.cat([per_expert, per_expert])
    if odd and case == "in_rank_of_other_tokens":
        in_rank = torch.roll(in_rank, 1, dims=0) if in_rank.shape[0] > 1 else ~in_rank
        in_rank[0] = ~in_rank[0]
    if odd and case == "per_rank":
        per_rank = per_rank + 1
    if odd and case == "duplicate_ids":
        idx = idx.clone()
        idx[:, 1] = idx[:, 0].clamp(min=0)
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, num_experts)

    def call():
        return buf.dispatch(
            inp.x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=idx,
            topk_weights=inp.topk_weights,
        )

    msg, _ = _raises(InvalidInputError, call)
    _still_works(buf, rank, world)
    return msg


@pytest.mark.parametrize(
    "case, needle",
    [
        ("per_expert_x100", "num_tokens_per_expert disagrees with topk_idx"),
        ("per_expert_negative", "num_tokens_per_expert disagrees with topk_idx"),
        ("per_expert_2e", "num_tokens_per_expert, is_token_in_rank disagree with topk_idx"),
        ("in_rank_of_other_tokens", "is_token_in_rank disagrees with topk_idx"),
        ("per_rank", "num_tokens_per_rank disagrees with topk_idx"),
        ("duplicate_ids", "the same expert twice in one token"),
    ],
)
def test_layout_tensors_that_disagree_with_topk_idx(pool2, case, needle):
    msgs = pool2.run(HERE, "w_bad_layout", case)
    assert msgs[0] == msgs[1], msgs
    assert "rank 1 rejected its arguments" in msgs[0], msgs[0]
    assert needle in msgs[0], msgs[0]


# ---- the packed dispatch header the kernels backend's notify step carries ----------------------
def test_packed_header_round_trips_and_names_the_odd_rank():
    from uccl_ep_megatron.backends.agreement import (
        check_packed_headers,
        describe_packed_header,
        pack_dispatch_header,
    )
    from uccl_ep_megatron.core.errors import InvalidInputError

    bf16 = pack_dispatch_header(torch.bfloat16, 7168, 0, 8, 256)
    assert describe_packed_header(bf16) == (
        "dtype=bfloat16, num_topk=8, num_scales=0, hidden=7168, num_experts=256"
    )
    fp8 = pack_dispatch_header(torch.float8_e4m3fn, 7168, 56, 8, 256)
    assert "num_scales=56" in describe_packed_header(fp8)
    # Every field is seen: changing any one of them changes the word.
    variants = [
        pack_dispatch_header(torch.float16, 7168, 0, 8, 256),
        pack_dispatch_header(torch.bfloat16, 4096, 0, 8, 256),
        pack_dispatch_header(torch.bfloat16, 7168, 0, 6, 256),
        pack_dispatch_header(torch.bfloat16, 7168, 0, 8, 64),
        fp8,
    ]
    assert len({bf16, *variants}) == 6
    assert -(1 << 63) <= min(variants) and max(variants) < 1 << 63  # fits the kernel's int64
    check_packed_headers([bf16] * 4, "dispatch")
    with pytest.raises(InvalidInputError) as info:
        check_packed_headers([bf16, bf16, variants[0], bf16], "dispatch")
    text = str(info.value)
    assert "rank 2: dtype=float16" in text and "rank 0: dtype=bfloat16" in text, text


# ---- messages that name what the user set -----------------------------------------------------
def w_ranks_per_node_on_one_rank(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    saved = os.environ.pop("UCCL_EP_RANKS_PER_NODE", None)
    if rank == 1:
        os.environ["UCCL_EP_RANKS_PER_NODE"] = "1"
    try:
        msg, dt = _raises(InvalidInputError, lambda: _buffer(world))
    finally:
        os.environ.pop("UCCL_EP_RANKS_PER_NODE", None)
        if saved is not None:
            os.environ["UCCL_EP_RANKS_PER_NODE"] = saved
    assert dt < FAST_S, dt
    return msg


def test_ranks_per_node_set_on_one_rank_names_the_variable(pool2):
    """Not "ranks disagree on Config.num_max_rdma_chunked_send_tokens": no Config was passed."""
    for msg in pool2.run(HERE, "w_ranks_per_node_on_one_rank"):
        assert "UCCL_EP_RANKS_PER_NODE (or BufferOptions.ranks_per_node) differs" in msg, msg
        assert "unset on rank 0, '1' on rank 1" in msg, msg


def w_x_and_topk_rows_differ(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    buf = _buffer(world)
    inp = _inputs(rank, world)
    x = inp.x[:-1]  # one token short of topk_idx
    msg, _ = _raises(
        InvalidInputError,
        lambda: _dispatch(buf, x, inp.topk_idx, inp.topk_weights, EPR * world),
    )
    _still_works(buf, rank, world)
    return msg, inp.x.shape[0]


def test_x_rows_and_topk_idx_rows_that_differ_are_named_as_such(pool2):
    for msg, rows in pool2.run(HERE, "w_x_and_topk_rows_differ"):
        assert f"x has {rows - 1} rows (tokens) but topk_idx has {rows}" in msg, msg


def w_fp32_combine_after_bf16_dispatch(rank, world):
    from uccl_ep_megatron import Buffer
    from uccl_ep_megatron.core.errors import BufferTooSmallError

    hidden = 256
    nvl = Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(hidden * 2, world)
    buf = Buffer(None, nvl, 0, backend="reference")  # sized for bf16 rows, as DeepEP users do
    inp = _inputs(rank, world, hidden=hidden)
    x = inp.x.to(torch.bfloat16)
    recv_x, _, _, _, handle, _ = _dispatch(buf, x, inp.topk_idx, inp.topk_weights, EPR * world)
    msg, _ = _raises(BufferTooSmallError, lambda: buf.combine(recv_x.float(), handle))
    return msg


def test_fp32_combine_after_a_bf16_dispatch_names_the_dtype(pool2):
    for msg in pool2.run(HERE, "w_fp32_combine_after_bf16_dispatch"):
        assert "x.dtype=torch.float32 (4 bytes per element)" in msg, msg
        assert "Pass x in bfloat16" in msg, msg

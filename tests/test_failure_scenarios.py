"""How ranks fail together (reference backend, gloo): a rank late past the timeout, a rank
interrupted in a call, a rank that never constructs its Buffer, a rank killed in a call, and
two Buffers called in different orders.

Every surviving rank must raise a clear error naming the rank at fault within a bound, no
process may abort (gloo aborts the process when a collective meets the peer's copy of one that
was abandoned), and afterwards a new Buffer must work and the process group must still carry
collectives. Each scenario runs in fresh processes of its own: a killed or broken rank must
not leave anything behind for other tests.

Functions named ``s_*`` run on every rank.
"""

from __future__ import annotations

import _thread
import os
import pickle
import signal
import sys
import tempfile
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from oracle import expected_for, make_inputs  # noqa: E402

EPR, TOPK, HIDDEN = 4, 3, 32


# ---- the harness: fresh ranks that may die ---------------------------------------------------
HERE = os.path.abspath(__file__)


def run_ranks(name, world, env, may_die=False):
    """Run ``name(rank, world)`` on ``world`` fresh ranks; {rank: result} of the ranks that
    returned. Results travel through files, so those of the survivors arrive even when a rank
    dies (``may_die``: the pool then reports the dead rank, which the scenario expects)."""
    from dist_utils import DistPool

    with tempfile.TemporaryDirectory() as tmp:
        pool = DistPool(world)
        try:
            pool.run(HERE, "_keep_result", name, tmp, env=env)
            died = None
        except TimeoutError as exc:  # a rank died: the pool says which
            if not may_die:
                raise
            died = str(exc)
        finally:
            pool.close()
        outs = {}
        for r in range(world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outs[r] = pickle.load(f)
    return outs, died


def _keep_result(rank, world, name, tmp):
    out = globals()[name](rank, world)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    return out


# ---- helpers on the ranks ----------------------------------------------------------------
def _buffer(world):
    from uccl_ep_megatron import Buffer

    nvl = Buffer.get_dispatch_config(world).get_nvl_buffer_size_hint(HIDDEN * 4, world)
    return Buffer(None, nvl, 0, backend="reference")


def _dispatch(buf, rank, world, seed=1):
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs

    inp = make_inputs(seed, rank, world, 9, HIDDEN, EPR * world, TOPK, "random")
    layout = buf.get_dispatch_layout(inp.topk_idx, EPR * world)
    return buf.dispatch(inp.x, **dispatch_kwargs(layout, inp.topk_idx, inp.topk_weights))


def _round_trip_ok(buf, rank, world, seed=7):
    """A dispatch whose every output matches an independent oracle, and its combine."""
    inputs = [
        make_inputs(seed, r, world, 9, HIDDEN, EPR * world, TOPK, "random") for r in range(world)
    ]
    exp = expected_for(rank, world, inputs, EPR * world)
    recv_x, recv_idx, recv_w, counts, handle, _ = _dispatch(buf, rank, world, seed)
    assert torch.equal(recv_x, exp.recv_x)
    assert torch.equal(recv_idx, exp.recv_topk_idx) and torch.equal(recv_w, exp.recv_topk_weights)
    assert counts == exp.per_expert
    combined, _, _ = buf.combine(recv_x, handle)
    assert combined.shape == inputs[rank].x.shape


def _group_works(world):
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    assert t.item() == world


def _raises(exc_type, fn):
    t0 = time.monotonic()
    try:
        fn()
    except exc_type as e:
        return str(e), time.monotonic() - t0
    raise AssertionError(f"no {exc_type.__name__} was raised")


# ---- 1. a rank late past the timeout; the others follow the advice --------------------------
def s_late_rank(rank, world):
    from uccl_ep_megatron.core.errors import CommTimeoutError, UcclEpError

    a = _buffer(world)
    if rank == 1:
        time.sleep(4.0)
        late = _raises(UcclEpError, lambda: _dispatch(a, rank, world))
    else:
        late = _raises(CommTimeoutError, lambda: _dispatch(a, rank, world))
    b = _buffer(world)  # the advice: a new Buffer on every rank
    _round_trip_ok(b, rank, world)
    _group_works(world)
    return late


def test_a_rank_late_past_the_timeout_breaks_only_that_buffer():
    # Before: rank 0 aborted (gloo EnforceNotMet, exit -6), which fails the pool's run.
    outs, _ = run_ranks("s_late_rank", 2, {"UCCL_EP_TIMEOUT_MS": "3000"})
    msg0, dt0 = outs[0]
    assert 2.9 < dt0 < 6, dt0
    assert "did not complete within UCCL_EP_TIMEOUT_MS=3000 ms: rank 1 (not in any call" in msg0
    assert "the process group is not affected" in msg0 and "create a new Buffer" in msg0
    msg1, dt1 = outs[1]
    assert dt1 < 2, dt1  # the late rank learns at once that rank 0 gave up
    assert "rank 0 gave up on the call-header exchange of dispatch #1" in msg1, msg1


# ---- 2. Ctrl-C in a call on one rank --------------------------------------------------------
def s_interrupted(rank, world):
    from uccl_ep_megatron.core.errors import UcclEpError

    a = _buffer(world)
    if rank == 0:
        threading.Timer(0.5, _thread.interrupt_main).start()  # what Ctrl-C raises
        msg, dt = _raises(KeyboardInterrupt, lambda: _dispatch(a, rank, world))
        assert dt < 2, dt
        again, _ = _raises(UcclEpError, lambda: _dispatch(a, rank, world))
        assert "this Buffer is unusable: rank 0 was interrupted" in again, again
        out = again
    else:
        time.sleep(2.0)
        out, dt = _raises(UcclEpError, lambda: _dispatch(a, rank, world))
        assert dt < 2, dt
    b = _buffer(world)
    _round_trip_ok(b, rank, world)
    _group_works(world)
    return out


def test_ctrl_c_in_a_call_is_reported_to_the_peer_and_aborts_nothing():
    outs, _ = run_ranks("s_interrupted", 2, {"UCCL_EP_TIMEOUT_MS": "20000"})
    assert (
        "rank 0 was interrupted (KeyboardInterrupt) in the call-header exchange of dispatch #1"
        in outs[1]
    )


# ---- 3. a rank that never constructs its Buffer -----------------------------------------------
def s_absent_constructor(rank, world):
    from uccl_ep_megatron.core.errors import CommTimeoutError

    if rank == world - 1:
        time.sleep(3.0)
    msg, dt = _raises(CommTimeoutError, lambda: _buffer(world))
    buf = _buffer(world)  # every rank tries again
    _round_trip_ok(buf, rank, world)
    _group_works(world)
    return msg, dt


def test_construction_is_bounded_and_names_the_absent_rank():
    outs, _ = run_ranks("s_absent_constructor", 3, {"UCCL_EP_TIMEOUT_MS": "2000"})
    for rank in (0, 1):
        msg, dt = outs[rank]
        assert 1.9 < dt < 5, dt  # before: gloo's 30-minute default
        assert "waiting for rank(s) [2] to construct Buffer #1" in msg, msg
        assert "nothing is pending on the process group" in msg
    msg, dt = outs[2]
    assert dt < 1.0, dt
    assert "(this rank arrived after that)" in msg, msg


# ---- 4. a rank killed in a call ------------------------------------------------------------------
def s_killed(rank, world):
    from uccl_ep_megatron.core.errors import UcclEpError

    a = _buffer(world)
    _round_trip_ok(a, rank, world)
    if rank == world - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    return _raises(UcclEpError, lambda: _dispatch(a, rank, world))


def test_a_killed_rank_is_named_at_once():
    outs, died = run_ranks("s_killed", 3, {"UCCL_EP_TIMEOUT_MS": "30000"}, may_die=True)
    assert died is not None and "ranks [2] died" in died, died
    assert sorted(outs) == [0, 1], outs
    for rank in (0, 1):
        msg, dt = outs[rank]
        assert dt < 5, dt  # far below the 30 s timeout
        assert "rank(s) [2] exited" in msg, msg


# ---- 5. two Buffers called in different orders ----------------------------------------------
def s_two_buffers(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError

    a, b = _buffer(world), _buffer(world)
    first = a if rank == 0 else b
    out = _raises(InvalidInputError, lambda: _dispatch(first, rank, world))
    c = _buffer(world)
    _round_trip_ok(c, rank, world)
    return out


def test_two_buffers_called_in_different_orders_raise_on_every_rank():
    outs, _ = run_ranks("s_two_buffers", 2, {"UCCL_EP_TIMEOUT_MS": "30000"})
    for rank in (0, 1):
        msg, dt = outs[rank]
        assert dt < 5, dt
        assert "the ranks call their Buffers in different orders" in msg, msg
    assert "rank 1 waits in dispatch #1 of Buffer #2" in outs[0][0], outs[0][0]


def test_the_call_header_names_the_buffer():
    """Over one exchange (NCCL groups share it), rows of different Buffers never match."""
    from uccl_ep_megatron.backends.agreement import KIND_DISPATCH, Agreement, CallHeader, encode_row
    from uccl_ep_megatron.core.errors import InvalidInputError

    rows = [
        encode_row(CallHeader(kind=KIND_DISPATCH, seq=1, buffer=b), 2, torch.device("cpu")).tolist()
        for b in (1, 2)
    ]
    with pytest.raises(
        InvalidInputError,
        match=r"rank 0 in dispatch #1 of Buffer #1, rank 1 in dispatch #1 of Buffer #2",
    ):
        Agreement.decode(rows).check("dispatch #1")


# ---- the Buffer's own group: connected on every rank, released without a trace ---------------
def w_make_and_drop(rank, world, n):
    import gc

    def counts():
        gc.collect()
        return len(os.listdir("/proc/self/fd")), len(os.listdir(f"/proc/{os.getpid()}/task"))

    for i in range(n):
        if i == 5:
            start = counts()
        buf = _buffer(world)
        if i % 10 == 0:
            _round_trip_ok(buf, rank, world, seed=i)
        del buf  # dropped at once: its group goes while a slower rank may still connect
    return start, counts()


def test_buffers_made_and_dropped_quickly_connect_and_leak_nothing():
    """gloo's constructor returns once this rank's pairs are up; a rank that dropped its
    group at once used to fail a slower peer's connect (about 1 in 300 at 3 ranks)."""
    from dist_utils import DistPool

    pool = DistPool(4)
    try:
        outs = pool.run(HERE, "w_make_and_drop", 120)
    finally:
        pool.close()
    for start, end in outs:
        assert start == end, (start, end)  # open files and threads

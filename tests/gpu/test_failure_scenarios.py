"""How ranks fail together on the ``kernels`` backend: a rank sleeping past the timeout (before
a dispatch, and before a combine), two Buffers called in different orders, and a rank killed
in a call; with ranks sharing one GPU under CUDA MPS (gloo group) and on one GPU each (NCCL
group).

Every rank that lives must raise a clear error naming the rank at fault within a bound: the
rank that waits times out, and the rank that comes late raises too, at once, naming the rank
that gave up (its abort record, ``kAbortOffset`` in csrc/kernels/intranode.h), instead of
passing the barrier that rank signalled before giving up and moving rows nobody takes.
Afterwards the process group must still carry a new Buffer whose dispatch moves exactly the
rows the ``reference`` oracle moves.

Bounds: a kernel wait gives up after ``UCCL_EP_TIMEOUT_MS``, so the rank that waits raises
within that plus the launch; a rank that finds an abort record raises well before its own
timeout could have fired. A killed peer never signals again; the survivor learns of it when its
process ends (the liveness watcher, ``backends/liveness.py``, posts an abort record in the dead
rank's name into the survivor's own control region) and raises within ``KILLED_S`` of the
kill, long before the timeout. The test's own coordination waits are bounded in the store, so
no scenario can block for the process group's timeout, and each ``run`` is bounded by
``SCENARIO_S``. Dispatches here are exact (the host reads the counts), so the late rank raises
in the call itself; a combine raises at the next host-visible point (``check_errors``).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import (  # noqa: E402
    NUM_GPUS,
    dispatch,
    keep_result,
    nvl_bytes_for,
    raised,
    require_kernels,
    run_keeping_results,
    scenario_inputs,
    store_meet,
)

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

HERE = os.path.abspath(__file__)
TIMEOUT_MS = 3000
LATE_S = 2 * TIMEOUT_MS / 1e3  # the late rank arrives after its peer surely gave up
WAIT_BOUND_S = TIMEOUT_MS / 1e3 + 5  # the rank that waits: one kernel deadline, launches
AT_ONCE_S = 0.75 * TIMEOUT_MS / 1e3  # a rank that finds the record: before its own deadline
MEET_S = 30.0  # the test's own waits for the other rank
KILL_AFTER_S = 0.5  # the killed rank dies this long after the survivor entered its dispatch
KILLED_S = 1.0  # the survivor raises within this of the kill (the timeout is 3 s)
SCENARIO_S = 60.0  # one pool.run
HIDDEN = 256


# ---- placements: ranks sharing one GPU (MPS, gloo) and one GPU each (NCCL) -------------------
def _placements():
    return [
        pytest.param(1, id="shared-gpu-mps"),
        pytest.param(
            2, id="gpu-per-rank", marks=pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs")
        ),
    ]


@pytest.fixture(scope="module", params=_placements())
def ranks(request):
    """Two ranks per placement, shared by the scenarios that leave both alive (pytest groups
    the tests by placement); the killed-rank scenario runs last and ends its pool."""
    from uccl_ep_megatron.cluster.local import RankPool, mps_available

    require_kernels()
    if request.param == 1 and not mps_available():
        pytest.skip("2 ranks on one GPU need CUDA MPS")
    pool = RankPool(2, num_gpus=request.param, task_timeout_s=SCENARIO_S, group_timeout_s=MEET_S)
    try:
        yield pool
    finally:
        pool.close()


def run_scenario(pool, name: str) -> tuple[dict, str | None]:
    """Run ``name`` on the pool's ranks; the survivors' results arrive when a rank dies (the
    pool then names the dead rank and closes)."""
    if not pool.alive():
        pytest.skip("an earlier scenario ended this placement's ranks")
    outs, died, _ = run_keeping_results(
        pool, (HERE, "_keep"), name, env={"UCCL_EP_TIMEOUT_MS": str(TIMEOUT_MS)}
    )
    return outs, died


def _keep(rank, world, name, tmp):
    return keep_result(tmp, rank, globals()[name](rank, world, name))


# ---- on the ranks ----------------------------------------------------------------------------
def _meet(name: str, world: int) -> None:
    store_meet(name, world, MEET_S)


def _buffer(world):
    from uccl_ep_megatron import Buffer

    return Buffer(None, nvl_bytes_for(world, HIDDEN), 0, backend="kernels")


def _inputs(rank, world):
    return scenario_inputs(rank, world, HIDDEN, seed=11)


def _dispatch(buf, rank, world):
    x, idx, w = _inputs(rank, world)
    lay = buf.get_dispatch_layout(idx, 4 * world)[:4]
    out = dispatch(buf, x, lay, idx, w)
    torch.cuda.synchronize()
    return out


def _after(rank, world, name) -> str:
    """The group after the failure: a new kernels Buffer whose dispatch equals the reference
    oracle's."""
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs
    from uccl_ep_megatron.cluster.local import reference_oracle

    _meet(f"{name}/after", world)
    got = _dispatch(_buffer(world), rank, world)
    oracle = reference_oracle(None, nvl_bytes_for(world, HIDDEN), 0)
    x, idx, w = _inputs(rank, world)
    lay = oracle.get_dispatch_layout(idx, 4 * world)[:4]
    want = oracle.dispatch(x, **dispatch_kwargs(lay, idx, w))
    assert torch.equal(got[0].cpu(), want[0].cpu()), "recv_x differs from the reference"
    assert torch.equal(got[1].cpu(), want[1].cpu()), "recv_topk_idx differs from the reference"
    assert torch.equal(got[2].cpu(), want[2].cpu()), "recv_topk_weights differ"
    assert got[3] == want[3], (got[3], want[3])
    return "usable"


def sleeper(rank, world, name):
    """Rank 1 sleeps past rank 0's timeout before its first dispatch."""
    a = _buffer(world)
    _meet(f"{name}/start", world)
    if rank == 1:
        time.sleep(LATE_S)
    failed = raised(lambda: _dispatch(a, rank, world))
    return [failed], _after(rank, world, name)


def late_combine(rank, world, name):
    """Both ranks dispatch; rank 1 sleeps past rank 0's timeout before the combine. A combine
    never waits on the host: its failure is raised by ``check_errors`` once it has run."""
    a = _buffer(world)
    recv_x, _, recv_w, _, handle, _ = _dispatch(a, rank, world)
    _meet(f"{name}/start", world)
    if rank == 1:
        time.sleep(LATE_S)

    def combine():
        a.combine(recv_x, handle, recv_w)
        torch.cuda.synchronize()
        a.check_errors()

    failed = raised(combine)
    return [failed], _after(rank, world, name)


def two_buffers(rank, world, name):
    """Rank 0 calls Buffer A, then B; rank 1 calls B, then A. Each first call times out (the
    other rank waits in the other Buffer); once both have, each second call meets a Buffer the
    other rank gave up on."""
    a, b = _buffer(world), _buffer(world)
    first, second = (a, b) if rank == 0 else (b, a)
    _meet(f"{name}/start", world)
    failed = [raised(lambda: _dispatch(first, rank, world))]
    _meet(f"{name}/between", world)
    failed.append(raised(lambda: _dispatch(second, rank, world)))
    return failed, _after(rank, world, name)


def killed(rank, world, name):
    """Rank 1 is killed while rank 0 waits for it in a dispatch."""
    a = _buffer(world)
    _dispatch(a, rank, world)  # one good call first: both ranks are set up
    _meet(f"{name}/start", world)
    if rank == 1:
        time.sleep(KILL_AFTER_S)
        os.kill(os.getpid(), signal.SIGKILL)
    return [raised(lambda: _dispatch(a, rank, world))], "not checked (rank 1 is dead)"


# ---- the scenarios (in this order: the last one kills a rank) --------------------------------
def _show(name, outs):
    """What each rank raised and how long it took, and what the group was after (pytest -rA
    prints it): the record of what the kernels backend does in each scenario."""
    for rank, (failures, after) in sorted(outs.items()):
        for i, (cls, msg, dt) in enumerate(failures):
            print(f"{name} rank {rank} call {i + 1}: {cls} after {dt:.2f} s: {msg}")
        print(f"{name} rank {rank}: afterwards the group is {after}")


def _timed_out(failure, other):
    """The rank that waited: a CommTimeoutError naming the rank it waited for."""
    cls, msg, dt = failure
    assert cls == "CommTimeoutError", failure
    assert f"waiting for rank {other}" in msg, msg
    assert dt < WAIT_BOUND_S, (dt, msg)


def _told(failure, other, site):
    """The late rank: raised at once, naming the rank that gave up and where."""
    cls, msg, dt = failure
    assert cls == "CommTimeoutError", failure
    assert f"rank {other} gave up on the {site} barrier" in msg, msg
    assert dt < AT_ONCE_S, (dt, msg)


def test_a_rank_sleeping_past_the_timeout(ranks):
    outs, died = run_scenario(ranks, "sleeper")
    _show("sleeper", outs)
    assert died is None and sorted(outs) == [0, 1], (died, outs)
    _timed_out(outs[0][0][0], 1)
    _told(outs[1][0][0], 0, "dispatch notify")
    assert outs[0][1] == outs[1][1] == "usable", outs


def test_a_rank_late_for_a_combine(ranks):
    outs, died = run_scenario(ranks, "late_combine")
    _show("late_combine", outs)
    assert died is None and sorted(outs) == [0, 1], (died, outs)
    _timed_out(outs[0][0][0], 1)
    assert "combine entry" in outs[0][0][0][1], outs[0]
    _told(outs[1][0][0], 0, "combine entry")
    assert outs[0][1] == outs[1][1] == "usable", outs


def test_two_buffers_called_in_different_orders(ranks):
    """No wrong rows: each rank's first call times out naming the other, each second call
    raises at once naming the rank that gave up on that Buffer, and the group goes on."""
    outs, died = run_scenario(ranks, "two_buffers")
    _show("two_buffers", outs)
    assert died is None and sorted(outs) == [0, 1], (died, outs)
    for rank, other in ((0, 1), (1, 0)):
        first, second = outs[rank][0]
        _timed_out(first, other)
        _told(second, other, "dispatch notify")
        assert outs[rank][1] == "usable", outs[rank]


def test_a_killed_rank(ranks):
    outs, died = run_scenario(ranks, "killed")
    _show("killed", outs)
    assert died is not None and "ranks [1] died" in died, died
    assert 0 in outs, "rank 0 wrote no result"
    cls, msg, dt = outs[0][0][0]
    # Found when rank 1's process ended, not by the timeout: at once, naming rank 1.
    assert cls == "CommTimeoutError", outs[0]
    assert "rank 1's process (pid " in msg and "exited" in msg, msg
    assert "restart the job" in msg, msg
    assert dt < KILL_AFTER_S + KILLED_S, (dt, msg)

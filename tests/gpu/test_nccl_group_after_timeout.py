"""A timed-out call over an NCCL group (``reference`` backend, one GPU per rank): NCCL cannot
cancel the collective the waiting rank leaves queued, so the process group itself is reported
unusable, and the next ``Buffer()`` on it raises at once saying to create a new process group
(``_POISONED`` in backends/agreement/group.py, checked first thing in ``api/topology.meet``).
The gloo side, where only the Buffer breaks, is tests/test_failure_scenarios.py.

Rank 1 sleeps past the timeout before its second dispatch (the first one, on both ranks, sets
up the lazily created NCCL communicator, whose creation would otherwise block rank 0 until
rank 1 arrives). Rank 0 must raise ``CommTimeoutError`` naming rank 1 once the timeout has
passed and not long after; rank 1, waking, must raise at once naming the rank that gave up
(its header all-gather meets rank 0's abandoned one, its next collective finds the store's
record). Then a new ``Buffer()`` on the group must raise at once on both ranks.

Nothing may hang or abort: the test's own waits are bounded in the store, the scenario by
``SCENARIO_S`` (the pool names a rank that dies or stalls), and the NCCL watchdog timeout
(``GROUP_S``) is well past the scenario, so the collective rank 1 leaves queued cannot take
its process down before the results are in. After the failure the ranks touch no GPU stream
(the Buffer's stream waits for that collective forever) and the pool is closed.
"""

from __future__ import annotations

import os
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
    run_keeping_results,
    scenario_inputs,
    store_meet,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(NUM_GPUS < 2, reason="an NCCL group needs 2 GPUs (one per rank)"),
]

HERE = os.path.abspath(__file__)
TIMEOUT_MS = 3000
TIMEOUT_S = TIMEOUT_MS / 1e3
LATE_S = 2 * TIMEOUT_S  # rank 1 arrives after rank 0 surely gave up
WAIT_BOUND_S = TIMEOUT_S + 5  # rank 0: the timeout, then the error
AT_ONCE_S = 0.75 * TIMEOUT_S  # rank 1: told by the store, before its own timeout could fire
CONSTRUCT_S = 1.0  # a Buffer() on a poisoned group raises before any exchange
MEET_S = 30.0  # the test's own waits for the other rank
SCENARIO_S = 60.0  # one pool.run
GROUP_S = 300.0  # the NCCL watchdog: far past the scenario and the pool's close
HIDDEN = 256
CALL = "the call-header exchange of dispatch #2"  # the first call is the warm-up


def run_scenario(pool) -> tuple[dict, str | None, bool]:
    """Run the scenario on the pool's ranks: the results by rank (a survivor's arrive when a
    rank dies; the pool then names it), and whether every rank was still alive afterwards."""
    return run_keeping_results(pool, (HERE, "_keep"), env={"UCCL_EP_TIMEOUT_MS": str(TIMEOUT_MS)})


def _keep(rank, world, tmp):
    return keep_result(tmp, rank, late_rank(rank, world))


# ---- on the ranks ----------------------------------------------------------------------------
def _meet(name: str, world: int) -> None:
    store_meet(name, world, MEET_S)


def _buffer(world):
    from uccl_ep_megatron import Buffer

    return Buffer(None, nvl_bytes_for(world, HIDDEN), 0, backend="reference")


def _inputs(rank, world):
    return scenario_inputs(rank, world, HIDDEN, seed=23)


def _rows_for(rank, world) -> int:
    """Rows ``rank`` receives: tokens of every rank with an expert on ``rank``."""
    total = 0
    for r in range(world):
        _, idx, _ = _inputs(r, world)
        total += int(((idx // 4) == rank).any(1).sum())
    return total


def late_rank(rank, world) -> dict:
    """A good dispatch on both ranks; then rank 1 sleeps past rank 0's timeout before the
    second; then each rank tries a new Buffer on the same group."""
    buf = _buffer(world)
    x, idx, w = _inputs(rank, world)
    lay = buf.get_dispatch_layout(idx, 4 * world)[:4]
    warm = dispatch(buf, x, lay, idx, w)
    torch.cuda.synchronize()  # and the layout the timed call reuses is ready before the clock
    out = {"warm_rows": (warm[0].shape[0], _rows_for(rank, world))}
    _meet("start", world)
    if rank == 1:
        time.sleep(LATE_S)
    # No synchronize after these: the Buffer's stream waits for a collective that never ends.
    out["call"] = raised(lambda: dispatch(buf, x, lay, idx, w))
    out["new_buffer"] = raised(lambda: _buffer(world))
    return out


# ---- the test --------------------------------------------------------------------------------
def _show(outs):
    """What each rank raised and how long it took (pytest -rA prints it)."""
    for rank, out in sorted(outs.items()):
        for step in ("call", "new_buffer"):
            cls, msg, dt = out[step]
            print(f"rank {rank} {step}: {cls} after {dt:.2f} s: {msg}")


def _says_new_process_group(failure, gave_up):
    """A Buffer() on the poisoned group: at once, why, and what to do."""
    cls, msg, dt = failure
    assert cls == "CommTimeoutError", failure
    assert msg.startswith(f"the process group is unusable: {gave_up}"), msg
    assert "NCCL cannot cancel that collective" in msg, msg
    assert "Create a new process group" in msg, msg
    assert dt < CONSTRUCT_S, (dt, msg)


def test_a_timed_out_call_over_nccl_makes_the_group_unusable():
    from uccl_ep_megatron.cluster.local import RankPool

    pool = RankPool(2, num_gpus=2, task_timeout_s=SCENARIO_S, group_timeout_s=GROUP_S)
    try:
        assert pool.backend == "nccl", pool.placement
        outs, died, alive = run_scenario(pool)
    finally:
        pool.close()
    _show(outs)
    assert died is None and sorted(outs) == [0, 1], (died, outs)
    assert alive, "a rank's process ended during the scenario (aborted?)"
    for rank in (0, 1):
        got, want = outs[rank]["warm_rows"]
        assert got == want, f"rank {rank}: the warm-up dispatch received {got} rows, not {want}"

    gave_up = f"rank 0 gave up on {CALL} after UCCL_EP_TIMEOUT_MS={TIMEOUT_MS} ms"
    # Rank 0 waited: a timeout naming rank 1, no sooner than UCCL_EP_TIMEOUT_MS.
    cls, msg, dt = outs[0]["call"]
    assert cls == "CommTimeoutError", outs[0]["call"]
    assert msg.startswith(f"rank 0: {CALL} (Buffer #"), msg
    assert f"within UCCL_EP_TIMEOUT_MS={TIMEOUT_MS} ms: rank 1 (not in any call" in msg, msg
    assert "its process group is unusable too" in msg, msg
    assert "create a new process group" in msg, msg
    assert TIMEOUT_S <= dt < WAIT_BOUND_S, (dt, msg)
    # Rank 1 came late: told at once that rank 0 gave up, and that the group is gone too.
    cls, msg, dt = outs[1]["call"]
    assert gave_up in msg, outs[1]["call"]
    assert "its process group is unusable too" in msg, msg
    assert dt < AT_ONCE_S, (dt, msg)
    # Both ranks left a collective queued on the group: a new Buffer on it says so.
    for rank in (0, 1):
        _says_new_process_group(outs[rank]["new_buffer"], gave_up)

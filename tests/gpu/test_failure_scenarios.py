"""How ranks fail together on the ``kernels`` backend: a rank sleeping past the timeout, a rank
killed in a call, and two Buffers called in different orders; with ranks sharing one GPU under
CUDA MPS (gloo group) and on one GPU each (NCCL group).

Every rank that lives must raise a clear error naming the rank at fault within a bound, no
process may hang or abort, and afterwards the process group must still carry a barrier and a
new Buffer must move exactly the rows the ``reference`` oracle moves (or, where that cannot
be, the error must say the group is unusable and to create a new one).

Bounds: the intranode kernels give up a wait after ``UCCL_EP_TIMEOUT_MS`` (notify after twice
that), so a rank learns of a peer that never comes within 2 x the timeout, plus the launch.
A killed peer is reported by that timeout too: its kernels stop writing, they do not signal.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import NUM_GPUS, dispatch, nvl_bytes_for, require_kernels  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

HERE = os.path.abspath(__file__)
TIMEOUT_MS = 3000
BOUND_S = 4 * TIMEOUT_MS / 1e3 + 15  # two kernel deadlines, launches and the host poll
HIDDEN = 256


# ---- placements: ranks sharing one GPU (MPS, gloo) and one GPU each (NCCL) -------------------
def _placements():
    out = [pytest.param(1, id="shared-gpu-mps")]
    out.append(
        pytest.param(
            2,
            id="gpu-per-rank",
            marks=pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 GPUs"),
        )
    )
    return out


def run_scenario(name: str, gpus: int, may_die: bool = False) -> tuple[dict, str | None]:
    """Run ``name`` on 2 fresh ranks on ``gpus`` GPUs; results travel through files so the
    survivors' arrive when a rank dies (the pool then names the dead rank)."""
    from dist_utils import DistPool

    from uccl_ep_megatron.cluster.local import mps_available

    require_kernels()
    if gpus == 1 and not mps_available():
        pytest.skip("2 ranks on one GPU need CUDA MPS")
    with tempfile.TemporaryDirectory() as tmp:
        pool = DistPool(2, gpus=gpus, task_timeout_s=BOUND_S + 120)
        died = None
        try:
            pool.run(HERE, "_keep", name, tmp, env={"UCCL_EP_TIMEOUT_MS": str(TIMEOUT_MS)})
        except TimeoutError as exc:
            if not may_die:
                raise
            died = str(exc)
        finally:
            pool.close()
        outs = {}
        for r in range(2):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outs[r] = pickle.load(f)
    return outs, died


def _keep(rank, world, name, tmp):
    out = globals()[name](rank, world)
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    return out


# ---- on the ranks ----------------------------------------------------------------------------
def _buffer(world):
    from uccl_ep_megatron import Buffer

    return Buffer(None, nvl_bytes_for(world, HIDDEN), 0, backend="kernels")


def _inputs(rank, world):
    num_tokens = 64 + 8 * rank
    gen = torch.Generator(device="cuda").manual_seed(11 + rank)
    idx = torch.randint(0, 4 * world, (num_tokens, 2), device="cuda", generator=gen)
    idx[:, 1] = (idx[:, 0] + 1) % (4 * world)  # distinct experts per token
    w = torch.rand(num_tokens, 2, device="cuda", generator=gen)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    return x, idx, w


def _dispatch(buf, rank, world):
    x, idx, w = _inputs(rank, world)
    lay = buf.get_dispatch_layout(idx, 4 * world)[:4]
    out = dispatch(buf, x, lay, idx, w)
    torch.cuda.synchronize()
    return out


def _raises(fn) -> tuple[str, str, float]:
    """(class name, message, seconds) of the error ``fn`` raises."""
    from uccl_ep_megatron.core.errors import UcclEpError

    t0 = time.monotonic()
    try:
        fn()
    except UcclEpError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    raise AssertionError("no error was raised")


def _after(rank, world) -> str:
    """The group after the failure: a barrier over it, then a new kernels Buffer whose
    dispatch equals the reference oracle's; or an error saying the group is unusable."""
    import torch.distributed as dist

    from uccl_ep_megatron.cluster.local import reference_oracle
    from uccl_ep_megatron.core.errors import UcclEpError

    dist.barrier()
    try:
        buf = _buffer(world)
        got = _dispatch(buf, rank, world)
    except UcclEpError as exc:
        assert re.search(r"process group|create a new", str(exc)), str(exc)
        return f"unusable: {exc}"
    oracle = reference_oracle()
    x, idx, w = _inputs(rank, world)
    lay = oracle.get_dispatch_layout(idx, 4 * world)[:4]
    want = oracle.dispatch(x, **_kwargs(lay, idx, w))
    assert torch.equal(got[0].cpu(), want[0].cpu()), "recv_x differs from the reference"
    assert torch.equal(got[1].cpu(), want[1].cpu()), "recv_topk_idx differs from the reference"
    assert torch.equal(got[2].cpu(), want[2].cpu()), "recv_topk_weights differ"
    assert got[3] == want[3], (got[3], want[3])
    return "usable"


def _kwargs(lay, idx, w):
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs

    return dispatch_kwargs(lay, idx, w)


def sleeper(rank, world):
    """Rank 1 sleeps past the timeout before its first dispatch."""
    a = _buffer(world)
    if rank == 1:
        time.sleep(TIMEOUT_MS / 1e3 * 2.5)
    failed = _raises(lambda: _dispatch(a, rank, world))
    return failed, _after(rank, world)


def killed(rank, world):
    """Rank 1 is killed while rank 0 waits for it in a dispatch."""
    a = _buffer(world)
    _dispatch(a, rank, world)  # one good call first: both ranks are set up
    if rank == 1:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    return _raises(lambda: _dispatch(a, rank, world)), "not checked (rank 1 is dead)"


def two_buffers(rank, world):
    """Rank 0 calls Buffer A first, rank 1 Buffer B."""
    a, b = _buffer(world), _buffer(world)
    first = a if rank == 0 else b
    failed = _raises(lambda: _dispatch(first, rank, world))
    return failed, _after(rank, world)


# ---- the scenarios ---------------------------------------------------------------------------
def _show(name, outs):
    """What each rank raised and how long it took, and what the group was after (pytest -rA
    prints it): the record of what the kernels backend does in each scenario."""
    for rank, ((cls, msg, dt), after) in sorted(outs.items()):
        print(f"{name} rank {rank}: {cls} after {dt:.2f} s: {msg}")
        print(f"{name} rank {rank}: afterwards the group is {after}")


@pytest.mark.parametrize("gpus", _placements())
def test_a_rank_sleeping_past_the_timeout(gpus):
    outs, _ = run_scenario("sleeper", gpus)
    _show("sleeper", outs)
    for rank, other in ((0, 1), (1, 0)):
        (cls, msg, dt), after = outs[rank]
        assert dt < BOUND_S, (rank, dt, msg)
        assert f"rank {other}" in msg, (rank, msg)
        assert after == "usable" or after.startswith("unusable: "), after
    assert outs[0][0][0] == "CommTimeoutError", outs[0]


@pytest.mark.parametrize("gpus", _placements())
def test_a_killed_rank(gpus):
    outs, died = run_scenario("killed", gpus, may_die=True)
    _show("killed", outs)
    assert died is not None and "ranks [1] died" in died, died
    (cls, msg, dt), _ = outs[0]
    assert dt < BOUND_S, (dt, msg)
    assert "rank 1" in msg, msg


@pytest.mark.parametrize("gpus", _placements())
def test_two_buffers_called_in_different_orders(gpus):
    """No wrong rows: each rank raises, naming the other, and the group goes on."""
    outs, _ = run_scenario("two_buffers", gpus)
    _show("two_buffers", outs)
    for rank, other in ((0, 1), (1, 0)):
        (cls, msg, dt), after = outs[rank]
        assert dt < BOUND_S, (rank, dt, msg)
        assert f"rank {other}" in msg, (rank, msg)
        assert after == "usable" or after.startswith("unusable: "), after

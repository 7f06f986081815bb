"""The local launcher (uccl_ep_megatron.cluster.local) on CPU: rank placement, the group it
picks, the MPS daemon's start/stop commands and environment (against a stand-in control
program that records what it was asked), and cleanup when ranks fail or die."""

from __future__ import annotations

import os
import stat

import pytest

from uccl_ep_megatron.cluster import local
from uccl_ep_megatron.cluster.local import Mps, Placement, RankPool, place


def test_placement_round_robin_and_group_backend():
    assert place(4, 0) == Placement(4) and place(4, 0).world == 4
    assert place(4, 0).backend == "gloo" and not place(4, 0).shared
    p = place(8, 1)
    assert p.gpus == (0,) * 8 and p.shared and p.backend == "gloo" and p.world == 8
    p = place(4, 2)
    assert p.gpus == (0, 1, 0, 1) and p.shared and p.backend == "gloo"
    p = place(4, 8)
    assert p.gpus == (0, 1, 2, 3) and not p.shared and p.backend == "nccl"
    p = place(2, 2)
    assert p.gpus == (0, 1) and p.backend == "nccl"


@pytest.mark.parametrize("world,gpus", [(0, 1), (-2, 1), (2, -1), (True, 1), (2.0, 1)])
def test_placement_rejects_bad_counts(world, gpus):
    with pytest.raises(ValueError, match="world=|num_gpus="):
        place(world, gpus)


def _fake_control(tmp_path, fail_start: bool = False) -> tuple[str, str]:
    """A stand-in for nvidia-cuda-mps-control: logs argv, the pipe dir and stdin; ``-d``
    creates the control pipe the real daemon makes (or fails)."""
    log = tmp_path / "mps.log"
    script = tmp_path / "fake-mps-control"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "argv=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {log}\n'
        'if [ "$1" = "-d" ]; then\n'
        + ("  exit 3\n" if fail_start else "")
        + '  : > "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0\n'
        "fi\n"
        f'read cmd; echo "stdin=$cmd" >> {log}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), str(log)


def test_mps_start_stop_commands_env_and_refcount(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setenv("CUDA_MPS_LOG_DIRECTORY", "/elsewhere")
    control, log = _fake_control(tmp_path)
    mps = Mps(control=control, start_timeout_s=5)
    mps.start()
    mps.start()  # a second user shares the daemon
    d = mps.dir
    assert mps.running and d and os.path.isdir(d)
    pipe, logdir = os.path.join(d, "pipe"), os.path.join(d, "log")
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe  # what spawned ranks inherit
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == logdir
    mps.stop()
    assert mps.running and os.path.isdir(d)  # one user left
    mps.stop()
    assert not mps.running and not os.path.exists(d)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert os.environ["CUDA_MPS_LOG_DIRECTORY"] == "/elsewhere"
    lines = open(log).read().splitlines()
    assert lines == [
        f"argv=-d pipe={pipe} log={logdir}",
        f"argv= pipe={pipe} log={logdir}",
        "stdin=quit",
    ], lines
    mps.stop()  # idempotent


def test_mps_failed_start_cleans_up(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    control, _ = _fake_control(tmp_path, fail_start=True)
    mps = Mps(control=control, start_timeout_s=5)
    with pytest.raises(Exception, match="exit status 3|returned non-zero"):
        mps.start()
    assert not mps.running and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    missing = Mps(control=str(tmp_path / "no-such-program"))
    with pytest.raises(RuntimeError, match="no-such-program.*not on the PATH"):
        missing.start()
    assert not missing.running


def _rank_info(rank: int, world: int, boom_rank: int = -1) -> dict:
    import torch.distributed as dist

    if rank == boom_rank:
        raise ValueError(f"boom on {rank}")
    return {"rank": rank, "world": world, "backend": dist.get_backend()}


def _die(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(7)
    return None


# Functions of a test file reach the ranks by path (test files are not importable by name).
INFO = (__file__, "_rank_info")


def test_pool_runs_on_every_rank_and_reports_failures():
    with RankPool(3, num_gpus=0, task_timeout_s=120) as pool:
        assert pool.backend == "gloo"
        out = pool.run(INFO)
        assert out == [{"rank": r, "world": 3, "backend": "gloo"} for r in range(3)]
        with pytest.raises(AssertionError, match=r"(?s)failed on 1 rank.*rank 2.*boom on 2"):
            pool.run(INFO, 2)
        assert pool.alive()  # a Python error leaves the ranks usable
        assert pool.run(INFO)[1]["rank"] == 1
    assert not pool.alive()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(INFO)


def test_pool_names_a_dead_rank_and_closes():
    pool = RankPool(2, num_gpus=0, task_timeout_s=60)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] died"):
        pool.run((__file__, "_die"))
    assert not pool.alive()


def test_shared_gpu_pool_stops_mps_when_ranks_fail(tmp_path, monkeypatch):
    """Ranks placed to share GPU 0 (here: ranks that cannot reach any GPU, so they die at
    start-up): the pool raises naming them, and the MPS daemon it started is stopped."""
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.setattr(local, "visible_gpus", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks see no GPU even on a GPU host
    control, log = _fake_control(tmp_path)
    mps = Mps(control=control, start_timeout_s=5)
    pool = RankPool(2, mps_daemon=mps, task_timeout_s=60)
    assert pool.placement.shared and pool.backend == "gloo" and mps.running
    with pytest.raises(TimeoutError, match="died"):
        pool.run(INFO)
    assert not mps.running
    assert open(log).read().splitlines()[-1] == "stdin=quit"


def test_shared_gpu_env_splits_the_mps_queue_pool():
    from uccl_ep_megatron.cluster.local import shared_gpu_env

    got = [int(shared_gpu_env(n)["CUDA_DEVICE_MAX_CONNECTIONS"]) for n in (1, 2, 4, 8, 16)]
    assert got == [32, 32, 16, 8, 8]


def test_ranks_sharing_gpus_split_the_queue_pool_of_the_one_mps_server(tmp_path, monkeypatch):
    """4 ranks on 2 GPUs are 4 clients of one MPS server: 16 queues each, not the 32 that 2
    ranks per GPU would give (4 x 32 failed to create a context on 2 H200s)."""
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks see no GPU and exit at once
    seen: dict[str, str] = {}
    real = local._environ

    def recording(updates):
        seen.update(updates)
        return real(updates)

    monkeypatch.setattr(local, "_environ", recording)
    control, _ = _fake_control(tmp_path)
    with RankPool(4, num_gpus=2, mps_daemon=Mps(control=control, start_timeout_s=5)) as pool:
        assert pool.placement.gpus == (0, 1, 0, 1) and pool.placement.shared
    assert seen["CUDA_DEVICE_MAX_CONNECTIONS"] == "16"

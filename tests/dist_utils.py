"""Run test bodies on several gloo (or NCCL) ranks.

A ``DistPool`` spawns ``world_size`` processes once and keeps them; each test sends the path
of its own file plus a function name, every rank imports that file and runs the function with
``(rank, world_size, *args)``. Results come back per rank; a failure on any rank re-raises
here with that rank's traceback. Keeping the processes alive costs one torch import per rank
per world size instead of one per test, which matters on a 2-core CI machine.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import queue
import sys
import tempfile
import traceback
from typing import Any

import torch.multiprocessing as mp

TASK_TIMEOUT_S = float(os.environ.get("UCCL_EP_TEST_TIMEOUT_S", "240"))


def _load(path: str):
    name = "_dist_test_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, world_size: int, init_file: str, backend: str, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=45),
    )
    while True:
        task = tasks.get()
        if task is None:
            break
        path, fn_name, args, env = task
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out = getattr(_load(path), fn_name)(rank, world_size, *args)
            results.put((rank, True, out))
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            results.put((rank, False, traceback.format_exc()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    dist.destroy_process_group()


class DistPool:
    """``world_size`` long-lived ranks that run test functions on request."""

    def __init__(self, world_size: int, backend: str = "gloo") -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        self._dir = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._dir.name, "init")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, init_file, backend, self._tasks[r], self._results),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, path: str, fn_name: str, *args: Any, env: dict[str, str] | None = None) -> list:
        """Run ``fn_name`` of the file at ``path`` on every rank; returns per-rank results."""
        for q in self._tasks:
            q.put((path, fn_name, args, dict(env or {})))
        outs: list[Any] = [None] * self.world_size
        failures = []
        for _ in range(self.world_size):
            try:
                rank, ok, out = self._results.get(timeout=TASK_TIMEOUT_S)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                self.close()
                raise TimeoutError(
                    f"{fn_name}: no result within {TASK_TIMEOUT_S}s (dead ranks: {dead})"
                ) from None
            if ok:
                outs[rank] = out
            else:
                failures.append(f"--- rank {rank} ---\n{out}")
        if failures:
            raise AssertionError(
                f"{fn_name} failed on {len(failures)} rank(s):\n" + "\n".join(failures)
            )
        return outs

    def close(self) -> None:
        for q, p in zip(self._tasks, self._procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._dir.cleanup()

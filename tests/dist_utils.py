"""Run test bodies on several ranks: the package's launcher (``uccl_ep_megatron.cluster.local``)
with the call shape the tests use.

A ``DistPool`` spawns ``world_size`` processes once and keeps them; each test sends the path
of its own file plus a function name, every rank imports that file and runs the function with
``(rank, world_size, *args)``. Results come back per rank; a failure on any rank re-raises
here with that rank's traceback. Keeping the processes alive costs one torch import per rank
per world size instead of one per test, which matters on a 2-core CI machine.

``gpus=0`` (the default) gives CPU ranks in a gloo group. ``gpus=N`` places the ranks
round-robin on N GPUs: an NCCL group when each rank has its own GPU, else ranks sharing GPUs
under CUDA MPS in a gloo group (the launcher starts and stops MPS).
"""

from __future__ import annotations

import os
from typing import Any

from uccl_ep_megatron.cluster.local import RankPool


class DistPool(RankPool):
    """``world_size`` long-lived ranks that run test functions on request."""

    def __init__(self, world_size: int, gpus: int = 0, task_timeout_s: float | None = None):
        # The tests' bound on one case: UCCL_EP_TEST_TIMEOUT_S (slow or shared machines).
        if task_timeout_s is None:
            task_timeout_s = float(os.environ.get("UCCL_EP_TEST_TIMEOUT_S", "240"))
        super().__init__(world_size, num_gpus=gpus, task_timeout_s=task_timeout_s)
        self.world_size = world_size

    def run(self, path: str, fn_name: str, *args: Any, env: dict[str, str] | None = None) -> list:
        """Run ``fn_name`` of the file at ``path`` on every rank; returns per-rank results."""
        return super().run((path, fn_name), *args, env=env)

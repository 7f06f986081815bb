"""What the multi-GPU benchmarks (``bench intranode``, ``bench internode``) share: one process
per GPU joined in an NCCL group, DeepSeek-V3-style random routed inputs, and the JSON hand-off
of rank 0's results back to the launching process."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def spawn_ranks(worker: Callable[..., None], world: int, *args: Any) -> dict:
    """Run ``worker(rank, world, init_file, *args, out_path)`` on ``world`` GPUs; return the
    JSON that rank 0 wrote to ``out_path``."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result.json")
        torch.multiprocessing.spawn(
            worker, args=(world, os.path.join(d, "init"), *args, out), nprocs=world
        )
        with open(out) as f:
            return json.load(f)


def init_rank(rank: int, world: int, init_file: str) -> None:
    """Bind this process to GPU ``rank`` and join the NCCL group (file rendezvous)."""
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )


def routed_inputs(a: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids (uniform random scores), weights and BF16 rows for ``a``'s shape, per rank."""
    T, H, E, K = a["tokens"], a["hidden"], a["experts"], a["topk"]
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen, device="cuda")
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    return idx, w, x

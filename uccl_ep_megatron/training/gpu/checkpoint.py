"""Checkpoints of the GPU job through ``megatron.core.dist_checkpointing``.

Model and optimizer sharded state dicts, scheduler and iteration as common state, in
``iter_NNNNNNN/``; ``latest_checkpointed_iteration.txt`` names the newest (Megatron-LM's layout).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _latest(ckpt_dir: Path) -> int | None:
    tracker = ckpt_dir / TRACKER
    return int(tracker.read_text().strip()) if tracker.is_file() else None


def save_checkpoint(ckpt_dir: Path, iteration: int, gpt, optimizer, scheduler) -> Path:
    """Save a distributed checkpoint of ``iteration`` and point the tracker at it."""
    from megatron.core import dist_checkpointing

    path = ckpt_dir / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": gpt.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state["scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (ckpt_dir / TRACKER).write_text(str(iteration))
    return path


def load_checkpoint(ckpt_dir: Path, gpt, optimizer, scheduler) -> int:
    """Load the tracker's checkpoint; returns its iteration (0 when there is none)."""
    from megatron.core import dist_checkpointing

    iteration = _latest(ckpt_dir)
    if iteration is None:
        return 0
    path = ckpt_dir / f"iter_{iteration:07d}"
    state = {"model": gpt.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    return int(loaded["iteration"])


__all__ = ["TRACKER", "load_checkpoint", "save_checkpoint"]

"""Checkpoints of the GPU job through ``megatron.core.dist_checkpointing``.

Model and optimizer sharded state dicts, scheduler and iteration as common state, in
``iter_NNNNNNN/``; ``latest_checkpointed_iteration.txt`` names the newest (Megatron-LM's layout).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from uccl_ep_megatron.core.errors import UnsupportedError

TRACKER = "latest_checkpointed_iteration.txt"


# The distributed optimizer's checkpoint format: ``dp_reshardable``, Megatron-LM's default
# (reloadable at the same data-parallel size). megatron-core's own default
# (``fully_sharded_model_space``) is refused by 0.16+ ("ShardedTensor.flattened_range is not
# supported"); older releases are refused earlier (``check_distributed_optimizer_checkpoints``).
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def check_distributed_optimizer_checkpoints() -> None:
    """Raise before the model is built when this megatron-core cannot checkpoint a distributed
    optimizer: before 0.16, without Apex or Transformer Engine (torch's Adam keeps a ``step``
    per parameter), either the save fails (``dp_reshardable``: a scalar where a shard is
    expected) or the reload does (``KeyError: 'step'``, ``assert len(steps) == 1``)."""
    from megatron.core import package_info
    from megatron.core.optimizer import distrib_optimizer

    version = (int(package_info.MAJOR), int(package_info.MINOR))
    if version < (0, 16) and not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        raise UnsupportedError(
            f"parallelism.use_distributed_optimizer=true with checkpoints: megatron-core "
            f"{package_info.__version__} without Apex or Transformer Engine cannot reload a "
            "distributed optimizer's checkpoint; install megatron-core >= 0.16, set "
            "parallelism.use_distributed_optimizer=false, or train without checkpoints "
            "(training.save_interval=0 and no --resume)"
        )


def _distributed_optimizers(optimizer):
    """The (DistributedOptimizer, its torch optimizer) pairs of a possibly chained optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            yield opt, opt.optimizer


def _allocate_optimizer_state(optimizer) -> None:
    """A fresh distributed optimizer has no per-parameter state, and megatron-core's
    ``state_dict()`` (called to build the sharded state dict it loads into) then fails without
    Apex or Transformer Engine (its ``assert len(steps) == 1``). Allocate the state the load
    overwrites: megatron-core's zero moments (``init_state_fn``) and torch Adam's step count
    (set after the load by ``_restore_adam_steps``). The parameters are not touched
    (megatron-core's own FSDP path takes an optimizer step on zero gradients instead, which
    applies weight decay to the fp32 main parameters)."""
    import torch

    for opt, inner in _distributed_optimizers(optimizer):
        if len(inner.state) != 0:
            continue
        if opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0, dtype=torch.float32))


def _restore_adam_steps(optimizer) -> None:
    """After a distributed optimizer's load, torch Adam's per-parameter step counts are the
    placeholders the load copied its parameter state into (megatron-core reloads moments and
    fp32 main parameters, but the steps only into the parameter groups): set them from the
    groups' reloaded step, or the next update's bias correction would start over."""
    import torch

    for _, inner in _distributed_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                state = inner.state[p]
                if "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


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
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], metadata=dict(_OPTIMIZER_METADATA)
    )
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
    _allocate_optimizer_state(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(
        state["model"], is_loading=True, metadata=dict(_OPTIMIZER_METADATA)
    )
    loaded = dist_checkpointing.load(state, str(path))
    gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    _restore_adam_steps(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    return int(loaded["iteration"])


__all__ = [
    "TRACKER",
    "check_distributed_optimizer_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

"""The ``uccl_ep`` dispatcher's metrics inside Megatron-LM's own training loop.

Megatron-LM logs loss, throughput and TFLOP/s itself (``training_log`` in
``megatron/training/training.py``) to its wandb and tensorboard writers. :func:`install` wraps
that function so that, on every call, the per-step dispatch/combine metrics the ``uccl_ep``
dispatcher recorded (``uccl_ep_megatron.telemetry.dispatch``: time, GB/s, expert-load imbalance)
go to the same writers at the same iteration, under ``uccl_ep/<metric>``. Every rank collects
(which resets its records); Megatron-LM creates the writers on the last rank only, so that
rank's values are the ones logged.

Call it after Megatron-LM's directory is importable and before ``pretrain`` runs, e.g. right
after ``megatron_plugin.install()`` in ``python -m uccl_ep_megatron.run``. The plugin calls it
itself when ``--moe-uccl-ep-metrics`` is on, and then times every MoE layer's dispatcher
(``uccl_ep``, ``alltoall``, ``flex``) through ``telemetry.dispatch.instrument``, forward and
backward. The last rank also prints each iteration's values as one line,
``uccl_ep metrics | iteration N | name value | ...``, for scripts that read the log.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

from uccl_ep_megatron.core.errors import UnsupportedError

log = logging.getLogger(__name__)

PREFIX = "uccl_ep/"


def wrap_training_log(
    original: Callable[..., Any],
    get_writers: Callable[[], list[Any]],
    collect: Callable[[], dict[str, float]],
) -> Callable[..., Any]:
    """``original`` followed by logging ``collect()`` to every writer at its ``iteration``.

    Args:
        original: Megatron-LM's ``training_log`` (any version: ``iteration`` is found by name).
        get_writers: returns the writers present on this rank (wandb module/run with
            ``log(dict, step)``, tensorboard ``SummaryWriter`` with ``add_scalar``).
        collect: returns this step's metrics (``{name: value}``, possibly empty).
    """
    try:
        signature = inspect.signature(original)
    except (TypeError, ValueError) as exc:
        raise UnsupportedError(f"cannot read the signature of {original!r}: {exc}") from exc
    if "iteration" not in signature.parameters:
        raise UnsupportedError(
            f"{original.__module__}.{original.__qualname__} has no 'iteration' parameter; this "
            "Megatron-LM version is not supported by the uccl_ep metrics hook"
        )

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        iteration = signature.bind_partial(*args, **kwargs).arguments.get("iteration")
        values = collect()
        if values and iteration is not None:
            if _last_rank():
                fields = " | ".join(f"{k} {v:.6g}" for k, v in sorted(values.items()))
                print(f"uccl_ep metrics | iteration {iteration} | {fields}", flush=True)
            for writer in get_writers():
                if hasattr(writer, "add_scalar"):
                    for key, value in values.items():
                        writer.add_scalar(PREFIX + key, value, iteration)
                else:
                    writer.log({PREFIX + k: v for k, v in values.items()}, iteration)
        return result

    training_log.uccl_ep_wrapped = True
    return training_log


def _last_rank() -> bool:
    """Whether this process is the one Megatron-LM logs from (the last rank; no group: yes)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank() == dist.get_world_size() - 1


def install() -> bool:
    """Hook Megatron-LM's ``training_log``; returns ``False`` when Megatron-LM is not importable.

    Also turns on the dispatcher's metric recording (``dispatch_metrics.enable()``).
    """
    try:
        from megatron.training import global_vars
        from megatron.training import training as megatron_training
    except (ImportError, SyntaxError) as exc:  # absent, or newer than this Python
        log.info("Megatron-LM's training loop is not importable (%s); no metrics hook", exc)
        return False
    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics

    if getattr(megatron_training.training_log, "uccl_ep_wrapped", False):
        return True

    def writers() -> list[Any]:
        found = []
        for name in ("get_wandb_writer", "get_tensorboard_writer"):
            getter = getattr(global_vars, name, None)
            writer = getter() if getter is not None else None
            if writer is not None:
                found.append(writer)
        return found

    def collect() -> dict[str, float]:
        return dispatch_metrics.collect().summary()

    dispatch_metrics.enable()
    megatron_training.training_log = wrap_training_log(
        megatron_training.training_log, writers, collect
    )
    return True


__all__ = ["PREFIX", "install", "wrap_training_log"]

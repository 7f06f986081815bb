"""Bounded waits for collectives: a rank that never reaches the call becomes a
``CommTimeoutError`` naming this rank and the call, not a hang."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch

from uccl_ep_megatron.core.errors import CommTimeoutError, UcclEpError


def timeout_error(rank: int, what: str, call: str, timeout_ms: int) -> CommTimeoutError:
    return CommTimeoutError(
        f"rank {rank}: {what} of {call} did not complete within UCCL_EP_TIMEOUT_MS={timeout_ms} "
        "ms: another rank of the group did not reach the same call (it crashed, raised before "
        "the call, destroyed its Buffer, or is in another collective). Raise UCCL_EP_TIMEOUT_MS "
        "if it is only slow. This Buffer is unusable now."
    )


def wait_work(work: Any, timeout_ms: int, on_timeout: Callable[[], UcclEpError]) -> None:
    """``work.wait`` bounded by ``timeout_ms`` (CPU / gloo collectives)."""
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=timeout_ms))
    except RuntimeError as exc:
        raise on_timeout() from exc


def wait_stream(timeout_ms: int, on_timeout: Callable[[], UcclEpError]) -> None:
    """Wait for the current CUDA stream's work so far, giving up after ``timeout_ms``."""
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + timeout_ms / 1e3
    spins = 0
    while not event.query():
        spins += 1
        if spins > 64:
            if time.monotonic() > deadline:
                raise on_timeout()
            time.sleep(50e-6)

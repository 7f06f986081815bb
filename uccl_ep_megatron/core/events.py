"""``EventOverlap``: DeepEP's handle for asynchronous communication.

An operation called with ``async_finish=True`` returns an ``EventOverlap`` recorded on the
communication stream; the caller makes its own stream wait for it when it needs the outputs.
On the CPU (gloo) every operation completes before it returns, so the event is empty and
waiting is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class EventOverlap:
    """A recorded device event plus the tensors that must stay alive until it completes.

    Args:
        event: a ``torch.cuda.Event`` (``torch.Event`` on other devices) or ``None``.
        extra_tensors: tensors kept referenced so the allocator cannot reuse their memory
            before the event completes.
    """

    def __init__(
        self,
        event: torch.cuda.Event | None = None,
        extra_tensors: Iterable[torch.Tensor] | None = None,
    ) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        """Make the current stream wait until the recorded work is done."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Block the host until the recorded work is done."""
        if self.event is not None:
            self.event.synchronize()

    def __enter__(self) -> EventOverlap:
        """``with event:`` runs the body overlapped; leaving it waits for the event."""
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'set' if self.event is not None else None})"


def capture() -> EventOverlap:
    """An ``EventOverlap`` recorded now on the current CUDA stream (empty on the CPU)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return EventOverlap(None)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return EventOverlap(event)

"""Where a ``Buffer`` call runs: on the communication stream, ordered after the caller's work,
with its inputs and outputs recorded on the streams that use them, so the caching allocator
never recycles memory one stream still reads; or, for a synchronous call (no ``async_finish``,
no ``previous_event``) of a backend that ``runs_on_caller_stream``, on the caller's stream
itself.

A synchronous call on the communication stream is bracketed by two joins (the comm stream
waits for the caller's, then the caller's waits for the comm stream), so its work is ordered
exactly as if it ran on the caller's stream; running it there drops two events, two stream
waits, the stream switches and every ``record_stream`` (host time, tens of microseconds under
MPS) and changes nothing the caller can observe. What the Buffer itself must keep is the order
of its own calls (they share its staging buffers): a call on another stream than the previous
one first makes its stream wait for an event recorded then on the previous call's stream."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from uccl_ep_megatron.backends.base import DispatchResult
from uccl_ep_megatron.core.events import EventOverlap


class CommStream:
    """Mixin of ``Buffer``: its communication stream and ``_run``. Uses the ``Buffer``'s
    ``_check_event`` (``ArgumentChecks``) and tells its backend the caller's stream
    (``Backend.caller_stream``)."""

    def _init_comm_stream(self, device: torch.device, device_index: int) -> None:
        """A dedicated stream on a CUDA ``device`` (none on the CPU), and the two events that
        join every call into and out of it, made once."""
        self._device_index = device_index
        self._comm_stream = None
        if device.type == "cuda":
            self._comm_stream = torch.cuda.Stream(device=device)
            self._joined = torch.cuda.Event()
            self._finished = torch.cuda.Event()
            c = self._comm_stream
            self._comm_ids = (c.stream_id, c.device_index, c.device_type)
            # torch.cuda.Stream of each (stream_id, device_index, device_type) a caller used:
            # torch.cuda.current_stream() builds a new one per call (~10 us under MPS).
            self._callers: dict[tuple[int, int, int], torch.cuda.Stream] = {}
            # The stream this Buffer's previous call ran on (raw handle, 0: none yet): a call
            # on another stream is ordered after it first (see the module docstring).
            self._last_raw = 0
            self._last_stream: torch.cuda.Stream | None = None
            # Synchronous calls run on the caller's stream (set by Buffer from its backend).
            self._direct = False
            self._comm_used = False  # an asynchronous call has run on the comm stream

    def _follow(self, raw: int, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` (raw handle ``raw``; None: the current stream) wait for this
        Buffer's previous call, which ran on another stream: an event recorded now on that
        stream covers it. Only when the stream changes between calls, and not while the
        current stream is being captured into a CUDA graph: a captured stream cannot wait for
        work outside the capture (torch.cuda.graph synchronizes the device before capturing,
        and a replay is ordered by its caller)."""
        if stream is None:
            stream = self._caller_stream(self._device_index)
        last = self._last_stream
        if last is not None and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record(last)
            stream.wait_event(event)
        self._last_raw, self._last_stream = raw, stream

    def _caller_stream(self, index: int) -> torch.cuda.Stream:
        ids = torch._C._cuda_getCurrentStream(index)
        stream = self._callers.get(ids)
        if stream is None:
            if len(self._callers) > 64:  # streams a caller made and dropped
                self._callers.clear()
            stream = self._callers[ids] = torch.cuda.Stream(
                stream_id=ids[0], device_index=ids[1], device_type=ids[2]
            )
        return stream

    def _run(
        self,
        fn: Callable[[], Any],
        inputs: Callable[[], Sequence[torch.Tensor]],
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
        outputs: Callable[[Any], Sequence[torch.Tensor | None]] | None = None,
    ) -> tuple[Any, EventOverlap]:
        """Run ``fn`` on the comm stream, ordered after the caller's work, or (a synchronous
        call of a ``runs_on_caller_stream`` backend) on the caller's stream.

        On the comm stream, what ``fn`` reads (``inputs()``) is recorded there and what it
        returns on the caller's stream, so the caching allocator never recycles memory one
        stream still uses; ``fn`` allocates its outputs with the comm stream current whatever
        ``allocate_on_comm_stream`` says (see ``dispatch``). ``outputs(result)`` names the
        result's tensors (None entries skipped); without it every tensor inside the result
        (nested tuples) counts.
        """
        self._check_event(previous_event)
        comm = self._comm_stream
        if comm is None:
            return fn(), EventOverlap(None)
        index = self._device_index
        if (
            self._direct
            and not async_finish
            and previous_event is None
            and torch._C._cuda_getDevice() == index
        ):
            # On the caller's stream (see the module docstring): nothing to join or record.
            raw = torch._C._cuda_getCurrentRawStream(index)
            if raw != self._last_raw:
                self._follow(raw, None)
            self._backend.caller_stream = raw
            return fn(), EventOverlap(None)
        if not self._comm_used:
            # Memory a synchronous call handed out may now be read on the comm stream.
            self._comm_used = True
            self._backend.note_stream(comm.cuda_stream)
        compute = self._caller_stream(index)
        self._backend.caller_stream = compute.cuda_stream
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            # Stream.wait_stream with an event made once (it creates one per call): a wait
            # takes the event's latest record, so reusing it orders the same work.
            self._joined.record(compute)
            comm.wait_event(self._joined)
        if self._last_raw != comm.cuda_stream:
            # The previous call ran on a third stream (the join above covers the caller's).
            self._follow(comm.cuda_stream, comm)
        if torch._C._cuda_getDevice() == index:
            # torch.cuda.stream() without its context manager (host time): setting a stream
            # keeps the current device when the stream is on it, so restoring is exact.
            set_stream = torch._C._cuda_setStream
            comm_ids = self._comm_ids
            set_stream(stream_id=comm_ids[0], device_index=comm_ids[1], device_type=comm_ids[2])
            try:
                out = fn()
            finally:
                set_stream(
                    stream_id=compute.stream_id,
                    device_index=compute.device_index,
                    device_type=compute.device_type,
                )
        else:
            with torch.cuda.stream(comm):
                out = fn()
        read = inputs()
        for t in read:
            if t.is_cuda:
                t.record_stream(comm)
        produced = tensors(out) if outputs is None else outputs(out)
        for t in produced:
            if t is not None and t.is_cuda:
                t.record_stream(compute)
        if async_finish:
            event = torch.cuda.Event()
            event.record(comm)
            kept = [t for t in produced if t is not None]
            return out, EventOverlap(event, [*read, *kept])
        self._finished.record(comm)
        compute.wait_event(self._finished)
        return out, EventOverlap(None)


def dispatch_outputs(r: DispatchResult) -> tuple[torch.Tensor | None, ...]:
    """The tensors of a backend's ``DispatchResult`` that a caller gets (what ``tensors``
    finds in it), each storage once: views of the rank prefix matrix's tensor (the kernels
    backend's recv_count and per-expert counts) are covered by recording the matrix. Receive
    arena outputs (``r.arena``) are left out: ``record_stream`` does nothing for memory the
    caching allocator did not hand out (the arena orders its blocks itself), and each call
    costs host time."""
    prefix = r.rank_prefix_matrix
    base = prefix._base
    count, per_expert = r.recv_count, r.recv_tokens_per_expert
    if base is not None:
        if count is not None and count._base is base:
            count = None
        if per_expert is not None and per_expert._base is base:
            per_expert = None
    if r.arena:
        return (prefix, count, per_expert)
    return (
        r.recv_x,
        r.recv_x_scales,
        r.recv_topk_idx,
        r.recv_topk_weights,
        prefix,
        r.recv_src_idx,
        count,
        per_expert,
    )


def cached_outputs(r: DispatchResult) -> tuple[torch.Tensor | None, ...]:
    """What a cached dispatch hands back: received rows (and FP8 scales), unless they live in
    the receive arena (see ``dispatch_outputs``). The result's other tensors are the handle's,
    recorded when the handle was made."""
    return () if r.arena else (r.recv_x, r.recv_x_scales)


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples/lists/NamedTuples (outputs to record on a stream).
    A sequence that starts with a plain number is taken as numbers only (a count list of
    hundreds of ints would otherwise cost ~200 us per dispatch to walk)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if not isinstance(obj, tuple | list) or (obj and isinstance(obj[0], int | float)):
        return []
    out: list[torch.Tensor] = []
    for item in obj:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, tuple | list):
            out.extend(tensors(item))
    return out


__all__ = ["CommStream", "cached_outputs", "dispatch_outputs", "tensors"]

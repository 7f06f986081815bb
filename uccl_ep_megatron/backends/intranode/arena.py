"""The receive arena of zero-copy dispatch: registered memory that dispatch outputs are carved
from, so peers write each row straight into the tensor the caller gets back.

Each rank owns one region (``UCCL_EP_RECV_ARENA_BYTES``), cudaMalloc'd and IPC-mapped by every
peer once, when the Buffer is created. A dispatch takes one block holding its five outputs
(``recv_x``, scales, top-k ids, weights, source indices); the returned tensors are views of one
uint8 tensor that PyTorch owns like any other: ``torch.as_tensor`` of a holder object exposing
``__cuda_array_interface__`` keeps the holder alive until the storage is freed, in whatever
order Megatron frees saved activations. The holder's release records a CUDA event on the
freeing (current) stream and on the allocation stream, and queues the block; a later dispatch
that reuses any of its bytes makes its stream wait on those events first, which gives the
caching allocator's semantics (work already queued on the stream that freed it, or that it
was allocated on, finishes before the memory is written again). ``Tensor.record_stream`` is a
no-op for memory torch did not allocate, so work on a third stream must be ordered before the
tensor dies (as the Buffer's own comm/compute hand-off is). A call whose outputs do not fit
takes the staged path.

``BlockAllocator`` is plain host bookkeeping (first fit over offset-sorted free ranges,
coalesced on free), kept free of CUDA so it is tested on its own.
"""

from __future__ import annotations

import bisect
import importlib.util
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALIGN = 256  # every block and every output inside it starts 256-byte aligned


def align_up(v: int, a: int = ALIGN) -> int:
    return (v + a - 1) // a * a


@dataclass
class _Range:
    offset: int
    size: int
    # Events (opaque to the allocator) the next user of these bytes must wait for.
    events: list[Any] = field(default_factory=list)


class BlockAllocator:
    """First-fit allocation of ``ALIGN``-multiples in ``[0, capacity)``.

    ``free`` may be called from any point of the program (a tensor's deleter runs wherever its
    storage dies, garbage collection included), so it only appends to a queue; ``take`` folds
    the queue into the free list (coalescing neighbours) before it searches.

    Args:
        capacity: bytes managed (rounded down to ``ALIGN``).
        done: whether an event has completed (completed events are dropped, not waited on).
    """

    def __init__(self, capacity: int, done: Callable[[Any], bool] = lambda e: False) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity} must be non-negative")
        self.capacity = capacity // ALIGN * ALIGN
        self._done = done
        self._free: list[_Range] = [_Range(0, self.capacity)] if self.capacity else []
        self._pending: deque[_Range] = deque()
        self.live = 0  # blocks handed out and not yet freed

    def take(self, nbytes: int) -> tuple[int, list[Any]] | None:
        """The offset of a free block of ``nbytes`` (lowest that fits) and the events its user
        must wait for, or ``None`` when no free range holds it."""
        if nbytes <= 0:
            raise ValueError(f"nbytes={nbytes} must be positive")
        self._fold_pending()
        size = align_up(nbytes)
        for i, r in enumerate(self._free):
            if r.size < size:
                continue
            events = [e for e in r.events if not self._done(e)]
            if r.size == size:
                del self._free[i]
            else:
                # The rest keeps the events: its bytes were used by the same frees.
                self._free[i] = _Range(r.offset + size, r.size - size, list(events))
            self.live += 1
            return r.offset, events
        return None

    def free(self, offset: int, nbytes: int, events: list[Any]) -> None:
        """Queue ``[offset, offset + nbytes)`` (a block ``take`` returned) for reuse after
        ``events``."""
        self._pending.append(_Range(offset, align_up(nbytes), list(events)))

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range, pending frees folded in (for tests and logs)."""
        self._fold_pending()
        return [(r.offset, r.size) for r in self._free]

    def _fold_pending(self) -> None:
        while self._pending:
            r = self._pending.popleft()
            self.live -= 1
            i = bisect.bisect_left([f.offset for f in self._free], r.offset)
            if i > 0 and self._free[i - 1].offset + self._free[i - 1].size > r.offset:
                raise RuntimeError(f"block at {r.offset} freed twice or never taken")
            if i < len(self._free) and r.offset + r.size > self._free[i].offset:
                raise RuntimeError(f"block at {r.offset} freed twice or never taken")
            self._free.insert(i, r)
            if i + 1 < len(self._free) and r.offset + r.size == self._free[i + 1].offset:
                nxt = self._free.pop(i + 1)
                r.size += nxt.size
                r.events += nxt.events
            if i > 0 and self._free[i - 1].offset + self._free[i - 1].size == r.offset:
                prev = self._free[i - 1]
                prev.size += r.size
                prev.events += r.events
                del self._free[i]
                r = prev
            # A range that is never chosen would gather the events of every free merged into
            # it: keep only those still pending.
            r.events = [e for e in r.events if not self._done(e)]


@dataclass
class OutputLayout:
    """Byte offsets of the five dispatch outputs inside a block, and its size."""

    x: int
    scales: int
    idx: int
    w: int
    src: int
    end: int


def output_layout(
    rows: int, row_bytes: int, num_scales: int, num_topk: int, idx_size: int, src: bool
) -> OutputLayout:
    """Where a dispatch's outputs go in its block (each ``ALIGN``-aligned; absent ones empty)."""
    scales = align_up(rows * row_bytes)
    idx = align_up(scales + rows * num_scales * 4)
    w = align_up(idx + rows * num_topk * idx_size)
    src_at = align_up(w + rows * num_topk * 4)
    end = align_up(src_at + (rows * 4 if src else 0))
    return OutputLayout(0, scales, idx, w, src_at, end)


@dataclass
class RecvOutputs:
    """A dispatch's five outputs (recv_x, scales, ids, weights, source indices; None where
    absent), whether they live in the receive arena, and the receive entry naming them."""

    tensors: tuple[Any, ...]
    zero_copy: bool
    entry: list[int]  # {mode, arena offsets}: see kRecvEntryOffset


class _View:
    """``nbytes`` of device memory at ``ptr`` as ``torch.as_tensor`` reads them (version 3 of
    the CUDA array interface, no "stream" key: the caller orders the work)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class _Holder(_View):
    """Owner of one block: the storage of the tensors viewing it keeps it alive, and its
    ``__del__`` (the storage's deleter) hands the block back."""

    def __init__(self, arena: RecvArena, offset: int, nbytes: int, stream: torch.cuda.Stream):
        super().__init__(arena.base + offset, nbytes)
        self._arena, self._offset, self._nbytes, self._stream = arena, offset, nbytes, stream

    def __del__(self) -> None:
        self._arena.release(self._offset, self._nbytes, self._stream)


class RecvArena:
    """This rank's receive arena and its mappings of the peers' (see the module docstring).

    Collective: every rank of ``group`` creates it at the same point. Zero-copy needs an arena
    on every rank, so when any rank asks for 0 bytes none is allocated (``enabled`` False).
    """

    def __init__(
        self, c: Any, group: dist.ProcessGroup, rank: int, device: int, nbytes: int, num_ranks: int
    ) -> None:
        from uccl_ep_megatron.backends.ipc_buffer import IpcBuffers

        self._device = device
        self.nbytes = align_up(max(0, int(nbytes)))
        if self.nbytes and importlib.util.find_spec("numpy") is None:
            # torch reads __cuda_array_interface__ through numpy's dtype parser.
            log.warning("receive arena off on rank %d: numpy is not installed", rank)
            self.nbytes = 0
        sizes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, self.nbytes, group=group)
        self.enabled = min(sizes) > 0
        self._ipc: IpcBuffers | None = None
        self._alloc = BlockAllocator(0)
        self.fallbacks = 0  # dispatches that did not fit and took the staged path
        self._closed = False
        self._deferred: list[tuple[int, int]] = []  # blocks freed while a graph was captured
        if not self.enabled:
            return
        self._ipc = IpcBuffers(
            c, group, rank, device, self.nbytes, list(range(num_ranks)), keep_bytes=0
        )
        self.base = self._ipc.local
        self._alloc = BlockAllocator(self.nbytes, lambda e: e.query())

    @property
    def ptrs(self) -> list[int]:
        """Every rank's arena as mapped here (own included), or [] when disabled."""
        return self._ipc.ptrs if self._ipc is not None else []

    @property
    def sizes(self) -> list[int]:
        """Bytes of every rank's arena, or [] when disabled."""
        return list(self._ipc.sizes) if self._ipc is not None else []

    def take(self, nbytes: int, stream: torch.cuda.Stream) -> torch.Tensor | None:
        """A uint8 tensor of ``nbytes`` in the arena whose memory nothing else uses until the
        tensor (and every view of it) dies; ``stream`` waits for the block's earlier users
        first. ``None`` when the arena is off, closed or full (counted, logged once)."""
        if not self.enabled or self._closed or nbytes <= 0:
            return None
        self._fold_deferred(stream)
        got = self._alloc.take(nbytes)
        if got is None:
            self.fallbacks += 1
            if self.fallbacks == 1:
                log.warning(
                    "receive arena full (%d bytes, %d blocks live): a dispatch needing %d bytes "
                    "takes the staged path; raise UCCL_EP_RECV_ARENA_BYTES to avoid the extra "
                    "copy (logged once)",
                    self.nbytes,
                    self._alloc.live,
                    nbytes,
                )
            return None
        offset, events = got
        for e in events:
            stream.wait_event(e)
        holder = _Holder(self, offset, nbytes, stream)
        dev = torch.device("cuda", self._device)
        try:
            if torch.cuda.current_device() == self._device:
                block = torch.as_tensor(holder, device=dev)
            else:  # torch may place the array on the current device and then copy it
                with torch.cuda.device(self._device):
                    block = torch.as_tensor(holder, device=dev)
            if block.data_ptr() != self.base + offset:
                raise RuntimeError("torch.as_tensor copied the block instead of viewing it")
        except Exception as exc:  # noqa: BLE001 - this rank goes on staged, said loudly
            # The holder (and with it the block) dies with this frame.
            log.error(
                "receive arena off on this rank from now on: torch %s cannot view its memory "
                "(%s); dispatches take the staged path",
                torch.__version__,
                exc,
            )
            self.enabled = False
            return None
        return block

    def outputs(
        self,
        rows: int,
        hidden: int,
        dtype: torch.dtype,
        num_scales: int,
        topk_idx: torch.Tensor | None,
        cached_src: torch.Tensor | None,
        dev: torch.device,
        capturing: bool,
    ) -> RecvOutputs:
        """A dispatch's outputs: views of one block (zero-copy) when they fit, else torch
        allocations (staged). ``cached_src``: a cached dispatch's source indices (the handle's),
        reused instead of allocated. Not while capturing a graph: replays would keep writing a
        block the arena may hand out again."""
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        idx_dtype = torch.int64 if topk_idx is None else topk_idx.dtype
        lay = output_layout(
            rows,
            hidden * dtype.itemsize,
            num_scales,
            num_topk,
            idx_dtype.itemsize,
            cached_src is None,
        )
        block = None
        if rows > 0 and not capturing:
            block = self.take(lay.end, torch.cuda.current_stream(self._device))

        def out(at: int, cols: int, dt: torch.dtype) -> torch.Tensor:
            if block is None:
                return torch.empty(rows, cols, dtype=dt, device=dev)
            return block[at : at + rows * cols * dt.itemsize].view(dt).view(rows, cols)

        recv_x = out(lay.x, hidden, dtype)
        recv_scales = recv_idx = recv_w = None
        if num_scales:
            recv_scales = out(lay.scales, num_scales, torch.float32)
        if topk_idx is not None:
            recv_idx = out(lay.idx, num_topk, idx_dtype)
            recv_w = out(lay.w, num_topk, torch.float32)
        recv_src = out(lay.src, 1, torch.int32).view(rows) if cached_src is None else cached_src
        tensors = (recv_x, recv_scales, recv_idx, recv_w, recv_src)
        entry = [0] + [-1] * 5
        if block is not None:
            mine = tensors if cached_src is None else tensors[:4] + (None,)
            entry = [1] + [-1 if t is None else t.data_ptr() - self.base for t in mine]
        return RecvOutputs(tensors, block is not None, entry)

    def live_blocks(self) -> int:
        """Blocks whose tensors are still alive (frees queued so far folded in)."""
        self._alloc.free_ranges()
        return self._alloc.live

    def fill_free(self, byte: int, stream: torch.cuda.Stream) -> None:
        """Fill every free byte of the arena with ``byte`` on ``stream`` (tests poison outputs
        this way, so an element no kernel wrote shows up). Synchronizes the device first, so
        no earlier user of those bytes is still running."""
        if self._ipc is None or self._closed:
            return
        torch.cuda.synchronize(self._device)
        self._fold_deferred(stream)
        dev = torch.device("cuda", self._device)
        with torch.cuda.stream(stream):
            for offset, size in self._alloc.free_ranges():
                torch.as_tensor(_View(self.base + offset, size), device=dev).fill_(byte)

    def release(self, offset: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        """A block's storage died: queue it behind events on the freeing and allocation
        streams. Runs from a tensor deleter (any thread, any time): never raises."""
        try:
            if self._closed and self._ipc is None:
                return
            if torch.cuda.is_current_stream_capturing():
                # No event can be recorded into a capture; fold it in at the next eager take.
                self._deferred.append((offset, nbytes))
                return
            events = []
            current = torch.cuda.current_stream(self._device)
            for s in {current, stream}:
                e = torch.cuda.Event()
                e.record(s)
                events.append(e)
            self._alloc.free(offset, nbytes, events)
            if self._closed:
                self._free_if_idle()
        except Exception as exc:  # noqa: BLE001 - a deleter must not raise
            log.warning("receive arena: block at %d not returned (%s)", offset, exc)

    def _fold_deferred(self, stream: torch.cuda.Stream) -> None:
        while self._deferred:
            offset, nbytes = self._deferred.pop()
            e = torch.cuda.Event()
            e.record(stream)
            self._alloc.free(offset, nbytes, [e])

    def close(self, collective: bool, timeout_ms: int) -> None:
        """Close the peer mappings (collectively, as the staging buffer), and free this rank's
        arena now or, while dispatch outputs still live in it, when the last of them dies."""
        if self._ipc is None or self._closed:
            self._closed = True
            return
        self._closed = True
        self._ipc.close(collective, timeout_ms, keep_local=True)
        self._free_if_idle()

    def _free_if_idle(self) -> None:
        ipc = self._ipc
        if ipc is None or not ipc.local:
            return
        self._alloc.free_ranges()  # folds pending frees into the live count
        if self._alloc.live == 0:
            torch.cuda.synchronize(self._device)
            ipc.free_local()
            self._ipc = None


__all__ = ["ALIGN", "BlockAllocator", "OutputLayout", "RecvArena", "output_layout"]

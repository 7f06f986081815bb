"""The receive arena of zero-copy dispatch: registered memory that dispatch outputs are carved
from, so peers write each row straight into the tensor the caller gets back.

Each rank owns one region (``UCCL_EP_RECV_ARENA_BYTES``), cudaMalloc'd and IPC-mapped by every
peer once, when the Buffer is created. A dispatch takes one block holding its five outputs
(``recv_x``, scales, top-k ids, weights, source indices). The allocator and the tensors live in
C++ (``_C.RecvArenaCore``, csrc/bindings/recv_arena.cc): each output is a torch tensor made from
a DLPack capsule whose deleter drops a reference of the block, so the block goes back when the
last view of any output dies, in whatever order Megatron frees saved activations, and one call
makes all five (the Python version cost ~15 torch operations per dispatch).

Stream order: the block is taken on the call's stream (the Buffer's communication stream, or
the caller's for a synchronous call: ``api/streams.py``) for use on the caller's stream (the one
current when the Buffer was called). When the block's last tensor dies an event is recorded on
both (and on the communication stream once an asynchronous call ran there, ``note_stream``),
and the next call that reuses any of its bytes makes its stream wait for them: the caching
allocator's guarantee for memory used on its allocation stream and a ``record_stream``'d one
(``Tensor.record_stream`` is a no-op for this memory). Work on a third stream must be ordered
before the tensor dies (as the Buffer's own comm/compute hand-off is). A call whose outputs do
not fit takes the staged path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALIGN = 256  # every block and every output inside it starts 256-byte aligned

# DLPack (code, bits) of each row dtype; FP8 rows come as uint8 and are viewed as FP8.
_DL = {
    torch.bfloat16: (4, 16),
    torch.float16: (2, 16),
    torch.float32: (2, 32),
}
_NO_ENTRY = [0] + [-1] * 5


@dataclass
class RecvOutputs:
    """A dispatch's five outputs (recv_x, scales, ids, weights, source indices; None where
    absent), whether they live in the receive arena, and the receive entry naming them.
    A reserved block's tensors are made after the launches that fill it (``made``): until
    then ``tensors`` is None and ``reservation`` (a ``_C.RecvReservation``) holds the block."""

    tensors: tuple[Any, ...] | None
    zero_copy: bool
    entry: list[int]  # {mode, arena offsets}: see kRecvEntryOffset
    reservation: Any = None
    dtype: torch.dtype | None = None  # recv_x's (FP8 rows come as uint8 and are viewed)

    def made(self, rows: int = -1) -> tuple[Any, ...]:
        """The five outputs, made from the reservation on first use (of its first ``rows``
        rows; -1: all)."""
        if self.tensors is None:
            self.adopt(self.reservation.tensors(rows))
        return self.tensors

    def adopt(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        """The five outputs from ``tensors``, the reservation's as a binding made them (FP8
        rows viewed as ``dtype``); they hold the block from now on."""
        x, scales, idx, w, src = tensors
        if x.dtype != self.dtype:
            x = x.view(self.dtype)
        self.tensors = (x, scales, idx, w, src)
        self.reservation = None
        return self.tensors


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


class RecvArena:
    """This rank's receive arena and its mappings of the peers' (see the module docstring).

    Collective: every rank of ``group`` creates it at the same point. Zero-copy needs an arena
    on every rank, so when any rank asks for 0 bytes none is allocated (``enabled`` False).
    ``peers``: the group ranks whose arenas this rank maps, in kernel order (default: all
    ``num_ranks``; the internode backend maps its node's).
    """

    def __init__(
        self,
        c: Any,
        group: dist.ProcessGroup,
        rank: int,
        device: int,
        nbytes: int,
        num_ranks: int,
        peers: list[int] | None = None,
    ) -> None:
        from uccl_ep_megatron.backends.ipc_buffer import IpcBuffers

        self._device = device
        self.nbytes = (max(0, int(nbytes)) + ALIGN - 1) // ALIGN * ALIGN
        sizes: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, self.nbytes, group=group)
        self.enabled = min(sizes) > 0
        self._ipc: IpcBuffers | None = None
        self._core: Any = None
        self.fallbacks = 0  # dispatches that did not fit and took the staged path
        self._closed = False
        if not self.enabled:
            return
        mapped = list(range(num_ranks)) if peers is None else list(peers)
        self._ipc = IpcBuffers(c, group, rank, device, self.nbytes, mapped, keep_bytes=0)
        self.base = self._ipc.local
        self._core = c.RecvArenaCore(self.base, self.nbytes, device, True)

    @property
    def core(self) -> Any:
        """The C++ allocator (``_C.RecvArenaCore``) while blocks can be taken, else None."""
        return self._core if self.enabled and not self._closed else None

    @property
    def ptrs(self) -> list[int]:
        """Every mapped rank's arena as mapped here (own included), or [] when disabled."""
        return self._ipc.ptrs if self._ipc is not None else []

    @property
    def sizes(self) -> list[int]:
        """Bytes of every rank's arena, or [] when disabled."""
        return list(self._ipc.sizes) if self._ipc is not None else []

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
        stream: int,
        use_stream: int,
        later: bool = False,
    ) -> RecvOutputs:
        """A dispatch's outputs: views of one block (zero-copy) when they fit, else torch
        allocations (staged). ``cached_src``: a cached dispatch's source indices (the handle's),
        reused instead of allocated. ``stream``: the call's (it waits for the block's earlier
        users); ``use_stream``: the caller's. Not while capturing a graph: replays would keep
        writing a block the arena may hand out again. ``later``: a zero-copy block's tensors
        are made by ``RecvOutputs.made`` (after the launches), not now."""
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        got = None
        if rows > 0 and not capturing and self.enabled and not self._closed:
            code, bits = _DL.get(dtype, (1, 8))
            idx_bits = 32 if topk_idx is not None and topk_idx.dtype == torch.int32 else 64
            try:
                take = self._core.reserve if later and cached_src is None else self._core.outputs
                got = take(
                    rows,
                    hidden,
                    code,
                    bits,
                    num_scales,
                    num_topk,
                    idx_bits,
                    cached_src is None,
                    stream,
                    use_stream,
                )
            except Exception as exc:  # noqa: BLE001 - this rank goes on staged, said loudly
                log.error(
                    "receive arena off on this rank from now on: torch %s cannot view its memory "
                    "(%s); dispatches take the staged path",
                    torch.__version__,
                    exc,
                )
                self.enabled = False
            if got is None and self.enabled:
                self._full(rows)
        if got is not None and not isinstance(got, tuple):  # a reservation
            return RecvOutputs(None, True, got.entry, got, dtype)
        if got is not None:
            x, scales, idx, w, src, entry = got
            if x.dtype != dtype:  # FP8 rows
                x = x.view(dtype)
            if cached_src is not None:
                src = cached_src
            return RecvOutputs((x, scales, idx, w, src), True, entry)
        idx_dtype = torch.int64 if topk_idx is None else topk_idx.dtype

        def out(cols: int, dt: torch.dtype) -> torch.Tensor:
            return torch.empty(rows, cols, dtype=dt, device=dev)

        recv_x = out(hidden, dtype)
        recv_scales = out(num_scales, torch.float32) if num_scales else None
        recv_idx = recv_w = None
        if topk_idx is not None:
            recv_idx = out(num_topk, idx_dtype)
            recv_w = out(num_topk, torch.float32)
        recv_src = (
            torch.empty(rows, dtype=torch.int32, device=dev) if cached_src is None else cached_src
        )
        return RecvOutputs((recv_x, recv_scales, recv_idx, recv_w, recv_src), False, _NO_ENTRY)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` starts inside this rank's arena (where peers can read it in place)."""
        return self.enabled and self.base <= t.data_ptr() < self.base + self.nbytes

    def combine_input(
        self, rows: int, hidden: int, dtype: torch.dtype, stream: int, use_stream: int
    ) -> torch.Tensor | None:
        """A ``[rows, hidden]`` block for a combine's x (``Buffer.get_combine_input``): taken
        on ``stream`` (its writer), also used on ``use_stream`` (combine's); ``None`` when the
        arena is off, the dtype is not a combine dtype or the block does not fit."""
        if rows <= 0 or hidden <= 0 or not self.enabled or self._closed or dtype not in _DL:
            return None
        code, bits = _DL[dtype]
        got = self._core.outputs(rows, hidden, code, bits, 0, 0, 64, False, stream, use_stream)
        return None if got is None else got[0]

    def note_stream(self, stream: int) -> None:
        """Record the death of every block on ``stream`` too, from now on (besides the
        streams it was taken and used on): a block taken on the caller's stream may be read
        by a later call on the communication stream."""
        if self._core is not None:
            self._core.note_stream(stream)

    def _full(self, rows: int) -> None:
        self.fallbacks += 1
        if self.fallbacks == 1:
            log.warning(
                "receive arena full (%d bytes, %d blocks live): a dispatch of %d rows takes the "
                "staged path; raise UCCL_EP_RECV_ARENA_BYTES to avoid the extra copy (logged "
                "once)",
                self.nbytes,
                self._core.live,
                rows,
            )

    def live_blocks(self) -> int:
        """Blocks whose tensors are still alive."""
        return 0 if self._core is None else self._core.live

    def fill_free(self, byte: int, stream: torch.cuda.Stream) -> None:
        """Fill every free byte of the arena with ``byte`` on ``stream`` (tests poison outputs
        this way, so an element no kernel wrote shows up). Synchronizes the device before, so
        no earlier user of those bytes is still running, and after: the next call may run on
        another stream (the direct lane's, the caller's) and its peers write into blocks taken
        from these bytes, neither ordered after ``stream``."""
        if self._ipc is None or self._closed:
            return
        torch.cuda.synchronize(self._device)
        dev = torch.device("cuda", self._device)
        with torch.cuda.stream(stream):
            for offset, size in self._core.free_ranges():
                torch.as_tensor(_View(self.base + offset, size), device=dev).fill_(byte)
        torch.cuda.synchronize(self._device)

    def close(self, collective: bool, timeout_ms: int) -> None:
        """Close the peer mappings (collectively, as the staging buffer), and free this rank's
        arena now or, while dispatch outputs still live in it, when the last of them dies."""
        if self._ipc is None or self._closed:
            self._closed = True
            return
        self._closed = True
        ipc = self._ipc
        ipc.close(collective, timeout_ms, keep_local=True)
        if not ipc.local:  # kept allocated (no collective teardown): no take after this
            self._core.close(False)
        elif self._core.close(True):
            ipc.free_local()
        else:
            ipc.local = 0  # the core frees it when the last output dies
        self._ipc = None


__all__ = ["ALIGN", "RecvArena", "RecvOutputs"]

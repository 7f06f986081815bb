"""NVLink buffers shared over CUDA/HIP IPC by the ranks of a node, and their collective regrow.

The ``kernels`` and ``kernels_internode`` backends stage a whole call's rows in the receiving
rank's buffer, so the bytes a call needs grow with its token count, which a ``Buffer`` created
from DeepEP's size hints (``Config.get_nvl_buffer_size_hint``) does not know. Rather than fail,
a call that does not fit grows the buffers of every rank at once. The decision is collective
without any extra communication: it depends only on the all-gathered count matrix, which every
rank of the group holds identically, so every rank decides the same at the same call.

A regrow first synchronizes every rank's device (a barrier after each rank's sync), so no kernel
touches any buffer while it runs, then carries the control region (barrier flags and counts,
which hold monotonically increasing sequence numbers) over to the new buffer.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.core.errors import BufferTooSmallError

log = logging.getLogger(__name__)

_ALIGN = 2 << 20  # round regrown sizes to 2 MiB


def grown_size(need: int, current: int) -> int:
    """Bytes to allocate when ``need`` exceeds ``current``: 1/8 headroom, at least 1.5x."""
    size = max(need + need // 8, current + current // 2)
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


class IpcBuffers:
    """One rank's registered buffer plus its IPC mappings of the buffers of ``peers``.

    Args:
        c: the ``_C`` module.
        group: the process group (every rank takes part in creation and regrow).
        rank: this rank's index in ``group``.
        device: the CUDA device index.
        nbytes: bytes of this rank's buffer.
        peers: group ranks whose buffers this rank maps (itself included), in kernel order.
        keep_bytes: leading bytes (the control region) carried over by a regrow.
        extra: any picklable value all-gathered along with the handles at creation.
        allow_grow: ``grow`` reallocates (``BufferOptions.grow_nvl_buffer``); when False it
            raises ``BufferTooSmallError`` instead.
    """

    def __init__(
        self,
        c: Any,
        group: dist.ProcessGroup,
        rank: int,
        device: int,
        nbytes: int,
        peers: list[int],
        keep_bytes: int,
        extra: Any = None,
        allow_grow: bool = True,
    ) -> None:
        self._c, self._group, self._rank, self._device = c, group, rank, device
        self.allow_grow = allow_grow
        self._peers, self._keep = list(peers), int(keep_bytes)
        self.grows = 0
        with torch.cuda.device(device):
            self.local = c.device_alloc_zeroed(int(nbytes))
            handle = c.ipc_get_handle(self.local)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (handle, int(nbytes), extra), group=group)
        self.extras = [g[2] for g in gathered]
        self.sizes = [int(g[1]) for g in gathered]
        self.ptrs = self._open([g[0] for g in gathered])

    def _open(self, handles: list[bytes]) -> list[int]:
        with torch.cuda.device(self._device):
            return [
                self.local if r == self._rank else self._c.ipc_open_handle(handles[r])
                for r in self._peers
            ]

    def _close_peers(self) -> None:
        with torch.cuda.device(self._device):
            for r, ptr in zip(self._peers, self.ptrs, strict=True):
                if r != self._rank:
                    self._c.ipc_close_handle(ptr)

    def grow(self, needs: list[int], what: str) -> bool:
        """Grow every buffer whose rank needs more bytes; collective over the group.

        Every rank must call this at the same call with the same ``needs`` (bytes needed by
        each group rank) before launching that call's kernels. Returns whether
        anything grew. Raises ``BufferTooSmallError`` on every rank when a rank cannot
        allocate (the buffers stay as they were).
        """
        if all(n <= s for n, s in zip(needs, self.sizes, strict=True)):
            return False
        if not self.allow_grow:
            worst = max(range(len(needs)), key=lambda r: needs[r] - self.sizes[r])
            raise BufferTooSmallError(
                f"{what}: rank {worst} needs num_nvl_bytes >= {needs[worst]}, but its Buffer has "
                f"{self.sizes[worst]} and growing is off (BufferOptions.grow_nvl_buffer=False "
                "or UCCL_EP_GROW_NVL_BUFFER=0); create every Buffer with more num_nvl_bytes "
                "(the kernels stage a whole call's rows) or turn growing on"
            )
        old_size = self.sizes[self._rank]
        new_size = old_size
        if needs[self._rank] > old_size:
            new_size = grown_size(needs[self._rank], old_size)
        c = self._c
        new_ptr, error = 0, ""
        # Quiesce: once every rank synchronized its device, no kernel writes any buffer, so the
        # control region copied below is final.
        torch.cuda.synchronize(self._device)
        dist.all_gather_object([None] * len(self.sizes), None, group=self._group)
        with torch.cuda.device(self._device):
            handle = c.ipc_get_handle(self.local)
            if new_size != old_size:
                try:
                    new_ptr = c.device_alloc_zeroed(new_size)
                    c.device_copy(new_ptr, self.local, self._keep)
                    handle = c.ipc_get_handle(new_ptr)
                except Exception as exc:  # noqa: BLE001 - reported on every rank below
                    if new_ptr:
                        c.device_free(new_ptr)
                    new_ptr, error = 0, f"{type(exc).__name__}: {exc}"
        gathered: list[Any] = [None] * len(self.sizes)
        dist.all_gather_object(gathered, (handle, new_size, error), group=self._group)
        failed = [(r, g[1], g[2]) for r, g in enumerate(gathered) if g[2]]
        if failed:
            if new_ptr:
                with torch.cuda.device(self._device):
                    c.device_free(new_ptr)
            r, size, err = failed[0]
            raise BufferTooSmallError(
                f"{what}: rank {r} could not grow its NVLink buffer to {size} bytes ({err}); "
                f"create every Buffer with num_nvl_bytes >= {needs[r]} up front or send fewer "
                "tokens per call"
            )
        # A buffer is freed only once every rank has closed its mapping of it (the barrier).
        self._close_peers()
        dist.all_gather_object([None] * len(self.sizes), None, group=self._group)
        if new_ptr:
            with torch.cuda.device(self._device):
                c.device_free(self.local)
            self.local = new_ptr
        self.sizes = [int(g[1]) for g in gathered]
        self.ptrs = self._open([g[0] for g in gathered])
        self.grows += 1
        if new_ptr:
            log.warning(
                "rank %d: %s grew the NVLink buffer from %d to %d bytes (pass num_nvl_bytes >= "
                "%d to allocate it up front)",
                self._rank,
                what,
                old_size,
                new_size,
                needs[self._rank],
            )
        return True

    def close(
        self, collective: bool = True, timeout_ms: int | None = None, keep_local: bool = False
    ) -> None:
        """Close the peer mappings, then free this rank's buffer once no peer maps it.

        ``collective`` (``Buffer.destroy()``; every rank of the group must call it, as with
        DeepEP): sync the device, close the mappings, wait for every rank to have closed
        theirs (a barrier bounded by ``timeout_ms``), then free. Otherwise (``Buffer.__del__``,
        interpreter exit, or no usable process group), where a collective could hang or fail,
        only the mappings are closed and the own buffer is left allocated (the driver reclaims
        it at process exit): freeing it while a peer still maps it is undefined in CUDA. When
        the barrier times out the buffer is likewise kept and ``CommTimeoutError`` raised.
        ``keep_local``: after a collective close, leave the own buffer allocated for the
        caller to free with ``free_local()`` (memory that tensors may still use).
        """
        if not self.ptrs:
            return
        alone = all(r == self._rank for r in self._peers)
        usable = collective and not sys.is_finalizing() and dist.is_initialized()
        with torch.cuda.device(self._device):
            torch.cuda.synchronize(self._device)  # no kernel of ours still uses a mapping
            self._close_peers()
        self.ptrs = []
        if not alone and not usable:
            self._leak("no collective teardown (Buffer.__del__ or interpreter exit)")
            return
        if not alone:
            from uccl_ep_megatron.backends.agreement import timeout_error, wait_work
            from uccl_ep_megatron.core.config import effective_env

            if timeout_ms is None:
                timeout_ms = int(effective_env()["UCCL_EP_TIMEOUT_MS"])
            rank = dist.get_rank(self._group)

            def expired() -> Exception:
                self._leak("the teardown barrier timed out")
                return timeout_error(rank, "the teardown barrier", "destroy()", timeout_ms)

            with torch.cuda.device(self._device):
                work = dist.barrier(group=self._group, async_op=True)
            wait_work(work, timeout_ms, expired)
        if not keep_local:
            self.free_local()

    def free_local(self) -> None:
        """Free this rank's buffer (after ``close``: no peer maps it any more)."""
        if not self.local:
            return
        with torch.cuda.device(self._device):
            self._c.device_free(self.local)
        self.local = 0

    def _leak(self, why: str) -> None:
        global leaked_bytes
        leaked_bytes += self.sizes[self._rank]
        log.warning(
            "rank %d: %s: keeping this rank's %d-byte NVLink buffer allocated (peers may still "
            "map it) until the process exits; call Buffer.destroy() on every rank to free it",
            self._rank,
            why,
            self.sizes[self._rank],
        )
        self.local = 0


# Bytes of own buffers kept allocated by non-collective teardowns in this process.
leaked_bytes = 0


__all__ = ["IpcBuffers", "grown_size"]

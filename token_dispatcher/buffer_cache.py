"""One ``Buffer`` per communication group, shared by every MoE layer that uses the group.

A ``Buffer`` holds the registered NVLink/RDMA memory, which is large, so the layers of a model
share it (as Megatron's DeepEP path does). The cache grows a group's buffer when a layer needs
more bytes (a larger hidden size); autograd contexts keep a reference to the ``Buffer`` they
dispatched with, so a replaced buffer stays alive until its backward has run.

There is no module-level cache: the plugin's ``install()`` makes one that every layer it builds
is given (``UcclEpTokenDispatcher(..., buffers=cache)``); a dispatcher built without one owns a
private cache.
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.distributed as dist

from uccl_ep_megatron.api.buffer import Buffer
from uccl_ep_megatron.core.config import Config, default_combine_config, default_dispatch_config
from uccl_ep_megatron.core.options import BufferOptions


def configs(num_ranks: int, num_sms: int) -> tuple[Config, Config]:
    """(dispatch, combine) ``Config`` of a group of ``num_ranks`` with an SM budget."""
    return default_dispatch_config(num_ranks, num_sms), default_combine_config(num_ranks, num_sms)


@functools.lru_cache(maxsize=64)
def required_bytes(num_ranks: int, hidden_bytes: int, num_sms: int) -> tuple[int, int]:
    """(NVL bytes, RDMA bytes) that dispatch and combine of ``hidden_bytes`` rows need (cached:
    every MoE layer asks on every forward)."""
    nvl = rdma = 0
    for config in configs(num_ranks, num_sms):
        nvl = max(nvl, config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        rdma = max(rdma, config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
    return nvl, rdma


def hidden_bytes_of(x: torch.Tensor) -> int:
    """DeepEP's row size convention: ``hidden * max(element_size, 2)``."""
    return x.shape[-1] * max(x.element_size(), 2)


class BufferCache:
    """Maps a process group to the ``Buffer`` its layers share."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str | None, BufferOptions | None], Buffer] = {}
        self._lock = threading.Lock()

    def get(
        self,
        group: dist.ProcessGroup,
        hidden_bytes: int,
        backend: str | None,
        num_sms: int,
        options: BufferOptions | None = None,
    ) -> Buffer:
        """A ``Buffer`` over ``group`` large enough for rows of ``hidden_bytes``, made with
        ``options`` (the plugin's proxy knobs) when it has to be made.

        Creating a ``Buffer`` is collective: every rank of ``group`` must ask for the same
        ``hidden_bytes`` at the same point, which holds for the layers of one model.
        """
        num_ranks = dist.get_world_size(group)
        nvl, rdma = required_bytes(num_ranks, hidden_bytes, num_sms)
        key = (id(group), backend, options)
        with self._lock:
            buf = self._buffers.get(key)
            if (
                buf is None
                or buf.group is not group
                or buf.num_nvl_bytes < nvl
                or buf.num_rdma_bytes < rdma
            ):
                buf = Buffer(group, nvl, rdma, backend=backend, options=options)
                self._buffers[key] = buf
            return buf

    def clear(self) -> None:
        """Forget every buffer (each is released when its last user lets go of it)."""
        with self._lock:
            self._buffers.clear()

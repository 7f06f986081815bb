"""Backends that move the bytes behind ``Buffer``.

- ``reference``: pure torch.distributed, any device, any rank count (the oracle).
- ``kernels``: our CUDA/HIP kernels (``_C``), selected when built with a GPU toolchain and the
  group's tensors live on GPUs: the intranode kernels when the group is one node, the
  internode (FIFO -> proxy -> transport) kernels when it spans several (virtual) nodes.
"""

from __future__ import annotations

import importlib
import logging

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.base import Backend, Topology
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.core.options import BufferOptions

log = logging.getLogger(__name__)

BACKENDS = {
    "reference": "uccl_ep_megatron.backends.reference:ReferenceBackend",
    "kernels": "uccl_ep_megatron.backends.intranode:KernelsBackend",
    "kernels_internode": "uccl_ep_megatron.backends.internode:InternodeBackend",
}


def _kernels_impl(topology: Topology) -> str:
    return "kernels" if topology.num_nodes == 1 else "kernels_internode"


def _load(name: str) -> type[Backend]:
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def kernels_unsupported_reason(topology: Topology, device: torch.device) -> str | None:
    """Why the ``kernels`` backend cannot serve this group, or ``None`` when it can."""
    from uccl_ep_megatron.core._c import load

    if load().build_info["gpu"] == "none":
        return "the _C extension was built without a GPU toolchain (no nvcc/hipcc at build time)"
    if device.type != "cuda":
        return f"the group's tensors live on {device.type}, the kernels need GPUs"
    try:
        backend_cls = _load(_kernels_impl(topology))
    except ImportError as exc:
        return f"the kernels backend could not be imported ({exc})"
    return backend_cls.unsupported_reason(topology, device)


def create_backend(
    name: str,
    group: dist.ProcessGroup,
    topology: Topology,
    device: torch.device,
    num_nvl_bytes: int,
    num_rdma_bytes: int,
    options: BufferOptions,
) -> Backend:
    """Instantiate backend ``name`` (``auto``, ``kernels`` or ``reference``) with resolved
    ``options`` (``BufferOptions.resolved()``)."""
    if name not in ("auto", "kernels", "reference"):
        raise InvalidInputError(
            f"backend={name!r} is unknown; use 'auto', 'kernels' or 'reference' "
            "(argument `backend=`, BufferOptions.backend or env UCCL_EP_BACKEND)"
        )
    if name in ("auto", "kernels"):
        reason = kernels_unsupported_reason(topology, device)
        if reason is None:
            name = _kernels_impl(topology)
        elif name == "kernels":
            raise UnsupportedError(f"backend='kernels' is unavailable: {reason}")
        else:
            if device.type == "cuda":
                log.warning("uccl_ep: using the reference backend because %s", reason)
            name = "reference"
    return _load(name)(group, topology, device, num_nvl_bytes, num_rdma_bytes, options)


__all__ = ["BACKENDS", "Backend", "Topology", "create_backend", "kernels_unsupported_reason"]

"""Exceptions raised by uccl_ep_megatron.

The C++ core raises its own hierarchy (``csrc/common/errors.h``); the bindings translate each
class into the matching class here, so callers catch one hierarchy whichever side failed.
"""

from __future__ import annotations


class UcclEpError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class InvalidInputError(UcclEpError, ValueError):
    """An argument has the wrong dtype, shape, device, range or provenance."""


class BufferTooSmallError(InvalidInputError):
    """The ``Buffer`` was created with fewer NVL/RDMA bytes than a call needs."""


class UnsupportedError(UcclEpError):
    """The configuration is valid but not supported by this backend, build or machine."""


class CommTimeoutError(UcclEpError, TimeoutError):
    """A bounded wait ran out; the message names the stalled rank and channel."""


class TransportError(UcclEpError):
    """A transport (verbs RC, EFA SRD, ipc) or system call failed."""


class GpuError(UcclEpError):
    """A CUDA/HIP runtime call failed."""


__all__ = [
    "BufferTooSmallError",
    "CommTimeoutError",
    "GpuError",
    "InvalidInputError",
    "TransportError",
    "UcclEpError",
    "UnsupportedError",
]

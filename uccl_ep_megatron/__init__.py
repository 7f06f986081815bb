"""uccl_ep_megatron: portable GPU-initiated expert-parallel dispatch/combine for Megatron-Core.

``from uccl_ep_megatron import Buffer`` is DeepEP's normal-mode ``Buffer`` API.
"""

from uccl_ep_megatron.api.buffer import Buffer
from uccl_ep_megatron.backends.base import DispatchHandle
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    GpuError,
    InvalidInputError,
    TransportError,
    UcclEpError,
    UnsupportedError,
)
from uccl_ep_megatron.core.events import EventOverlap
from uccl_ep_megatron.core.options import BufferOptions

__version__ = "0.1.0"

__all__ = [
    "Buffer",
    "BufferOptions",
    "BufferTooSmallError",
    "CommTimeoutError",
    "Config",
    "DispatchHandle",
    "EventOverlap",
    "GpuError",
    "InvalidInputError",
    "TransportError",
    "UcclEpError",
    "UnsupportedError",
    "__version__",
]

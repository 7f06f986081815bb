"""uccl_ep_megatron: portable GPU-initiated expert-parallel dispatch/combine for Megatron-Core."""

from uccl_ep_megatron.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    GpuError,
    InvalidInputError,
    TransportError,
    UcclEpError,
    UnsupportedError,
)

__version__ = "0.1.0"

__all__ = [
    "BufferTooSmallError",
    "CommTimeoutError",
    "GpuError",
    "InvalidInputError",
    "TransportError",
    "UcclEpError",
    "UnsupportedError",
    "__version__",
]

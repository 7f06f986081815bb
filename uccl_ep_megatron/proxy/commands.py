"""Transfer-command constructors: validated ``(lo, hi)`` tuples a CPU producer pushes.

The 16-byte ``TransferCmd`` is packed in C++ (``csrc/fifo/cmd_builder``); these wrap it so tests
and benchmarks can drive a proxy from the host.
"""

from __future__ import annotations

from uccl_ep_megatron.core import _c


def cmd_write(dst_rank: int, src_offset: int, dst_offset: int, length: int) -> tuple[int, int]:
    """A Write of ``length`` bytes between the symmetric regions."""
    return tuple(_c.load().cmd_write(dst_rank, src_offset, dst_offset, length))


def cmd_write_atomic(
    dst_rank: int, src_offset: int, dst_offset: int, length: int, index: int, value: int
) -> tuple[int, int]:
    """A Write that adds ``value`` to counter ``index`` of ``dst_rank`` once its bytes landed."""
    return tuple(_c.load().cmd_write_atomic(dst_rank, src_offset, dst_offset, length, index, value))


def cmd_atomic(dst_rank: int, index: int, value: int) -> tuple[int, int]:
    """A software atomic ordered after the channel's earlier writes to ``dst_rank``."""
    return tuple(_c.load().cmd_atomic(dst_rank, index, value))


def cmd_drain(upto: int | None = None) -> tuple[int, int]:
    """Completes once the channel's messages up to FIFO index ``upto`` (default: all) completed."""
    return tuple(_c.load().cmd_drain_all() if upto is None else _c.load().cmd_drain(upto))


def cmd_barrier(same_rail: bool = False) -> tuple[int, int]:
    """Completes once every peer (or same-rail peer) pushed a Barrier on the same channel."""
    return tuple(_c.load().cmd_barrier(same_rail))


__all__ = ["cmd_atomic", "cmd_barrier", "cmd_drain", "cmd_write", "cmd_write_atomic"]

"""Sizes of one call: whether its rings fit the RDMA region (host arithmetic,
``_C.internode``), the NVLink staging it needs, and its freshly allocated outputs."""

from __future__ import annotations

from typing import Any

import torch

from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import BufferTooSmallError, InvalidInputError


def check_rings(
    c: Any, region_bytes: int, num_nodes: int, combine: bool, config: Config, slot_bytes: int
) -> None:
    """Raise when the send + receive rings of a dispatch (or combine) with ``slot_bytes``
    slots do not fit half the RDMA region, or one chunk exceeds an RDMA write."""
    lay = c.internode.ring_layout(
        combine,
        region_bytes,
        config.num_channels,
        num_nodes,
        config.num_max_rdma_chunked_recv_tokens,
        slot_bytes,
    )
    if lay["bytes"] > lay["half_bytes"]:
        op = "combine" if combine else "dispatch"
        raise BufferTooSmallError(
            f"{op}: {config.num_channels} channels x {num_nodes} nodes x "
            f"{config.num_max_rdma_chunked_recv_tokens} ring slots of {slot_bytes} bytes "
            f"(send + receive) need {lay['bytes']} bytes, but half the RDMA buffer is "
            f"{lay['half_bytes']} (num_rdma_bytes={region_bytes}); create the Buffer "
            f"with num_rdma_bytes >= {2 * lay['bytes'] + 32} or lower "
            "num_max_rdma_chunked_recv_tokens / num_sms"
        )
    max_len = c.cmd_limits["max_length"]
    if config.num_max_rdma_chunked_send_tokens * slot_bytes > max_len:
        raise InvalidInputError(
            f"Config.num_max_rdma_chunked_send_tokens={config.num_max_rdma_chunked_send_tokens}"
            f" x {slot_bytes}-byte slots exceeds one RDMA write ({max_len} bytes); lower it"
        )


def fit_staging(
    ipc: Any, stage_offset: int, rows_of_rank: tuple[int, ...], slot_bytes: int, op: str
) -> None:
    """Grow the NVLink buffers (collectively) when a rank stages more rows than they hold.

    ``rows_of_rank`` is identical on every rank: from the all-gathered counts, or
    ``num_worst_tokens`` everywhere in a sync-free call.
    """
    needs = [stage_offset + rows * slot_bytes for rows in rows_of_rank]
    if torch.cuda.is_current_stream_capturing() and any(
        n > s for n, s in zip(needs, ipc.sizes, strict=True)
    ):
        raise BufferTooSmallError(
            f"{op}: the NVLink staging must grow to {max(needs)} bytes during CUDA graph "
            "capture; run one eager call of the same size before capturing"
        )
    ipc.grow(needs, f"{op} staging {max(rows_of_rank)} rows of {slot_bytes} bytes")


def dispatch_outputs(
    rows: int,
    x: torch.Tensor,
    num_scales: int,
    idx_dtype: torch.dtype | None,
    num_topk: int,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``recv_x``, scales, top-k ids and weights of a dispatch (``None`` where not used).

    Uninitialized: with num_worst_tokens the rows past the received ones are padding, whose
    ids (-1) and weights (0) the tables' launch fills (``DispatchTablesTensors``); their
    ``recv_x`` rows and scales are unspecified (as in DeepEP; filling them cost a 235 MB memset
    per DeepSeek-V3 dispatch at EP4).
    """
    dev = x.device
    recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=dev)
    scales = torch.empty(rows, num_scales, dtype=torch.float32, device=dev) if num_scales else None
    ids = weights = None
    if idx_dtype is not None:
        ids = torch.empty(rows, num_topk, dtype=idx_dtype, device=dev)
        weights = torch.empty(rows, num_topk, dtype=torch.float32, device=dev)
    return recv_x, scales, ids, weights


__all__ = ["check_rings", "dispatch_outputs", "fit_staging"]

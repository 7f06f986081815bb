"""What the internode backend hands to ``_C.internode.dispatch_call`` / ``combine_call``: the ring
shape and the tensors of a launch as named tuples, read by name on the C++ side (never a long
positional list whose ints could trade places)."""

from __future__ import annotations

from typing import NamedTuple

import torch

Tensor = torch.Tensor | None


class RingShape(NamedTuple):
    """The rings of one call: channels (``Config.num_sms / 2``), slots per (channel, node) ring
    and tokens per RDMA write."""

    channels: int
    slots: int
    chunk: int


class InternodeDispatchTensors(NamedTuple):
    """Inputs, index tables and outputs of one internode dispatch (``None``: not used)."""

    x: torch.Tensor
    x_scales: Tensor
    topk_idx: Tensor
    topk_weights: Tensor
    dst_row: torch.Tensor
    lists: torch.Tensor
    list_count: torch.Tensor
    plan: torch.Tensor
    recv_rows: torch.Tensor
    recv_prefix: torch.Tensor
    recv_x: torch.Tensor
    recv_x_scales: Tensor
    recv_topk_idx: Tensor
    recv_topk_weights: Tensor
    recv_src_idx: Tensor  # None for a cached dispatch: the handle has the sources


class InternodeCombineTensors(NamedTuple):
    """Inputs, index tables and outputs of one internode combine."""

    x: torch.Tensor
    topk_weights: Tensor
    bias0: Tensor
    bias1: Tensor
    out: torch.Tensor
    out_weights: Tensor
    recv_count: torch.Tensor
    plan: torch.Tensor
    lists: torch.Tensor
    list_count: torch.Tensor
    src_tokens: torch.Tensor
    dst_row: torch.Tensor
    stream_cum: torch.Tensor


__all__ = ["InternodeCombineTensors", "InternodeDispatchTensors", "RingShape"]

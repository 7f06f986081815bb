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


class DispatchTablesTensors(NamedTuple):
    """What ``_C.internode.dispatch_tables`` reads (``rows``, ``in_rank``) and fills (the rest,
    int32 on the GPU; ``tables.py`` has their meaning). A cached dispatch passes only
    ``in_rank``, ``lists`` and ``list_count``. A sync-free dispatch passes its padded outputs
    too, which the same launch fills whole (the data kernel then writes the received rows)."""

    rows: Tensor  # int64 [R, width]: the gathered call headers
    in_rank: torch.Tensor  # bool [T, R]
    dst_row: Tensor  # [T, R]
    lists: torch.Tensor  # [N, T]
    list_count: torch.Tensor  # [C, N]
    rank_prefix: Tensor  # [R, R]
    recv_rows: Tensor  # [L]
    recv_prefix: Tensor  # [R + 1]
    recv_count: Tensor  # [1]
    src_tokens: Tensor  # [N]
    plan: Tensor  # [N, plan_tokens, L], set to -1
    pad_ids: Tensor = None  # int64 / int32 [W, K] recv_topk_idx, set to -1
    pad_weights: Tensor = None  # float32 [W, K] recv_topk_weights, set to 0
    pad_src: Tensor = None  # int32 [W] recv_src_idx, set to -1


class CombineTablesTensors(NamedTuple):
    """What ``_C.internode.combine_tables`` reads (``in_rank``, ``plan``, ``src_tokens``) and
    fills (``cum``, ``lists``, ``list_count``)."""

    in_rank: torch.Tensor  # bool [T, R]
    plan: torch.Tensor  # [N, plan_tokens, L]
    src_tokens: torch.Tensor  # [N]
    cum: torch.Tensor  # [T, N]
    lists: torch.Tensor  # [N, plan_tokens]
    list_count: torch.Tensor  # [C, N]


class RoutingCheckTensors(NamedTuple):
    """What ``_C.internode.routing_check`` reads (the caller's routing and layout) and writes
    (``out``: min id, max id, layout bits; ``scratch``: its counters)."""

    topk_idx: torch.Tensor  # int64 / int32 [T, K]
    per_rank: torch.Tensor  # int32 [R]
    per_rdma: Tensor  # int32 [N]
    per_expert: torch.Tensor  # int32 [E]
    in_rank: torch.Tensor  # bool [T, R]
    scratch: torch.Tensor  # int64, zeros but word 0 = -1 (each launch leaves it so)
    out: torch.Tensor  # int64 [3]


__all__ = [
    "RoutingCheckTensors",
    "CombineTablesTensors",
    "DispatchTablesTensors",
    "InternodeCombineTensors",
    "InternodeDispatchTensors",
    "RingShape",
]

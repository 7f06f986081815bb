"""Index tables of the internode kernels in torch form (no host sync).

The backend builds them with one kernel launch per call (``_C.internode.dispatch_tables`` /
``combine_tables``, csrc/kernels/internode/tables.cu): a call's host path then costs one launch
instead of a hundred small torch ops. These functions define what the tables mean, and the
GPU tests hold the kernels' tables to them.

Everything here derives from device tensors: the caller's ``is_token_in_rank`` and the
all-gathered call-header rows (``agreement.py``), which carry every rank's counts. Token counts
that size a table may be device tensors too, so a sync-free call never reads one back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uccl_ep_megatron.backends.agreement import Agreement, row_counts, row_num_tokens
from uccl_ep_megatron.backends.base import Topology


def streams(
    mask: torch.Tensor, num_tokens: torch.Tensor | int, num_channels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel token streams of B sources at once.

    Source b has ``num_tokens[b]`` tokens (an int, or a ``[B]`` device tensor) split into
    ``num_channels`` contiguous ranges as ``_C.internode.channel_range`` splits them; stream
    (c, b) is the tokens t of range c with ``mask[b, t]``, ascending. Columns of ``mask`` at or
    past ``num_tokens[b]`` are ignored.

    Returns:
        lists: ``[B, P]`` int32; stream (c, b) is ``lists[b, begin(c) : begin(c) + count[c, b]]``.
        count: ``[C, B]`` int32 tokens per stream.
        cum: ``[B, P]`` int32, inclusive count of masked tokens of t's range up to t.
    """
    num_src, width = mask.shape
    dev = mask.device
    if isinstance(num_tokens, torch.Tensor):
        tokens = num_tokens.to(device=dev, dtype=torch.int64).expand(num_src)
    else:
        # A fill on the device: torch.as_tensor(int, device=cuda) is a pageable host-to-device
        # copy, which synchronizes the stream (2 per sync-free call, seen on the device).
        tokens = torch.full((num_src,), int(num_tokens), dtype=torch.int64, device=dev)
    if width == 0:
        return (
            torch.zeros(num_src, 0, dtype=torch.int32, device=dev),
            torch.zeros(num_channels, num_src, dtype=torch.int32, device=dev),
            torch.zeros(num_src, 0, dtype=torch.int32, device=dev),
        )
    per = torch.clamp((tokens + num_channels - 1) // num_channels, min=1)[:, None]  # [B, 1]
    t = torch.arange(width, device=dev)[None, :]
    mask = mask & (t < tokens[:, None])
    begin = torch.minimum((t // per) * per, tokens[:, None])
    cs = mask.to(torch.int64).cumsum(1)
    cs_pad = torch.cat([torch.zeros(num_src, 1, dtype=torch.int64, device=dev), cs], 1)
    cum = cs - cs_pad.gather(1, begin)
    index = torch.where(mask, begin + cum - 1, width)
    lists = torch.full((num_src, width + 1), -1, dtype=torch.int32, device=dev)
    lists.scatter_(1, index, t.to(torch.int32).expand(num_src, -1).contiguous())
    c = torch.arange(num_channels, device=dev)[:, None]  # [C, 1]
    begins = torch.minimum(c * per.t(), tokens[None, :])  # [C, B]
    ends = torch.minimum(begins + per.t(), tokens[None, :])
    last = torch.clamp(ends - 1, min=0, max=width - 1)
    at_last = cum.t().gather(0, last)  # cum[b, last[c, b]]
    count = torch.where(ends > begins, at_last, torch.zeros_like(at_last))
    return lists[:, :width].contiguous(), count.to(torch.int32), cum.to(torch.int32)


def stream_tables(
    mask: torch.Tensor, num_channels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel token streams of a ``[T, N]`` token->node mask, without a host sync.

    Tokens are split into ``num_channels`` contiguous ranges (``_C.internode.channel_range``);
    the stream (channel c, node n) is the tokens of range c with ``mask[t, n]``, ascending.

    Returns:
        lists: ``[N, T]`` int32; stream (c, n) is ``lists[n, begin(c) : begin(c) + count[c, n]]``.
        count: ``[C, N]`` int32 tokens per stream.
        cum: ``[T, N]`` int32, inclusive count of masked tokens of t's range up to t (the ring
            position of t's entry in its stream is ``cum - 1``).
    """
    lists, count, cum = streams(mask.t(), mask.shape[0], num_channels)
    return lists, count, cum.t().contiguous()


def dst_rows(is_token_in_rank: torch.Tensor, first_row: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` int32 final row of token t at rank r (``first_row[r]`` + its position), -1 if
    t does not go to r: the receiver's order is source rank major, token order within."""
    pos = is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
    return torch.where(is_token_in_rank, first_row.to(torch.int32)[None, :] + pos, -1).to(
        torch.int32
    )


@dataclass(frozen=True)
class CallTables:
    """What one dispatch's kernels need from every rank's counts, on the device (int32)."""

    rank_prefix_matrix: torch.Tensor  # [R, R]: [i][r] = rows r gets from ranks 0..i
    first_row: torch.Tensor  # [R]: this rank's first row at every rank
    recv_rows: torch.Tensor  # [L]: rows each rank of this node receives
    recv_prefix: torch.Tensor  # [R + 1]: first row from each source here, then the total
    recv_count: torch.Tensor  # [1]: rows this rank receives
    src_tokens: torch.Tensor  # [N]: tokens of source (m, this local rank) for every node m


def call_tables(rows: torch.Tensor, rank: int, ranks_per_node: int) -> CallTables:
    """The tables of a dispatch from the all-gathered call-header rows ``[R, width]``."""
    counts = row_counts(rows)  # [s][r]: rows rank s sends to rank r
    prefix = counts.cumsum(0)
    node0 = rank // ranks_per_node * ranks_per_node
    column = prefix[:, rank]
    recv_prefix = torch.cat([column - counts[:, rank], column[-1:]])
    return CallTables(
        rank_prefix_matrix=prefix.to(torch.int32),
        first_row=(prefix - counts)[rank].to(torch.int32),
        recv_rows=prefix[-1, node0 : node0 + ranks_per_node].to(torch.int32),
        recv_prefix=recv_prefix.to(torch.int32),
        recv_count=column[-1:].to(torch.int32),
        src_tokens=row_num_tokens(rows)[rank % ranks_per_node :: ranks_per_node].to(torch.int32),
    )


@dataclass(frozen=True)
class DispatchState:
    """What combine and cached dispatch need from a dispatch (kept in the handle): the
    tables stay on the GPU, next to the sizes the host knows without reading them back."""

    rank_prefix_matrix: torch.Tensor  # [R, R] int32
    dst_row: torch.Tensor  # [T, R] int32
    plan: torch.Tensor  # [N, plan_T, L] int32: rows of tokens this rank forwarded
    plan_tokens: int
    src_tokens: torch.Tensor  # [N] int32: tokens of source (m, this local rank)
    recv_rows: torch.Tensor  # [L] int32: rows each local rank receives
    recv_prefix: torch.Tensor  # [R + 1] int32
    recv_count: torch.Tensor  # [1] int32
    out_rows: int  # rows of the outputs: received rows, or num_worst_tokens
    stage_rows: tuple[int, ...]  # NVLink staging rows every rank needs


def state_sizes(
    topology: Topology, num_worst_tokens: int, agreed: Agreement | None
) -> tuple[int, int, tuple[int, ...]]:
    """``(out_rows, plan_tokens, stage_rows)`` of a non-cached dispatch, known on the host: from
    the host-read rows ``agreed`` (exact mode) or ``num_worst_tokens`` W (sync-free)."""
    if num_worst_tokens > 0:
        return num_worst_tokens, num_worst_tokens, (num_worst_tokens,) * topology.num_ranks
    stage_rows = tuple(agreed.received)
    return stage_rows[topology.rank], max(1, max(agreed.num_tokens)), stage_rows


def expert_counts(
    per_expert: torch.Tensor, rank: int, experts_per_rank: int, alignment: int
) -> torch.Tensor:
    """``[E_local]`` int32 rows this rank receives per local expert, rounded up to
    ``alignment``, from the all-gathered ``[R, E]`` per-expert counts of every rank."""
    lo = rank * experts_per_rank
    n = per_expert[:, lo : lo + experts_per_rank].to(torch.int64).sum(0)
    return ((n + alignment - 1) // alignment * alignment).to(torch.int32)


def received_expert_counts(
    recv_topk_idx: torch.Tensor, experts_per_rank: int, alignment: int
) -> torch.Tensor:
    """``[E_local]`` int32 received rows per local expert, rounded up to ``alignment``, from
    a dispatch's own ``recv_topk_idx`` (local ids, -1 elsewhere and on padding rows): a token
    names an expert at most once, so this equals ``expert_counts`` without a collective."""
    ids = recv_topk_idx.reshape(-1).to(torch.int64)
    slot = torch.where(ids >= 0, ids, experts_per_rank)
    n = torch.zeros(experts_per_rank + 1, dtype=torch.int64, device=ids.device)
    n.scatter_add_(0, slot, torch.ones_like(slot))
    n = n[:experts_per_rank]
    return ((n + alignment - 1) // alignment * alignment).to(torch.int32)


__all__ = [
    "CallTables",
    "DispatchState",
    "call_tables",
    "dst_rows",
    "expert_counts",
    "received_expert_counts",
    "state_sizes",
    "stream_tables",
    "streams",
]

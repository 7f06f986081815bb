"""The ``reference`` backend: dispatch/combine in plain PyTorch over torch.distributed.

It is the correctness oracle of every kernel test and a portable fallback (gloo on CPU, NCCL
on GPU). It produces exactly the contract outputs of ``Buffer`` (ordering, handle, local
expert ids, weights) with few collectives: every call starts with the all-gather of the call
header (``agreement.py``), which also carries the per-rank counts, then a dispatch gathers the
per-expert counts (only when it returns them) and moves packed rows with one all-to-all; a
combine is one all-to-all. Rows travel as raw bytes so every dtype (BF16, FP8, float64 for
gradcheck) takes the same path on every process group. Every collective is bounded by
``UCCL_EP_TIMEOUT_MS``: a rank that never arrives makes the others raise ``CommTimeoutError``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from uccl_ep_megatron.backends.agreement import DTYPE_CODES, DispatchExperts
from uccl_ep_megatron.backends.base import (
    Backend,
    DispatchArgs,
    DispatchHandle,
    DispatchResult,
    Layout,
)
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import InvalidInputError


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[T, ...]`` tensor -> ``[T, nbytes]`` uint8 view of the same memory."""
    t = t.contiguous()
    cols = math.prod(t.shape[1:])
    return t.view(t.shape[0], cols).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, cols: int) -> torch.Tensor:
    # A fresh copy: a column slice may start at an offset the target dtype cannot view.
    return b.clone(memory_format=torch.contiguous_format).view(dtype).view(b.shape[0], cols)


def _send_order(is_token_in_rank: torch.Tensor) -> torch.Tensor:
    """Token indices in send order: destination rank major, token order within a rank."""
    return is_token_in_rank.t().nonzero(as_tuple=True)[1]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class ReferenceBackend(Backend):
    """Pure torch.distributed implementation of the ``Buffer`` contract."""

    name = "reference"
    agrees_per_call = True
    # Pure torch moves any dtype; these are the ones the call header can name.
    x_dtypes = frozenset(DTYPE_CODES)

    _call = ""  # the call whose header was exchanged last: names it in later errors

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        topo = self.topology
        num_tokens = topk_idx.shape[0]
        experts_per_rank = num_experts // topo.num_ranks
        ids = topk_idx.long()
        # As in the kernels, ids outside [0, E) count nowhere; dispatch reports them.
        valid = (ids >= 0) & (ids < num_experts)
        num_tokens_per_expert = torch.bincount(ids[valid], minlength=num_experts).int()
        # Invalid entries land in a spare column that is dropped afterwards.
        dst = torch.where(valid, ids // experts_per_rank, topo.num_ranks)
        mask = torch.zeros(num_tokens, topo.num_ranks + 1, dtype=torch.bool, device=ids.device)
        mask.scatter_(1, dst, True)
        is_token_in_rank = mask[:, : topo.num_ranks].contiguous()
        num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
        num_tokens_per_rdma_rank = None
        if topo.num_nodes > 1:
            per_node = is_token_in_rank.view(num_tokens, topo.num_nodes, topo.ranks_per_node)
            num_tokens_per_rdma_rank = per_node.any(2).sum(0, dtype=torch.int32)
        return Layout(
            num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank
        )

    # ---- collectives, on the Buffer's channel, each bounded by UCCL_EP_TIMEOUT_MS ---------
    def exchange_header(
        self, row: torch.Tensor, call: str, experts: DispatchExperts | None = None
    ) -> list[list[int]]:
        self.comm.check_usable()
        self._call = call  # names the call in the errors of its later collectives
        rows = self._all_gather_rows(row, "the call-header exchange", call)
        return rows.cpu().tolist()

    def _all_gather_rows(self, row: torch.Tensor, what: str, call: str) -> torch.Tensor:
        work, parts = self.comm.all_gather(row)
        self.comm.wait(work, what, call)
        return torch.stack(parts)

    def _all_to_all(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], call: str
    ) -> torch.Tensor:
        recv = torch.empty(sum(recv_counts), send.shape[1], dtype=send.dtype, device=send.device)
        work = self.comm.all_to_all_single(recv, send, recv_counts, send_counts)
        self.comm.wait(work, "the all-to-all of rows", call)
        return recv

    # ---- dispatch ------------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        rank = self.topology.rank
        rank_prefix_matrix, recv_tokens_per_expert = self._prefix_matrix(args)
        column = rank_prefix_matrix[:, rank].to(torch.int64)
        recv_counts = torch.diff(column, prepend=column.new_zeros(1)).tolist()
        num_recv = int(column[-1].item())
        recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_weights = self._move_rows(
            args, recv_counts
        )
        num_recv_per_expert: list[int] = []
        if recv_tokens_per_expert is not None and args.num_worst_tokens == 0:
            num_recv_per_expert = recv_tokens_per_expert.tolist()
        out_rows = num_recv
        if args.num_worst_tokens > 0:
            out_rows = args.num_worst_tokens
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights = _pad_rows(
                args.num_worst_tokens,
                num_recv,
                (recv_x, 0),
                (recv_scales, 0),
                (recv_topk_idx, -1),
                (recv_topk_weights, 0),
            )
            if args.cached is None:
                (recv_src_idx,) = _pad_rows(args.num_worst_tokens, num_recv, (recv_src_idx, -1))
        return DispatchResult(
            recv_x=recv_x,
            recv_x_scales=recv_scales,
            recv_topk_idx=recv_topk_idx,
            recv_topk_weights=recv_topk_weights,
            num_recv_tokens_per_expert=num_recv_per_expert,
            rank_prefix_matrix=rank_prefix_matrix,
            recv_src_idx=recv_src_idx,
            num_recv_tokens=out_rows,
            state=num_recv,  # rows really received (combine reads x up to here)
            recv_count=None if args.cached is not None else column[-1:].to(torch.int32),
            recv_tokens_per_expert=recv_tokens_per_expert,
        )

    def _prefix_matrix(self, args: DispatchArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rank prefix matrix [R, R] int32, aligned rows per local expert or None when
        cached): the handle's, or from the rank counts that came with the call header and the
        all-gathered per-expert counts."""
        if args.cached is not None:
            return args.cached.rank_prefix_matrix, None
        topo = self.topology
        counts = torch.tensor(args.agreed.counts, dtype=torch.int64, device=args.x.device)
        experts_per_rank = args.num_experts // topo.num_ranks
        per_expert = self._all_gather_rows(
            args.num_tokens_per_expert.to(torch.int64),
            "the all-gather of per-expert counts",
            self._call,
        ).sum(0)
        align = args.expert_alignment
        local = per_expert[topo.rank * experts_per_rank : (topo.rank + 1) * experts_per_rank]
        recv_tokens_per_expert = ((local + align - 1) // align * align).to(torch.int32)
        return counts.cumsum(0).to(torch.int32), recv_tokens_per_expert

    def _move_rows(self, args: DispatchArgs, recv_counts: list[int]) -> tuple[Any, ...]:
        """One all-to-all of every row's bytes (x, scales, and unless cached: source index,
        global ids, weights): (recv_x, recv_scales, recv_src_idx, recv_topk_idx,
        recv_topk_weights), the ids made local (-1 elsewhere, weight 0 there)."""
        x = args.x
        num_tokens, hidden = x.shape
        cached = args.cached
        pieces = [_as_bytes(x)]
        if args.x_scales is not None:
            pieces.append(_as_bytes(args.x_scales))
        if cached is None:
            pieces.append(_as_bytes(torch.arange(num_tokens, dtype=torch.int32, device=x.device)))
            if args.topk_idx is not None:
                pieces.append(_as_bytes(args.topk_idx.to(torch.int64)))
                pieces.append(_as_bytes(args.topk_weights.to(torch.float32)))
        widths = [p.shape[1] for p in pieces]
        send = torch.cat(pieces, dim=1)[_send_order(args.is_token_in_rank)]
        send_counts = args.is_token_in_rank.sum(0, dtype=torch.int64).tolist()
        recv = self._all_to_all(send, send_counts, recv_counts, self._call)
        cols = list(torch.split(recv, widths, dim=1))
        recv_x = _from_bytes(cols.pop(0), x.dtype, hidden)
        recv_scales = None
        if args.x_scales is not None:
            recv_scales = _from_bytes(cols.pop(0), torch.float32, args.x_scales.shape[1])
        if cached is not None:
            return recv_x, recv_scales, cached.recv_src_idx, None, None
        recv_src_idx = _from_bytes(cols.pop(0), torch.int32, 1).view(-1)
        if args.topk_idx is None:
            return recv_x, recv_scales, recv_src_idx, None, None
        k = args.topk_idx.shape[1]
        gid = _from_bytes(cols.pop(0), torch.int64, k)
        weights = _from_bytes(cols.pop(0), torch.float32, k)
        experts_per_rank = args.num_experts // self.topology.num_ranks
        local = gid - self.topology.rank * experts_per_rank
        mine = (gid >= 0) & (local >= 0) & (local < experts_per_rank)
        recv_topk_idx = torch.where(mine, local, -1).to(args.topk_idx.dtype)
        return recv_x, recv_scales, recv_src_idx, recv_topk_idx, torch.where(mine, weights, 0.0)

    # ---- combine -------------------------------------------------------------------------
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rank = self.topology.rank
        self.comm.check_usable()
        num_recv = handle.state
        column = handle.rank_prefix_matrix[:, rank].to(torch.int64)
        back_counts = torch.diff(column, prepend=column.new_zeros(1)).tolist()
        sent_counts = handle.num_tokens_per_rank.to(torch.int64).tolist()

        pieces = [_as_bytes(x[:num_recv])]
        if topk_weights is not None:
            pieces.append(_as_bytes(topk_weights[:num_recv].to(torch.float32)))
        widths = [p.shape[1] for p in pieces]
        recv = self._all_to_all(torch.cat(pieces, dim=1), back_counts, sent_counts, self._call)
        cols = torch.split(recv, widths, dim=1)

        num_tokens, hidden = handle.is_token_in_rank.shape[0], x.shape[1]
        order = _send_order(handle.is_token_in_rank)
        acc_dtype = _accumulate_dtype(x.dtype)
        acc = torch.zeros(num_tokens, hidden, dtype=acc_dtype, device=x.device)
        acc.index_add_(0, order, _from_bytes(cols[0], x.dtype, hidden).to(acc_dtype))
        for b in bias:
            acc += b.to(acc_dtype)
        combined_weights = None
        if topk_weights is not None:
            k = topk_weights.shape[1]
            combined_weights = torch.zeros(num_tokens, k, dtype=torch.float32, device=x.device)
            combined_weights.index_add_(0, order, _from_bytes(cols[1], torch.float32, k))
        return acc.to(x.dtype), combined_weights


def _pad_rows(
    rows: int, num_recv: int, *fills: tuple[torch.Tensor | None, float]
) -> list[torch.Tensor | None]:
    """Each ``(tensor, fill)`` padded with ``fill`` to exactly ``rows`` rows
    (``num_worst_tokens``); ``None`` stays ``None``."""
    if num_recv > rows:
        raise InvalidInputError(
            f"num_worst_tokens={rows} but this rank receives {num_recv} rows; pass "
            f"num_worst_tokens >= {num_recv} (the worst case is num_tokens * num_ranks)"
        )

    def pad(t: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        if t is None:
            return None
        out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        out[:num_recv] = t
        return out

    return [pad(t, fill) for t, fill in fills]

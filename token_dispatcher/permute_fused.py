"""The fused GPU kernels of the local permutation (``csrc/kernels/permute.cu``):
``permute_fused`` / ``unpermute_fused``, planning included, with no host sync. Used on CUDA/HIP
tensors when ``_C`` has them; same results as the torch path (``permute_torch.py``)."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from uccl_ep_megatron.token_dispatcher.permute_torch import check_capacity

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError

# (rows, hidden, dtype) -> an uninitialized [rows, hidden] tensor for an unpermute's output.
Allocator = Callable[[int, int, torch.dtype], torch.Tensor]

_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@functools.cache
def _c() -> Any:
    # The extension itself, not through the package root (which imports the layers above).
    return importlib.import_module("uccl_ep_megatron._C")


def fused_available(device: torch.device) -> bool:
    """Whether the fused permute kernels can run on ``device`` (a GPU, and ``_C`` has them)."""
    if device.type != "cuda":
        return False
    c = _c()
    return bool(getattr(c, "permute_kernels_built", lambda: False)())


@dataclass
class FusedPlan:
    """What the fused kernels computed for one dispatch; both directions reuse it."""

    pair_dest: torch.Tensor  # [N, K] int32: output row of each (row, slot) pair, -1 = none
    src_row: torch.Tensor  # [R] int32: received row of each output row, -1 = padding
    counts: torch.Tensor  # [L] int32: routed pairs per local expert (before capacity)
    segment_rows: torch.Tensor  # [L] int32 on the device: rows per segment
    offsets: torch.Tensor  # [L + 1] int32: segment starts
    dropped: torch.Tensor  # [1] int64: pairs that got no row, accumulated by the kernels
    num_recv: int
    tokens_per_expert: list[int] | None  # rows per segment, known on the host (None: packed)

    @property
    def live_end(self) -> torch.Tensor | None:
        """Packed plans: the last segment's end (``offsets[L:]``, on the device); the row
        kernels leave the rows at or past it unwritten. ``None`` when every row is a segment's."""
        return self.offsets[-1:] if self.tokens_per_expert is None else None


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _plan_fused(
    recv_topk_idx: torch.Tensor,
    recv_probs: torch.Tensor,
    num_local_experts: int,
    align: int,
    tokens_per_expert: list[int] | None,
    capacity: int,
    recv_count: torch.Tensor | None,
    dropped: torch.Tensor | None,
    packed: bool,
    max_rows: int,
) -> tuple[FusedPlan, torch.Tensor]:
    num_recv, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    # Rows per segment as the host knows them (None: the bounded layout knows only the total).
    sizes: list[int] | None = None
    if capacity:
        sizes = [capacity] * num_local_experts
    elif not packed:
        if tokens_per_expert is None or len(tokens_per_expert) != num_local_experts:
            raise InvalidInputError(
                f"exact mode needs the host rows per local expert ({num_local_experts} entries, "
                f"the dispatch's num_recv_tokens_per_expert_list), got {tokens_per_expert!r}"
            )
        sizes = [int(t) for t in tokens_per_expert]
    num_out = max_rows if sizes is None else sum(sizes)
    idx = recv_topk_idx if recv_topk_idx.dtype in (torch.int32, torch.int64) else None
    if idx is None:
        raise InvalidInputError(f"recv_topk_idx.dtype={recv_topk_idx.dtype}: must be int32/int64")
    idx = idx.contiguous()
    probs = recv_probs.detach().to(torch.float32).contiguous()
    if recv_count is not None and (recv_count.dtype != torch.int32 or recv_count.numel() != 1):
        raise InvalidInputError(
            f"recv_count must be an int32 [1] tensor (handle.recv_count), got "
            f"{recv_count.dtype} {tuple(recv_count.shape)}"
        )
    if dropped is None:
        dropped = torch.zeros(1, dtype=torch.int64, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    plan = FusedPlan(
        pair_dest=torch.empty(num_recv, num_topk, **i32),
        src_row=torch.empty(num_out, **i32),
        counts=torch.empty(num_local_experts, **i32),
        segment_rows=torch.empty(num_local_experts, **i32),
        offsets=torch.empty(num_local_experts + 1, **i32),
        dropped=dropped,
        num_recv=num_recv,
        tokens_per_expert=None if packed else sizes,
    )
    out_probs = torch.empty(num_out, dtype=torch.float32, device=device)
    _c().permute_plan(
        topk_idx=idx.data_ptr(),
        idx_is_64=idx.dtype == torch.int64,
        num_rows=num_recv,
        num_topk=num_topk,
        recv_count=0 if recv_count is None else recv_count.data_ptr(),
        num_experts=num_local_experts,
        align=align,
        capacity=capacity,
        packed=packed,
        num_out_rows=num_out,
        probs=probs.data_ptr(),
        pair_dest=plan.pair_dest.data_ptr(),
        src_row=plan.src_row.data_ptr(),
        out_probs=out_probs.data_ptr(),
        counts=plan.counts.data_ptr(),
        tokens_per_expert=plan.segment_rows.data_ptr(),
        offsets=plan.offsets.data_ptr(),
        dropped=dropped.data_ptr(),
        stream=_stream(device),
    )
    return plan, out_probs


def _gather(
    src: torch.Tensor, row_map: torch.Tensor, hidden: int, bound: torch.Tensor | None
) -> torch.Tensor:
    src = src.contiguous()
    out = torch.empty(row_map.numel(), hidden, dtype=src.dtype, device=src.device)
    _c().gather_rows(
        src=src.data_ptr(),
        row_map=row_map.data_ptr(),
        num_out_rows=row_map.numel(),
        bound=0 if bound is None else bound.data_ptr(),
        row_bytes=hidden * src.element_size(),
        out=out.data_ptr(),
        stream=_stream(src.device),
    )
    return out


def _reduce(
    src: torch.Tensor,
    pair_dest: torch.Tensor,
    src_probs: torch.Tensor | None = None,
    alloc: Allocator | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if src.dtype not in _DTYPE_CODES:
        raise UnsupportedError(
            f"fused unpermute of {src.dtype} rows: use bfloat16, float16 or float32"
        )
    src = src.contiguous()
    num_recv, num_topk = pair_dest.shape
    if alloc is not None:
        out = alloc(num_recv, src.shape[1], src.dtype)
    else:
        out = torch.empty(num_recv, src.shape[1], dtype=src.dtype, device=src.device)
    out_probs = None
    if src_probs is not None:
        src_probs = src_probs.to(torch.float32).contiguous()
        out_probs = torch.empty(num_recv, num_topk, dtype=torch.float32, device=src.device)
    _c().reduce_rows(
        src=src.data_ptr(),
        pair_dest=pair_dest.data_ptr(),
        num_rows=num_recv,
        num_topk=num_topk,
        hidden=src.shape[1],
        dtype=_DTYPE_CODES[src.dtype],
        out=out.data_ptr(),
        src_probs=0 if src_probs is None else src_probs.data_ptr(),
        out_probs=0 if out_probs is None else out_probs.data_ptr(),
        stream=_stream(src.device),
    )
    return out, out_probs


class _FusedPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, recv_x: torch.Tensor, recv_probs: torch.Tensor, spec: dict[str, Any]):
        plan, out_probs = _plan_fused(recv_probs=recv_probs, **spec)
        spec["plan"] = plan
        ctx.plan = plan
        ctx.probs_dtype = recv_probs.dtype
        ctx.x_meta = (recv_x.shape[1], recv_x.dtype)
        return _gather(recv_x, plan.src_row, recv_x.shape[1], plan.live_end), out_probs

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor | None, grad_probs: torch.Tensor | None):
        plan: FusedPlan = ctx.plan
        if grad_rows is None:
            hidden, dtype = ctx.x_meta
            grad_rows = torch.zeros(
                plan.src_row.numel(), hidden, dtype=dtype, device=plan.src_row.device
            )
        if grad_probs is None:
            grad_probs = torch.zeros(plan.src_row.numel(), device=grad_rows.device)
        grad_x, grad_recv_probs = _reduce(grad_rows, plan.pair_dest, grad_probs)
        return grad_x, grad_recv_probs.to(ctx.probs_dtype), None


class _FusedUnpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, expert_out: torch.Tensor, plan: FusedPlan, alloc: Allocator | None):
        ctx.plan = plan
        out, _ = _reduce(expert_out, plan.pair_dest, alloc=alloc)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        plan: FusedPlan = ctx.plan
        return _gather(grad_out, plan.src_row, grad_out.shape[1], plan.live_end), None, None


def permute_fused(
    recv_x: torch.Tensor,
    recv_probs: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    num_local_experts: int,
    *,
    align: int = 1,
    tokens_per_expert: list[int] | None = None,
    capacity: int = 0,
    recv_count: torch.Tensor | None = None,
    dropped: torch.Tensor | None = None,
    packed: bool = False,
    max_rows: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, FusedPlan]:
    """``permute`` on the GPU kernels, planning included; no host sync.

    Args:
        recv_x: ``[N, H]`` received rows (any dtype; copied as bytes).
        recv_probs: ``[N, K]`` routing probabilities of the received slots.
        recv_topk_idx: ``[N, K]`` local expert ids, -1 = none (padding rows: all -1).
        num_local_experts: experts hosted on this rank.
        align: exact mode rounds each segment up to a multiple of this with zero rows.
        tokens_per_expert: exact mode: rows per segment as the host knows them (the dispatch's
            ``num_recv_tokens_per_expert_list`` with ``expert_alignment=align``).
        capacity: when > 0, capacity mode: every segment has exactly this many rows.
        packed: the segments back to back, their sizes known on the GPU only
            (``plan.segment_rows``, ``plan.offsets``; ``plan.tokens_per_expert`` is ``None``),
            for experts that take device counts, so that their GEMMs skip the padding. With a
            capacity, segment ``e`` holds its kept pairs (at most ``capacity``, rounded up to
            ``align``) in ``L * capacity`` rows; without one (the bounded layout), every pair
            (each segment rounded up to ``align``) in ``max_rows`` rows. The rows past the last
            segment are padding, left unwritten in both directions (nothing reads them).
        max_rows: the bounded layout's rows (``packed`` without a capacity): an upper bound
            of the aligned pairs, e.g. ``N x min(K, L) + L x (align - 1)``; pairs past it
            would be dropped and counted.
        recv_count: int32 ``[1]`` device tensor of valid rows (``handle.recv_count``); rows at
            or past it are skipped. ``None``: all rows.
        dropped: int64 ``[1]`` device counter the kernels add the dropped pairs to (``None``:
            a fresh one, ``plan.dropped``).

    Returns:
        ``(rows [R, H], probs [R] float32, plan)``; gradients flow to ``recv_x`` and
        ``recv_probs`` (summed in fp32 in top-k slot order).
    """
    if align < 1:
        raise InvalidInputError(f"align={align}: must be >= 1")
    check_capacity(capacity, align)
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise InvalidInputError(f"max_rows={max_rows!r}: must be an int >= 0")
    if packed and not capacity and not max_rows:
        raise InvalidInputError(
            "packed=True needs capacity > 0 or, for the bounded layout, max_rows > 0 (exact "
            "mode's host sizes are packed already)"
        )
    if max_rows and (capacity or not packed):
        raise InvalidInputError(
            f"max_rows={max_rows} bounds the packed layout without a capacity: pass packed=True "
            f"and capacity=0 (got packed={packed}, capacity={capacity})"
        )
    if recv_topk_idx.shape[0] != recv_x.shape[0] or recv_probs.shape != recv_topk_idx.shape:
        raise InvalidInputError(
            f"recv_x {tuple(recv_x.shape)}, recv_probs {tuple(recv_probs.shape)} and "
            f"recv_topk_idx {tuple(recv_topk_idx.shape)} disagree; pass one dispatch's outputs"
        )
    spec: dict[str, Any] = dict(
        recv_topk_idx=recv_topk_idx,
        num_local_experts=num_local_experts,
        align=align,
        tokens_per_expert=tokens_per_expert,
        capacity=capacity,
        recv_count=recv_count,
        dropped=dropped,
        packed=packed,
        max_rows=max_rows,
    )
    rows, probs = _FusedPermute.apply(recv_x, recv_probs, spec)
    return rows, probs, spec["plan"]


def unpermute_fused(
    plan: FusedPlan, expert_out: torch.Tensor, alloc: Allocator | None = None
) -> torch.Tensor:
    """``unpermute`` on the GPU kernels: per received row, the fp32 sum of its expert rows in
    top-k slot order, cast back (bf16, fp16 or fp32); zero for padding rows. ``alloc(rows,
    hidden, dtype)`` gives the output tensor (e.g. ``Buffer.get_combine_input``, so that the
    combine that follows reads it in place); default: ``torch.empty``."""
    if expert_out.shape[0] != plan.src_row.numel():
        raise InvalidInputError(
            f"expert output has {expert_out.shape[0]} rows but dispatch produced "
            f"{plan.src_row.numel()}; pass the experts' output for this dispatch"
        )
    return _FusedUnpermute.apply(expert_out, plan, alloc)


__all__ = ["FusedPlan", "fused_available", "permute_fused", "unpermute_fused"]

"""Local permutation between the dispatch receive layout and per-expert order.

Two implementations with the same results: the fused GPU kernels (``csrc/kernels/permute.cu``,
``permute_fused`` / ``unpermute_fused``), used on CUDA/HIP tensors when ``_C`` has them, and
the torch path below (``make_plan`` / ``permute`` / ``unpermute``), used on the CPU and as the
independent reference of the kernels' tests.

``Buffer.dispatch`` returns each received token once, with the ids of the local experts it
chose (``-1`` elsewhere). Megatron's experts want one contiguous segment per local expert
(a token appears once per chosen local expert), segments in expert order, tokens inside a
segment in receive order, with one routing probability per row. With padding for quantized
GEMMs each segment is rounded up to a multiple of the alignment with zero rows (probability
0) that ``unpermute`` drops again.

Capacity mode (``capacity=C > 0``): every segment has exactly ``C`` rows; pairs past the first
``C`` of an expert (in receive order) get no row, contribute nothing to ``unpermute`` and are
counted in ``dropped`` (an int64 tensor on the device, so counting costs no host sync).

Everything here is differentiable, so gradients reach the received rows and the received
probabilities.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from uccl_ep_megatron.errors import InvalidInputError, UnsupportedError


@dataclass
class PermutePlan:
    """Where each per-expert row comes from; made once per dispatch, used by both directions."""

    src_row: torch.Tensor  # [rows] int64 source row in recv_x; num_recv for padding rows
    dest: torch.Tensor  # [pairs] int64 row of each (token, expert) pair; len(src_row) = none
    pair_row: torch.Tensor  # [routed] int64 received row of each pair
    pair_slot: torch.Tensor  # [routed] int64 top-k slot of each pair
    num_recv: int
    tokens_per_expert: list[int]  # per local expert, padded when alignment > 1 (or [C] * L)
    dropped: torch.Tensor  # int64 scalar on the device: pairs that got no row (capacity)
    dense: bool = False  # every pair has a row and there is no padding: dest is 0..rows-1


def make_plan(
    recv_topk_idx: torch.Tensor,
    num_local_experts: int,
    align: int = 1,
    counts: list[int] | None = None,
    capacity: int = 0,
) -> PermutePlan:
    """Plan the per-expert order of ``recv_topk_idx`` ([N, K] local expert ids, -1 = none).

    Args:
        recv_topk_idx: local expert ids from ``Buffer.dispatch``.
        num_local_experts: experts hosted on this rank.
        align: round each expert's row count up to a multiple of this (1 = no padding).
        counts: routed rows per local expert, as ``Buffer.dispatch`` returns them
            (``num_recv_tokens_per_expert_list`` with alignment 1). With them the plan is built
            without a host sync; without them they are counted here (one sync per read-back).
        capacity: when > 0, every expert gets exactly this many rows (capacity mode).
    """
    if align < 1:
        raise InvalidInputError(f"align={align}: must be >= 1")
    check_capacity(capacity, align)
    num_recv, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    idx = recv_topk_idx.long()
    if capacity:
        return _capacity_plan(idx, num_local_experts, capacity)
    if counts is None:
        if idx.numel() and int(idx.max()) >= num_local_experts:
            raise InvalidInputError(
                f"received local expert id {int(idx.max())} but this rank hosts "
                f"{num_local_experts} experts; num_moe_experts must be divisible by the EP size"
            )
        counts = torch.bincount(idx[idx >= 0], minlength=num_local_experts).tolist()
    elif len(counts) != num_local_experts:
        raise InvalidInputError(
            f"counts has {len(counts)} entries but this rank hosts {num_local_experts} experts"
        )
    routed = int(sum(counts))
    # Routed (row, slot) pairs in row-major order; their number is known, so no sync.
    flat = torch.nonzero_static((idx >= 0).reshape(-1), size=routed).reshape(-1)
    pair_row, pair_slot = flat // max(num_topk, 1), flat % max(num_topk, 1)
    expert = idx.reshape(-1)[flat]
    # Sort pairs by (expert, received row): the stable key keeps receive order per expert.
    order = torch.argsort(expert * max(num_recv, 1) + pair_row, stable=True)
    pair_row, pair_slot, expert = pair_row[order], pair_slot[order], expert[order]

    # Segment starts on the device (a host list would need a copy the stream waits for).
    count_t = torch.zeros(num_local_experts, dtype=torch.long, device=device)
    count_t.index_add_(0, expert, torch.ones_like(expert))
    padded = (count_t + align - 1) // align * align if align > 1 else count_t
    start_unpadded = torch.cumsum(count_t, 0) - count_t
    start_padded = torch.cumsum(padded, 0) - padded
    rank_in_expert = torch.arange(routed, device=device) - start_unpadded[expert]
    dest = start_padded[expert] + rank_in_expert
    padded_list = [(c + align - 1) // align * align for c in counts]
    total = int(sum(padded_list))
    src_row = torch.full((total,), num_recv, dtype=torch.long, device=device)
    src_row[dest] = pair_row
    return PermutePlan(
        src_row=src_row,
        dest=dest,
        pair_row=pair_row,
        pair_slot=pair_slot,
        num_recv=num_recv,
        tokens_per_expert=padded_list,
        dropped=torch.zeros((), dtype=torch.long, device=device),
        dense=total == routed,
    )


def _capacity_plan(idx: torch.Tensor, num_local_experts: int, capacity: int) -> PermutePlan:
    """Capacity mode without host reads: every pair takes part, dropped ones (and slots
    without an expert) aim at a spare row ``L * C`` that ``permute`` cuts off."""
    num_recv, num_topk = idx.shape
    device = idx.device
    num_pairs = num_recv * num_topk
    total = num_local_experts * capacity
    flat_idx = idx.reshape(-1)
    valid = (flat_idx >= 0) & (flat_idx < num_local_experts)
    expert = torch.where(valid, flat_idx, num_local_experts)  # L = "no expert" sorts last
    flat = torch.arange(num_pairs, device=device)
    order = torch.argsort(expert * max(num_pairs, 1) + flat, stable=True)
    expert, flat = expert[order], flat[order]
    count_t = torch.bincount(expert, minlength=num_local_experts + 1)
    start = torch.cumsum(count_t, 0) - count_t
    rank_in_expert = torch.arange(num_pairs, device=device) - start[expert]
    keep = (expert < num_local_experts) & (rank_in_expert < capacity)
    dest = torch.where(keep, expert * capacity + rank_in_expert, total)
    pair_row = flat // max(num_topk, 1)
    src_row = torch.full((total + 1,), num_recv, dtype=torch.long, device=device)
    src_row = src_row.scatter(0, dest, torch.where(keep, pair_row, num_recv))[:total]
    return PermutePlan(
        src_row=src_row,
        dest=dest,
        pair_row=pair_row,
        pair_slot=flat % max(num_topk, 1),
        num_recv=num_recv,
        tokens_per_expert=[capacity] * num_local_experts,
        dropped=(count_t[:num_local_experts] - capacity).clamp(min=0).sum(),
    )


def check_capacity(capacity: int, align: int) -> None:
    """Raise unless ``capacity`` is 0 (exact mode) or a positive multiple of ``align``."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise InvalidInputError(f"capacity={capacity!r}: must be an int >= 0 (0 = exact mode)")
    if capacity % align:
        raise InvalidInputError(
            f"capacity={capacity} is not a multiple of the alignment {align}: round it up to "
            f"{(capacity + align - 1) // align * align}"
        )


def permute(
    plan: PermutePlan, recv_x: torch.Tensor, recv_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and probabilities in per-expert order (padding rows zero, probability 0)."""
    total = plan.src_row.numel()
    if plan.dense:
        rows = recv_x.index_select(0, plan.pair_row)
    else:
        padded_x = torch.cat([recv_x, recv_x.new_zeros(1, recv_x.shape[1])])
        rows = padded_x.index_select(0, plan.src_row)
    pair_probs = recv_probs[plan.pair_row, plan.pair_slot]
    # Row `total` is the capacity plan's spare row for pairs without a row.
    probs = pair_probs.new_zeros(total + 1).index_copy(0, plan.dest, pair_probs)[:total]
    return rows, probs


def unpermute(plan: PermutePlan, expert_out: torch.Tensor) -> torch.Tensor:
    """Sum each token's expert outputs back into its received row (padding rows dropped)."""
    if expert_out.shape[0] != plan.src_row.numel():
        raise InvalidInputError(
            f"expert output has {expert_out.shape[0]} rows but dispatch produced "
            f"{plan.src_row.numel()}; pass the experts' output for this dispatch"
        )
    # Accumulate in fp32: a token sums up to top-k expert outputs, bf16 sums would round twice.
    acc_dtype = torch.float32 if expert_out.dtype in (torch.bfloat16, torch.float16) else None
    src = expert_out if acc_dtype is None else expert_out.to(acc_dtype)
    out = src.new_zeros(plan.num_recv + 1, expert_out.shape[1])
    out = out.index_add(0, plan.src_row, src)[: plan.num_recv]
    return out if acc_dtype is None else out.to(expert_out.dtype)


# ---- fused GPU kernels ------------------------------------------------------------------------
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


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
    tokens_per_expert: list[int]  # rows per segment, known on the host


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
) -> tuple[FusedPlan, torch.Tensor]:
    num_recv, num_topk = recv_topk_idx.shape
    device = recv_topk_idx.device
    if capacity:
        sizes = [capacity] * num_local_experts
    elif tokens_per_expert is None or len(tokens_per_expert) != num_local_experts:
        raise InvalidInputError(
            f"exact mode needs the host rows per local expert ({num_local_experts} entries, "
            f"the dispatch's num_recv_tokens_per_expert_list), got {tokens_per_expert!r}"
        )
    else:
        sizes = [int(t) for t in tokens_per_expert]
    num_out = sum(sizes)
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
        tokens_per_expert=sizes,
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


def _gather(src: torch.Tensor, row_map: torch.Tensor, hidden: int) -> torch.Tensor:
    src = src.contiguous()
    out = torch.empty(row_map.numel(), hidden, dtype=src.dtype, device=src.device)
    _c().gather_rows(
        src=src.data_ptr(),
        row_map=row_map.data_ptr(),
        num_out_rows=row_map.numel(),
        row_bytes=hidden * src.element_size(),
        out=out.data_ptr(),
        stream=_stream(src.device),
    )
    return out


def _reduce(
    src: torch.Tensor, pair_dest: torch.Tensor, src_probs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if src.dtype not in _DTYPE_CODES:
        raise UnsupportedError(
            f"fused unpermute of {src.dtype} rows: use bfloat16, float16 or float32"
        )
    src = src.contiguous()
    num_recv, num_topk = pair_dest.shape
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
        return _gather(recv_x, plan.src_row, recv_x.shape[1]), out_probs

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
    def forward(ctx: Any, expert_out: torch.Tensor, plan: FusedPlan):
        ctx.plan = plan
        out, _ = _reduce(expert_out, plan.pair_dest)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        plan: FusedPlan = ctx.plan
        return _gather(grad_out, plan.src_row, grad_out.shape[1]), None


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
    )
    rows, probs = _FusedPermute.apply(recv_x, recv_probs, spec)
    return rows, probs, spec["plan"]


def unpermute_fused(plan: FusedPlan, expert_out: torch.Tensor) -> torch.Tensor:
    """``unpermute`` on the GPU kernels: per received row, the fp32 sum of its expert rows in
    top-k slot order, cast back (bf16, fp16 or fp32); zero for padding rows."""
    if expert_out.shape[0] != plan.src_row.numel():
        raise InvalidInputError(
            f"expert output has {expert_out.shape[0]} rows but dispatch produced "
            f"{plan.src_row.numel()}; pass the experts' output for this dispatch"
        )
    return _FusedUnpermute.apply(expert_out, plan)


# ---- Megatron's permutation (Transformer Engine's fused kernels with --moe-permute-fusion) ------
def megatron_fused_permute_available() -> bool:
    """Whether megatron-core has Transformer Engine's fused permute/unpermute."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return False
    return bool(getattr(moe_utils, "HAVE_TE", False)) and all(
        getattr(moe_utils, name, None) is not None
        for name in ("fused_permute_with_probs", "fused_unpermute")
    )


@dataclass
class MegatronPlan:
    """What Megatron's ``unpermute`` needs from its ``permute``."""

    sorted_indices: torch.Tensor
    routing_map: torch.Tensor  # [N, L] bool
    restore_shape: torch.Size
    fused: bool
    tokens_per_expert: list[int]


def permute_megatron(
    recv_x: torch.Tensor,
    recv_probs: torch.Tensor,
    recv_topk_idx: torch.Tensor,
    num_local_experts: int,
    tokens_per_expert: list[int],
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, MegatronPlan]:
    """Exact-mode permutation through megatron-core's ``moe_utils.permute`` (``fused``:
    Transformer Engine's kernels, as ``--moe-permute-fusion`` asks): the receive layout becomes
    a routing map ``[N, L]`` and probabilities ``[N, L]``; Megatron orders rows by expert, then
    received row, the same order as the other paths. No alignment padding."""
    from megatron.core.transformer.moe.moe_utils import permute as mc_permute

    num_recv = recv_topk_idx.shape[0]
    # Slots without an expert go to a spare column L, cut off afterwards.
    col = torch.where(recv_topk_idx >= 0, recv_topk_idx, num_local_experts).long()
    shape = (num_recv, num_local_experts + 1)
    device = recv_topk_idx.device
    routing_map = torch.zeros(shape, dtype=torch.bool, device=device).scatter_(1, col, True)
    routing_map = routing_map[:, :num_local_experts].contiguous()
    probs_map = (
        torch.zeros(shape, dtype=recv_probs.dtype, device=device)
        .scatter(1, col, recv_probs)[:, :num_local_experts]
        .contiguous()
    )
    rows, probs, sorted_indices = mc_permute(
        recv_x,
        routing_map,
        probs=probs_map,
        num_out_tokens=sum(tokens_per_expert),
        fused=fused,
    )
    plan = MegatronPlan(sorted_indices, routing_map, recv_x.shape, fused, list(tokens_per_expert))
    return rows, probs, plan


def unpermute_megatron(plan: MegatronPlan, expert_out: torch.Tensor) -> torch.Tensor:
    """megatron-core's ``unpermute`` of ``permute_megatron``'s rows (sum per received row)."""
    from megatron.core.transformer.moe.moe_utils import unpermute as mc_unpermute

    return mc_unpermute(
        expert_out,
        plan.sorted_indices,
        restore_shape=plan.restore_shape,
        routing_map=plan.routing_map,
        fused=plan.fused,
    )

"""The torch path of the local permutation (see ``permute.py``): ``make_plan`` / ``permute`` /
``unpermute``, used on the CPU and as the independent reference of the fused kernels' tests,
and ``check_capacity``, which every path applies.

Capacity mode (``capacity=C > 0``): every segment has exactly ``C`` rows; pairs past the first
``C`` of an expert (in receive order) get no row, contribute nothing to ``unpermute`` and are
counted in ``dropped`` (an int64 tensor on the device, so counting costs no host sync).
Everything here is differentiable, so gradients reach the received rows and the received
probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from uccl_ep_megatron.core.errors import InvalidInputError


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


__all__ = ["PermutePlan", "check_capacity", "make_plan", "permute", "unpermute"]

"""The local permutation through megatron-core's own ``moe_utils.permute`` / ``unpermute``
(Transformer Engine's fused kernels with ``--moe-permute-fusion``), exact mode only."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    # megatron-core <= 0.18 returns (rows, probs, sorted indices); 0.19 adds the pad offsets
    # and padded counts of its align_size path, both None here (no alignment).
    rows, probs, sorted_indices = mc_permute(
        recv_x,
        routing_map,
        probs=probs_map,
        num_out_tokens=sum(tokens_per_expert),
        fused=fused,
    )[:3]
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


__all__ = [
    "MegatronPlan",
    "megatron_fused_permute_available",
    "permute_megatron",
    "unpermute_megatron",
]

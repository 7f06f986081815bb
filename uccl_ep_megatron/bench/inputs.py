"""Inputs the multi-rank benchmarks (``bench intranode``, ``bench internode``) share. The ranks
themselves come from the one launcher, ``uccl_ep_megatron.cluster.local``."""

from __future__ import annotations

import torch


def routed_inputs(a: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids (uniform random scores), weights and BF16 rows for ``a``'s shape, per rank."""
    T, H, E, K = a["tokens"], a["hidden"], a["experts"], a["topk"]
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen, device="cuda")
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    return idx, w, x

"""Inputs the multi-rank benchmarks (``bench intranode``, ``bench internode``) share. The ranks
themselves come from the one launcher, ``uccl_ep_megatron.cluster.local``."""

from __future__ import annotations

import argparse

import torch


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The shape ``routed_inputs`` reads (DeepSeek-V3's by default)."""
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--experts", type=int, default=256, help="routed experts in total")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")


def routed_inputs(a: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids (uniform random scores), weights and BF16 rows for ``a``'s shape, per rank."""
    T, H, E, K = a["tokens"], a["hidden"], a["experts"], a["topk"]
    gen = torch.Generator(device="cuda").manual_seed(rank)
    idx = torch.rand(T, E, generator=gen, device="cuda").topk(K, dim=1).indices
    w = torch.rand(T, K, generator=gen, device="cuda")
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    return idx, w, x


def dispatch_kwargs(layout, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> dict:
    """The keywords of ``Buffer.dispatch`` for the first four tensors ``get_dispatch_layout``
    returned and the routing they came from."""
    per_rank, per_rdma, per_expert, in_rank = layout[:4]
    return dict(
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
    )

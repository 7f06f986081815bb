"""Independent oracle for the Buffer contract, written with plain loops and indexing.

Every rank can regenerate every other rank's inputs from the seed, so the expected outputs of
any rank are computed from the global routing without calling the code under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("random", "skewed", "no_remote", "empty_rank")


@dataclass
class RankInputs:
    x: torch.Tensor  # [T, H] float32 master copy
    topk_idx: torch.Tensor  # [T, K] int64
    topk_weights: torch.Tensor  # [T, K] float32


def num_tokens_of(rank: int, base: int, seed: int) -> int:
    # Uneven token counts; rank 1 has none in every third seed.
    if rank == 1 and seed % 3 == 0:
        return 0
    return base + (rank * 7 + seed) % 5


def make_inputs(
    seed: int,
    rank: int,
    world: int,
    base_tokens: int,
    hidden: int,
    num_experts: int,
    topk: int,
    mode: str,
) -> RankInputs:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    t = num_tokens_of(rank, base_tokens, seed)
    epr = num_experts // world
    idx = torch.empty(t, topk, dtype=torch.int64)
    for i in range(t):
        if mode == "skewed" and torch.rand(1, generator=g).item() < 0.8:
            pool = torch.arange(min(num_experts, topk + 1))  # most tokens pick the first experts
        elif mode == "no_remote":
            pool = torch.arange(rank * epr, (rank + 1) * epr)
        elif mode == "empty_rank":
            pool = torch.arange(0, (world - 1) * epr)  # nobody routes to the last rank
        else:
            pool = torch.arange(num_experts)
        k_here = min(topk, len(pool))
        choice = pool[torch.randperm(len(pool), generator=g)[:k_here]]
        row = torch.full((topk,), -1, dtype=torch.int64)
        row[:k_here] = choice
        # Some -1 slots, and every 7th token routed nowhere at all.
        drop = torch.rand(topk, generator=g) < 0.15
        row[drop] = -1
        if i % 7 == 6:
            row[:] = -1
        idx[i] = row
    x = torch.randn(t, hidden, generator=g)
    w = torch.rand(t, topk, generator=g) + 0.1
    return RankInputs(x, idx, w)


def dest_ranks(topk_row: torch.Tensor, epr: int) -> list[int]:
    return sorted({int(e) // epr for e in topk_row.tolist() if e >= 0})


@dataclass
class Expected:
    recv_x: torch.Tensor
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    recv_src_idx: list[int]
    per_expert: list[int]  # unaligned counts per local expert
    rank_prefix_matrix: torch.Tensor
    num_tokens_per_rank: list[int]
    num_tokens_per_expert: list[int]
    is_token_in_rank: torch.Tensor


def expected_for(rank: int, world: int, all_inputs: list[RankInputs], num_experts: int) -> Expected:
    epr = num_experts // world
    rows, ids, ws, src = [], [], [], []
    counts = torch.zeros(world, world, dtype=torch.int64)
    for s, inp in enumerate(all_inputs):
        for t in range(inp.x.shape[0]):
            dsts = dest_ranks(inp.topk_idx[t], epr)
            for d in dsts:
                counts[s, d] += 1
            if rank in dsts:
                rows.append(inp.x[t])
                local = [
                    int(e) - rank * epr if e >= 0 and int(e) // epr == rank else -1
                    for e in inp.topk_idx[t].tolist()
                ]
                ids.append(local)
                ws.append(
                    [
                        w if e >= 0 else 0.0
                        for w, e in zip(inp.topk_weights[t].tolist(), local, strict=True)
                    ]
                )
                src.append(t)
    hidden = all_inputs[0].x.shape[1]
    k = all_inputs[0].topk_idx.shape[1]
    recv_topk_idx = torch.tensor(ids, dtype=torch.int64).view(-1, k)
    per_expert = [int((recv_topk_idx == e).any(1).sum()) for e in range(epr)]
    mine = all_inputs[rank]
    in_rank = torch.zeros(mine.x.shape[0], world, dtype=torch.bool)
    per_e = [0] * num_experts
    for t in range(mine.x.shape[0]):
        for d in dest_ranks(mine.topk_idx[t], epr):
            in_rank[t, d] = True
        for e in mine.topk_idx[t].tolist():
            if e >= 0:
                per_e[e] += 1
    return Expected(
        recv_x=torch.stack(rows) if rows else torch.empty(0, hidden),
        recv_topk_idx=recv_topk_idx,
        recv_topk_weights=torch.tensor(ws, dtype=torch.float32).view(-1, k),
        recv_src_idx=src,
        per_expert=per_expert,
        rank_prefix_matrix=counts.cumsum(0).to(torch.int32),
        num_tokens_per_rank=in_rank.sum(0).tolist(),
        num_tokens_per_expert=per_e,
        is_token_in_rank=in_rank,
    )


def expected_combine(rank: int, world: int, all_inputs: list[RankInputs], num_experts: int):
    """Combine when every rank r sends back ``recv_x * (r + 1)`` and its received weights."""
    epr = num_experts // world
    mine = all_inputs[rank]
    out = torch.zeros_like(mine.x, dtype=torch.float64)
    for t in range(mine.x.shape[0]):
        for d in dest_ranks(mine.topk_idx[t], epr):
            out[t] += mine.x[t].double() * (d + 1)
    weights = torch.where(mine.topk_idx >= 0, mine.topk_weights, 0.0)
    return out, weights

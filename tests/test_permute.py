"""The dispatcher's local permutation (token_dispatcher/permute.py) against a direct Python
construction: per local expert, the received rows that chose it in receive order, each
segment padded to the alignment; built from the dispatch's counts (no host sync) or by
counting, the plans must be the same."""

from __future__ import annotations

import pytest
import torch
from uccl_ep_megatron.token_dispatcher.permute import make_plan, permute, unpermute

from uccl_ep_megatron.core.errors import InvalidInputError


def _segments(idx: torch.Tensor, num_local: int) -> list[list[int]]:
    """Per local expert, the received rows that chose it, in receive order."""
    rows, k = idx.shape
    return [[r for r in range(rows) for s in range(k) if idx[r, s] == e] for e in range(num_local)]


def _check_rows(out: torch.Tensor, p: torch.Tensor, x: torch.Tensor, rows: list[int]) -> None:
    """Per-expert row i is x[rows[i]], or a zero row with probability 0 where rows[i] is -1."""
    for i, r in enumerate(rows):
        if r < 0:
            assert torch.all(out[i] == 0) and p[i] == 0
        else:
            assert torch.equal(out[i], x[r])


def _oracle(idx: torch.Tensor, num_local: int, align: int) -> tuple[list[int], list[int]]:
    """(source row of every per-expert row, -1 for padding; padded rows per expert)."""
    rows: list[int] = []
    sizes: list[int] = []
    for seg in _segments(idx, num_local):
        pad = (len(seg) + align - 1) // align * align - len(seg)
        rows += seg + [-1] * pad
        sizes.append(len(seg) + pad)
    return rows, sizes


@pytest.mark.parametrize("align", [1, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_matches_direct_construction(align, seed):
    g = torch.Generator().manual_seed(seed)
    num_recv, k, num_local = 37 + seed * 11, 3, 5
    idx = torch.randint(-1, num_local, (num_recv, k), generator=g)
    idx[seed] = -1  # a row that chose no local expert
    rows, sizes = _oracle(idx, num_local, align)
    counts = [int((idx == e).sum()) for e in range(num_local)]
    for plan in (
        make_plan(idx, num_local, align),
        make_plan(idx.to(torch.int32), num_local, align, counts=counts),
    ):
        assert plan.tokens_per_expert == sizes
        src = plan.src_row.tolist()
        assert [-1 if r == num_recv else r for r in src] == rows
        x = torch.randn(num_recv, 8, generator=g, dtype=torch.float64)
        probs = torch.rand(num_recv, k, generator=g, dtype=torch.float64)
        out, p = permute(plan, x, probs)
        _check_rows(out, p, x, rows)
        # Unpermute sums a row's expert outputs: identity rows come back times their count.
        back = unpermute(plan, out)
        chosen = (idx >= 0).sum(1, keepdim=True).to(x.dtype)
        torch.testing.assert_close(back, x * chosen)


def test_counts_of_the_wrong_length_are_rejected():
    idx = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(InvalidInputError, match="counts has 2 entries but this rank hosts 3"):
        make_plan(idx, 3, 1, counts=[8, 0])


def test_out_of_range_local_id_is_rejected_when_counting():
    idx = torch.tensor([[0, 3]])
    with pytest.raises(InvalidInputError, match="received local expert id 3"):
        make_plan(idx, 3)


def _capacity_oracle(idx: torch.Tensor, num_local: int, capacity: int):
    """(source row of every per-expert row, -1 for padding; dropped pairs)."""
    rows: list[int] = []
    dropped = 0
    for seg in _segments(idx, num_local):
        dropped += max(0, len(seg) - capacity)
        seg = seg[:capacity]
        rows += seg + [-1] * (capacity - len(seg))
    return rows, dropped


@pytest.mark.parametrize("capacity", [1, 4, 8, 40])
@pytest.mark.parametrize("seed", [0, 1])
def test_capacity_plan_keeps_the_first_pairs_and_counts_the_rest(capacity, seed):
    g = torch.Generator().manual_seed(seed)
    num_recv, k, num_local = 29, 3, 4
    idx = torch.randint(-1, num_local, (num_recv, k), generator=g)
    idx[-3:] = -1  # padding rows of a sync-free dispatch
    rows, dropped = _capacity_oracle(idx, num_local, capacity)
    plan = make_plan(idx, num_local, capacity=capacity)
    assert plan.tokens_per_expert == [capacity] * num_local
    assert int(plan.dropped) == dropped
    assert [-1 if r == num_recv else r for r in plan.src_row.tolist()] == rows
    x = torch.randn(num_recv, 8, generator=g, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(num_recv, k, generator=g, dtype=torch.float64, requires_grad=True)
    out, p = permute(plan, x, probs)
    kept = torch.zeros(num_recv, k, dtype=torch.float64)  # which (row, slot) pairs got a row
    for e in range(num_local):
        pairs = [(r, s) for r in range(num_recv) for s in range(k) if idx[r, s] == e]
        for r, s in pairs[:capacity]:
            kept[r, s] = 1.0
    _check_rows(out, p, x, rows)
    back = unpermute(plan, out)
    torch.testing.assert_close(back, x * kept.sum(1, keepdim=True))
    (back.sum() + p.sum()).backward()
    torch.testing.assert_close(x.grad, kept.sum(1, keepdim=True).expand_as(x))
    torch.testing.assert_close(probs.grad, kept)


def test_capacity_must_be_a_multiple_of_the_alignment():
    with pytest.raises(InvalidInputError, match="not a multiple of the alignment 4"):
        make_plan(torch.zeros(2, 1, dtype=torch.long), 1, 4, capacity=6)


def test_packed_segments_need_a_capacity_or_a_bound():
    from uccl_ep_megatron.token_dispatcher.permute_fused import permute_fused

    idx = torch.zeros(2, 1, dtype=torch.long)
    x, p = torch.zeros(2, 4), torch.ones(2, 1)
    with pytest.raises(InvalidInputError, match="packed=True needs capacity > 0 or"):
        permute_fused(x, p, idx, 1, packed=True)
    # The bound is for the packed layout without a capacity only.
    with pytest.raises(InvalidInputError, match="max_rows=4 bounds the packed layout"):
        permute_fused(x, p, idx, 1, packed=True, capacity=2, max_rows=4)
    with pytest.raises(InvalidInputError, match="max_rows=4 bounds the packed layout"):
        permute_fused(x, p, idx, 1, max_rows=4)
    with pytest.raises(InvalidInputError, match="max_rows=-1"):
        permute_fused(x, p, idx, 1, packed=True, max_rows=-1)


@pytest.mark.megatron
@pytest.mark.parametrize("seed", [0, 3])
def test_megatron_permutation_of_the_receive_layout_equals_ours(seed):
    """``permute_megatron`` (megatron-core's ``moe_utils.permute``; its unfused path here, TE's
    kernels with --moe-permute-fusion on a GPU) gives the rows, order, probabilities, sums and
    gradients of the torch path."""
    pytest.importorskip("megatron.core")
    from uccl_ep_megatron.token_dispatcher.permute import permute_megatron, unpermute_megatron

    g = torch.Generator().manual_seed(seed)
    num_recv, k, num_local = 23, 3, 5
    scores = torch.rand(num_recv, num_local, generator=g)
    idx = scores.topk(k, dim=1).indices
    idx[torch.rand(num_recv, k, generator=g) < 0.3] = -1
    counts = [int((idx == e).sum()) for e in range(num_local)]
    x = torch.randn(num_recv, 8, generator=g, dtype=torch.float64)
    probs = torch.rand(num_recv, k, generator=g, dtype=torch.float64) * (idx >= 0)
    outs = []
    for path in ("torch", "megatron"):
        xx, pp = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        if path == "torch":
            plan = make_plan(idx, num_local, counts=counts)
            rows, p = permute(plan, xx, pp)
            back = unpermute(plan, rows * 2.0)
        else:
            rows, p, mplan = permute_megatron(xx, pp, idx, num_local, counts, fused=False)
            assert mplan.tokens_per_expert == counts
            back = unpermute_megatron(mplan, rows * 2.0)
        (back.sum() + (p * 3.0).sum()).backward()
        outs.append((rows.detach(), p.detach(), back.detach(), xx.grad, pp.grad))
    names = ("rows", "probs", "unpermute", "x grad", "probs grad")
    for name, a, b in zip(names, *outs, strict=True):
        torch.testing.assert_close(a, b, msg=name)

"""The host-side arithmetic of ``_C``'s intranode call bindings, checked against independent
references: the exact-mode row counts read off the rank prefix matrix, and the NaN fill word
the poison fold writes in each dtype. Runs wherever ``_C`` was built with the GPU kernels
(no GPU needed); the launches themselves are covered by ``tests/gpu/``."""

from __future__ import annotations

import random

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.core.errors import InvalidInputError

pytestmark = pytest.mark.skipif(
    not _C.kernels_built(), reason="_C was built without the GPU kernels (no nvcc/hipcc)"
)


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
def test_exact_rows_match_the_count_matrix(num_ranks):
    rng = random.Random(num_ranks)
    for _ in range(20):
        # counts[s][j]: rows rank s sends to rank j; the prefix matrix sums them over s.
        counts = [[rng.randrange(0, 50) for _ in range(num_ranks)] for _ in range(num_ranks)]
        prefix = []
        for s in range(num_ranks):
            for j in range(num_ranks):
                prefix.append(sum(counts[i][j] for i in range(s + 1)))
        for rank in range(num_ranks):
            received = [sum(counts[s][j] for s in range(num_ranks)) for j in range(num_ranks)]
            back = [sum(c for j, c in enumerate(counts[s]) if j != s) for s in range(num_ranks)]
            expected = (
                received[rank],
                max(received),
                counts[rank][rank],
                sum(counts[rank]),
                max(back),
            )
            rows = _C.intranode_exact_rows(prefix, rank, num_ranks)
            got = (
                rows.num_recv,
                rows.staging_rows,
                rows.own_rows,
                rows.send_rows,
                rows.combine_rows,
            )
            assert got == expected
            assert not rows.bound  # known only after the counts were read


def test_exact_rows_reject_a_wrong_matrix():
    with pytest.raises(InvalidInputError, match="rank=0 num_ranks=2 with 3 prefix entries"):
        _C.intranode_exact_rows([1, 2, 3], 0, 2)
    with pytest.raises(InvalidInputError, match="rank=2 num_ranks=2"):
        _C.intranode_exact_rows([1, 2, 3, 4], 2, 2)


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e4m3fnuz],
)
def test_fill_word_is_torchs_nan(dtype):
    raw = torch.tensor([float("nan")], dtype=dtype).view(torch.uint8).tolist()
    assert _C.intranode_fill_word(dtype) == int.from_bytes(bytes(raw * (8 // len(raw))), "little")


def test_fill_word_of_integers_is_zero():
    assert _C.intranode_fill_word(torch.int64) == 0
    assert _C.intranode_fill_word(torch.int32) == 0


def _dsv3_rows(num_ranks: int, tokens: int = 4096) -> tuple[int, int]:
    """(rows a rank pushes back, rows its reducers read plus write) of a combine after a
    DeepSeek-V3 dispatch (top-8 of 256 experts, uniform routing): a token reaches a given rank
    with p = 1 - C(256 - 256/R, 8) / C(256, 8)."""
    from math import comb

    p = 1 - comb(256 - 256 // num_ranks, 8) / comb(256, 8)
    push = round(tokens * p * (num_ranks - 1))  # rows received from peers go back
    reduce = round(tokens * p * num_ranks) + tokens  # every returned row read, one row written
    return push, reduce


@pytest.mark.parametrize(("num_ranks", "pushers"), [(2, 7), (4, 9), (8, 9)])
def test_combine_split_of_dsv3_at_12_sms(num_ranks, pushers):
    # The split docs/performance.md ("Sender/receiver and pusher/reducer splits") derives.
    assert _C.combine_push_blocks(*_dsv3_rows(num_ranks), 12) == pushers


def test_combine_split_properties():
    assert _C.combine_push_blocks(0, 100, 12) == 0  # one rank, or nothing received: all reduce
    assert _C.combine_push_blocks(100, 0, 12) == 12  # no tokens of its own: all push
    rng = random.Random(5)
    for _ in range(200):
        push, reduce, blocks = (
            rng.randrange(1, 10**6),
            rng.randrange(1, 10**6),
            rng.randrange(2, 64),
        )
        got = _C.combine_push_blocks(push, reduce, blocks)
        assert 1 <= got <= blocks - 1  # both sides have work: each keeps a block
        # The pushers' share of the weighted transfers, rounded up (pushers that are done
        # reduce too), unless clamped.
        share = blocks * 4 * push / (4 * push + reduce)
        assert share <= got < share + 1 or got in (1, blocks - 1), (push, reduce, blocks, got)
        assert _C.combine_push_blocks(push * 2, reduce, blocks) >= got  # more to push: no fewer

"""The host-side arithmetic of ``_C``'s intranode call bindings, checked against independent
references: the exact-mode row counts read off the rank prefix matrix, and the NaN fill word
the poison fold writes in each dtype. Runs wherever ``_C`` was built with the GPU kernels
(no GPU needed); the launches themselves are covered by ``tests/gpu/``."""

from __future__ import annotations

import random

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.errors import InvalidInputError

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
            assert _C.intranode_exact_rows(prefix, rank, num_ranks) == expected


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

"""The dispatch header the intranode notify step carries in one int64 per rank (kernels
backend), checked on the host from every rank's word."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from uccl_ep_megatron.backends.agreement.row import _DTYPE_NAMES, DTYPE_CODES
from uccl_ep_megatron.core.errors import InvalidInputError

_PACKED_FIELDS = (
    ("dtype", 8),
    ("num_topk", 8),
    ("num_scales", 12),
    ("hidden", 20),
    ("num_experts", 16),
)


def pack_dispatch_header(
    dtype: torch.dtype, hidden: int, num_scales: int, num_topk: int, num_experts: int
) -> int:
    """One int64 of what every rank's dispatch must agree on (fields past their width wrap,
    which can only hide a mismatch of values that large, never invent one)."""
    word, shift = 0, 0
    values = {
        "dtype": DTYPE_CODES.get(dtype, 0),
        "num_topk": num_topk,
        "num_scales": num_scales,
        "hidden": hidden,
        "num_experts": num_experts,
    }
    for name, bits in _PACKED_FIELDS:
        word |= (values[name] & ((1 << bits) - 1)) << shift
        shift += bits
    return word - (1 << 64) if word >= 1 << 63 else word


def pack_combine_header(dtype: torch.dtype, hidden: int, num_topk: int, num_bias: int) -> int:
    """``pack_dispatch_header``'s word for a combine: the weights' columns (0 without) in the
    top-k field, the bias count in the experts field."""
    return pack_dispatch_header(dtype, hidden, 0, num_topk, num_bias)


def describe_packed_header(word: int) -> str:
    word &= (1 << 64) - 1
    parts, shift = [], 0
    for name, bits in _PACKED_FIELDS:
        value = word >> shift & ((1 << bits) - 1)
        shift += bits
        parts.append(f"{name}={_DTYPE_NAMES.get(value, value) if name == 'dtype' else value}")
    return ", ".join(parts)


def check_packed_headers(words: Sequence[int], call: str) -> None:
    """Raise ``InvalidInputError`` naming every rank whose packed header differs from rank
    0's (every rank holds the same words, so every rank raises the same error)."""
    if all(w == words[0] for w in words):
        return
    rows = "; ".join(f"rank {r}: {describe_packed_header(w)}" for r, w in enumerate(words))
    raise InvalidInputError(
        f"{call}: the ranks disagree on the call ({rows}); every rank of the group must pass "
        "x of the same dtype and hidden size, the same top-k and num_experts, and FP8 on all "
        "ranks or none. No rank moved any data"
    )

"""The host checks of a call run on the GPU (``device_verdict``), for sync-free calls, and the
text of their verdict."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from uccl_ep_megatron.backends.agreement.row import (
    _AGREED,
    _ERROR_CLASSES,
    _FIELD_TEXT,
    _FIELDS,
    _MAGIC,
    COUNTS_COLUMN,
    EXPERTS_COLUMN,
    KIND_DISPATCH,
    describe_layout_bits,
    row_counts,
    row_num_tokens,
)

# Verdict codes of ``device_verdict``, in the order the host checks run (the first failing
# check, at its lowest rank, is the one reported).
VERDICTS = (
    "error",  # the rank's own argument checks failed (value: its error class code)
    "magic",  # a header of another format (value: its magic word)
    "buffer",  # the rank is in a call of another Buffer (value: that Buffer's number)
    "call",  # the rank is in another call of this Buffer (value: its call number)
    "field",  # a field that must agree differs from rank 0's (value: index into _AGREED)
    "expert_id",  # an expert id outside [-1, E) (value: the id)
    "layout",  # layout tensors that disagree with topk_idx (value: LAYOUT_BITS)
    "worst_differs",  # num_worst_tokens differs from rank 0's (value: the rank's)
    "worst_overflow",  # more rows arrive than num_worst_tokens (value: the rows)
    "worst_tokens",  # more tokens than num_worst_tokens (value: the tokens)
)


class VerdictColumns(NamedTuple):
    """Where ``device_verdict`` finds each header field in a row: what a GPU kernel that
    computes the same verdict (``_C.internode.call_verdict``) reads by name."""

    kind: int
    seq: int
    error: int
    magic: int
    buffer: int
    num_experts: int
    num_worst_tokens: int
    agreed: tuple[int, ...]
    checks: int  # id min, id max, layout bits
    experts: int  # the per-expert block (int32 slots, two to a word)
    counts: int  # rows each rank sends to every rank
    magic_value: int
    kind_dispatch: int


@functools.cache
def verdict_columns() -> VerdictColumns:
    at = _FIELDS.index
    return VerdictColumns(
        kind=at("kind"),
        seq=at("seq"),
        error=at("error"),
        magic=at("magic"),
        buffer=at("buffer"),
        num_experts=at("num_experts"),
        num_worst_tokens=at("num_worst_tokens"),
        agreed=tuple(at(f) for f in _AGREED),
        checks=len(_FIELDS),
        experts=EXPERTS_COLUMN,
        counts=COUNTS_COLUMN,
        magic_value=_MAGIC,
        kind_dispatch=KIND_DISPATCH,
    )


@functools.cache
def _agreed_columns(device: torch.device) -> torch.Tensor:
    """Columns of the ``_AGREED`` fields in a header row, on ``device`` (made once)."""
    return torch.tensor([_FIELDS.index(f) for f in _AGREED], dtype=torch.int64, device=device)


def device_verdict(rows: torch.Tensor) -> torch.Tensor:
    """The host checks of a call (``Agreement`` and ``Buffer._agree``) on the GPU, no sync.

    ``rows`` are every rank's all-gathered rows ``[R, width]`` of one sync-free call, where
    every rank passes the same ``num_worst_tokens`` W, receives at most W rows and has at most
    W tokens (the internode kernels size their tables from W). Returns int64 ``[3]``:
    (code, rank, value); code 0 when every check passes, else 1 + the index into ``VERDICTS``
    of the first failing check, the lowest failing rank and its value. Identical on every
    rank, since every rank holds the same rows.
    """
    col = {name: rows[:, i] for i, name in enumerate(_FIELDS)}
    n = len(_FIELDS)
    num_ranks = rows.shape[0]
    dev = rows.device
    dispatch = col["kind"] == KIND_DISPATCH
    # A cached device index: indexing a CUDA tensor with a Python list copies the list from
    # pageable memory and synchronizes (torch's sync debug mode caught it on the device).
    agreed = rows.index_select(1, _agreed_columns(dev))
    differs = agreed != agreed[:1]
    lo, hi, bits = rows[:, n], rows[:, n + 1], rows[:, n + 2]
    worst = col["num_worst_tokens"]
    received = row_counts(rows).sum(0)
    tokens = row_num_tokens(rows)
    checks = [
        (col["error"] != 0, col["error"]),
        (col["magic"] != _MAGIC, col["magic"]),
        (col["buffer"] != col["buffer"][:1], col["buffer"]),
        ((col["kind"] != col["kind"][:1]) | (col["seq"] != col["seq"][:1]), col["seq"]),
        (differs.any(1), differs.to(torch.int64).argmax(1)),
        (
            dispatch & (lo <= hi) & ((lo < -1) | (hi >= col["num_experts"])),
            torch.where(lo < -1, lo, hi),
        ),
        (dispatch & (bits != 0), bits),
        (dispatch & (worst != worst[:1]), worst),
        (dispatch & (received > worst), received),
        (dispatch & (tokens > worst), tokens),
    ]
    bad = torch.stack([c for c, _ in checks])  # [checks, R]
    values = torch.stack([v.to(torch.int64) for _, v in checks])
    keys = torch.arange(bad.numel(), device=dev).view_as(bad)
    first = torch.where(bad, keys, bad.numel()).min()
    found = first < bad.numel()
    at = torch.clamp(first, max=bad.numel() - 1)
    code = torch.where(found, at // num_ranks + 1, 0)
    rank = torch.where(found, at % num_ranks, 0)
    value = torch.where(found, values.flatten().gather(0, at.view(1))[0], 0)
    return torch.stack([code, rank, value]).to(torch.int64)


def verdict_message(code: int, rank: int, value: int) -> str:
    """The text of a ``device_verdict`` (code >= 1) for the error every rank raises."""
    what = VERDICTS[code - 1] if 1 <= code <= len(VERDICTS) else f"code {code}"
    if what == "error":
        cls = _ERROR_CLASSES[value - 1].__name__ if 1 <= value <= len(_ERROR_CLASSES) else value
        return (
            f"rank {rank} rejected its arguments ({cls}; that rank raised the details). No rank "
            "moved any data; fix the call on that rank"
        )
    if what == "magic":
        return (
            f"rank {rank} sent a call header of another format ({value:#x}); every rank must run "
            "the same uccl_ep_megatron version"
        )
    if what == "buffer":
        return (
            f"rank {rank} was in a call of Buffer #{value} while rank 0 was in another Buffer; "
            "every rank must call the Buffers of a group in the same order"
        )
    if what == "call":
        return (
            f"rank {rank} was in call #{value} of this Buffer while rank 0 was in another; every "
            "rank must make the same sequence of dispatch / cached dispatch / combine calls"
        )
    if what == "field":
        field = _AGREED[value] if 0 <= value < len(_AGREED) else f"field {value}"
        return (
            f"ranks disagree on {_FIELD_TEXT.get(field, field)}: rank {rank} differs from rank 0. "
            "Every rank must pass the same shapes, dtypes, flags and config to the same call"
        )
    if what == "expert_id":
        return (
            f"rank {rank}'s topk_idx contains expert id {value}; ids must be in [0, num_experts) "
            "or -1 for an unused slot"
        )
    if what == "layout":
        return f"rank {rank}: {describe_layout_bits(value)}"
    if what == "worst_differs":
        return (
            f"rank {rank} passed num_worst_tokens={value}, unlike rank 0; the internode kernels "
            "size their tables from it, so every rank must pass the same value"
        )
    if what == "worst_overflow":
        return (
            f"rank {rank} receives {value} rows, more than num_worst_tokens; pass "
            f"num_worst_tokens >= {value} (the worst case is num_tokens * num_ranks)"
        )
    if what == "worst_tokens":
        return (
            f"rank {rank} has {value} tokens, more than num_worst_tokens; the internode kernels "
            "need num_worst_tokens >= every rank's token count"
        )
    return f"rank {rank}: check {what} failed (value {value})"

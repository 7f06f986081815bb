"""The row: the call header every rank contributes, its encoding, and its decoded, checked form
(``Agreement``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from uccl_ep_megatron.core.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    InvalidInputError,
    UcclEpError,
    UnsupportedError,
)

KIND_DISPATCH, KIND_CACHED, KIND_COMBINE = 1, 2, 3
KIND_NAMES = {KIND_DISPATCH: "dispatch", KIND_CACHED: "cached dispatch", KIND_COMBINE: "combine"}
_MAGIC = 0x55455033  # "UEP3": a row of this layout (with the per-expert block)

# Stable codes of the x dtypes (the same on every rank and build).
_DTYPES = (
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e4m3fnuz,
)
DTYPE_CODES = {d: i + 1 for i, d in enumerate(_DTYPES)}
_DTYPE_NAMES = {i + 1: str(d).removeprefix("torch.") for i, d in enumerate(_DTYPES)}

# Error classes a rank can report through the flag (peers raise the same class).
_ERROR_CLASSES: tuple[type[UcclEpError], ...] = (
    InvalidInputError,
    BufferTooSmallError,
    UnsupportedError,
    CommTimeoutError,
    UcclEpError,
)

# Bits of the layout check word (``routing_check``).
LAYOUT_BITS = {
    1: "num_tokens_per_rank",
    2: "num_tokens_per_rdma_rank",
    4: "num_tokens_per_expert",
    8: "is_token_in_rank",
    16: "topk_idx (the same expert twice in one token)",
}


@dataclasses.dataclass(frozen=True)
class CallHeader:
    """One rank's view of a call. Every field but ``num_worst_tokens`` must agree."""

    kind: int
    seq: int  # this Buffer's count of dispatch/combine calls, this one included
    error: int = 0  # 0, or 1 + index into _ERROR_CLASSES: this rank's checks failed
    dtype: int = 0  # DTYPE_CODES of x
    hidden: int = 0
    num_scales: int = 0  # FP8 scales per row (0: not FP8)
    num_topk: int = 0  # dispatch: columns of topk_idx; combine: of topk_weights (0: none)
    num_experts: int = 0
    handle_seq: int = 0  # seq of the dispatch that made the handle (cached dispatch, combine)
    num_bias: int = 0
    num_sms: int = 0
    rdma_send: int = 0
    rdma_recv: int = 0
    num_worst_tokens: int = 0
    # The Buffer's number, agreed at construction (``agreement.group``): two Buffers of one
    # group called in different orders meet in one exchange over NCCL, and must not match.
    buffer: int = 0
    magic: int = _MAGIC


_FIELDS = tuple(f.name for f in dataclasses.fields(CallHeader))
_AGREED = tuple(
    f for f in _FIELDS if f not in ("kind", "seq", "error", "num_worst_tokens", "buffer", "magic")
)
_FIELD_TEXT = {
    "dtype": "the dtype of x",
    "hidden": "the hidden size of x",
    "num_scales": "FP8 scales per row (0 = not FP8)",
    "num_topk": "the top-k columns (0 = none passed)",
    "num_experts": "num_experts",
    "handle_seq": "the handle (number of the dispatch that made it)",
    "num_bias": "the number of bias tensors",
    "num_sms": "Config.num_sms",
    "rdma_send": "Config.num_max_rdma_chunked_send_tokens",
    "rdma_recv": "Config.num_max_rdma_chunked_recv_tokens",
}
_CHECK_WORDS = 3  # expert id min, max, layout bits

# Per-expert counts a row carries: a dispatch's tokens per expert travel with its header, so
# an exact dispatch needs no second exchange for them (each rank sums its own experts' columns
# on the device and reads only those back with the header). Every row has the block, whatever
# its call: the all-gather needs one width on every rank, and ranks that disagree on the call
# (one combines while another dispatches, or is in another Buffer) must still complete the
# exchange to learn it. So the width cannot follow a call's num_experts; it is fixed here. 512
# covers the routed experts of today's MoE models (DeepSeek-V3 256, Kimi K2 384, Qwen3-Next
# 512); a dispatch with more leaves the block zero and gathers its counts apart (the same
# numbers, one more exchange). Counts are int32 (a rank's tokens), two to a word: 2 KB a row.
EXPERT_SLOTS = 512
_EXPERT_WORDS = EXPERT_SLOTS // 2


def row_width(num_ranks: int) -> int:
    return len(_FIELDS) + _CHECK_WORDS + _EXPERT_WORDS + num_ranks + 1


class DispatchExperts(NamedTuple):
    """A non-cached dispatch's per-expert counts, which its row carries (``encode_row``), and
    what its exact-mode exchange reads back of every rank's (``local_expert_counts``)."""

    counts: torch.Tensor  # [E] tokens this rank sends to each expert (num_tokens_per_expert)
    alignment: int  # expert_alignment of the received counts

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[0])

    @property
    def carried(self) -> bool:
        """The row carries the counts (else the block is zero and they are gathered apart)."""
        return self.num_experts <= EXPERT_SLOTS


def error_class(code: int) -> type[UcclEpError]:
    """The class ``error_code`` encoded (``UcclEpError`` for an unknown code)."""
    return _ERROR_CLASSES[code - 1] if 1 <= code <= len(_ERROR_CLASSES) else UcclEpError


def error_code(exc: BaseException) -> int:
    for i, cls in enumerate(_ERROR_CLASSES):
        if type(exc) is cls:
            return i + 1
    for i, cls in enumerate(_ERROR_CLASSES):
        if isinstance(exc, cls):
            return i + 1
    return len(_ERROR_CLASSES)  # anything else is reported as a UcclEpError


def encode_row(
    header: CallHeader,
    num_ranks: int,
    device: torch.device,
    checks: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    num_tokens: int = 0,
    experts: DispatchExperts | None = None,
) -> torch.Tensor:
    """The int64 row this rank contributes; ``checks``, ``counts`` and ``experts.counts`` may
    be device tensors: [header fields | checks | per-expert block | counts per rank | tokens].

    The host-known words travel through pinned memory with an asynchronous copy, so building
    the row never waits for the GPU (a pageable copy would synchronize the stream). A row with
    nothing from the device (a combine, a cached dispatch, a rank whose checks failed) is
    built whole on the host: one copy instead of a copy, zero fills and a concatenation.
    """
    values = header_words(header)
    carried = experts is not None and experts.carried
    if checks is None and counts is None and not carried:
        middle = _CHECK_WORDS + _EXPERT_WORDS + num_ranks
        return _to_device(values + [0] * middle + [num_tokens], device)
    words = _to_device(values + [num_tokens], device)
    if checks is None:
        checks = torch.zeros(_CHECK_WORDS, dtype=torch.int64, device=device)
    if counts is None:
        counts = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    if carried:
        per_expert = experts.counts.to(device=device, dtype=torch.int32)
        block = torch.nn.functional.pad(per_expert, (0, EXPERT_SLOTS - experts.num_experts))
        block = block.view(torch.int64)
    else:
        block = torch.zeros(_EXPERT_WORDS, dtype=torch.int64, device=device)
    # torch.cat promotes the int32 counts to the int64 row in the same kernel.
    return torch.cat(
        [
            words[:-1],
            checks.to(device=device).reshape(_CHECK_WORDS),
            block,
            counts.to(device=device).reshape(num_ranks),
            words[-1:],
        ]
    )


def header_words(header: CallHeader) -> list[int]:
    """The host-known words of a row, in column order: the header fields."""
    return [getattr(header, f) for f in _FIELDS]


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    # Made in pinned memory directly (pin_memory() would copy a pageable tensor first).
    host = torch.tensor(values, dtype=torch.int64, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


# Columns of a row: the per-expert block after the header fields and checks, then the per-rank
# counts (the internode tables kernel takes this column), then the token count (last).
EXPERTS_COLUMN = len(_FIELDS) + _CHECK_WORDS
COUNTS_COLUMN = EXPERTS_COLUMN + _EXPERT_WORDS


def host_part(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, width - block]`` every column of the rows ``[R, width]`` but the per-expert block:
    what the host checks read (``Agreement.decode`` takes rows with or without the block)."""
    return torch.cat([rows[:, :EXPERTS_COLUMN], rows[:, COUNTS_COLUMN:]], 1, out=out)


def local_expert_counts(
    rows: torch.Tensor,
    rank: int,
    experts_per_rank: int,
    alignment: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[experts_per_rank]`` int64 rows ``rank`` receives per local expert, rounded up to
    ``alignment``: the sum over source ranks of the columns of its experts in the per-expert
    blocks of all-gathered rows ``[R, width]`` (no host sync)."""
    block = rows[:, EXPERTS_COLUMN:COUNTS_COLUMN].view(torch.int32)  # [R, EXPERT_SLOTS]
    lo = rank * experts_per_rank
    n = torch.sum(block[:, lo : lo + experts_per_rank], 0, dtype=torch.int64, out=out)
    if alignment > 1:
        n.add_(alignment - 1).div_(alignment, rounding_mode="floor").mul_(alignment)
    return n


def row_counts(rows: torch.Tensor) -> torch.Tensor:
    """``[R, R]`` counts of all-gathered rows ``[R, width]``: [s][r] = rows s sends to r."""
    return rows[:, COUNTS_COLUMN : COUNTS_COLUMN + rows.shape[0]]


def row_num_tokens(rows: torch.Tensor) -> torch.Tensor:
    """``[R]`` tokens of every rank, from all-gathered rows ``[R, width]``."""
    return rows[:, -1]


@dataclasses.dataclass(frozen=True)
class Agreement:
    """Every rank's row of one call, decoded (identical on every rank)."""

    headers: list[CallHeader]
    id_bounds: list[tuple[int, int]]  # per rank (min, max) of topk_idx; (0, -1) when empty
    layout_bits: list[int]
    counts: list[list[int]]  # counts[s][r]: rows rank s sends to rank r
    num_tokens: list[int]

    @staticmethod
    def decode(rows: Sequence[Sequence[int]]) -> Agreement:
        """``rows``: every rank's row as Python ints (``tolist``), with or without the
        per-expert block. Host time grows with the ranks: in an agreed call every rank sends
        the same header fields, so one ``CallHeader`` serves every rank that sent them."""
        n, num_ranks = len(_FIELDS), len(rows)
        made: dict[tuple[int, ...], CallHeader] = {}
        headers = []
        for row in rows:
            key = tuple(row[:n])
            header = made.get(key)
            if header is None:
                header = made[key] = CallHeader(*key)
            headers.append(header)
        return Agreement(
            headers,
            [(row[n], row[n + 1]) for row in rows],
            [row[n + 2] for row in rows],
            # From the end: rows read back without their per-expert block (host_part) or whole.
            [list(row[-1 - num_ranks : -1]) for row in rows],
            [row[-1] for row in rows],
        )

    @functools.cached_property
    def received(self) -> list[int]:
        """Rows each rank receives (column sums of ``counts``), summed once."""
        return [sum(column) for column in zip(*self.counts, strict=True)]

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, h in enumerate(self.headers) if h.error]

    def check(self, call: str) -> None:
        """Raise the same ``InvalidInputError`` on every rank when the ranks disagree."""
        hs = self.headers
        if hs[0].magic == _MAGIC and all(h is hs[0] for h in hs):
            return  # every rank sent one valid header (decode shares it): nothing disagrees
        if any(h.magic != _MAGIC for h in hs):
            bad = [r for r, h in enumerate(hs) if h.magic != _MAGIC]
            raise InvalidInputError(
                f"{call}: rank(s) {bad} sent a call header of another format; every rank must run "
                "the same uccl_ep_megatron version"
            )
        if len({h.buffer for h in hs}) > 1:
            where = ", ".join(
                f"rank {r} in {KIND_NAMES.get(h.kind, h.kind)} #{h.seq} of Buffer #{h.buffer}"
                for r, h in enumerate(hs)
            )
            raise InvalidInputError(
                f"ranks are in calls of different Buffers: {where}; every rank must call the "
                "Buffers of a group in the same order. No rank moved any data"
            )
        if len({(h.kind, h.seq) for h in hs}) > 1:
            where = ", ".join(
                f"rank {r} in {KIND_NAMES.get(h.kind, h.kind)} #{h.seq}" for r, h in enumerate(hs)
            )
            raise InvalidInputError(
                f"ranks are in different calls of this Buffer: {where}; every rank must make the "
                "same sequence of dispatch / cached dispatch / combine calls (e.g. backward on "
                "every rank, not on some)"
            )
        problems = []
        for f in _AGREED:
            values = [getattr(h, f) for h in hs]
            if len(set(values)) > 1:
                problems.append(f"{_FIELD_TEXT[f]}: {_by_value(f, values)}")
        if problems:
            raise InvalidInputError(
                f"{call}: ranks disagree on " + "; ".join(problems) + ". Every rank must pass "
                "the same shapes, dtypes, flags and config to the same call"
            )

    def check_routing(self, call: str) -> None:
        """Every rank's expert ids and layout tensors (from backends that check on the GPU)."""
        for r, h in enumerate(self.headers):
            lo, hi = self.id_bounds[r]
            if lo <= hi and (lo < -1 or hi >= h.num_experts):
                bad = lo if lo < -1 else hi
                raise InvalidInputError(
                    f"{call}: rank {r}'s topk_idx contains expert id {bad}; ids must be in "
                    f"[0, {h.num_experts}) or -1 for an unused slot"
                )
        for r, bits in enumerate(self.layout_bits):
            if bits:
                raise InvalidInputError(f"{call}: rank {r}: {describe_layout_bits(bits)}")

    def check_worst_tokens(self, call: str) -> None:
        """Every rank's ``num_worst_tokens`` against the rows it receives (non-cached dispatch)."""
        for r, (h, rows) in enumerate(zip(self.headers, self.received, strict=True)):
            if 0 < h.num_worst_tokens < rows:
                raise InvalidInputError(
                    f"{call}: rank {r} passed num_worst_tokens={h.num_worst_tokens} but receives "
                    f"{rows} rows; pass num_worst_tokens >= {rows} (the worst case is num_tokens * "
                    "num_ranks)"
                )


def describe_layout_bits(bits: int) -> str:
    wrong = [name for bit, name in LAYOUT_BITS.items() if bits & bit]
    verb = "disagrees" if len(wrong) == 1 else "disagree"
    return (
        f"{', '.join(wrong)} {verb} with topk_idx: pass the tensors "
        "get_dispatch_layout(topk_idx, num_experts) returned for this topk_idx, and give every "
        "token distinct experts"
    )


def _by_value(field: str, values: list[int]) -> str:
    groups: dict[int, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(v, []).append(r)
    show = (lambda v: _DTYPE_NAMES.get(v, str(v))) if field == "dtype" else str
    return ", ".join(
        f"{show(v)} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
        for v, rs in groups.items()
    )


def peer_error(call: str, agreement: Agreement, texts: list[Any]) -> UcclEpError:
    """The error every rank raises when some rank's own checks failed (``texts``: per rank
    ``(class name, message)`` or ``None``)."""
    failed = agreement.failed_ranks
    first = failed[0]
    cls = _ERROR_CLASSES[agreement.headers[first].error - 1]
    parts = []
    for r in failed:
        text = texts[r] if r < len(texts) else None
        detail = f"{text[0]}: {text[1]}" if text else "no message"
        parts.append(f"rank {r} rejected its arguments ({detail})")
    return cls(
        f"{call}: " + "; ".join(parts) + ". No rank moved any data; fix the call on that rank"
    )


def describe_error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)

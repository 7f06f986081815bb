"""Agreement before action: the per-call header every rank exchanges with its counts.

Before a dispatch, cached dispatch or combine moves any byte, each rank contributes one
fixed-size row to an all-gather over the group: a header describing the call as this rank sees
it (which call of the ``Buffer``, dtype, hidden size, top-k, experts, FP8 scales, handle,
config, and an error flag when its own argument checks failed), the routing checks that need
the GPU (expert-id bounds, layout-vs-``topk_idx`` mismatches), and the counts the call needs
anyway (tokens sent to each rank, tokens of this rank). Every rank then holds every rank's row
and runs the same checks on the same data, so when ranks disagree, or one rank rejected its
arguments, every rank raises the same error naming the rank, the call and the reason, instead
of one rank failing alone while the others wait in a collective (or, worse, move bytes laid out
differently: a bf16 1.0 read as fp16 arrives as 1.875).

The row has the same length on every rank whatever the call (header, 3 check words, one count
per rank, the token count), so even ranks in different calls complete the exchange and report
it. A rank whose checks failed still takes part, with the error flag set; the text of its error
then follows in a second exchange that only the error path makes.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from uccl_ep_megatron.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    InvalidInputError,
    UcclEpError,
    UnsupportedError,
)

KIND_DISPATCH, KIND_CACHED, KIND_COMBINE = 1, 2, 3
KIND_NAMES = {KIND_DISPATCH: "dispatch", KIND_CACHED: "cached dispatch", KIND_COMBINE: "combine"}
_MAGIC = 0x55455031  # "UEP1": a row of this layout

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
    magic: int = _MAGIC


_FIELDS = tuple(f.name for f in dataclasses.fields(CallHeader))
_AGREED = tuple(
    f for f in _FIELDS if f not in ("kind", "seq", "error", "num_worst_tokens", "magic")
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


def row_width(num_ranks: int) -> int:
    return len(_FIELDS) + _CHECK_WORDS + num_ranks + 1


# The dispatch header the intranode notify step carries in one int64 per rank (kernels backend):
# dtype code 8 bits, top-k 8, FP8 scales per row 12, hidden 20, experts 16.
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
) -> torch.Tensor:
    """The int64 row this rank contributes; ``checks`` and ``counts`` may be device tensors.

    The host-known words travel through pinned memory with an asynchronous copy, so building
    the row never waits for the GPU (a pageable copy would synchronize the stream).
    """
    host = torch.tensor([getattr(header, f) for f in _FIELDS] + [num_tokens], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    words = host.to(device, non_blocking=True)
    if checks is None:
        checks = torch.zeros(_CHECK_WORDS, dtype=torch.int64, device=device)
    if counts is None:
        counts = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    return torch.cat(
        [
            words[:-1],
            checks.to(device=device, dtype=torch.int64).reshape(_CHECK_WORDS),
            counts.to(device=device, dtype=torch.int64).reshape(num_ranks),
            words[-1:],
        ]
    )


def row_counts(rows: torch.Tensor) -> torch.Tensor:
    """``[R, R]`` counts of all-gathered rows ``[R, width]``: [s][r] = rows s sends to r."""
    start = len(_FIELDS) + _CHECK_WORDS
    return rows[:, start : start + rows.shape[0]]


def row_num_tokens(rows: torch.Tensor) -> torch.Tensor:
    """``[R]`` tokens of every rank, from all-gathered rows ``[R, width]``."""
    return rows[:, -1]


# Verdict codes of ``device_verdict``, in the order the host checks run (the first failing
# check, at its lowest rank, is the one reported).
VERDICTS = (
    "error",  # the rank's own argument checks failed (value: its error class code)
    "magic",  # a header of another format (value: its magic word)
    "call",  # the rank is in another call of this Buffer (value: its call number)
    "field",  # a field that must agree differs from rank 0's (value: index into _AGREED)
    "expert_id",  # an expert id outside [-1, E) (value: the id)
    "layout",  # layout tensors that disagree with topk_idx (value: LAYOUT_BITS)
    "worst_differs",  # num_worst_tokens differs from rank 0's (value: the rank's)
    "worst_overflow",  # more rows arrive than num_worst_tokens (value: the rows)
    "worst_tokens",  # more tokens than num_worst_tokens (value: the tokens)
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
        n, c = len(_FIELDS), _CHECK_WORDS
        headers, bounds, bits, counts, tokens = [], [], [], [], []
        for row in rows:
            row = [int(v) for v in row]
            values = dict(zip(_FIELDS, row[:n], strict=True))
            headers.append(CallHeader(**values))
            bounds.append((row[n], row[n + 1]))
            bits.append(row[n + 2])
            counts.append(row[n + c : -1])
            tokens.append(row[-1])
        return Agreement(headers, bounds, bits, counts, tokens)

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, h in enumerate(self.headers) if h.error]

    def check(self, call: str) -> None:
        """Raise the same ``InvalidInputError`` on every rank when the ranks disagree."""
        hs = self.headers
        if any(h.magic != _MAGIC for h in hs):
            bad = [r for r, h in enumerate(hs) if h.magic != _MAGIC]
            raise InvalidInputError(
                f"{call}: rank(s) {bad} sent a call header of another format; every rank must run "
                "the same uccl_ep_megatron version"
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
        for r, h in enumerate(self.headers):
            rows = sum(c[r] for c in self.counts)
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


# ---- bounded waits for collectives --------------------------------------------------------------
def timeout_error(rank: int, what: str, call: str, timeout_ms: int) -> CommTimeoutError:
    return CommTimeoutError(
        f"rank {rank}: {what} of {call} did not complete within UCCL_EP_TIMEOUT_MS={timeout_ms} "
        "ms: another rank of the group did not reach the same call (it crashed, raised before "
        "the call, destroyed its Buffer, or is in another collective). Raise UCCL_EP_TIMEOUT_MS "
        "if it is only slow. This Buffer is unusable now."
    )


def wait_work(work: Any, timeout_ms: int, on_timeout: Callable[[], UcclEpError]) -> None:
    """``work.wait`` bounded by ``timeout_ms`` (CPU / gloo collectives)."""
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=timeout_ms))
    except RuntimeError as exc:
        raise on_timeout() from exc


def wait_stream(timeout_ms: int, on_timeout: Callable[[], UcclEpError]) -> None:
    """Wait for the current CUDA stream's work so far, giving up after ``timeout_ms``."""
    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + timeout_ms / 1e3
    spins = 0
    while not event.query():
        spins += 1
        if spins > 64:
            if time.monotonic() > deadline:
                raise on_timeout()
            time.sleep(50e-6)


__all__ = [
    "Agreement",
    "CallHeader",
    "DTYPE_CODES",
    "KIND_CACHED",
    "KIND_COMBINE",
    "KIND_DISPATCH",
    "KIND_NAMES",
    "LAYOUT_BITS",
    "VERDICTS",
    "describe_error",
    "device_verdict",
    "describe_layout_bits",
    "encode_row",
    "error_code",
    "peer_error",
    "row_counts",
    "row_num_tokens",
    "row_width",
    "timeout_error",
    "verdict_message",
    "wait_stream",
    "wait_work",
]

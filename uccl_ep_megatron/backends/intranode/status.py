"""What the intranode kernels report, in words: the exception each status-word code becomes
(their layout: ``csrc/kernels/intranode.h``), every rank's notify checks, and the call
descriptions the errors quote."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from uccl_ep_megatron.backends.agreement import check_packed_headers, error_class
from uccl_ep_megatron.backends.base import check_expert_ids
from uccl_ep_megatron.core._c import load as load_c
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError, UcclEpError

_SITES = {
    1: "dispatch notify",
    2: "dispatch receive",
    3: "combine entry",
    4: "combine receive",
    5: "dispatch receive-entry",  # a sender waiting for a peer's zero-copy output addresses
    6: "combine done",  # a rank combining in place, waiting for a peer to finish reading its x
}
# kCheckWords of intranode.h (_C.NOTIFY_CHECK_WORDS): one row of notify's input checks per rank
CHECK_WORDS = 6
# Kinds of a peer's abort record (abort_word in intranode.h): it rejected its arguments, one of
# its kernel waits timed out, or its host gave up on the call (interrupted, failed, stuck); or
# its process exited (posted in its name by the rank that saw it exit, into its own region).
ABORT_REJECTED, ABORT_TIMED_OUT, ABORT_HOST_GAVE_UP, ABORT_PEER_EXITED = 1, 2, 3, 4

# Host waits on the GPU that the CUDA runtime does not see: an exact dispatch spins on the
# counts its notify writes into mapped host memory (no synchronize, no copy). Counted per
# process so that sync counters (bench layer, tests) can add them to the runtime's.
_host_waits = 0


def note_host_wait() -> None:
    global _host_waits
    _host_waits += 1


def host_waits() -> int:
    """Host waits on mapped memory so far in this process (exact dispatches' count reads)."""
    return _host_waits


def describe_call(
    call: str, dtype: torch.dtype, hidden: int, num_scales: int, extra: str = ""
) -> str:
    fp8 = f", FP8 scales={num_scales}" if num_scales else ""
    tail = f", {extra}" if extra else ""
    return f"{call} (dtype={str(dtype).removeprefix('torch.')}, hidden={hidden}{fp8}{tail})"


def check_all_ranks(rows: list[int], num_experts: int) -> None:
    """Raise the first bad input of any rank, on every rank. ``rows`` holds each rank's notify
    checks (id min, id max, first rank whose ``num_tokens_per_rank`` entry differs from
    ``is_token_in_rank``'s column, that entry, that column's sum, the packed call header),
    identical everywhere, so all ranks raise together at the same call instead of the others
    waiting for that rank's rows until the timeout, rows landing past outputs sized from the
    wrong count, or bytes of one dtype read as another."""
    if load_c().notify_checks_good(rows, num_experts):
        return  # every rank's words are good: the per-rank checks below would pass (host time)
    w = CHECK_WORDS
    check_packed_headers(rows[w - 1 :: w], "dispatch")
    for r in range(len(rows) // w):
        lo, hi, dest, given, actual = rows[r * w : r * w + 5]
        try:
            check_expert_ids(lo, hi, num_experts)
        except InvalidInputError as exc:
            raise InvalidInputError(f"rank {r}: {exc}") from None
        if dest >= 0:
            raise InvalidInputError(
                f"rank {r}: num_tokens_per_rank[{dest}]={given} but is_token_in_rank marks "
                f"{actual} tokens for rank {dest}; pass the layout tensors that "
                "get_dispatch_layout(topk_idx) returns"
            )


def abort_word(kind: int, code: int = 0, site: int = 0, peer: int = 0, seq: int = 0) -> int:
    """An abort record's word as ``abort_word`` of intranode.h packs it:
    ``{seq:32 | peer waited for:8 | site:8 | kind:8 | error class code:8}``."""
    return (
        (seq & 0xFFFFFFFF) << 32
        | (peer & 0xFF) << 24
        | (site & 0xFF) << 16
        | (kind & 0xFF) << 8
        | (code & 0xFF)
    )


def gave_up_reason(rank: int, call: str, error: BaseException) -> str:
    """What a rank whose host gives up on ``call`` tells its peers (the wording of the
    store's "gave up" record, ``agreement/group.py``)."""
    text = str(error).removeprefix(f"rank {rank}: ")
    if isinstance(error, CommTimeoutError):
        return f"rank {rank} gave up on {call}: {text.split('; ', 1)[0]}"
    if isinstance(error, Exception):
        return f"rank {rank} abandoned {call}: {type(error).__name__}: {text.split('. ', 1)[0]}"
    return f"rank {rank} was interrupted ({type(error).__name__}) in {call}"


def peer_abort_error(
    rank: int, peer: int, word: int, reason: str, timeout_ms: int, call: str
) -> UcclEpError:
    """The exception of a rank whose wait (or barrier, passed before the peer gave up) found
    rank ``peer``'s abort record ``(word, reason)`` in this rank's ``call``."""
    kind, code = word >> 8 & 0xFF, word & 0xFF
    unusable = "This Buffer is unusable now; create a new one on every rank."
    if kind == ABORT_TIMED_OUT:
        site, waited, seq = word >> 16 & 0xFF, word >> 24 & 0xFF, word >> 32
        who = "this rank" if waited == rank else f"rank {waited}"
        return CommTimeoutError(
            f"rank {rank}: {call} cannot complete: rank {peer} gave up on the "
            f"{_SITES.get(site, f'site {site}')} barrier (#{seq}) after UCCL_EP_TIMEOUT_MS="
            f"{timeout_ms} ms waiting for {who}, and moves no more data in this Buffer ({who} "
            "was late, crashed or called a different sequence of collectives; raise "
            f"UCCL_EP_TIMEOUT_MS if it is only slow). That call's outputs were not written. "
            f"{unusable}"
        )
    if kind == ABORT_PEER_EXITED:
        return peer_exited_error(rank, call, reason or f"rank {peer}'s process exited")
    if kind == ABORT_HOST_GAVE_UP:
        return UcclEpError(
            f"rank {rank}: {call} cannot complete: {reason or f'rank {peer} gave up on a call'}; "
            f"it moves no more data in this Buffer. {unusable}"
        )
    return error_class(code)(
        f"rank {rank}: rank {peer} rejected its arguments ({reason}); no "
        f"rank moved data for that call. Fix the call on rank {peer}. {unusable}"
    )


def peer_exited_reason(peer: int, pid: int) -> str:
    """The abort record's text of a peer whose process exited (what ``peer_exited_error``
    quotes)."""
    return f"rank {peer}'s process (pid {pid}) exited"


def peer_exited_error(rank: int, call: str, reason: str) -> CommTimeoutError:
    """The exception of a rank whose ``call`` cannot complete because a peer's process exited
    (``reason``: ``peer_exited_reason``)."""
    return CommTimeoutError(
        f"rank {rank}: {call} cannot complete: {reason} (seen as it happened, not after "
        "UCCL_EP_TIMEOUT_MS); that rank moves no more data and the group cannot go on without "
        "it. The process group is gone: restart the job on every rank (that rank's own log "
        "says why it died)."
    )


def status_error(
    c: Any,
    words: tuple[int, int, int, int],
    rank: int,
    timeout_ms: int,
    last_header: str,
    read_abort: Callable[[int], tuple[int, str]],
) -> UcclEpError:
    """The exception the status words ``(code, a, b, extra)`` describe on ``rank``.

    ``last_header`` describes this rank's last device-checked call; ``read_abort(a)`` reads
    rank ``a``'s abort record (word, reason) from this rank's control region.
    """
    code, a, b, extra = words
    if code == c.STATUS_TIMEOUT:
        return CommTimeoutError(
            f"rank {rank}: timed out after {timeout_ms} ms at the "
            f"{_SITES.get(extra, f'site {extra}')} barrier (#{b}) waiting for rank {a}; "
            f"rank {a} did not reach the same dispatch/combine call (crashed, or called a "
            "different sequence of collectives). Raise UCCL_EP_TIMEOUT_MS if it is only "
            "slow. This Buffer is unusable now; create a new one."
        )
    if code == c.STATUS_PEER_ABORT:
        word, reason = read_abort(a)
        return peer_abort_error(rank, a, word, reason, timeout_ms, f"this rank's {last_header}")
    if code == c.STATUS_HEADER_MISMATCH:
        return InvalidInputError(
            f"rank {rank}: the call of rank {a} differs from this rank's "
            f"{last_header}: every rank must pass x of the same dtype and hidden size "
            "(FP8 on all ranks or none), the same top-k and num_experts and, to combine, "
            "topk_weights on all ranks or none and the same number of biases. That call's "
            "outputs were NaN (no data moved). This Buffer is unusable now; create a new one."
        )
    after = (
        " A sync-free call (num_worst_tokens > 0) found it on the GPU: that call's outputs "
        "and those of every later call of this Buffer hold NaN rows, -1 ids and source "
        "indices and 0 weights. This Buffer is unusable now; create a new one."
    )
    if code == c.STATUS_BAD_EXPERT_ID:
        return InvalidInputError(
            f"rank {a}: topk_idx contains expert id {b}; ids must be in [0, {extra}) or -1 "
            f"for an unused slot.{after}"
        )
    if code == c.STATUS_LAYOUT_MISMATCH:
        given, actual = extra >> 32, ((extra & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000
        return InvalidInputError(
            f"rank {a}: num_tokens_per_rank[{b}]={given} but is_token_in_rank marks "
            f"{actual} tokens for rank {b}; pass the layout tensors that "
            f"get_dispatch_layout(topk_idx) returns.{after}"
        )
    if code == c.STATUS_DISPATCH_OVERFLOW:
        return InvalidInputError(
            f"num_worst_tokens={extra} but rank {a} receives {b} rows; pass "
            f"num_worst_tokens >= {b} (the worst case is num_tokens * num_ranks).{after}"
        )
    if code == c.STATUS_COMBINE_OVERFLOW:
        return InvalidInputError(
            f"combine of a sync-free handle: rank {a} gets {b} rows back but the combine "
            f"staging holds num_worst_tokens={extra} rows per rank; pass num_worst_tokens >= "
            f"(num_ranks - 1) * num_tokens (num_tokens * num_ranks always fits).{after}"
        )
    return UcclEpError(f"status words report unknown code {code} ({a}, {b}, {extra})")

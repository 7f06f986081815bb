"""CPU checks of the ``kernels`` backend's host-side decisions that need no GPU: the exception
each status-word code becomes (what ``Buffer.check_errors()`` and the next call raise after a
sync-free call found bad input on the GPU), and the guard that refuses to grow the buffer while
a CUDA graph is captured or after one was. Needs ``_C`` built with the GPU kernels (for the
status codes); the device tests are tests/gpu/test_sync_free.py."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.backends.base import Topology
from uccl_ep_megatron.core.errors import BufferTooSmallError, CommTimeoutError, InvalidInputError

if not _C.kernels_built():  # the status codes below are attributes of a GPU build only
    pytest.skip("_C was built without the GPU kernels", allow_module_level=True)


def _backend(sizes: tuple[int, ...] = (1 << 20, 1 << 20)):
    """A KernelsBackend with only the host state these decisions read (no GPU, no group)."""
    from uccl_ep_megatron.backends.intranode.backend import KernelsBackend

    be = object.__new__(KernelsBackend)
    be._c = _C
    be.topology = Topology(rank=1, num_ranks=len(sizes), ranks_per_node=len(sizes))
    be._timeout_ms = 250
    be._last_call = ("dispatch", torch.bfloat16, 7168, 0)
    be._reported = False
    be._captured = False
    be._region_lock = threading.Lock()  # a regrow holds it (the liveness watcher's posts)
    grows: list[int] = []
    be._ipc = types.SimpleNamespace(sizes=list(sizes), grow=lambda needs, what: grows.append(1))
    return be, grows


def test_status_codes_are_distinct():
    codes = [
        _C.STATUS_TIMEOUT,
        _C.STATUS_BAD_EXPERT_ID,
        _C.STATUS_LAYOUT_MISMATCH,
        _C.STATUS_DISPATCH_OVERFLOW,
        _C.STATUS_COMBINE_OVERFLOW,
    ]
    assert len(set(codes)) == len(codes) and 0 not in codes


@pytest.mark.parametrize(
    "words, kind, needles",
    [
        ((_C.STATUS_TIMEOUT, 0, 17, 3), CommTimeoutError, ["waiting for rank 0", "combine entry"]),
        (
            (_C.STATUS_BAD_EXPERT_ID, 3, 300, 256),
            InvalidInputError,
            ["rank 3:", "expert id 300", "[0, 256)", "unusable"],
        ),
        (
            (_C.STATUS_LAYOUT_MISMATCH, 2, 0, (5 << 32) | 7),
            InvalidInputError,
            ["rank 2:", "num_tokens_per_rank[0]=5", "marks 7 tokens", "get_dispatch_layout"],
        ),
        (
            (_C.STATUS_DISPATCH_OVERFLOW, 0, 1600, 1599),
            InvalidInputError,
            ["num_worst_tokens=1599", "rank 0 receives 1600 rows", ">= 1600"],
        ),
        (
            (_C.STATUS_COMBINE_OVERFLOW, 1, 900, 800),
            InvalidInputError,
            ["rank 1 gets 900 rows back", "num_worst_tokens=800"],
        ),
        (
            (_C.STATUS_HEADER_MISMATCH, 0, 5, 1),
            InvalidInputError,
            ["call of rank 0 differs from this rank's dispatch (dtype=bfloat16, hidden=7168)"],
        ),
    ],
)
def test_status_words_name_rank_and_value(words, kind, needles):
    be, _ = _backend()
    err = be._status_error(*words)
    assert type(err) is kind, err
    assert all(n in str(err) for n in needles), str(err)
    # An input error counts as reported, so destroy() does not raise it a second time.
    assert be._reported == (kind is InvalidInputError)


def test_grow_refused_while_capturing_and_after_a_capture():
    be, grows = _backend()
    be._fit(1 << 10, "dispatch of 1 row", capturing=True)  # fits: nothing to grow
    with pytest.raises(BufferTooSmallError, match="while a CUDA graph is being captured"):
        be._fit(1 << 21, "dispatch of up to 64 rows", capturing=True)
    assert grows == []
    be._fit(1 << 21, "dispatch of up to 64 rows", capturing=False)
    assert grows == [1]  # eager, never captured: grows
    be._captured = True
    with pytest.raises(BufferTooSmallError, match=r"num_nvl_bytes >= 4194304"):
        be._fit(1 << 22, "combine of up to 64 rows", capturing=False)
    assert grows == [1]


def test_check_all_ranks_raises_exactly_for_bad_words():
    # Notify's per-rank check rows (id min, id max, first disagreeing rank, its two counts,
    # packed header), random good and bad: raising must match an independent per-rank judgement,
    # and a bad row's error names its rank.
    import random

    from uccl_ep_megatron.backends.intranode.status import CHECK_WORDS, check_all_ranks

    rng = random.Random(7)
    experts = 64
    for _ in range(2000):
        ranks = rng.choice([1, 2, 4, 8])
        rows, bad_ranks, headers = [], [], []
        for r in range(ranks):
            lo = rng.choice([-1, 0, 3, -1, -2, -5])
            hi = rng.choice([experts - 1, 0, 10, -1, experts, experts + 7])
            dest = rng.choice([-1, -1, -1, 0, 2])
            header = rng.choice([5, 5, 5, 5, 9])
            rows += [lo, hi, dest, 3, 4] + [0] * (CHECK_WORDS - 6) + [header]
            headers.append(header)
            if lo < -1 or hi >= experts or dest >= 0:
                bad_ranks.append(r)
        expect_bad = bool(bad_ranks) or len(set(headers)) > 1
        try:
            check_all_ranks(rows, experts)
            raised = None
        except InvalidInputError as exc:
            raised = str(exc)
        assert (raised is not None) == expect_bad, (rows, raised)
        if raised is not None and len(set(headers)) == 1:
            assert raised.startswith(f"rank {bad_ranks[0]}: "), (rows, raised)


def test_notify_checks_good_reads_whole_rows_only():
    # The predicate the kernels backend trusts before judging rows one by one (also inside
    # intranode_ahead_finish): rows of NOTIFY_CHECK_WORDS, the Python constant's width; a
    # partial row or no row at all is never called good.
    from uccl_ep_megatron.backends.intranode.status import CHECK_WORDS
    from uccl_ep_megatron.core._c import load

    c = load()
    assert c.NOTIFY_CHECK_WORDS == CHECK_WORDS
    good = [-1, 63, -1, 0, 0, 5]
    assert c.notify_checks_good(good * 3, 64)
    assert not c.notify_checks_good(good * 3, 63)  # id 63 of 63 experts
    assert not c.notify_checks_good(good * 3 + [0], 64)
    assert not c.notify_checks_good([], 64)
    assert not c.notify_checks_good(good + good[:-1] + [6], 64)  # two headers

"""The call-header row with its per-expert block, and what an exact internode dispatch reads of
the gathered rows: one copy holding every rank's row without the block and this rank's local
experts' received counts, checked on CPU against plain Python loops over the same counts.

The internode exchange itself (``CallHeaderExchange``) runs here with the all-gather replaced by
stacking every rank's row, which is what ``all_gather_into_tensor`` returns, and the bounded
stream wait replaced by a plain read: the rest (layout, sums, alignment, split, checks) is the
product code.
"""

from __future__ import annotations

import random

import pytest
import torch

from uccl_ep_megatron.backends.agreement import (
    EXPERT_SLOTS,
    KIND_CACHED,
    KIND_COMBINE,
    KIND_DISPATCH,
    VERDICTS,
    Agreement,
    CallHeader,
    DispatchExperts,
    device_verdict,
    encode_row,
    error_code,
    host_part,
    local_expert_counts,
    row_counts,
    row_num_tokens,
    row_width,
)
from uccl_ep_megatron.backends.base import Topology
from uccl_ep_megatron.backends.internode.header import CallHeaderExchange
from uccl_ep_megatron.core.errors import InvalidInputError

CPU = torch.device("cpu")


def _dispatch_row(world, seq, per_expert, alignment=1, counts=None, tokens=7, worst=0):
    header = CallHeader(
        kind=KIND_DISPATCH,
        seq=seq,
        dtype=1,
        hidden=256,
        num_topk=2,
        num_experts=len(per_expert),
        num_sms=24,
        num_worst_tokens=worst,
        buffer=3,
    )
    if counts is None:
        counts = list(range(world))
    experts = DispatchExperts(torch.tensor(per_expert, dtype=torch.int32), alignment)
    checks = torch.tensor([0, len(per_expert) - 1, 0])
    row = encode_row(
        header, world, CPU, checks, torch.tensor(counts, dtype=torch.int32), tokens, experts
    )
    return row, experts


def _combine_row(world, seq):
    header = CallHeader(kind=KIND_COMBINE, seq=seq, dtype=1, hidden=256, handle_seq=1, buffer=3)
    return encode_row(header, world, CPU)


def _oracle(per_expert: list[list[int]], rank: int, alignment: int) -> list[int]:
    """Rows ``rank`` receives per local expert, aligned: plain loops over every source."""
    world, num_experts = len(per_expert), len(per_expert[0])
    epr = num_experts // world
    out = []
    for e in range(rank * epr, (rank + 1) * epr):
        total = 0
        for src in range(world):
            total += per_expert[src][e]
        out.append((total + alignment - 1) // alignment * alignment)
    return out


@pytest.mark.parametrize("world", [2, 4, 16, 64])
def test_rows_of_every_call_have_one_width(world):
    """The all-gather needs one width on every rank, whatever call each rank is in."""
    small, _ = _dispatch_row(world, 2, [1] * (2 * world))
    full, _ = (
        _dispatch_row(world, 2, [1] * EXPERT_SLOTS) if EXPERT_SLOTS % world == 0 else (small, 0)
    )
    over, _ = _dispatch_row(world, 2, [1] * (EXPERT_SLOTS + world))
    cached = encode_row(CallHeader(kind=KIND_CACHED, seq=2, handle_seq=1), world, CPU)
    failed = encode_row(CallHeader(kind=KIND_DISPATCH, seq=2, error=1), world, CPU)
    rows = [small, full, over, cached, failed, _combine_row(world, 2)]
    assert {tuple(r.shape) for r in rows} == {(row_width(world),)}
    assert all(r.dtype == torch.int64 for r in rows)
    # More experts than the block holds: the block stays zero (gathered apart), the rest is intact.
    decoded = Agreement.decode([over.tolist()] * world)
    assert decoded.headers[0].num_experts == EXPERT_SLOTS + world
    assert decoded.counts[0] == list(range(world)) and decoded.num_tokens[0] == 7


@pytest.mark.parametrize("seed", range(8))
def test_local_expert_counts_equal_plain_loops(seed):
    rnd = random.Random(seed)
    world = rnd.choice([2, 3, 4, 8, 16])
    epr = rnd.randint(1, EXPERT_SLOTS // world)
    num_experts = world * epr
    alignment = rnd.choice([1, 2, 4, 16, 128])
    per_expert = [
        [rnd.choice([0, rnd.randint(0, 5000)]) for _ in range(num_experts)] for _ in range(world)
    ]
    rows = torch.stack([_dispatch_row(world, 5, per_expert[r], alignment)[0] for r in range(world)])
    for rank in range(world):
        got = local_expert_counts(rows, rank, epr, alignment)
        assert got.dtype == torch.int64
        assert got.tolist() == _oracle(per_expert, rank, alignment), (rank, alignment)


def test_host_part_decodes_like_the_whole_rows():
    rnd = random.Random(3)
    world = 4
    counts = [[rnd.randint(0, 99) for _ in range(world)] for _ in range(world)]
    tokens = [rnd.randint(0, 99) for _ in range(world)]
    rows = torch.stack(
        [
            _dispatch_row(world, 2, [r + 1] * 16, counts=counts[r], tokens=tokens[r])[0]
            for r in range(world)
        ]
    )
    whole, part = Agreement.decode(rows.tolist()), Agreement.decode(host_part(rows).tolist())
    assert whole == part
    assert part.counts == counts and part.num_tokens == tokens
    assert row_counts(rows).tolist() == counts and row_num_tokens(rows).tolist() == tokens


class _Exchange(CallHeaderExchange):
    """The internode header exchange of rank ``rank``, the all-gather given as stacked rows."""

    def __init__(self, rank: int, world: int, gathered: torch.Tensor) -> None:
        self.topology = Topology(rank=rank, num_ranks=world, ranks_per_node=1)
        self._gathered = gathered
        self._init_header_exchange()

    def check(self) -> None:
        pass

    def _gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return self._gathered

    def _read(self, t: torch.Tensor, what: str, call: str) -> list:
        self.reads = getattr(self, "reads", 0) + 1
        self.read_words = t.numel()
        return t.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_exact_dispatch_reads_rows_and_local_counts_in_one_copy(seed):
    rnd = random.Random(100 + seed)
    world = rnd.choice([2, 4, 8])
    epr = rnd.randint(1, 64)
    alignment = rnd.choice([1, 8, 128])
    per_expert = [[rnd.randint(0, 300) for _ in range(world * epr)] for _ in range(world)]
    built = [_dispatch_row(world, 4, per_expert[r], alignment) for r in range(world)]
    gathered = torch.stack([row for row, _ in built])
    for rank in range(world):
        ex = _Exchange(rank, world, gathered)
        rows = ex.exchange_header(built[rank][0], "dispatch #4", built[rank][1])
        assert ex.reads == 1
        # Never the [R, E] counts: the header part of every row, and this rank's experts.
        assert ex.read_words == world * (row_width(world) - EXPERT_SLOTS // 2) + epr
        assert Agreement.decode(rows) == Agreement.decode(gathered.tolist())
        taken = ex._take_rows()
        want = _oracle(per_expert, rank, alignment)
        assert taken.experts.host == want
        assert taken.experts.device.dtype == torch.int32
        assert taken.experts.device.tolist() == want
        assert taken.rows is gathered and taken.verdict is None


def test_combine_and_oversized_dispatch_read_no_expert_counts():
    world = 2
    combine = torch.stack([_combine_row(world, 3)] * world)
    ex = _Exchange(0, world, combine)
    rows = ex.exchange_header(combine[0], "combine #3")
    assert ex.reads == 1 and ex._take_rows().experts is None
    assert [Agreement.decode(rows).headers[r].kind for r in range(world)] == [KIND_COMBINE] * 2
    over = [_dispatch_row(world, 3, [1] * (EXPERT_SLOTS + 2)) for _ in range(world)]
    ex = _Exchange(1, world, torch.stack([row for row, _ in over]))
    ex.exchange_header(over[1][0], "dispatch #3", over[1][1])
    assert ex._take_rows().experts is None  # gathered apart by the dispatch (same numbers)


def test_rank_in_dispatch_while_another_combines_is_detected():
    """One rank dispatches (its row full of counts) while the other combines: the rows have
    one width, so the exchange completes and both the host checks and the GPU verdict name it."""
    world = 2
    dispatch_row, experts = _dispatch_row(world, 2, [5] * 8)
    gathered = torch.stack([dispatch_row, _combine_row(world, 2)])
    for rank, (row, exp) in enumerate([(dispatch_row, experts), (gathered[1], None)]):
        rows = _Exchange(rank, world, gathered).exchange_header(row, "call #2", exp)
        with pytest.raises(InvalidInputError, match="rank 0 in dispatch #2, rank 1 in combine #2"):
            Agreement.decode(rows).check("call #2")
    code, rank, value = device_verdict(gathered).tolist()
    assert (VERDICTS[code - 1], rank) == ("call", 1)


def test_worst_tokens_that_differ_raise_on_the_exact_ranks():
    world = 2
    exact, experts = _dispatch_row(world, 2, [1] * 4)
    sync_free, _ = _dispatch_row(world, 2, [1] * 4, worst=64)
    gathered = torch.stack([exact, sync_free])
    with pytest.raises(InvalidInputError, match="rank 1 passed num_worst_tokens=64"):
        _Exchange(0, world, gathered).exchange_header(exact, "dispatch #2", experts)


def test_failed_rank_row_reports_its_error_class():
    world = 4
    ok = [_dispatch_row(world, 2, [1] * 8)[0] for _ in range(world - 1)]
    failed = encode_row(
        CallHeader(kind=KIND_DISPATCH, seq=2, error=error_code(InvalidInputError("x")), buffer=3),
        world,
        CPU,
    )
    gathered = torch.stack([*ok, failed])
    rows = _Exchange(0, world, gathered).exchange_header(ok[0], "dispatch #2")
    assert Agreement.decode(rows).failed_ranks == [world - 1]
    code, rank, _ = device_verdict(gathered).tolist()
    assert (VERDICTS[code - 1], rank) == ("error", world - 1)


def test_decode_shares_one_header_and_still_names_every_disagreement():
    world = 8
    rows = [_dispatch_row(world, 2, [1] * 16)[0].tolist() for _ in range(world)]
    agreed = Agreement.decode(rows)
    assert all(h is agreed.headers[0] for h in agreed.headers)
    agreed.check("dispatch #2")
    odd = [list(r) for r in rows]
    odd[5][list(CallHeader.__dataclass_fields__).index("hidden")] = 512
    with pytest.raises(InvalidInputError, match="the hidden size of x: 256 on ranks 0, 1, 2, 3"):
        Agreement.decode(odd).check("dispatch #2")
    magic = list(CallHeader.__dataclass_fields__).index("magic")
    foreign = [r[:magic] + [7] + r[magic + 1 :] for r in rows]
    with pytest.raises(InvalidInputError, match=r"rank\(s\) \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        Agreement.decode(foreign).check("dispatch #2")


@pytest.mark.parametrize("seed", range(4))
def test_received_rows_are_the_column_sums_of_the_counts(seed):
    rnd = random.Random(seed)
    world = rnd.choice([2, 5, 16])
    counts = [[rnd.randint(0, 1000) for _ in range(world)] for _ in range(world)]
    rows = [
        _dispatch_row(world, 2, [0] * world, counts=counts[r])[0].tolist() for r in range(world)
    ]
    received = Agreement.decode(rows).received
    for r in range(world):
        total = 0
        for s in range(world):
            total += counts[s][r]
        assert received[r] == total


class _GroupExchange(CallHeaderExchange):
    """The internode header exchange of rank ``rank`` over a real process group (CPU rows)."""

    def __init__(self, rank: int, world: int, group, timeout_ms: int) -> None:
        self.topology = Topology(rank=rank, num_ranks=world, ranks_per_node=1)
        self.group, self.device, self._timeout_ms = group, CPU, timeout_ms
        self._init_header_exchange()

    def check(self) -> None:
        pass


def w_gather_without_a_peer(rank: int, world: int) -> dict:
    """Both ranks gather a row once; then the last rank stays away from the second gather."""
    import datetime
    import time

    import torch.distributed as dist

    from uccl_ep_megatron.core.errors import CommTimeoutError

    # A group of its own: the gather left pending on it must not reach later tests' collectives.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    ex = _GroupExchange(rank, world, group, timeout_ms=500)
    ex._call = "combine #9"
    rows = [_combine_row(world, 9 + r) for r in range(world)]
    gathered = ex._gather_rows(rows[rank]).tolist() == torch.stack(rows).tolist()
    if rank == world - 1:
        return {"gathered": gathered}
    t0 = time.monotonic()
    try:
        ex._gather_rows(rows[rank])
    except CommTimeoutError as exc:
        return {
            "gathered": gathered,
            "error": str(exc),
            "s": time.monotonic() - t0,
            "broken": ex._broken,
        }
    return {"gathered": gathered, "error": ""}


def test_gloo_header_gather_is_bounded_and_names_the_call(pool2):
    """A gloo group (ranks sharing a GPU) waits for the header all-gather on the host: a rank
    whose peer never joins raises within UCCL_EP_TIMEOUT_MS (gloo's own limit is minutes),
    naming itself and the call, and marks the Buffer unusable."""
    out = pool2.run(__file__, "w_gather_without_a_peer")
    assert all(o["gathered"] for o in out), out
    first = out[0]
    assert "rank 0: the call-header all-gather of combine #9 did not complete" in first["error"], (
        out
    )
    assert "UCCL_EP_TIMEOUT_MS=500" in first["error"], out
    assert 0.4 < first["s"] < 5, out
    assert first["broken"] == "the call-header all-gather of combine #9 timed out", out

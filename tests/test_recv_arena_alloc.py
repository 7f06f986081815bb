"""The receive arena's block allocator (``backends/intranode/arena.py``) against a reference
model: a map of which ALIGN-sized units are in use, where first fit is the lowest run of free
units that holds the request. Random take/free sequences must give the same offsets, the same
exhaustion answers and the same free ranges (coalesced) as the model; events of freed blocks
must reach the next user of any of their bytes, and completed ones must not."""

from __future__ import annotations

import random

import pytest

from uccl_ep_megatron.backends.intranode.arena import ALIGN, BlockAllocator, output_layout


class Model:
    """Units of ALIGN bytes, each free or not, plus the events pending on each unit."""

    def __init__(self, capacity: int) -> None:
        self.used = [False] * (capacity // ALIGN)
        self.events: list[set] = [set() for _ in self.used]

    def take(self, nbytes: int) -> int | None:
        n = -(-nbytes // ALIGN)
        run = 0
        for i, u in enumerate(self.used):
            run = 0 if u else run + 1
            if run == n:
                start = i - n + 1
                for j in range(start, i + 1):
                    self.used[j] = True
                return start * ALIGN
        return None

    def events_of(self, offset: int, nbytes: int) -> set:
        n = -(-nbytes // ALIGN)
        out = set()
        for j in range(offset // ALIGN, offset // ALIGN + n):
            out |= self.events[j]
        return out

    def free(self, offset: int, nbytes: int, event) -> None:
        n = -(-nbytes // ALIGN)
        for j in range(offset // ALIGN, offset // ALIGN + n):
            assert self.used[j]
            self.used[j] = False
            self.events[j] = {event}

    def clear_events(self, offset: int, nbytes: int) -> None:
        n = -(-nbytes // ALIGN)
        for j in range(offset // ALIGN, offset // ALIGN + n):
            self.events[j] = set()

    def free_ranges(self) -> list[tuple[int, int]]:
        out, start = [], None
        for i, u in enumerate([*self.used, True]):
            if not u and start is None:
                start = i
            elif u and start is not None:
                out.append((start * ALIGN, (i - start) * ALIGN))
                start = None
        return out


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_match_first_fit_model(seed):
    rng = random.Random(seed)
    capacity = 64 * ALIGN
    alloc = BlockAllocator(capacity)
    model = Model(capacity)
    live: list[tuple[int, int]] = []
    next_event = 0
    for _ in range(400):
        if live and rng.random() < 0.45:
            offset, nbytes = live.pop(rng.randrange(len(live)))
            alloc.free(offset, nbytes, [next_event])
            model.free(offset, nbytes, next_event)
            next_event += 1
        else:
            nbytes = rng.choice([1, ALIGN, ALIGN + 1, 3 * ALIGN, rng.randrange(1, 20 * ALIGN)])
            want = model.take(nbytes)
            got = alloc.take(nbytes)
            if want is None:
                assert got is None, (nbytes, got)
                continue
            assert got is not None and got[0] == want, (nbytes, got, want)
            # Every event of a free that covered any byte of the block is passed on (none
            # completes here); the allocator may be conservative only within the range it
            # carved the block from, so the model's set must be contained in what it returns.
            need = model.events_of(want, nbytes)
            assert need <= set(got[1]), (got, need)
            model.clear_events(want, nbytes)
            live.append((want, nbytes))
        assert alloc.free_ranges() == model.free_ranges()
        assert alloc.live == len(live)


def test_coalescing_restores_one_range_whatever_the_free_order():
    alloc = BlockAllocator(10 * ALIGN)
    blocks = [alloc.take(2 * ALIGN)[0] for _ in range(5)]
    assert blocks == [0, 2 * ALIGN, 4 * ALIGN, 6 * ALIGN, 8 * ALIGN]
    assert alloc.take(1) is None  # full
    for b in (2 * ALIGN, 6 * ALIGN, 0, 8 * ALIGN, 4 * ALIGN):
        alloc.free(b, 2 * ALIGN, [])
    assert alloc.free_ranges() == [(0, 10 * ALIGN)]
    assert alloc.take(10 * ALIGN)[0] == 0


def test_exhaustion_and_fragmentation():
    alloc = BlockAllocator(4 * ALIGN)
    a = alloc.take(ALIGN)[0]
    b = alloc.take(ALIGN)[0]
    c = alloc.take(2 * ALIGN)[0]
    assert (a, b, c) == (0, ALIGN, 2 * ALIGN)
    assert alloc.take(1) is None
    alloc.free(a, ALIGN, [])
    alloc.free(c, 2 * ALIGN, [])
    # 3 units free but not contiguous: 2 fit (at c), 3 do not.
    assert alloc.take(3 * ALIGN) is None
    assert alloc.take(2 * ALIGN)[0] == 2 * ALIGN
    assert alloc.take(ALIGN)[0] == 0


def test_completed_events_are_dropped_and_pending_ones_kept():
    done = {"e1"}
    alloc = BlockAllocator(4 * ALIGN, done=lambda e: e in done)
    a = alloc.take(ALIGN)[0]
    b = alloc.take(ALIGN)[0]
    alloc.free(a, ALIGN, ["e1"])
    alloc.free(b, ALIGN, ["e2"])
    offset, events = alloc.take(2 * ALIGN)
    assert offset == 0 and events == ["e2"]


def test_double_free_raises():
    alloc = BlockAllocator(4 * ALIGN)
    a = alloc.take(ALIGN)[0]
    alloc.free(a, ALIGN, [])
    alloc.free(a, ALIGN, [])
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free_ranges()


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="capacity"):
        BlockAllocator(-1)
    with pytest.raises(ValueError, match="nbytes"):
        BlockAllocator(ALIGN).take(0)


def test_output_layout_is_aligned_and_disjoint():
    lay = output_layout(rows=37, row_bytes=7168, num_scales=56, num_topk=8, idx_size=8, src=True)
    spans = [
        (lay.x, 37 * 7168),
        (lay.scales, 37 * 56 * 4),
        (lay.idx, 37 * 8 * 8),
        (lay.w, 37 * 8 * 4),
        (lay.src, 37 * 4),
    ]
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        assert a % ALIGN == 0 and a + n <= b
    assert lay.src + 37 * 4 <= lay.end and lay.end % ALIGN == 0
    no_src = output_layout(37, 7168, 0, 0, 8, src=False)
    assert no_src.end == no_src.src  # nothing after the (empty) weights


def test_merging_drops_completed_events():
    done: set = set()
    alloc = BlockAllocator(3 * ALIGN, done=lambda e: e in done)
    a, b = alloc.take(ALIGN)[0], alloc.take(ALIGN)[0]
    alloc.free(a, ALIGN, ["ea"])
    alloc.free_ranges()
    done.add("ea")
    alloc.free(b, ALIGN, ["eb"])
    assert alloc.take(3 * ALIGN) == (0, ["eb"])

"""The receive arena's allocator and output factory (``_C.RecvArenaCore``,
csrc/bindings/recv_arena.cc) on a host arena, against a reference model: a map of which
ALIGN-sized units are in use, where first fit is the lowest run of free units that holds the
request. Random take/free sequences (a block is freed when its last tensor dies) must give the
same offsets, exhaustion answers and coalesced free ranges as the model. The stream events of a
GPU arena are exercised by the GPU suites (tests/gpu/test_intranode.py reuses blocks across
calls on poisoned memory)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from uccl_ep_megatron.core._c import load

ALIGN = 256


@pytest.fixture(scope="module")
def c():
    return load()


class HostArena:
    """A RecvArenaCore over ``capacity`` bytes of host memory (kept alive here)."""

    def __init__(self, c, capacity: int) -> None:
        self.mem = torch.zeros(capacity + ALIGN, dtype=torch.uint8)
        self.base = (self.mem.data_ptr() + ALIGN - 1) // ALIGN * ALIGN
        self.core = c.RecvArenaCore(self.base, capacity, 0, False)

    def take(self, nbytes: int):
        """One uint8 output of ``nbytes`` rows x 1 column (the block is ``nbytes`` rounded up),
        or None when full."""
        got = self.core.outputs(nbytes, 1, 1, 8, 0, 0, 64, False, 0, 0)
        return None if got is None else got[0]

    def offset(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base


class Model:
    """Units of ALIGN bytes, each free or not."""

    def __init__(self, capacity: int) -> None:
        self.used = [False] * (capacity // ALIGN)

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

    def free(self, offset: int, nbytes: int) -> None:
        n = -(-nbytes // ALIGN)
        for j in range(offset // ALIGN, offset // ALIGN + n):
            assert self.used[j]
            self.used[j] = False

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
def test_random_sequences_match_first_fit_model(c, seed):
    rng = random.Random(seed)
    capacity = 64 * ALIGN
    arena = HostArena(c, capacity)
    model = Model(capacity)
    live: list[tuple[torch.Tensor, int, int]] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            t, offset, nbytes = live.pop(rng.randrange(len(live)))
            del t
            model.free(offset, nbytes)
        else:
            nbytes = rng.choice([1, ALIGN, ALIGN + 1, 3 * ALIGN, rng.randrange(1, 20 * ALIGN)])
            want = model.take(nbytes)
            t = arena.take(nbytes)
            if want is None:
                assert t is None, nbytes
                continue
            assert t is not None and arena.offset(t) == want, (nbytes, want)
            assert t.shape == (nbytes, 1) and t.dtype == torch.uint8
            live.append((t, want, nbytes))
        assert arena.core.free_ranges() == model.free_ranges()
        assert arena.core.live == len(live)


def test_coalescing_restores_one_range_whatever_the_free_order(c):
    arena = HostArena(c, 10 * ALIGN)
    blocks = [arena.take(2 * ALIGN) for _ in range(5)]
    assert [arena.offset(b) for b in blocks] == [0, 2 * ALIGN, 4 * ALIGN, 6 * ALIGN, 8 * ALIGN]
    assert arena.take(1) is None  # full
    for i in (1, 3, 0, 4, 2):
        blocks[i] = None
    assert arena.core.free_ranges() == [(0, 10 * ALIGN)]
    assert arena.offset(arena.take(10 * ALIGN)) == 0


def test_exhaustion_and_fragmentation(c):
    arena = HostArena(c, 4 * ALIGN)
    a, b, d = arena.take(ALIGN), arena.take(ALIGN), arena.take(2 * ALIGN)
    assert [arena.offset(t) for t in (a, b, d)] == [0, ALIGN, 2 * ALIGN]
    assert arena.take(1) is None
    del a, d
    # 3 units free but not contiguous: 2 fit (where d was), 3 do not.
    assert arena.take(3 * ALIGN) is None
    e = arena.take(2 * ALIGN)
    f = arena.take(ALIGN)
    assert (arena.offset(e), arena.offset(f)) == (2 * ALIGN, 0)
    assert b is not None


def test_outputs_are_aligned_disjoint_typed_and_named_by_the_entry(c):
    arena = HostArena(c, 1 << 20)
    rows, hidden, scales, topk = 37, 128, 3, 8
    x, s, idx, w, src, entry = arena.core.outputs(rows, hidden, 4, 16, scales, topk, 32, True, 0, 0)
    assert (x.dtype, x.shape) == (torch.bfloat16, (rows, hidden))
    assert (s.dtype, s.shape) == (torch.float32, (rows, scales))
    assert (idx.dtype, idx.shape) == (torch.int32, (rows, topk))
    assert (w.dtype, w.shape) == (torch.float32, (rows, topk))
    assert (src.dtype, src.shape) == (torch.int32, (rows,))
    tensors = (x, s, idx, w, src)
    assert entry == [1] + [arena.offset(t) for t in tensors]
    spans = sorted((arena.offset(t), t.numel() * t.element_size()) for t in tensors)
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        assert a % ALIGN == 0 and a + n <= b
    assert all(t.is_contiguous() for t in tensors)
    # Writes land in the arena's memory, where the entry says.
    idx.fill_(7)
    at = arena.base - arena.mem.data_ptr() + entry[3]
    assert arena.mem[at : at + 4].tolist() == [7, 0, 0, 0]
    # No scales, ids or source indices: absent outputs are None and -1 in the entry.
    got = arena.core.outputs(5, 64, 1, 8, 0, 0, 64, False, 0, 0)
    assert got[1:5] == (None, None, None, None) and got[5][2:] == [-1, -1, -1, -1]


def test_a_view_keeps_the_block_until_the_last_one_dies(c):
    arena = HostArena(c, 8 * ALIGN)
    outs = arena.core.outputs(2, 64, 2, 32, 0, 1, 64, True, 0, 0)
    tail = outs[0][1:]  # a view of recv_x
    weights = outs[3]
    del outs
    gc.collect()
    assert arena.core.live == 1
    del weights
    assert arena.core.live == 1
    del tail
    assert arena.core.live == 0 and arena.core.free_ranges() == [(0, 8 * ALIGN)]


def test_close_reports_whether_blocks_live(c):
    arena = HostArena(c, 4 * ALIGN)
    t = arena.take(ALIGN)
    assert arena.core.close(False) is False
    with pytest.raises(Exception, match="closed"):
        arena.take(ALIGN)
    del t
    assert arena.core.live == 0
    assert HostArena(c, 4 * ALIGN).core.close(False) is True


def test_bad_arguments_raise(c):
    with pytest.raises(Exception, match="aligned"):
        c.RecvArenaCore(ALIGN + 8, 1024, 0, False)
    arena = HostArena(c, 4 * ALIGN)
    with pytest.raises(Exception, match="rows=0"):
        arena.core.outputs(0, 8, 1, 8, 0, 0, 64, False, 0, 0)
    with pytest.raises(Exception, match="idx_bits=16"):
        arena.core.outputs(1, 8, 1, 8, 0, 1, 16, False, 0, 0)
    if not c.kernels_built():
        with pytest.raises(Exception, match="GPU build"):
            c.RecvArenaCore(0, 0, 0, True)


def test_a_reservation_holds_its_block_and_makes_the_same_tensors_later(c):
    arena = HostArena(c, 1 << 20)
    rows, hidden, scales, topk = 21, 64, 2, 4
    res = arena.core.reserve(rows, hidden, 4, 16, scales, topk, 64, True, 0, 0)
    assert arena.core.live == 1
    # The same layout as outputs() gives a block taken at the same place.
    ref = HostArena(c, 1 << 20)
    want = ref.core.outputs(rows, hidden, 4, 16, scales, topk, 64, True, 0, 0)
    assert res.entry == want[5]
    # A block taken while the reservation lives does not overlap it.
    other = arena.take(ALIGN)
    assert arena.offset(other) >= res.entry[5] + rows * 4
    x, s, idx, w, src = res.tensors()
    assert [(t.dtype, tuple(t.shape)) for t in (x, s, idx, w, src)] == [
        (t.dtype, tuple(t.shape)) for t in want[:5]
    ]
    assert [1] + [arena.offset(t) for t in (x, s, idx, w, src)] == res.entry
    with pytest.raises(Exception, match="made already"):
        res.tensors()
    # The block lives while the reservation or any tensor does.
    del res
    gc.collect()
    assert arena.core.live == 2
    del x, s, idx, w
    assert arena.core.live == 2
    del src, other
    gc.collect()
    assert arena.core.live == 0 and arena.core.free_ranges() == [(0, 1 << 20)]


def test_a_reservation_never_made_gives_its_block_back(c):
    arena = HostArena(c, 4 * ALIGN)
    res = arena.core.reserve(3 * ALIGN, 1, 1, 8, 0, 0, 64, False, 0, 0)
    assert arena.core.reserve(2 * ALIGN, 1, 1, 8, 0, 0, 64, False, 0, 0) is None  # full
    del res
    gc.collect()
    assert arena.core.live == 0 and arena.core.free_ranges() == [(0, 4 * ALIGN)]


def test_a_reservation_makes_tensors_of_its_first_rows(c):
    # A launch-ahead dispatch reserves its bound and makes tensors of the rows it received:
    # the same places, fewer rows; more rows than reserved raise.
    arena = HostArena(c, 1 << 20)
    rows, hidden, topk = 40, 32, 2
    too_many = arena.core.reserve(rows, hidden, 4, 16, 0, topk, 32, True, 0, 0)
    with pytest.raises(Exception, match="rows=41 exceeds the 40 rows reserved"):
        too_many.tensors(rows + 1)
    res = arena.core.reserve(rows, hidden, 4, 16, 0, topk, 32, True, 0, 0)
    x, s, idx, w, src = res.tensors(7)
    assert s is None
    assert [tuple(t.shape) for t in (x, idx, w, src)] == [(7, hidden), (7, topk), (7, topk), (7,)]
    assert [1] + [arena.offset(t) if t is not None else -1 for t in (x, s, idx, w, src)] == (
        res.entry
    )
    del too_many, res, x, idx, w, src
    gc.collect()
    assert arena.core.live == 0


def test_a_reservation_with_aux_holds_the_handles_send_pos_and_info(c):
    # intranode_dispatch_begin reserves one block for the outputs and the handle's send_pos
    # [tokens, ranks] and info [words] (int32): past the outputs, aligned, disjoint; the block
    # lives while any of the seven tensors does (a handle outlives its received rows).
    arena = HostArena(c, 1 << 20)
    rows, hidden, topk, tokens, ranks, info_words = 30, 64, 4, 50, 8, 8 * 8 + 32
    plain = arena.core.reserve(rows, hidden, 4, 16, 0, topk, 64, True, 0, 0)
    with pytest.raises(Exception, match="holds no send_pos/info"):
        plain.aux()
    aux = (tokens, ranks, info_words)
    res = arena.core.reserve(rows, hidden, 4, 16, 0, topk, 64, True, 0, 0, *aux)
    send_pos, info = res.aux()
    with pytest.raises(Exception, match="made already"):
        res.aux()
    assert (send_pos.dtype, tuple(send_pos.shape)) == (torch.int32, (tokens, ranks))
    assert (info.dtype, tuple(info.shape)) == (torch.int32, (info_words,))
    # The outputs keep the places a block without aux gives them (the entry is the same).
    assert [e - res.entry[1] if e >= 0 else -1 for e in res.entry[1:]] == [
        e - plain.entry[1] if e >= 0 else -1 for e in plain.entry[1:]
    ]
    x, _, idx, w, src = res.tensors(rows)
    spans = sorted(
        (arena.offset(t), t.numel() * t.element_size()) for t in (x, idx, w, src, send_pos, info)
    )
    for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
        assert a % ALIGN == 0 and a + n <= b
    assert arena.offset(src) < arena.offset(send_pos) < arena.offset(info)
    # The block's size covers info: the next block starts past it.
    after = arena.take(ALIGN)
    assert arena.offset(after) >= arena.offset(info) + info_words * 4
    del plain, res, x, idx, w, src, after
    gc.collect()
    assert arena.core.live == 1  # send_pos and info keep the block
    del send_pos
    assert arena.core.live == 1
    del info
    gc.collect()
    assert arena.core.live == 0 and arena.core.free_ranges() == [(0, 1 << 20)]


def test_reservation_aux_of_a_rank_gives_the_handles_views_of_info(c):
    # aux(rank): send_pos, then the handle's views of info [R*R matrix | per-expert rows]: the
    # matrix, the rank's received rows (the matrix's last row, that rank's column) and the
    # per-expert counts, at the places the plain info tensor has them, each holding the block.
    ranks, experts, tokens = 4, 6, 10
    for rank in range(ranks):
        arena = HostArena(c, 1 << 20)
        aux = (tokens, ranks, ranks * ranks + experts)
        plain = arena.core.reserve(8, 64, 4, 16, 0, 2, 64, True, 0, 0, *aux)
        old_send_pos, info = plain.aux()
        words = torch.arange(100, 100 + aux[2], dtype=torch.int32)
        info.copy_(words)
        at = arena.offset(info)
        del plain, old_send_pos, info
        gc.collect()
        res = arena.core.reserve(8, 64, 4, 16, 0, 2, 64, True, 0, 0, *aux)  # the same block
        send_pos, prefix, count, per_expert = res.aux(rank)
        assert arena.offset(prefix) == at
        assert (send_pos.dtype, tuple(send_pos.shape)) == (torch.int32, (tokens, ranks))
        assert torch.equal(prefix, words[: ranks * ranks].view(ranks, ranks))
        assert count.tolist() == [words[ranks * (ranks - 1) + rank].item()]
        assert torch.equal(per_expert, words[ranks * ranks :])
        with pytest.raises(Exception, match="made already"):
            res.aux(rank)
        del res, send_pos, prefix, per_expert
        gc.collect()
        assert arena.core.live == 1  # count alone keeps the block
        del count
        gc.collect()
        assert arena.core.live == 0
    with pytest.raises(Exception, match="rank=4 of 4 ranks"):
        HostArena(c, 1 << 20).core.reserve(8, 64, 4, 16, 0, 2, 64, True, 0, 0, *aux).aux(ranks)

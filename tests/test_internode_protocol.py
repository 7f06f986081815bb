"""The internode dispatch and combine ring protocols, run by CPU stand-ins for the kernels
over the real FIFO channels, proxies and ipc transport (reorder/delay injector off and on).

Each rank is one node (``ranks_per_node = 1``). A Python thread per rank plays, for every
channel, the dispatch sender block and the forwarder block exactly as
``csrc/kernels/internode.cu`` does, with the same layout arithmetic (``_C.internode``): the
sender packs tokens into its send ring, pushes Write pieces (split at the ring's wrap) whose
last piece carries the software-atomic ``tail += k``, waits for ``head`` before reusing slots
and ends each call with an end-of-stream atomic; the forwarder polls ``tail``/``done``, reads
the slots in order and returns them with ``head`` atomics (split into 11-bit steps). Rings are
tiny, so every stream wraps many times per call; positions persist across calls as in the
kernels' device state. Every forwarder must see exactly the expected token stream of every
source, in order, in every call, and every source must get back one partial per (token, node)
in its token order, consumed in windows of at most one ring (the combine receiver's rule).
This checks the counter indexing, the ordering of a chunk's write before its tail update, and
the cumulative positions, on an unordered transport too.
"""

from __future__ import annotations

import random
import struct
import threading
import time

import pytest

from uccl_ep_megatron import _C
from uccl_ep_megatron.proxy import (
    ProxyConfig,
    ProxyEndpoint,
    cmd_atomic,
    cmd_write,
    cmd_write_atomic,
)

IN = _C.internode
KIND = IN.COUNTER_KINDS
SLOT = 32  # bytes per ring slot: (call, source, channel, token) + padding
DEADLINE_S = 60.0


def _stream(call: int, src: int, dst: int, channel: int) -> list[int]:
    """Tokens source `src` sends to node `dst` on `channel` in `call` (both sides derive it)."""
    rng = random.Random(hash((call, src, dst, channel)) & 0xFFFFFFFF)
    n = rng.choice([0, 1, 2, 7, 19, 40, 61])
    return sorted(rng.sample(range(1000), n))


class _Rank:
    def __init__(
        self, ep, region, rank, world, channels, fifos, cap, chunk, region_bytes, late=False
    ):
        self.ep, self.region, self.rank, self.world = ep, region, rank, world
        self.channels, self.fifos, self.cap, self.chunk = channels, fifos, cap, chunk
        self.lay = IN.ring_layout(False, region_bytes, channels, world, cap, SLOT)
        self.region_bytes = region_bytes
        # Device-state equivalents, persistent across calls.
        self.sent = [[0] * world for _ in range(channels)]
        self.consumed = [[0] * world for _ in range(channels)]
        self.calls = [[0] * world for _ in range(channels)]
        self.clay = IN.ring_layout(True, region_bytes, channels, world, cap, SLOT)
        self.csent = [[0] * world for _ in range(channels)]
        self.cconsumed = [[0] * world for _ in range(channels)]
        self.received: dict[tuple[int, int], list[int]] = {}
        # late: a stream's last head increments of a call are held back and pushed only when
        # this rank starts its next call, as if the proxies still carried them then.
        self.late = late
        self.held: list[tuple[int, int, int, int]] = []  # (channel, dst, counter, delta)
        self.began_late = 0  # calls begun with held increments

    def head(self, c: int, dst: int, kind: str, delta: int, last: bool) -> None:
        idx = IN.counter_index(KIND[kind], c, self.rank)
        if self.late and last:
            self.held.append((c, dst, idx, delta))
            return
        for v in IN.atomic_steps(delta):
            self.push(c, cmd_atomic(dst, idx, v))

    def release_held(self) -> None:
        held, self.held = self.held, []
        self.began_late += bool(held)
        for c, dst, idx, delta in held:
            for v in IN.atomic_steps(delta):
                self.push(c, cmd_atomic(dst, idx, v))

    def slot(self, recv: bool, channel: int, node: int, index: int, combine: bool = False) -> int:
        return IN.ring_slot_offset(
            combine,
            recv,
            self.region_bytes,
            self.channels,
            self.world,
            self.cap,
            SLOT,
            channel,
            node,
            index,
        )

    def counters(self) -> list[int]:
        return self.ep.counter_values()

    def push(self, channel: int, cmd) -> None:
        self.ep.push(channel % self.fifos, cmd)

    def push_chunk(self, c: int, n: int, start: int, k: int, combine: bool = False) -> None:
        first, n1, n2 = IN.chunk_pieces(start, k, self.cap)
        kind = "combine_tail" if combine else "dispatch_tail"
        tail = IN.counter_index(KIND[kind], c, self.rank)
        pieces = [(start, n1)] + ([(start + n1, n2)] if n2 else [])
        inline = k <= IN.MAX_ATOMIC_STEP
        for j, (s, cnt) in enumerate(pieces):
            src = self.slot(False, c, n, s, combine)
            dst = self.slot(True, c, self.rank, s, combine)
            last = j == len(pieces) - 1
            if last and inline:
                self.push(c, cmd_write_atomic(n, src, dst, cnt * SLOT, tail, k))
            else:
                self.push(c, cmd_write(n, src, dst, cnt * SLOT))
        if not inline:
            for v in IN.atomic_steps(k):
                self.push(c, cmd_atomic(n, tail, v))

    def run_call(self, call: int) -> None:
        """One dispatch: all channels' senders and forwarders, interleaved like warps."""
        self.release_held()
        world, me = self.world, self.rank
        streams = {
            (c, n): _stream(call, me, n, c)
            for c in range(self.channels)
            for n in range(world)
            if n != me
        }
        pos = {key: 0 for key in streams}
        sender_done = [False] * self.channels
        fin = [[m == me for m in range(world)] for _ in range(self.channels)]
        expect = {
            (c, m): _stream(call, m, me, c)
            for c in range(self.channels)
            for m in range(world)
            if m != me
        }
        got: dict[tuple[int, int], list[int]] = {key: [] for key in expect}
        start = time.monotonic()
        while not (all(sender_done) and all(all(f) for f in fin)):
            if time.monotonic() - start > DEADLINE_S:
                raise AssertionError(
                    f"rank {me} call {call} stalled: sent={self.sent} consumed={self.consumed} "
                    f"counters={[v for v in self.counters() if v]}"
                )
            # The kernel's forwarder reads `done` before `tail` (the marker follows the stream's
            # last tail update, so a tail read after it is final). One snapshot reads the counter
            # array in index order, tail (kind 0) before done (kind 1): a marker could then be
            # seen with a stale tail. Take the markers from an earlier snapshot.
            dones = self.counters()
            vals = self.counters()
            for c in range(self.channels):
                # ---- sender block ----
                if not sender_done[c]:
                    remaining_any = False
                    for n in range(world):
                        if n == me:
                            continue
                        toks = streams[(c, n)]
                        left = len(toks) - pos[(c, n)]
                        if left <= 0:
                            continue
                        remaining_any = True
                        head = vals[IN.counter_index(KIND["dispatch_head"], c, n)]
                        room = self.cap - (self.sent[c][n] - head)
                        assert 0 <= room <= self.cap, (room, self.sent[c][n], head)
                        k = min(self.chunk, left, room)
                        if k <= 0:
                            continue
                        for i in range(k):
                            t = toks[pos[(c, n)] + i]
                            off = self.slot(False, c, n, self.sent[c][n] + i)
                            self.region.write(
                                off, struct.pack("<iiii", call, me, c, t).ljust(SLOT, b"\0")
                            )
                        self.push_chunk(c, n, self.sent[c][n], k)
                        self.sent[c][n] += k
                        pos[(c, n)] += k
                    if not remaining_any:
                        for n in range(world):
                            if n != me:
                                idx = IN.counter_index(KIND["dispatch_done"], c, me)
                                self.push(c, cmd_atomic(n, idx, 1))
                        sender_done[c] = True
                # ---- forwarder block ----
                for m in range(world):
                    if fin[c][m]:
                        continue
                    done = dones[IN.counter_index(KIND["dispatch_done"], c, m)]
                    tail = vals[IN.counter_index(KIND["dispatch_tail"], c, m)]
                    avail = tail - self.consumed[c][m]
                    assert 0 <= avail <= self.cap, (avail, tail, self.consumed[c][m])
                    if avail == 0 and done >= self.calls[c][m] + 1:
                        fin[c][m] = True
                        self.calls[c][m] += 1
                        continue
                    for i in range(avail):
                        off = self.slot(True, c, m, self.consumed[c][m] + i)
                        cl, src, ch, t = struct.unpack("<iiii", self.region.read(off, 16))
                        assert (cl, src, ch) == (call, m, c), (cl, src, ch, call, m, c)
                        got[(c, m)].append(t)
                    if avail:
                        self.consumed[c][m] += avail
                        last = len(got[(c, m)]) == len(expect[(c, m)])
                        self.head(c, m, "dispatch_head", avail, last)
            time.sleep(0)
        for key, toks in expect.items():
            assert got[key] == toks, (me, call, key, got[key][:8], toks[:8])
        self.received = got
        self.dispatched = streams

    def run_combine(self, call: int) -> None:
        """One combine: forward a partial per received token back to its source; as the
        source, consume every node's partials in token-order windows of at most `cap` tokens
        (the kernel's receiver), releasing ring slots after each window."""
        self.release_held()
        world, me = self.world, self.rank
        back = self.received  # (c, m) -> tokens of source m this rank forwards, in order
        pos = {key: 0 for key in back}
        window = min(self.cap, 4)
        # Receiver: per channel, the union of this rank's tokens over nodes, in token order.
        order = {
            c: sorted({t for n in range(world) if n != me for t in self.dispatched[(c, n)]})
            for c in range(self.channels)
        }
        wpos = {c: 0 for c in range(self.channels)}
        taken = {(c, n): 0 for c in range(self.channels) for n in range(world) if n != me}
        start = time.monotonic()
        while not (
            all(pos[k] == len(v) for k, v in back.items())
            and all(wpos[c] >= len(order[c]) for c in order)
        ):
            if time.monotonic() - start > DEADLINE_S:
                raise AssertionError(f"rank {me} combine {call} stalled: {pos} {wpos}")
            vals = self.counters()
            for c in range(self.channels):
                # ---- combine forwarder ----
                for m in range(world):
                    if m == me or pos[(c, m)] >= len(back[(c, m)]):
                        continue
                    head = vals[IN.counter_index(KIND["combine_head"], c, m)]
                    room = self.cap - (self.csent[c][m] - head)
                    assert 0 <= room <= self.cap
                    k = min(self.chunk, len(back[(c, m)]) - pos[(c, m)], room)
                    if k <= 0:
                        continue
                    for i in range(k):
                        t = back[(c, m)][pos[(c, m)] + i]
                        off = self.slot(False, c, m, self.csent[c][m] + i, True)
                        self.region.write(
                            off, struct.pack("<iiii", call, me, c, t).ljust(SLOT, b"\0")
                        )
                    self.push_chunk(c, m, self.csent[c][m], k, combine=True)
                    self.csent[c][m] += k
                    pos[(c, m)] += k
                # ---- combine receiver: one window at a time ----
                if wpos[c] >= len(order[c]):
                    continue
                win = order[c][wpos[c] : wpos[c] + window]
                need = {
                    n: sum(t in set(self.dispatched[(c, n)]) for t in win)
                    for n in range(world)
                    if n != me
                }
                ready = all(
                    vals[IN.counter_index(KIND["combine_tail"], c, n)]
                    >= self.cconsumed[c][n] + need[n]
                    for n in need
                )
                if not ready:
                    continue
                for n, cnt in need.items():
                    mine = [t for t in win if t in set(self.dispatched[(c, n)])]
                    for i in range(cnt):
                        off = self.slot(True, c, n, self.cconsumed[c][n] + i, True)
                        cl, src, ch, t = struct.unpack("<iiii", self.region.read(off, 16))
                        assert (cl, src, ch, t) == (call, n, c, mine[i]), (cl, src, ch, t, mine[i])
                    if cnt:
                        self.cconsumed[c][n] += cnt
                        taken[(c, n)] += cnt
                        last = taken[(c, n)] == len(self.dispatched[(c, n)])
                        self.head(c, n, "combine_head", cnt, last)
                wpos[c] += len(win)
            time.sleep(0)
        for (c, n), cnt in taken.items():
            assert cnt == len(self.dispatched[(c, n)])


@pytest.mark.parametrize("reorder", [False, True], ids=["ordered", "reorder"])
@pytest.mark.parametrize("cap,chunk", [(5, 3), (4, 4), (16, 6)])
def test_dispatch_ring_protocol_over_proxies(reorder, cap, chunk):
    _run_protocol(reorder, cap, chunk, late=False)


@pytest.mark.parametrize("reorder", [False, True], ids=["ordered", "reorder"])
def test_ring_protocol_with_head_increments_late_into_the_next_call(reorder):
    """Calls issued back to back (sync-free mode) are ordered by the call-header all-gather
    only: every rank's previous kernels finished, but the proxies may still carry their last
    head increments. Held back into the next call, they only delay its senders."""
    ranks = _run_protocol(reorder, 4, 3, late=True)
    assert all(r.began_late > 0 for r in ranks), [r.began_late for r in ranks]


def _run_protocol(reorder: bool, cap: int, chunk: int, late: bool) -> list[_Rank]:
    world, channels, fifos, calls = 3, 3, 2, 4
    lay = IN.ring_layout(False, 1 << 20, channels, world, cap, SLOT)
    region_bytes = 2 * (lay["bytes"] + 64)
    regions = [_C.HostRegion(region_bytes) for _ in range(world)]
    cfg = ProxyConfig(
        num_channels=fifos,
        num_threads=2,
        num_counters=IN.NUM_COUNTERS,
        ipc_reorder=reorder,
        ipc_seed=11,
        ipc_max_delay_us=30,
        transport="ipc",
        timeout_ms=30000,
    )
    eps = [
        ProxyEndpoint(regions[r].ptr, region_bytes, rank=r, world_size=world, config=cfg)
        for r in range(world)
    ]
    infos = [e.local_info for e in eps]
    for e in eps:
        e.connect(infos)
    ranks = [
        _Rank(eps[r], regions[r], r, world, channels, fifos, cap, chunk, region_bytes, late)
        for r in range(world)
    ]
    # Calls are separated by a barrier, as the kernels' calls are by the stream-ordered
    # call-header all-gather (both modes): it orders the rank threads, not the proxies.
    barrier = threading.Barrier(world)
    errs: list[BaseException] = []

    def run(r: int) -> None:
        try:
            for call in range(calls):
                ranks[r].run_call(call)
                barrier.wait(timeout=DEADLINE_S)
                ranks[r].run_combine(call)
                barrier.wait(timeout=DEADLINE_S)
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errs.append(e)
            barrier.abort()

    try:
        ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for e in eps:
            e.check()
        assert not errs, errs[0]
        stats = [e.stats() for e in eps]
        assert all(s["writes_posted"] > 0 for s in stats)
        if reorder:
            assert sum(s["held_out_of_order"] for s in stats) > 0
        # Every sender position equals its forwarder's consumed position (same cumulative index).
        for r in range(world):
            for n in range(world):
                if n != r:
                    for c in range(channels):
                        assert ranks[r].sent[c][n] == ranks[n].consumed[c][r]
                        assert ranks[n].csent[c][r] == ranks[r].cconsumed[c][n]
    finally:
        for e in eps:
            e.close()
    return ranks

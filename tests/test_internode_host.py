"""Host-side logic of the internode HT path, checked on CPU against brute-force models.

- the index tables the backend builds with torch (per-channel streams, final rows) against
  plain Python loops over the same definitions;
- the ring / chunk / counter arithmetic the kernels use (``csrc/kernels/internode_layout.h``,
  bound as ``_C.internode``), including a simulation of a sender and a receiver over many
  calls with rings that wrap hundreds of times: every token lands in the slot the receiver
  reads, every chunk becomes at most two writes, and tail updates (sequences of 11-bit
  software atomics) add up to exactly the tokens sent.
"""

from __future__ import annotations

import random

import pytest
import torch

from uccl_ep_megatron import _C
from uccl_ep_megatron.backends.internode import dst_rows, stream_tables

IN = _C.internode


def _ranges(num_tokens: int, num_channels: int) -> list[tuple[int, int]]:
    return [tuple(IN.channel_range(num_tokens, num_channels, c)) for c in range(num_channels)]


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 7, 64, 1000, 4097])
@pytest.mark.parametrize("num_channels", [1, 2, 3, 12, 32])
def test_channel_ranges_partition_tokens(num_tokens, num_channels):
    ranges = _ranges(num_tokens, num_channels)
    covered = [t for b, e in ranges for t in range(b, e)]
    assert covered == list(range(num_tokens))
    assert all(b <= e for b, e in ranges)


@pytest.mark.parametrize("seed", range(6))
def test_stream_tables_match_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_tokens, num_nodes, num_channels = rnd.randint(0, 300), rnd.randint(2, 5), rnd.randint(1, 9)
    mask = torch.rand(num_tokens, num_nodes, generator=gen) < rnd.random()
    lists, count, cum = stream_tables(mask, num_channels)
    assert lists.shape == (num_nodes, num_tokens) and count.shape == (num_channels, num_nodes)
    assert cum.shape == (num_tokens, num_nodes)
    for c, (b, e) in enumerate(_ranges(num_tokens, num_channels)):
        for n in range(num_nodes):
            stream = [t for t in range(b, e) if mask[t, n]]
            assert count[c, n].item() == len(stream)
            assert lists[n, b : b + len(stream)].tolist() == stream
            run = 0
            for t in range(b, e):
                run += int(mask[t, n])
                assert cum[t, n].item() == run


def test_dst_rows_follow_source_major_order():
    gen = torch.Generator().manual_seed(3)
    in_rank = torch.rand(50, 4, generator=gen) < 0.4
    first = torch.tensor([3, 0, 17, 5], dtype=torch.int32)
    rows = dst_rows(in_rank, first)
    for r in range(4):
        expect = first[r].item()
        for t in range(50):
            if in_rank[t, r]:
                assert rows[t, r].item() == expect
                expect += 1
            else:
                assert rows[t, r].item() == -1


def test_counter_and_state_indices_are_unique_and_in_range():
    seen = set()
    for kind in IN.COUNTER_KINDS.values():
        for c in range(IN.MAX_CHANNELS):
            for n in range(IN.MAX_NODES):
                i = IN.counter_index(kind, c, n)
                assert 0 <= i < IN.NUM_COUNTERS
                seen.add(i)
    assert len(seen) == len(IN.COUNTER_KINDS) * IN.MAX_CHANNELS * IN.MAX_NODES
    assert IN.NUM_COUNTERS <= _C.cmd_limits["num_atomic_counters"]


@pytest.mark.parametrize("delta", [0, 1, 5, 1022, 1023, 1024, 2047, 5000])
def test_atomic_steps_fit_the_immediate_and_sum_up(delta):
    steps = IN.atomic_steps(delta)
    assert sum(steps) == delta
    assert all(1 <= v <= _C.cmd_limits["max_atomic_value"] for v in steps)


@pytest.mark.parametrize(
    "row_bytes,ns,k,lpn", [(14336, 0, 8, 1), (7168, 56, 8, 4), (2048, 0, 0, 8), (896, 7, 3, 2)]
)
def test_slot_layouts_are_aligned_and_disjoint(row_bytes, ns, k, lpn):
    d = IN.dispatch_slot(row_bytes, ns, k, lpn)
    assert d["bytes"] % 16 == 0 and d["bytes"] >= d["rows"] + 4 * lpn
    assert d["x"] == 0 and d["scales"] == row_bytes and d["gid"] == row_bytes + 4 * ns
    assert d["weights"] == d["gid"] + 4 * k and d["src"] == d["weights"] + 4 * k
    c = IN.combine_slot(row_bytes, k)
    assert c["bytes"] % 16 == 0 and c["src"] == row_bytes + 4 * k
    s = IN.stage_slot(row_bytes, ns, k, 8)
    assert s["bytes"] % 16 == 0 and s["weights"] % 16 == 0 and s["idx"] % 16 == 0
    assert row_bytes + 4 * ns <= s["idx"] < row_bytes + 4 * ns + 16


def test_ring_layout_halves_never_overlap():
    region = (1 << 26) + 48
    d = IN.ring_layout(False, region, 4, 3, 8, 1024)
    c = IN.ring_layout(True, region, 4, 3, 8, 1024)
    assert d["half_offset"] == 0 and c["half_offset"] == d["half_bytes"]
    assert d["send_offset"] + d["bytes"] <= c["send_offset"]
    assert c["send_offset"] + c["bytes"] <= region
    assert d["recv_offset"] == d["send_offset"] + d["bytes"] // 2
    for off in (d["half_offset"], c["half_offset"], d["recv_offset"], c["recv_offset"]):
        assert off % 16 == 0


@pytest.mark.parametrize("cap,chunk", [(8, 3), (5, 2), (256, 20), (7, 7), (1, 1)])
def test_ring_simulation_over_many_calls(cap, chunk):
    """A sender and a receiver run the kernels' ring protocol for several calls: the chunk
    pieces the sender writes are exactly the slots the receiver reads, in order, and the ring
    never holds more than `cap` unread tokens."""
    rng = random.Random(cap * 31 + chunk)
    channels, nodes, slot = 3, 2, 48
    region = 1 << 20
    sent = consumed = 0  # cumulative positions, kept across calls (kernel state)
    tail = head = 0  # software-atomic counters at the receiver / sender
    ring_owner: dict[int, int] = {}  # receiver-side slot offset -> token id in it
    for _call in range(6):
        tokens = list(range(sent, sent + rng.randint(0, 400)))
        pending: list[tuple[int, list[int]]] = []  # (atomic total, written tokens) in flight
        i = 0
        while i < len(tokens) or pending or consumed < sent:
            # Sender: room from the head it last saw.
            room = cap - (sent - head)
            k = min(chunk, len(tokens) - i, room)
            if k > 0:
                first, n1, n2 = IN.chunk_pieces(sent, k, cap)
                assert n1 + n2 == k and 0 <= first < cap and n1 >= 1
                assert n2 == 0 or first + n1 == cap
                written = []
                for j, (start, n) in enumerate(((sent, n1), (sent + n1, n2))):
                    if n == 0:
                        continue
                    src = IN.ring_slot_offset(
                        False, False, region, channels, nodes, cap, slot, 2, 1, start
                    )
                    dst = IN.ring_slot_offset(
                        False, True, region, channels, nodes, cap, slot, 2, 0, start
                    )
                    assert src % 16 == 0 and dst % 16 == 0
                    for q in range(n):
                        ring_owner[dst + q * slot] = tokens[i + (n1 if j else 0) + q]
                        written.append(dst + q * slot)
                pending.append((sum(IN.atomic_steps(k)), written))
                sent += k
                i += k
            # Delivery: the proxy applies a chunk's tail update after its writes landed.
            if pending and rng.random() < 0.7:
                add, _ = pending.pop(0)
                tail += add
            # Receiver: consume what the tail shows, in ring order, then release slots.
            avail = tail - consumed
            assert 0 <= avail <= cap
            for q in range(avail):
                off = IN.ring_slot_offset(
                    False, True, region, channels, nodes, cap, slot, 2, 0, consumed + q
                )
                assert ring_owner.pop(off) == consumed + q  # the token written there, in order
            consumed += avail
            head = consumed
        assert consumed == sent == tail
    assert not ring_owner


def test_backend_selection_reasons_on_this_host():
    from uccl_ep_megatron.backends import _kernels_impl
    from uccl_ep_megatron.backends.base import Topology
    from uccl_ep_megatron.backends.internode import InternodeBackend

    two_nodes = Topology(rank=0, num_ranks=4, ranks_per_node=2)
    assert _kernels_impl(two_nodes) == "kernels_internode"
    reason = InternodeBackend.unsupported_reason(two_nodes, torch.device("cpu"))
    assert reason is not None  # no GPU build, or CPU tensors: never silently selected
    if IN.built():
        assert "cpu" in reason
        one_node = Topology(rank=0, num_ranks=4, ranks_per_node=4)
        assert "one node" in InternodeBackend.unsupported_reason(one_node, torch.device("cuda"))
        too_wide = Topology(rank=0, num_ranks=32, ranks_per_node=16)
        assert "16 ranks per node" in InternodeBackend.unsupported_reason(
            too_wide, torch.device("cuda")
        )

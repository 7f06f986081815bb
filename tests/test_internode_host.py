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
from uccl_ep_megatron.backends.agreement import (
    KIND_COMBINE,
    KIND_DISPATCH,
    VERDICTS,
    Agreement,
    CallHeader,
    device_verdict,
    encode_row,
)
from uccl_ep_megatron.backends.internode import (
    call_tables,
    dst_rows,
    expert_counts,
    received_expert_counts,
    stream_tables,
    streams,
)
from uccl_ep_megatron.core.errors import InvalidInputError

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


@pytest.mark.parametrize("seed", range(6))
def test_streams_of_sources_with_their_own_token_counts(seed):
    """The combine forwarder's streams: source b has tokens[b] tokens (a device tensor, never
    read on the host), columns past it are ignored, and each source's channel ranges are the
    ones its own channel_range gives."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    num_src, width, num_channels = rnd.randint(1, 5), rnd.randint(0, 200), rnd.randint(1, 9)
    tokens = [rnd.randint(0, width) for _ in range(num_src)]
    mask = torch.rand(num_src, width, generator=gen) < rnd.random()
    lists, count, cum = streams(mask, torch.tensor(tokens), num_channels)
    assert lists.shape == (num_src, width) and count.shape == (num_channels, num_src)
    for b in range(num_src):
        filled = 0
        for c, (lo, hi) in enumerate(_ranges(tokens[b], num_channels)):
            stream = [t for t in range(lo, hi) if mask[b, t]]
            assert count[c, b].item() == len(stream)
            assert lists[b, lo : lo + len(stream)].tolist() == stream
            run = 0
            for t in range(lo, hi):
                run += int(mask[b, t])
                assert cum[b, t].item() == run
            filled += len(stream)
        assert int((lists[b] >= 0).sum()) == filled  # nothing of the ignored columns


def _rows(headers, counts, tokens, checks=None):
    world = len(headers)
    return torch.stack(
        [
            encode_row(
                h,
                world,
                torch.device("cpu"),
                None if checks is None else torch.tensor(checks[r]),
                torch.tensor(counts[r]),
                tokens[r],
            )
            for r, h in enumerate(headers)
        ]
    )


@pytest.mark.parametrize("seed", range(4))
def test_call_tables_match_the_host_arithmetic(seed):
    """Prefix matrix, first rows, per-node receive rows, receive prefix and source token
    counts derived on the device equal the same quantities computed from host lists."""
    rnd = random.Random(seed)
    nodes, local = rnd.randint(2, 4), rnd.randint(1, 4)
    world = nodes * local
    counts = [[rnd.randint(0, 9) for _ in range(world)] for _ in range(world)]
    tokens = [rnd.randint(0, 50) for _ in range(world)]
    head = CallHeader(kind=KIND_DISPATCH, seq=1)
    rows = _rows([head] * world, counts, tokens)
    for rank in range(world):
        tab = call_tables(rows, rank, local)
        prefix = [
            [sum(counts[s][r] for s in range(i + 1)) for r in range(world)] for i in range(world)
        ]
        assert tab.rank_prefix_matrix.tolist() == prefix
        assert tab.first_row.tolist() == [
            sum(counts[s][r] for s in range(rank)) for r in range(world)
        ]
        node0 = rank // local * local
        assert tab.recv_rows.tolist() == [prefix[-1][node0 + j] for j in range(local)]
        starts = [sum(counts[s][rank] for s in range(i)) for i in range(world)]
        assert tab.recv_prefix.tolist() == starts + [prefix[-1][rank]]
        assert tab.recv_count.tolist() == [prefix[-1][rank]]
        assert tab.src_tokens.tolist() == [tokens[m * local + rank % local] for m in range(nodes)]


def test_expert_counts_are_aligned_sums_of_the_local_experts():
    per_expert = torch.tensor([[1, 2, 3, 4], [5, 0, 7, 129]], dtype=torch.int32)
    assert expert_counts(per_expert, 0, 2, 1).tolist() == [6, 2]
    assert expert_counts(per_expert, 1, 2, 1).tolist() == [10, 133]
    assert expert_counts(per_expert, 1, 2, 128).tolist() == [128, 256]
    assert expert_counts(per_expert, 0, 2, 4).dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_received_expert_counts_from_the_outputs(dtype):
    """Counting a dispatch's own local ids (padding rows -1) gives the aligned per-expert
    rows that the all-gathered counts give, with no collective."""
    gen = torch.Generator().manual_seed(5)
    epr, rows, k = 6, 40, 3
    ids = torch.stack([torch.randperm(epr + 4, generator=gen)[:k] for _ in range(rows)]) - 4
    ids = torch.where(ids < 0, -1, ids)  # -1: experts on other ranks
    ids = torch.cat([ids, torch.full((9, k), -1)]).to(dtype)  # padding rows
    per_source = torch.zeros(1, epr, dtype=torch.int32)  # one source sends every row here
    for e in range(epr):
        per_source[0, e] = int((ids == e).any(1).sum())
    for align in (1, 4, 128):
        want = expert_counts(per_source, 0, epr, align)
        assert received_expert_counts(ids, epr, align).tolist() == want.tolist()


def _verdict_cases():
    world = 4
    ok = CallHeader(
        kind=KIND_DISPATCH,
        seq=3,
        dtype=1,
        hidden=256,
        num_topk=2,
        num_experts=8,
        num_sms=24,
        num_worst_tokens=40,
    )
    counts = [[1, 2, 3, 4]] * world
    tokens = [10] * world
    checks = [[0, 7, 0]] * world
    yield "ok", [ok] * world, counts, tokens, checks, None
    yield (
        "error",
        [ok, ok, CallHeader(kind=KIND_DISPATCH, seq=3, error=1), ok],
        counts,
        tokens,
        checks,
        (2, 1),
    )
    yield (
        "buffer",
        [ok, CallHeader(**{**ok.__dict__, "buffer": 2}), ok, ok],
        counts,
        tokens,
        checks,
        (1, 2),
    )
    yield (
        "call",
        [ok, ok, ok, CallHeader(**{**ok.__dict__, "seq": 4})],
        counts,
        tokens,
        checks,
        (3, 4),
    )
    yield (
        "field",
        [ok, CallHeader(**{**ok.__dict__, "hidden": 512}), ok, ok],
        counts,
        tokens,
        checks,
        (1, 1),
    )
    yield (
        "expert_id",
        [ok] * world,
        counts,
        tokens,
        [[0, 7, 0], [0, 7, 0], [0, 8, 0], [-3, 7, 0]],
        (2, 8),
    )
    yield (
        "layout",
        [ok] * world,
        counts,
        tokens,
        [[0, 7, 0], [0, 7, 4], [0, 7, 0], [0, 7, 0]],
        (1, 4),
    )
    yield (
        "worst_differs",
        [ok, ok, CallHeader(**{**ok.__dict__, "num_worst_tokens": 41}), ok],
        counts,
        tokens,
        checks,
        (2, 41),
    )
    yield (
        "worst_overflow",
        [ok] * world,
        [[1, 2, 3, 14]] * world,
        tokens,
        checks,
        (3, 56),
    )
    yield (
        "worst_tokens",
        [ok] * world,
        counts,
        [10, 41, 10, 10],
        checks,
        (1, 41),
    )
    comb = CallHeader(kind=KIND_COMBINE, seq=5, dtype=1, hidden=256, handle_seq=3)
    zero = [[0] * world] * world
    yield "combine_ok", [comb] * world, zero, [0] * world, [[0, 8, 9]] * world, None


@pytest.mark.parametrize("case", list(_verdict_cases()), ids=lambda c: c[0])
def test_device_verdict_reports_what_the_host_checks_raise(case):
    """The GPU check of a sync-free call finds the first failing check at its lowest rank,
    in the order the host raises them, and passes what the host passes."""
    name, headers, counts, tokens, checks, expect = case
    rows = _rows(headers, counts, tokens, checks)
    code, rank, value = device_verdict(rows).tolist()
    if expect is None:
        assert code == 0, (VERDICTS[code - 1], rank, value)
    else:
        # (rank, value) of the first failing check, which is the case's own
        assert (VERDICTS[code - 1], rank, value) == (name, *expect), (code, rank, value)
    # The host checks raise for the same calls, except for the sizing rules only sync-free
    # calls have (one W for every rank, no rank with more tokens than W).
    agreed = Agreement.decode(rows.tolist())
    host_error = "error" if agreed.failed_ranks else None
    if host_error is None:
        try:
            agreed.check("call")
            if headers[0].kind == KIND_DISPATCH:
                agreed.check_routing("call")
                agreed.check_worst_tokens("call")
        except InvalidInputError as exc:
            host_error = str(exc)
    gpu_only = {"ok", "combine_ok", "worst_differs", "worst_tokens"}
    assert (host_error is None) == (name in gpu_only), (name, host_error)


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

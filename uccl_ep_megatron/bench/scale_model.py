"""The analytic scale model behind ``bench scale``: what the internode HT path should move per GPU
at EP16/32/64 on a given NIC, from the routing math, the protocol's command counts and measured
or stated per-command and per-byte costs. CPU only: nothing here touches a GPU or a NIC.

Per rank and call (expected values under random routing):

- **Bytes.** A token goes once to every remote node that hosts one of its top-k experts (one copy
  per destination node, as the kernels deduplicate), in a ring slot of the kernels' own layout
  (``_C.internode.dispatch_slot`` / ``combine_slot``: row, scales, ids, weights, rows). Combine
  sends one partial per (token, node) back, so the same count of combine slots.
- **Commands.** Each (channel, remote node) stream moves its tokens in chunks: one write with a
  piggy-backed tail atomic per chunk (two messages), a second write when a chunk wraps the ring,
  the receiver's head-update atomics (``head_per_chunk`` per chunk) and, for dispatch, one
  end-of-stream atomic per stream.
- **Time.** The largest of: the wire (bytes plus per-packet headers over the line rate), the NIC's
  per-message cost, the proxy (FIFO commands over threads x commands/s per thread), the GPU FIFO
  (pushes of one channel's thread, and the FIFO's total rate), the per-stream in-flight window
  (Little's law: bytes a stream may have in flight over a round trip), the ring's head loop,
  NVLink forwarding inside the destination node and, when given, a measured pipeline rate; plus
  a start-up of one barrier round trip and the first write.
- **Back to back** (sync-free calls with no host wait): each call's host path hides behind the
  previous call's GPU time, and each call pays a boundary, when given: the GPU-side time between
  one call's last write and the next call's first, in place of the start-up it contains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError

OPS = ("dispatch", "dispatch_fp8", "combine")
# DeepEP's tests (and UCCL-EP's port of them) count FP8 bytes as BF16 bytes times this factor.
FP8_FACTOR = (1 + 4 / 128) / 2
# Limits of the kernels (csrc/kernels/internode_layout.h and backends/internode).
MAX_NODES = 16
FIFO_CHANNELS = 8  # backends.internode.backend.NUM_FIFO_CHANNELS: ring channel c -> FIFO c % 8


# ---- routing ---------------------------------------------------------------------------------
def hit_probability(pool: int, group: int, topk: int) -> float:
    """P(at least one of ``topk`` distinct experts drawn uniformly from ``pool`` is among a given
    ``group`` of them)."""
    if not 0 < topk <= pool or not 0 <= group <= pool:
        raise InvalidInputError(f"top-{topk} of {pool} experts, a group of {group}: no such draw")
    return 1.0 - math.comb(pool - group, topk) / math.comb(pool, topk)


@dataclass(frozen=True)
class Routing:
    """Top-k of ``experts`` spread evenly over ``nodes`` x ``ranks_per_node`` ranks. With
    ``max_nodes`` (DeepSeek-V3's node-limited routing, as in DeepEP's published runs: top-4
    groups with one group per node) a token first picks that many nodes uniformly, then its
    experts uniformly among theirs; 0 = no limit (what ``bench internode`` routes)."""

    experts: int
    topk: int
    nodes: int
    ranks_per_node: int
    max_nodes: int = 0

    def __post_init__(self) -> None:
        ranks = self.nodes * self.ranks_per_node
        if self.nodes < 1 or self.ranks_per_node < 1 or self.experts % ranks:
            raise InvalidInputError(
                f"{self.experts} experts over {self.nodes} nodes x {self.ranks_per_node} ranks: "
                "the experts must split evenly over the ranks"
            )
        if self.max_nodes < 0 or self.topk > self.selected * self.experts // self.nodes:
            raise InvalidInputError(
                f"top-{self.topk} within {self.selected} of {self.nodes} nodes "
                f"({self.experts // self.nodes} experts each): not enough experts; raise "
                "--max-nodes or lower --topk"
            )

    @property
    def selected(self) -> int:
        return self.nodes if self.max_nodes == 0 else min(self.max_nodes, self.nodes)

    def _hit(self, group: int) -> float:
        """P(a given set of ``group`` experts, all on one node, receives the token)."""
        per_node = self.experts // self.nodes
        pool = self.selected * per_node
        return self.selected / self.nodes * hit_probability(pool, group, self.topk)

    def node_hit(self) -> float:
        """P(a given node hosts at least one of the token's experts)."""
        return self._hit(self.experts // self.nodes)

    def rank_hit(self) -> float:
        """P(a given rank hosts at least one of the token's experts)."""
        return self._hit(self.experts // (self.nodes * self.ranks_per_node))

    def remote_nodes_per_token(self) -> float:
        """Copies of a token that cross the network (one per remote destination node)."""
        return (self.nodes - 1) * self.node_hit()

    def nodes_per_token(self) -> float:
        """Nodes a token reaches, its own included (what DeepEP's benchmark counts as RDMA)."""
        return self.nodes * self.node_hit()

    def any_remote(self) -> float:
        """P(the token has at least one expert on a node other than its own)."""
        per_node = self.experts // self.nodes
        pool = self.selected * per_node
        own_only = math.comb(per_node, self.topk) / math.comb(pool, self.topk)
        return 1.0 - self.selected / self.nodes * own_only


# ---- traffic ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """One call's shape and the kernels' chunking (defaults: DeepSeek-V3 HT, the library's
    internode ``Config`` defaults at 24 SMs)."""

    tokens: int = 4096
    hidden: int = 7168
    experts: int = 256
    topk: int = 8
    ranks_per_node: int = 8
    sms: int = 24
    chunk: int = 20
    combine_chunk: int = 16
    ring: int = 128
    max_nodes: int = 4

    @property
    def channels(self) -> int:
        return self.sms // 2

    def chunk_of(self, op: str) -> int:
        return self.combine_chunk if op == "combine" else self.chunk


def slot_bytes(op: str, shape: Shape) -> int:
    """Bytes of one ring slot of ``op``, from the kernels' layout arithmetic."""
    from uccl_ep_megatron.core import _c

    lay = _c.load().internode
    if op == "combine":
        return int(lay.combine_slot(2 * shape.hidden, shape.topk)["bytes"])
    fp8 = op == "dispatch_fp8"
    row = shape.hidden * (1 if fp8 else 2)
    scales = shape.hidden // 128 if fp8 else 0
    return int(lay.dispatch_slot(row, scales, shape.topk, shape.ranks_per_node)["bytes"])


def atomic_steps(delta: int) -> int:
    """Software atomics (11-bit immediates) one counter update of ``delta`` takes."""
    from uccl_ep_megatron.core import _c

    return len(_c.load().internode.atomic_steps(delta))


@dataclass(frozen=True)
class Traffic:
    """What one rank sends per call of ``op`` to the other nodes (expected values)."""

    op: str
    nodes: int
    tokens: float  # token copies crossing the network
    bytes: float  # their slot bytes
    slot: int
    streams: int  # (channel, remote node)
    chunks: float  # chunks over all streams
    writes: float  # data writes (a chunk that wraps the ring is two)
    tails: float  # tail-update messages (piggy-backed atomics)
    heads: float  # head-update atomics this rank's receiver returns
    ends: float  # end-of-stream atomics
    commands: float  # FIFO commands this rank's GPU pushes
    messages: float  # messages this rank's NIC sends
    nvlink_bytes: float  # forwarded inside the destination node, per rank
    deepep_bytes: float  # DeepEP's benchmark accounting of the same call


def traffic(op: str, shape: Shape, nodes: int, head_per_chunk: float) -> Traffic:
    """Expected traffic of one rank's ``op`` call at ``nodes`` nodes."""
    if op not in OPS:
        raise InvalidInputError(f"op {op!r}: choose one of {', '.join(OPS)}")
    if not 2 <= nodes <= MAX_NODES or shape.tokens <= 0:
        raise InvalidInputError(
            f"{nodes} nodes, {shape.tokens} tokens: the internode path takes 2-{MAX_NODES} nodes "
            "and at least one token per rank"
        )
    r = Routing(shape.experts, shape.topk, nodes, shape.ranks_per_node, shape.max_nodes)
    k = shape.chunk_of(op)
    if not 0 < k <= shape.ring or not 2 <= shape.sms <= 64 or shape.sms % 2:
        raise InvalidInputError(
            f"chunk {k}, ring {shape.ring}, {shape.sms} SMs: need 0 < chunk <= ring and an even "
            "SM count in 2..64"
        )
    slot = slot_bytes(op, shape)
    tokens = shape.tokens * r.remote_nodes_per_token()
    streams = shape.channels * (nodes - 1)
    chunks = streams * math.ceil(tokens / streams / k)
    # Chunk starts walk the ring in steps of k: a fraction (k - 1) / ring of them straddle its end.
    writes = chunks * (1 + (k - 1) / shape.ring)
    steps = atomic_steps(k)
    tails = chunks * steps
    heads = chunks * head_per_chunk
    ends = float(streams) if op != "combine" else 0.0
    # A tail of one step rides on the chunk's last write command; larger ones are own commands.
    commands = writes + (0 if steps == 1 else tails) + heads + ends
    L = shape.ranks_per_node
    nvlink_rows = shape.tokens * nodes * (L - 1) * r.rank_hit()
    row_bytes = 2 * shape.hidden * (FP8_FACTOR if op == "dispatch_fp8" else 1.0)
    return Traffic(
        op=op,
        nodes=nodes,
        tokens=tokens,
        bytes=tokens * slot,
        slot=slot,
        streams=streams,
        chunks=chunks,
        writes=writes,
        tails=tails,
        heads=heads,
        ends=ends,
        commands=commands,
        messages=writes + tails + heads + ends,
        nvlink_bytes=nvlink_rows * slot,
        deepep_bytes=shape.tokens * r.nodes_per_token() * row_bytes,
    )


# ---- costs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Nic:
    """A NIC as the model sees it (per GPU). ``latency_us``: one way, NIC to NIC through one
    switch; ``completion_us``: what a write costs post-to-completion beyond the wire and two
    latencies (the ipc model's copy-engine floor); ``msg_us``: the NIC's time per message;
    ``max_inflight_*``: the proxy's per-stream caps (``UCCL_IB_MAX_INFLIGHT_*``; 0 bytes = none)."""

    key: str
    name: str
    line_gbps: float
    mtu: int
    header_bytes: int
    latency_us: float
    msg_us: float
    ordering: str
    max_inflight_msgs: int
    max_inflight_bytes: int = 0
    completion_us: float = 0.0
    notes: str = ""


@dataclass(frozen=True)
class Host:
    """Costs on the GPU/CPU side of the NIC; each field's source is in ``bench/scale.py``."""

    proxy_threads: int = 4
    cmds_per_s_per_thread: float = 1.0e6
    fifo_cmds_per_s: float = 80.5e6
    fifo_push_us: float = 0.86
    fifo_poll_us: float = 1.5
    nvlink_gbps: float = 300.0
    head_per_chunk: dict[str, float] = field(default_factory=dict)
    pipeline_gbps: dict[str, float] = field(default_factory=dict)
    # µs of host path per call ("dispatch", "combine"), before its kernels: argument checks,
    # the call-header exchange (a cross-rank barrier), tables and launches. Assumed the same at
    # every EP (the header's wait for the slowest rank and its per-rank counts grow with it).
    call_host_us: dict[str, float] = field(default_factory=dict)
    # µs per call ("dispatch", "combine") of sync-free calls back to back during which the wire
    # idles between one call's last write and the next call's first: GPU-side work on the
    # stream (the call-header all-gather, the index tables, the node barriers, the kernels'
    # ramp-up and tail). Assumed the same at every EP (the all-gather's wait and the tables
    # grow with the ranks).
    boundary_us: dict[str, float] = field(default_factory=dict)

    def heads(self, op: str) -> float:
        return self.head_per_chunk.get("combine" if op == "combine" else "dispatch", 1.0)

    def host_us(self, op: str) -> float:
        return self.call_host_us.get("combine" if op == "combine" else "dispatch", 0.0)

    def boundary(self, op: str) -> float:
        return self.boundary_us.get("combine" if op == "combine" else "dispatch", 0.0)


def _window_rate(t: Traffic, shape: Shape, nic: Nic) -> float:
    """Bytes/µs all streams sustain within the proxy's in-flight caps (Little's law)."""
    k = shape.chunk_of(t.op)
    chunk_bytes = k * t.slot
    ser = chunk_bytes / (nic.line_gbps * 1e3)
    rtt = 2 * nic.latency_us + nic.completion_us + nic.msg_us
    m = (t.writes + t.tails + t.heads) / t.chunks  # messages of one chunk in its stream
    in_flight = nic.max_inflight_msgs / m  # chunks
    if nic.max_inflight_bytes:
        in_flight = min(in_flight, max(1.0, nic.max_inflight_bytes // chunk_bytes))
    if in_flight >= 1:
        per_stream = in_flight * chunk_bytes / (ser + rtt)
    else:  # a chunk's messages leave a window at a time, each turn a round trip
        per_stream = chunk_bytes / (ser + m / nic.max_inflight_msgs * rtt)
    return t.streams * per_stream


def terms(t: Traffic, shape: Shape, nic: Nic, host: Host) -> dict[str, float]:
    """µs per call each resource needs on its own; the call takes the largest."""
    rate = nic.line_gbps * 1e3  # bytes per µs
    per_write = t.bytes / t.writes
    packets = t.writes * math.ceil(per_write / nic.mtu) + (t.messages - t.writes)
    threads = min(host.proxy_threads, FIFO_CHANNELS, shape.channels)
    k = shape.chunk_of(t.op)
    loop = k * t.slot / rate + 2 * nic.latency_us + nic.completion_us + 2 * host.fifo_poll_us
    per_channel = max(t.writes + t.ends, t.heads) / shape.channels
    out = {
        "line": (t.bytes + packets * nic.header_bytes) / rate,
        "NIC msgs": t.messages * nic.msg_us,
        "proxy": t.commands / (threads * host.cmds_per_s_per_thread) * 1e6,
        "FIFO": max(t.commands / host.fifo_cmds_per_s * 1e6, per_channel * host.fifo_push_us),
        "window": t.bytes / _window_rate(t, shape, nic),
        "ring": t.bytes / (t.streams * shape.ring * t.slot / loop),
        "NVLink": t.nvlink_bytes / (host.nvlink_gbps * 1e3),
    }
    if host.pipeline_gbps.get(t.op):
        out["pipeline"] = t.bytes / (host.pipeline_gbps[t.op] * 1e3)
    return out


def predict(op: str, shape: Shape, nodes: int, nic: Nic, host: Host) -> dict[str, Any]:
    """One row of the model: traffic, every term, the predicted time and GB/s, the limit."""
    t = traffic(op, shape, nodes, host.heads(op))
    us_of = terms(t, shape, nic, host)
    ranked = sorted(us_of, key=us_of.get, reverse=True)
    limit, runner_up = ranked[0], ranked[1]
    startup = 3 * nic.latency_us + nic.completion_us  # one barrier round trip, the first write
    us = us_of[limit] + startup
    # A single call: its host path, then the transfer; no boundary (its header exchange and
    # tables are in its host path, which waits for them in an exact call; its barrier and first
    # write are the start-up).
    # Sync-free calls back to back: the GPU runs each call's transfer and the boundary before
    # the next one, and the host path overlaps that. The boundary, measured from one call's last
    # write to the next call's first, holds a start-up (the last write landing, the barrier
    # round trip): a call takes the transfer plus the larger of the two, not both. It is not
    # added to the host path: a sync-free call's all-gather and tables wait on the stream, not
    # on the host, and the host path of exact calls already holds the header exchange.
    host_us, boundary = host.host_us(op), host.boundary(op)
    b2b_us = us - startup + max(startup, boundary)
    per_call, pipelined = us + host_us, max(b2b_us, host_us)
    others = max(v for name, v in us_of.items() if name != "proxy")
    threads = min(host.proxy_threads, FIFO_CHANNELS, shape.channels)
    return {
        "ep": nodes * shape.ranks_per_node,
        "nodes": nodes,
        "nic": nic.key,
        "op": op,
        "tokens": t.tokens,
        "mb": t.bytes / 1e6,
        "slot_bytes": t.slot,
        "streams": t.streams,
        "writes": t.writes,
        "commands": t.commands,
        "messages": t.messages,
        "terms_us": us_of,
        "startup_us": startup,
        "us": us,
        "gbps": t.bytes / us / 1e3,
        "line": t.bytes / us / 1e3 / nic.line_gbps,
        "limit": limit,
        "next": runner_up,
        "next_of_limit": us_of[runner_up] / us_of[limit],
        # The per-thread rate at which the proxy would become the limit.
        "proxy_break_even": t.commands / (threads * others) * 1e6,
        "deepep_gbps": t.deepep_bytes / us / 1e3,
        "host_us": host_us,
        "boundary_us": boundary,
        "gbps_per_call": t.bytes / per_call / 1e3,
        "gbps_pipelined": t.bytes / pipelined / 1e3,
    }


__all__ = [
    "FP8_FACTOR",
    "Host",
    "Nic",
    "OPS",
    "Routing",
    "Shape",
    "Traffic",
    "hit_probability",
    "predict",
    "slot_bytes",
    "terms",
    "traffic",
]

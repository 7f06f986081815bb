"""``uccl-ep-megatron bench scale``: the scale model. Predicted HT dispatch and combine GB/s per GPU
(inter-node bytes) at EP16/32/64 on 400G NICs, with the term that limits each, beside DeepEP V1's
and UCCL-EP's published numbers. CPU only: an analytic model (``scale_model.py``), no GPU, no NIC.

Where its inputs come from (every one has a flag):

- routing and slot bytes: the DeepSeek-V3 HT shape and the kernels' ring-slot layout
  (``_C.internode``), node-limited to 4 nodes per token as DeepEP's published runs route;
- chunk, ring, channels: the library's internode ``Config`` defaults at 24 SMs;
- GPU FIFO: 0.86 µs per push (one thread), 1.5 µs push-to-poll, 80.5 M commands/s over 4
  threads (``bench fifo``, one H200, docs/performance.md); NVLink: ~300 GB/s peer copy with both
  GPUs copying (H100/H200, docs/performance.md);
- ipc NIC model: 9.9 µs post-to-completion of one write at 0 µs latency (``bench internode
  --copy-only --window 1``); head updates per chunk: ``HEAD_PER_CHUNK``, from the NIC's message
  counts in bench/results/internode-h100-2x2-sweep.json;
- proxy commands/s per thread: 1 M, an assumption (a post and a completion per message, ~0.25 µs
  each, and the peers' immediates). No committed run saturates the proxies (1 -> 4 threads did not
  change them), so they bound it from below only (~45 K/s per thread); each row prints the rate
  at which the proxy would become the limit. ``--from-json`` takes a run's own numbers instead;
  ``bench proxy`` measures a host's rate with the proxies alone (CPU producers, no GPU).
- NIC presets: line rate, MTU, headers and ordering from public specifications; latencies and
  per-message costs are stated assumptions; in-flight caps from launch/nic_presets.yaml;
- host path per call (checks, the call-header exchange, tables, launches before the kernels):
  none unless ``--host-us`` or a run's exact calls (``--from-json``) give it; it is assumed the
  same at every EP, so what it predicts at larger EP is a bound from above.
- call boundary (the wire's idle time between sync-free calls back to back: header all-gather,
  tables, barriers, the kernels' ramp-up and tail): none unless ``--boundary-us`` or a run's
  ``pipelined`` rows with the modelled wire's accounting (``--from-json``) give it; also assumed
  the same at every EP, a bound from below of what it costs there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from dataclasses import replace
from typing import Any

from uccl_ep_megatron.bench.common import (
    add_json_argument,
    bench_main,
    flag_list,
    register_bench,
    write_json,
)
from uccl_ep_megatron.bench.scale_model import (
    MAX_NODES,
    OPS,
    Host,
    Nic,
    Shape,
    predict,
    traffic,
)
from uccl_ep_megatron.core.errors import InvalidInputError

IPC_COMPLETION_US = 9.9
# Head-update atomics per chunk the receiver returns (measured: NIC messages per call minus the
# writes, tails and end markers the model counts, over its chunks; 2x2, chunk 20 / 12).
HEAD_PER_CHUNK = {"dispatch": 1.14, "combine": 0.29}
ROCE_HEADER = 82  # preamble+IFG 20, MAC 14, FCS 4, IPv4 20, UDP 8, BTH 12, ICRC 4
IB_HEADER = 30  # LRH 8, BTH 12, ICRC 4, VCRC 2, RETH on a message's first packet


# The NIC presets (per GPU). Line rate, MTU, header bytes and ordering are public facts of each
# NIC; one-way latency (NIC to NIC through one switch) and the time per message are assumptions,
# stated in ``notes``; the in-flight caps are read from launch/nic_presets.yaml (``caps``).
_NIC_SPECS: tuple[dict[str, Any], ...] = (
    dict(
        key="efa",
        name="400G EFA (SRD)",
        caps="efa",
        line_gbps=50.0,
        mtu=8192,
        header_bytes=64,
        latency_us=8.0,
        msg_us=0.05,
        ordering="SRD",
        notes="one 400 Gb/s EFA device per GPU (p6-b200); MTU, headers, latency and 0.05 "
        "us/message assumed",
    ),
    dict(
        key="efa-p5en",
        name="200G EFA (SRD), p5en",
        caps="efa",
        line_gbps=25.0,
        mtu=8192,
        header_bytes=64,
        latency_us=8.0,
        msg_us=0.05,
        ordering="SRD",
        notes="p5en wires 2 x 200 Gb/s per H200; this tree drives one NIC per GPU (no "
        "multi-NIC aggregation); as efa otherwise",
    ),
    dict(
        key="cx7",
        name="ConnectX-7 400G IB (RC)",
        caps="cx7-ib",
        line_gbps=50.0,
        mtu=4096,
        header_bytes=IB_HEADER,
        latency_us=2.0,
        msg_us=0.005,
        ordering="RC",
        notes="NDR 400 Gb/s, MTU 4096; 2 us one way and 200 M messages/s assumed",
    ),
    dict(
        key="thor2",
        name="Broadcom Thor-2 400G RoCEv2 (RC)",
        caps="thor2",
        line_gbps=50.0,
        mtu=4096,
        header_bytes=ROCE_HEADER,
        latency_us=2.5,
        msg_us=0.01,
        ordering="RC",
        notes="RoCEv2, MTU 4096; 2.5 us and 100 M messages/s assumed; thor2 preset's caps",
    ),
    dict(
        key="pollara",
        name="AMD Pollara 400G RoCEv2 (RC)",
        caps="pollara",
        line_gbps=50.0,
        mtu=4096,
        header_bytes=ROCE_HEADER,
        latency_us=2.5,
        msg_us=0.01,
        ordering="RC",
        notes="RoCEv2, MTU 4096; 2.5 us and 100 M messages/s assumed; pollara preset's caps",
    ),
    dict(
        key="ipc",
        name="ipc NIC model",
        caps="none",
        line_gbps=50.0,
        mtu=4096,
        header_bytes=64,
        latency_us=3.0,
        msg_us=0.0,
        ordering="RC",
        completion_us=IPC_COMPLETION_US,
        notes="bench internode's emulator: 64 B per 4 KB packet, 9.9 us measured per write "
        "beyond the latencies",
    ),
)


def presets(link_gbps: float = 0.0, latency_us: float = -1.0) -> dict[str, Nic]:
    """The NIC presets; ``link_gbps`` (> 0) / ``latency_us`` (>= 0) override every preset's."""
    from uccl_ep_megatron.cluster.launch import nic_presets
    from uccl_ep_megatron.core import _c

    window = int(_c.load().cmd_limits["seq_window"])  # the proxy's cap when a preset sets none
    out = {}
    for spec in _NIC_SPECS:
        spec = dict(spec)
        env = nic_presets()[spec.pop("caps")]["env"]
        nic = Nic(
            **spec,
            max_inflight_msgs=int(env.get("UCCL_IB_MAX_INFLIGHT_NORMAL", 0)) or window,
            max_inflight_bytes=int(env.get("UCCL_IB_MAX_INFLIGHT_BYTES", 0)),
        )
        if link_gbps > 0:
            nic = dataclasses.replace(nic, line_gbps=link_gbps)
        if latency_us >= 0:
            nic = dataclasses.replace(nic, latency_us=latency_us)
        out[nic.key] = nic
    return out


# Published HT numbers (GB/s per GPU, each project's benchmark accounting: DeepEP's test, which
# UCCL-EP's benchmark ports, counts a token once per node it reaches, its own node included, and
# FP8 bytes as BF16 x (1 + 4/128) / 2). (preset, EP, op, low, high, source)
PUBLISHED: tuple[tuple[str, int, str, float, float, str], ...] = (
    ("cx7", 16, "dispatch_fp8", 43, 43, "DeepEP V1, H800+CX7"),
    ("cx7", 16, "combine", 43, 43, "DeepEP V1, H800+CX7"),
    ("cx7", 32, "dispatch_fp8", 58, 58, "DeepEP V1, H800+CX7"),
    ("cx7", 32, "combine", 57, 57, "DeepEP V1, H800+CX7"),
    ("cx7", 64, "dispatch_fp8", 51, 51, "DeepEP V1, H800+CX7"),
    ("cx7", 64, "combine", 50, 50, "DeepEP V1, H800+CX7"),
    ("cx7", 16, "dispatch_fp8", 74, 74, "UCCL-EP, MI300X+CX7"),
    ("cx7", 16, "dispatch", 82, 82, "UCCL-EP, MI300X+CX7"),
    ("cx7", 16, "combine", 78, 78, "UCCL-EP, MI300X+CX7"),
    ("cx7", 32, "dispatch_fp8", 60, 60, "UCCL-EP, MI300X+CX7"),
    ("cx7", 32, "dispatch", 61, 61, "UCCL-EP, MI300X+CX7"),
    ("cx7", 32, "combine", 60, 60, "UCCL-EP, MI300X+CX7"),
    ("cx7", 64, "dispatch_fp8", 52, 52, "UCCL-EP, MI300X+CX7"),
    ("cx7", 64, "combine", 51, 51, "UCCL-EP, MI300X+CX7"),
    ("efa", 16, "dispatch_fp8", 53, 53, "UCCL-EP, B200+400G EFA"),
    ("efa", 16, "combine", 60, 60, "UCCL-EP, B200+400G EFA"),
    ("efa", 32, "dispatch_fp8", 53, 53, "UCCL-EP, B200+400G EFA"),
    ("efa", 32, "combine", 57, 57, "UCCL-EP, B200+400G EFA"),
    ("efa-p5en", 16, "dispatch_fp8", 50, 50, "UCCL-EP, H200+2x200G EFA"),
    ("efa-p5en", 16, "combine", 18, 18, "UCCL-EP, H200+2x200G EFA"),
    ("efa-p5en", 32, "dispatch_fp8", 54, 54, "UCCL-EP, H200+2x200G EFA"),
    ("efa-p5en", 32, "combine", 43, 43, "UCCL-EP, H200+2x200G EFA"),
    ("thor2", 16, "dispatch_fp8", 71, 71, "UCCL-EP, MI300X+Thor-2"),
    ("thor2", 16, "dispatch", 81, 81, "UCCL-EP, MI300X+Thor-2"),
    ("thor2", 16, "combine", 45, 45, "UCCL-EP, MI300X+Thor-2"),
    ("thor2", 32, "dispatch_fp8", 49, 49, "UCCL-EP, MI300X+Thor-2"),
    ("thor2", 32, "dispatch", 55, 55, "UCCL-EP, MI300X+Thor-2"),
    ("thor2", 32, "combine", 50, 50, "UCCL-EP, MI300X+Thor-2"),
    ("pollara", 16, "dispatch", 74, 82, "UCCL-EP, MI355X+Pollara (EP16 range, not split by op)"),
)


def published_for(nic: str, ep: int, op: str) -> list[dict[str, Any]]:
    """Published numbers for one row, each also as inter-node payload GB/s: a share
    (nodes - 1) / nodes of DeepEP's count crosses the network (every node equally likely)."""
    nodes = ep // 8
    out = []
    for key, e, o, lo, hi, source in PUBLISHED:
        if key == nic and e == ep and o == op:
            wire = (nodes - 1) / nodes
            out.append({"source": source, "gbps": [lo, hi], "wire_gbps": [lo * wire, hi * wire]})
    return out


# ---- a measured run (--from-json) ------------------------------------------------------------
def _base_op(op: str) -> str:
    """``dispatch_sync_free`` -> ``dispatch``: the sync-free calls move the same traffic."""
    return next((o for o in ("dispatch_fp8", "dispatch", "combine") if op.startswith(o)), "")


def _run_shape(meta: dict[str, Any], op: str, chunk: int) -> tuple[Shape, int]:
    """The shape and node count a bench internode run used for ``op`` (uniform routing)."""
    rpn = int(meta["ranks_per_node"])
    shape = Shape(
        tokens=int(meta["tokens"]),
        hidden=int(meta["hidden"]),
        experts=int(meta["experts"]),
        topk=int(meta["topk"]),
        ranks_per_node=rpn,
        sms=int(meta["sms"]),
        max_nodes=0,
    )
    field_name = "combine_chunk" if op == "combine" else "chunk"
    return dataclasses.replace(shape, **{field_name: chunk}), int(meta["world"]) // rpn


def load_run(path: str) -> dict[str, Any]:
    """A ``bench internode --json`` file, checked to hold timed dispatch/combine rows."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidInputError(f"--from-json {path!r}: cannot read it as JSON ({e})") from None
    meta = run.get("meta") if isinstance(run, dict) else None
    need = ("tokens", "hidden", "experts", "topk", "world", "ranks_per_node", "sms")
    if not isinstance(meta, dict) or any(k not in meta for k in need):
        raise InvalidInputError(
            f"--from-json {path!r}: not a bench internode result (needs meta with {need})"
        )
    rows = [
        r
        for r in run.get("rows", [])
        if _base_op(r.get("op", ""))
        and all(k in r for k in ("threads", "writes", "chunk", "cmds_per_s", "gbps", "rdma_mb"))
    ]
    # Sync-free pairs back to back with the modelled wire's accounting (runs with a line rate).
    pipelined = [
        r
        for r in run.get("rows", [])
        if r.get("op") == "pipelined"
        and r.get("link_gbps")
        and isinstance(r.get("wire"), dict)
        and all(k in r["wire"] for k in ("busy_us", "idle_short_us"))
    ]
    if not rows:
        raise InvalidInputError(
            f"--from-json {path!r}: no timed dispatch/combine rows (a --copy-only run has none); "
            "give the JSON of a bench internode run without --copy-only"
        )
    return {"meta": meta, "rows": rows, "pipelined": pipelined, "path": path}


def pair_boundary_us(row: dict[str, Any]) -> float:
    """µs of one ``pipelined`` pair (a sync-free dispatch + combine, back to back) during which
    the wire idled between calls: the pair's steady time less the wire's busy time and its short
    gaps (< 50 µs, within a call). Not the trace's long gaps themselves: those also hold the
    pause between timed runs (barrier, sync, the first call's host path), spread over the pairs,
    which sync-free calls in a training step do not pay (busy + short + long exceeds the pair)."""
    w = row["wire"]
    return max(0.0, float(row["us"]) - float(w["busy_us"]) - float(w["idle_short_us"]))


def calibrate(run: dict[str, Any]) -> dict[str, Any]:
    """What a run says about the costs: head updates per chunk (from the NIC's message count),
    the highest commands/s per proxy thread it reached (a floor of what a thread can do): over
    the timed loop of any row, pipelined pairs included, or, where a row has its transfer time,
    its modelled commands per call over that time (every command of a call was posted while its
    kernels moved the rows); from its rows without a line rate, the GB/s the rest of the
    pipeline reached per op, the host path of its exact calls and, from its ``pipelined`` rows,
    the call boundary."""
    heads: dict[str, list[float]] = {"dispatch": [], "combine": []}
    hosts: dict[str, list[float]] = {"dispatch": [], "combine": []}
    pipeline: dict[str, float] = {}
    for r in run["rows"]:
        op = _base_op(r["op"])
        shape, nodes = _run_shape(run["meta"], op, int(r["chunk"]))
        t = traffic(op, shape, nodes, 0.0)
        kind = "combine" if op == "combine" else "dispatch"
        heads[kind].append(max(0.0, (float(r["writes"]) - t.messages) / t.chunks))
        if r.get("host_us") is not None and r["op"] in ("dispatch", "combine"):  # exact, BF16
            hosts[kind].append(float(r["host_us"]))
        if not r.get("link_gbps"):
            pipeline[op] = max(pipeline.get(op, 0.0), float(r["gbps"]))
    # Pairs back to back keep the proxies busiest: single calls leave them idle through their
    # host paths, so their commands/s alone say little about what a thread can do.
    floor = max(
        float(r["cmds_per_s"]) / int(r["threads"])
        for r in [*run["rows"], *run.get("pipelined", [])]
        if r.get("cmds_per_s") is not None and r.get("threads")
    )
    head_per_chunk = {k: statistics.median(v) for k, v in heads.items() if v}
    transfer_floor = max((_transfer_rate(run, r, head_per_chunk) for r in run["rows"]), default=0.0)
    # Per pair, median over every rank and configuration (as the host path); the trace does not
    # tell the dispatch's boundary from the combine's, so each call takes half.
    pairs = [pair_boundary_us(r) for r in run.get("pipelined", [])]
    boundary = statistics.median(pairs) / 2 if pairs else None
    return {
        "head_per_chunk": head_per_chunk,
        "cmds_per_s_per_thread_floor": max(floor, transfer_floor),
        "cmds_per_s_per_thread_loop": floor,
        "cmds_per_s_per_thread_transfer": transfer_floor,
        "pipeline_gbps": pipeline,
        "call_host_us": {k: statistics.median(v) for k, v in hosts.items() if v},
        "boundary_us": {} if boundary is None else {"dispatch": boundary, "combine": boundary},
    }


def _transfer_rate(run: dict[str, Any], r: dict[str, Any], head_per_chunk: dict) -> float:
    """Commands/s per proxy thread of a row during its transfer time (queued where measured):
    the modelled commands of one call over it; 0 for a row without one."""
    us = r.get("xq_us") or r.get("xfer_us")
    if not us or not r.get("threads") or not r.get("link_gbps"):
        return 0.0
    op = _base_op(r["op"])
    shape, nodes = _run_shape(run["meta"], op, int(r["chunk"]))
    kind = "combine" if op == "combine" else "dispatch"
    t = traffic(op, shape, nodes, head_per_chunk.get(kind, 0.0))
    return t.commands / (float(us) * 1e-6) / int(r["threads"])


def check_run(run: dict[str, Any], hosts: dict[str, Host]) -> list[dict[str, Any]]:
    """The model at each measured configuration of the run (ipc preset at the run's line rate,
    latency and threads) with each of ``hosts``' costs, beside what the run measured (rank 0)."""
    out = []
    for r in run["rows"]:
        if r.get("rank", 0) != 0 or not r.get("link_gbps"):
            continue
        op = _base_op(r["op"])
        shape, nodes = _run_shape(run["meta"], op, int(r["chunk"]))
        nic = presets(float(r["link_gbps"]), float(r.get("latency_us", 3.0)))["ipc"]
        row = {
            "op": r["op"],
            "threads": r["threads"],
            "chunk": r["chunk"],
            "link_gbps": r["link_gbps"],
            "measured_mb": r["rdma_mb"],
            "measured_gbps": r["gbps"],
        }
        for name, host in hosts.items():
            p = predict(op, shape, nodes, nic, replace(host, proxy_threads=int(r["threads"])))
            row.update(model_mb=p["mb"], **{f"{name}_gbps": p["gbps"], f"{name}_limit": p["limit"]})
        out.append(row)
    return out


# ---- command line ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench scale`` (see docs/cli.md)."""
    parser.add_argument("--ep", default="16,32,64", help="EP sizes (ranks), comma-separated")
    parser.add_argument(
        "--nics", default="efa,cx7,thor2,pollara", help="NIC presets (also efa-p5en, ipc)"
    )
    parser.add_argument("--ops", default=",".join(OPS), help="ops: " + ", ".join(OPS))
    parser.add_argument("--ranks-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size")
    parser.add_argument("--experts", type=int, default=256, help="routed experts in total")
    parser.add_argument("--topk", type=int, default=8, help="experts per token")
    parser.add_argument(
        "--max-nodes", type=int, default=4, help="nodes a token may reach (node-limited); 0 = any"
    )
    parser.add_argument("--sms", type=int, default=24, help="SM budget (2 per channel)")
    parser.add_argument(
        "--chunk", type=int, default=0, help="dispatch tokens per write; 0 = default"
    )
    parser.add_argument(
        "--combine-chunk", type=int, default=0, help="combine tokens per write; 0 = default"
    )
    parser.add_argument("--ring", type=int, default=0, help="ring slots per channel; 0 = default")
    parser.add_argument("--proxy-threads", type=int, default=4, help="proxy threads per GPU")
    parser.add_argument(
        "--cmds-per-s-per-thread",
        type=float,
        default=None,
        help="FIFO commands one proxy thread handles per second (default 1e6, or the run's floor)",
    )
    parser.add_argument(
        "--head-per-chunk",
        default=None,
        help="head updates per chunk, DISPATCH,COMBINE (default 1.14,0.29 or the run's)",
    )
    parser.add_argument("--fifo-push-us", type=float, default=0.86, help="GPU time per FIFO push")
    parser.add_argument("--fifo-poll-us", type=float, default=1.5, help="FIFO push-to-poll µs")
    parser.add_argument(
        "--fifo-cmds-per-s", type=float, default=80.5e6, help="FIFO commands/s of one GPU"
    )
    parser.add_argument(
        "--nvlink-gbps", type=float, default=300.0, help="NVLink GB/s a GPU forwards at"
    )
    parser.add_argument(
        "--pipeline-gbps",
        type=float,
        default=None,
        help="GB/s of everything but the NIC (kernels, proxy, ...); default none, or the run's",
    )
    parser.add_argument(
        "--host-us",
        default=None,
        help="host path per call in µs before its kernels, DISPATCH,COMBINE (default none, or "
        "the run's exact calls); adds GB/s per call and for sync-free calls back to back",
    )
    parser.add_argument(
        "--boundary-us",
        default=None,
        help="µs per call the wire idles between sync-free calls back to back, DISPATCH,COMBINE "
        "(default none, or half the run's pipelined pair's); lowers the back-to-back GB/s",
    )
    parser.add_argument(
        "--link-gbps", type=float, default=0.0, help="line rate of every preset; 0 = the preset's"
    )
    parser.add_argument(
        "--latency-us", type=float, default=-1.0, help="one-way µs of every preset; < 0 = its own"
    )
    parser.add_argument(
        "--from-json", default="", help="a bench internode --json file: take the costs from it"
    )
    add_json_argument(parser)


def register(subparsers: Any) -> None:
    """Adds ``scale`` to the ``bench`` subcommands."""
    register_bench(
        subparsers, "scale", "scale model: predicted internode GB/s at EP16-64", add_arguments, run
    )


def _shape(args: argparse.Namespace) -> Shape:
    from uccl_ep_megatron.core.config import default_combine_config, default_dispatch_config

    # The library's internode defaults (any multi-node group of this SM budget).
    d = default_dispatch_config(16, args.sms, 8)
    c = default_combine_config(16, args.sms, 8)
    return Shape(
        tokens=args.tokens,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        ranks_per_node=args.ranks_per_node,
        sms=args.sms,
        chunk=args.chunk or d.num_max_rdma_chunked_send_tokens,
        combine_chunk=args.combine_chunk or c.num_max_rdma_chunked_send_tokens,
        ring=args.ring or d.num_max_rdma_chunked_recv_tokens,
        max_nodes=args.max_nodes,
    )


def _per_kind(text: str, flag: str, example: str) -> dict[str, float]:
    """``DISPATCH,COMBINE``, two finite numbers >= 0, of ``flag`` as ``{"dispatch": ..,
    "combine": ..}``; anything else raises naming the flag, the value and the form."""
    try:
        values = [float(v) for v in str(text).split(",")]
    except ValueError:
        values = []
    if len(values) != 2 or not all(math.isfinite(v) and v >= 0 for v in values):
        raise InvalidInputError(f"{flag}={text!r}: give DISPATCH,COMBINE >= 0, e.g. {example}")
    return {"dispatch": values[0], "combine": values[1]}


def _host(args: argparse.Namespace, cal: dict[str, Any] | None) -> Host:
    """Host-side costs: flags first, then the run's (``--from-json``), then the defaults."""
    cal = cal or {}
    heads = dict(cal.get("head_per_chunk") or HEAD_PER_CHUNK)
    if args.head_per_chunk is not None:
        heads = _per_kind(args.head_per_chunk, "--head-per-chunk", "1,0.3")
    rate = args.cmds_per_s_per_thread
    if rate is None:
        rate = cal.get("cmds_per_s_per_thread_floor") or 1.0e6
    call_host = dict(cal.get("call_host_us") or {})
    if args.host_us is not None:
        call_host = _per_kind(args.host_us, "--host-us", "1500,800")
    boundary = dict(cal.get("boundary_us") or {})
    if args.boundary_us is not None:
        boundary = _per_kind(args.boundary_us, "--boundary-us", "200,200")
    pipeline = dict(cal.get("pipeline_gbps") or {})
    if args.pipeline_gbps is not None:
        pipeline = {op: args.pipeline_gbps for op in OPS} if args.pipeline_gbps > 0 else {}
    host = Host(
        proxy_threads=args.proxy_threads,
        cmds_per_s_per_thread=rate,
        fifo_cmds_per_s=args.fifo_cmds_per_s,
        fifo_push_us=args.fifo_push_us,
        fifo_poll_us=args.fifo_poll_us,
        nvlink_gbps=args.nvlink_gbps,
        head_per_chunk=heads,
        pipeline_gbps=pipeline,
        call_host_us=call_host,
        boundary_us=boundary,
    )
    for name in ("proxy_threads", "cmds_per_s_per_thread", "fifo_cmds_per_s", "nvlink_gbps"):
        if getattr(host, name) <= 0:
            flag = "--" + name.replace("_", "-")
            raise InvalidInputError(f"{flag}={getattr(host, name)}: must be > 0")
    if host.fifo_push_us < 0 or host.fifo_poll_us < 0:
        raise InvalidInputError("--fifo-push-us and --fifo-poll-us must be >= 0")
    return host


def _check_args(args: argparse.Namespace) -> list[int]:
    """The flags the model cannot take, each named with its fix; returns the EP sizes."""
    if not 2 <= args.sms <= 64 or args.sms % 2 or not 1 <= args.ranks_per_node <= 8:
        raise InvalidInputError(
            f"--sms {args.sms} --ranks-per-node {args.ranks_per_node}: the internode kernels "
            "take an even SM count in 2..64 and 1..8 GPUs per node"
        )
    if args.tokens <= 0 or args.hidden <= 0 or args.hidden % 128:
        raise InvalidInputError(
            f"--tokens={args.tokens} --hidden={args.hidden}: need tokens > 0 and a hidden size "
            "that is a positive multiple of 128 (FP8 scales per 128 elements)"
        )
    if args.link_gbps < 0:
        raise InvalidInputError(f"--link-gbps={args.link_gbps}: give a rate > 0, or 0 = presets'")
    eps = flag_list(args.ep, "--ep", int)
    for ep in eps:
        nodes = ep // args.ranks_per_node
        if ep % args.ranks_per_node or not 2 <= nodes <= MAX_NODES:
            raise InvalidInputError(
                f"--ep {ep} with --ranks-per-node {args.ranks_per_node}: the internode path "
                f"takes 2-{MAX_NODES} nodes of equal size"
            )
    return eps


def model(args: argparse.Namespace) -> dict[str, Any]:
    """Every (EP, NIC, op) row of the model, the inputs it used and, with ``--from-json``, the
    model at the run's own configurations beside what it measured."""
    eps = _check_args(args)
    run_ = load_run(args.from_json) if args.from_json else None
    cal = calibrate(run_) if run_ else None
    shape, host = _shape(args), _host(args, cal)
    nics = presets(args.link_gbps, args.latency_us)
    rows = []
    for ep in eps:
        for key in flag_list(args.nics, "--nics", str, tuple(nics)):
            for op in flag_list(args.ops, "--ops", str, OPS):
                row = predict(op, shape, ep // args.ranks_per_node, nics[key], host)
                row["published"] = published_for(key, ep, op) if args.ranks_per_node == 8 else []
                rows.append(row)
    return {
        "bench": "scale",
        "shape": dataclasses.asdict(shape),
        "host": dataclasses.asdict(host),
        "nics": {k: dataclasses.asdict(v) for k, v in nics.items()},
        "from_json": {"path": args.from_json, **cal} if cal else None,
        "check": check_run(run_, {"design": _host(args, None), "run": host}) if run_ else [],
        "rows": rows,
    }


def _us(per_kind: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} us" for k, v in per_kind.items()) or "none"


def _print_inputs(res: dict[str, Any]) -> None:
    s, h = res["shape"], res["host"]
    print(
        f"shape: {s['tokens']} tokens/rank, hidden {s['hidden']}, top-{s['topk']} of "
        f"{s['experts']}, {s['ranks_per_node']} GPUs/node, tokens reach <= "
        f"{s['max_nodes'] or 'any'} nodes; {s['sms']} SMs ({s['sms'] // 2} channels), chunk "
        f"{s['chunk']} / combine {s['combine_chunk']}, ring {s['ring']}"
    )
    print(
        f"host: {h['proxy_threads']} proxy threads x {h['cmds_per_s_per_thread'] / 1e3:.0f} K "
        f"cmds/s; FIFO push {h['fifo_push_us']} us, push-to-poll {h['fifo_poll_us']} us, "
        f"{h['fifo_cmds_per_s'] / 1e6:.1f} M cmds/s; NVLink {h['nvlink_gbps']:.0f} GB/s; head "
        f"updates per chunk {h['head_per_chunk']}; pipeline GB/s {h['pipeline_gbps'] or 'none'}"
        f"; host path per call {_us(h['call_host_us'])}; call boundary {_us(h['boundary_us'])}"
    )
    used = {r["nic"] for r in res["rows"]}
    for key, n in res["nics"].items():
        if key in used:
            cap = f"{n['max_inflight_msgs']} msgs" + (
                f" / {n['max_inflight_bytes']} B" if n["max_inflight_bytes"] else ""
            )
            print(
                f"  {key}: {n['name']}: {n['line_gbps']:g} GB/s, MTU {n['mtu']} + "
                f"{n['header_bytes']} B, {n['latency_us']:g} us one way, "
                f"{n['msg_us'] * 1e3:g} ns/msg, {n['ordering']}, in flight per stream {cap}; "
                f"{n['notes']}"
            )


def _published_text(pubs: list[dict[str, Any]]) -> str:
    def rng(v: list[float]) -> str:
        return f"{v[0]:.0f}" if v[0] == v[1] else f"{v[0]:.0f}-{v[1]:.0f}"

    return "; ".join(f"{p['source']} {rng(p['gbps'])} (~{rng(p['wire_gbps'])})" for p in pubs)


def print_table(res: dict[str, Any]) -> None:
    """The inputs, one line per (EP, NIC, op), and the check against a run when given."""
    _print_inputs(res)
    host = any(r["host_us"] for r in res["rows"])
    b2b = host or any(r["boundary_us"] for r in res["rows"])
    print(
        f"{'EP':>3} {'NIC':<8} {'op':<12} {'MB/rank':>7} {'msgs':>6} {'cmds':>6} {'us':>6} "
        f"{'GB/s':>5} {'line':>5} {'limit':<8} {'next':<13} {'proxy b/e':>9} {'DeepEP-acct':>11}"
        + (f" {'call':>5}" if host else "")
        + (f" {'b2b':>5}" if b2b else "")
        + "  published (~ inter-node)"
    )
    for r in res["rows"]:
        print(
            f"{r['ep']:>3} {r['nic']:<8} {r['op']:<12} {r['mb']:>7.1f} {r['messages']:>6.0f} "
            f"{r['commands']:>6.0f} {r['us']:>6.0f} {r['gbps']:>5.1f} {r['line']:>5.2f} "
            f"{r['limit']:<8} {r['next']:<8} {r['next_of_limit']:>4.2f} "
            f"{r['proxy_break_even'] / 1e3:>8.0f}K {r['deepep_gbps']:>11.1f}"
            + (f" {r['gbps_per_call']:>5.1f}" if host else "")
            + (f" {r['gbps_pipelined']:>5.1f}" if b2b else "")
            + f"  {_published_text(r['published'])}"
        )
    if b2b:
        print(
            ("call: GB/s of one call, its host path then its transfer; " if host else "")
            + "b2b: sync-free calls back to back, each host path hidden behind the previous "
            "call, each call paying the boundary in place of its start-up"
        )
    if res["check"]:
        print(
            f"{res['from_json']['path']}: measured beside the model at its settings (ipc preset, "
            "rank 0), with the default costs (design) and with the run's (run)"
        )
        print(
            f"{'op':<20} {'thr':>3} {'chunk':>5} {'link':>5} {'MB run/model':>13} "
            f"{'GB/s':>6} {'design':>7} {'limit':<8} {'run':>6} {'limit':<8}"
        )
        for c in res["check"]:
            print(
                f"{c['op']:<20} {c['threads']:>3} {c['chunk']:>5} {c['link_gbps']:>5g} "
                f"{c['measured_mb']:>6.1f}/{c['model_mb']:<6.1f} {c['measured_gbps']:>6.1f} "
                f"{c['design_gbps']:>7.1f} {c['design_limit']:<8} {c['run_gbps']:>6.1f} "
                f"{c['run_limit']:<8}"
            )


def run(args: argparse.Namespace) -> int:
    """Model, print, optionally write JSON."""
    res = model(args)
    print_table(res)
    write_json(args.json, res)
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main(add_arguments, run, argv, prog="python -m uccl_ep_megatron.bench.scale")


if __name__ == "__main__":
    sys.exit(main())

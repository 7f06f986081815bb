"""``bench scale``: the scale model's routing, byte and command counts against brute-force
simulation and the committed measurements, and the properties its predictions must have."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re

import pytest
import torch

from uccl_ep_megatron import cli
from uccl_ep_megatron.bench import scale
from uccl_ep_megatron.bench.scale_model import (
    OPS,
    Host,
    Routing,
    Shape,
    predict,
    traffic,
)
from uccl_ep_megatron.core import _c
from uccl_ep_megatron.core.errors import InvalidInputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def _route(tokens: int, experts: int, topk: int, nodes: int, max_nodes: int, seed: int = 0):
    """Top-k expert ids per token: uniform, or within ``max_nodes`` nodes picked uniformly."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    if max_nodes:
        per_node = experts // nodes
        picked = torch.rand(tokens, nodes, generator=gen).argsort(dim=1)[:, :max_nodes]
        allowed = torch.zeros(tokens, nodes, dtype=torch.bool)
        allowed.scatter_(1, picked, True)
        scores = scores.masked_fill(~allowed.repeat_interleave(per_node, dim=1), -1.0)
    return scores.topk(topk, dim=1).indices


@pytest.mark.parametrize("max_nodes", [0, 2])
def test_routing_matches_a_monte_carlo_of_the_routing(max_nodes):
    E, k, N, L, T = 64, 6, 4, 2, 60_000
    idx = _route(T, E, k, N, max_nodes)
    node_hits = torch.zeros(T, N, dtype=torch.bool)
    node_hits.scatter_(1, idx // (E // N), True)  # one copy per destination node
    rank_hits = torch.zeros(T, N * L, dtype=torch.bool)
    rank_hits.scatter_(1, idx // (E // (N * L)), True)
    r = Routing(E, k, N, L, max_nodes)
    src = 0  # the sending rank's node; by symmetry any
    remote = node_hits.sum(1) - node_hits[:, src].int()
    assert remote.float().mean().item() == pytest.approx(r.remote_nodes_per_token(), rel=0.01)
    assert node_hits.sum(1).float().mean().item() == pytest.approx(r.nodes_per_token(), rel=0.01)
    assert (remote > 0).float().mean().item() == pytest.approx(r.any_remote(), abs=0.01)
    assert rank_hits.float().mean().item() == pytest.approx(r.rank_hit(), rel=0.02)


def _align16(n: int) -> int:
    return (n + 15) // 16 * 16


@pytest.mark.parametrize("hidden,topk,L", [(7168, 8, 8), (4096, 4, 2), (2048, 32, 1)])
def test_slot_bytes_are_row_plus_metadata_and_fp8_halves_the_data(hidden, topk, L):
    shape = Shape(hidden=hidden, topk=topk, ranks_per_node=L, experts=256, max_nodes=0)
    meta = 4 * topk + 4 * topk + 4 + 4 * L  # ids, weights, source index, a row per local rank
    bf16, fp8 = (traffic(op, shape, 4, 1.0) for op in ("dispatch", "dispatch_fp8"))
    assert bf16.slot == _align16(2 * hidden + meta)
    assert fp8.slot == _align16(hidden + 4 * (hidden // 128) + meta)
    assert fp8.tokens == bf16.tokens
    data_bf16 = bf16.tokens * 2 * hidden
    data_fp8 = fp8.bytes - fp8.tokens * (fp8.slot - hidden)  # the slots' row bytes alone
    assert data_fp8 == pytest.approx(data_bf16 / 2, rel=1e-9)
    combine = traffic("combine", shape, 4, 1.0)
    assert combine.slot == _align16(2 * hidden + 4 * topk + 4)


def _measured_row(name: str, op: str) -> tuple[dict, dict]:
    with open(os.path.join(RESULTS, name)) as f:
        run = json.load(f)
    row = next(r for r in run["rows"] if r.get("op") == op and "rdma_mb" in r)
    return run["meta"], row


@pytest.mark.parametrize("op", ["dispatch", "dispatch_fp8", "combine"])
@pytest.mark.parametrize("name", ["internode-h100-2x2.json", "internode-h100-2x1.json"])
def test_bytes_per_rank_match_what_the_proxy_posted_in_the_committed_runs(name, op):
    meta, row = _measured_row(name, op)
    shape = Shape(
        tokens=meta["tokens"],
        hidden=meta["hidden"],
        experts=meta["experts"],
        topk=meta["topk"],
        ranks_per_node=meta["ranks_per_node"],
        sms=meta["sms"],
        max_nodes=0,
    )
    t = traffic(op, shape, meta["world"] // meta["ranks_per_node"], 1.0)
    assert t.bytes / 1e6 == pytest.approx(row["rdma_mb"], rel=0.01)


def _simulated_writes(shape: Shape, nodes: int, op: str, calls: int = 8) -> tuple[float, float]:
    """Writes and chunks of rank 0 (node 0) per call, from a routed batch: per channel's token
    range and remote node, chunks of at most ``chunk`` tokens, each split where it wraps the ring
    (the kernels' own ``chunk_pieces``); averaged over ``calls`` calls back to back, whose ring
    positions carry over as the kernels' cumulative counters do (a first call alone starts every
    ring at 0, where a chunk that divides the ring never wraps)."""
    lay = _c.load().internode
    idx = _route(shape.tokens, shape.experts, shape.topk, nodes, shape.max_nodes, seed=3)
    hits = torch.zeros(shape.tokens, nodes, dtype=torch.bool)
    hits.scatter_(1, idx // (shape.experts // nodes), True)
    k, C = shape.chunk_of(op), shape.channels
    per = math.ceil(shape.tokens / C)
    writes = chunks = 0
    for c in range(C):
        for n in range(1, nodes):
            start = 0
            for _ in range(calls):
                count = int(hits[c * per : (c + 1) * per, n].sum())
                while count > 0:
                    step = min(k, count)
                    _, _, n2 = lay.chunk_pieces(start, step, shape.ring)
                    writes += 2 if n2 else 1
                    chunks += 1
                    start, count = start + step, count - step
    return writes / calls, chunks / calls


@pytest.mark.parametrize(
    "op,nodes,max_nodes", [("dispatch", 2, 0), ("combine", 4, 0), ("dispatch", 8, 4)]
)
def test_command_counts_match_a_simulation_of_the_chunking(op, nodes, max_nodes):
    shape = Shape(max_nodes=max_nodes)
    writes, chunks = _simulated_writes(shape, nodes, op)
    t = traffic(op, shape, nodes, 1.0)
    assert t.chunks == pytest.approx(chunks, rel=0.05)
    assert t.writes == pytest.approx(writes, rel=0.06)
    # One FIFO command per write (tails ride on it), one per head update, and dispatch's markers.
    assert t.commands == pytest.approx(t.writes + t.heads + t.ends)
    assert t.messages == pytest.approx(t.writes + t.tails + t.heads + t.ends)


def test_head_updates_per_chunk_are_what_the_committed_run_shows():
    run = scale.load_run(os.path.join(RESULTS, "internode-h100-2x2-sweep.json"))
    cal = scale.calibrate(run)
    for kind, value in scale.HEAD_PER_CHUNK.items():
        assert cal["head_per_chunk"][kind] == pytest.approx(value, rel=0.05)


def _all_rows(host: Host) -> list[dict]:
    nics = scale.presets()
    return [
        predict(op, Shape(), ep // 8, nics[key], host)
        for ep in (16, 32, 64)
        for key in nics
        if key != "ipc"
        for op in OPS
    ]


def test_predictions_never_exceed_the_line_rate_or_any_term():
    nics = scale.presets()
    for host in (Host(), Host(cmds_per_s_per_thread=20e3), Host(nvlink_gbps=1e6)):
        for r in _all_rows(host):
            line = nics[r["nic"]].line_gbps
            assert 0 < r["gbps"] < line
            assert r["us"] >= max(r["terms_us"].values())
            assert r["terms_us"][r["limit"]] == max(r["terms_us"].values())


def test_doubling_proxy_threads_raises_a_command_bound_prediction():
    nic = scale.presets()["cx7"]
    slow = Host(cmds_per_s_per_thread=20e3, proxy_threads=1)
    one = predict("dispatch", Shape(), 4, nic, slow)
    two = predict("dispatch", Shape(), 4, nic, dataclasses.replace(slow, proxy_threads=2))
    assert one["limit"] == two["limit"] == "proxy"
    assert 1.8 < two["gbps"] / one["gbps"] <= 2.0  # only the start-up does not halve
    # Threads serve FIFO channels (8): more than that cannot help.
    eight = predict("dispatch", Shape(), 4, nic, dataclasses.replace(slow, proxy_threads=8))
    sixteen = predict("dispatch", Shape(), 4, nic, dataclasses.replace(slow, proxy_threads=16))
    assert sixteen["gbps"] == eight["gbps"]
    assert one["proxy_break_even"] == pytest.approx(two["proxy_break_even"] * 2)


def test_one_message_in_flight_per_stream_limits_few_streams():
    nic = scale.presets()["thor2"]
    assert nic.max_inflight_msgs == 1 and nic.max_inflight_bytes == 1572864
    few = Shape(sms=2, max_nodes=0)  # one channel: one stream per remote node
    capped = predict("dispatch", few, 2, nic, Host())
    open_ = predict("dispatch", few, 2, dataclasses.replace(nic, max_inflight_msgs=64), Host())
    assert capped["limit"] == "window"
    assert open_["gbps"] > capped["gbps"]
    # Latency is what a window of one message pays for.
    slower = predict("dispatch", few, 2, dataclasses.replace(nic, latency_us=10.0), Host())
    assert slower["gbps"] < capped["gbps"]


def test_published_numbers_convert_to_inter_node_bytes_by_the_remote_share():
    for ep, share in ((16, 0.5), (32, 0.75), (64, 0.875)):
        for p in scale.published_for("cx7", ep, "dispatch_fp8"):
            assert p["wire_gbps"][0] == pytest.approx(p["gbps"][0] * share)
    # DeepEP's accounting of the model's own rows: the same time, own-node copies counted.
    r = predict("dispatch", Shape(), 2, scale.presets()["cx7"], Host())
    t = traffic("dispatch", Shape(), 2, 1.0)
    assert r["deepep_gbps"] / r["gbps"] == pytest.approx(
        2 * 7168 * 2 / (1 * t.slot),
        rel=1e-9,  # 2 of 2 nodes counted against 1 of 2 crossing
    )


def test_cli_writes_every_row_and_checks_a_committed_run(tmp_path, capsys):
    out = tmp_path / "scale.json"
    run = os.path.join(RESULTS, "internode-h100-2x2.json")
    assert cli.main(["bench", "scale", "--from-json", run, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 3 * 4 * 3
    assert res["check"] and all(
        c["model_mb"] == pytest.approx(c["measured_mb"], rel=0.01) for c in res["check"]
    )
    assert res["host"]["cmds_per_s_per_thread"] == res["from_json"]["cmds_per_s_per_thread_floor"]
    assert "DeepEP V1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--ep", "12"], "--ep 12"),
        (["--ep", "256"], "2-16 nodes"),
        (["--sms", "23"], "--sms 23"),
        (["--nics", "ib9"], "--nics"),
        (["--ops", "dispatch,gather"], "--ops"),
        (["--cmds-per-s-per-thread", "0"], "cmds-per-s-per-thread"),
        (["--head-per-chunk", "1"], "--head-per-chunk"),
        (["--host-us", "1500"], "--host-us"),
        (["--host-us=-1,800"], "--host-us"),
        (["--topk", "200", "--ep", "64"], "top-200"),
    ],
)
def test_bad_input_names_the_flag(argv, needle):
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    with pytest.raises(InvalidInputError, match=needle):
        scale.model(parser.parse_args(argv))


def test_the_model_takes_only_what_the_kernels_take():
    with pytest.raises(InvalidInputError, match="2-16 nodes"):
        traffic("dispatch", Shape(), 1, 1.0)
    with pytest.raises(InvalidInputError, match="chunk 200, ring 128"):
        traffic("dispatch", Shape(chunk=200), 2, 1.0)


def test_from_json_rejects_a_copy_only_run():
    with pytest.raises(InvalidInputError, match="copy-only"):
        scale.load_run(os.path.join(RESULTS, "internode-copy-h100-2x2.json"))


@pytest.mark.parametrize("ep", [16, 64])
def test_a_calls_host_path_adds_to_it_and_hides_behind_the_previous_transfer_back_to_back(ep):
    nic = scale.presets()["cx7"]
    bare = Host()
    slow = Host(call_host_us={"dispatch": 1500.0, "combine": 800.0})
    for op, host_us in (("dispatch", 1500.0), ("dispatch_fp8", 1500.0), ("combine", 800.0)):
        a = predict(op, Shape(), ep // 8, nic, bare)
        b = predict(op, Shape(), ep // 8, nic, slow)
        assert a["gbps_per_call"] == a["gbps_pipelined"] == a["gbps"]  # no host term: as before
        assert b["us"] == a["us"] and b["host_us"] == host_us  # the transfer is unchanged
        mb = b["mb"] * 1e6
        assert b["gbps_per_call"] == pytest.approx(mb / (b["us"] + host_us) / 1e3, rel=1e-12)
        assert b["gbps_pipelined"] == pytest.approx(mb / max(b["us"], host_us) / 1e3, rel=1e-12)


def test_from_json_takes_the_host_path_of_the_runs_exact_bf16_calls():
    path = os.path.join(RESULTS, "internode-h100-2x2.json")
    with open(path) as f:
        rows = json.load(f)["rows"]
    cal = scale.calibrate(scale.load_run(path))
    for op in ("dispatch", "combine"):
        want = sorted(r["host_us"] for r in rows if r["op"] == op and "host_us" in r)
        mid = len(want) // 2
        median = want[mid] if len(want) % 2 else (want[mid - 1] + want[mid]) / 2
        assert cal["call_host_us"][op] == pytest.approx(median)


# ---- the call boundary -----------------------------------------------------------------------
def _b2b_us(row: dict, boundary: float) -> float:
    """A call's GPU time back to back: its transfer (the row's time less its start-up) plus the
    boundary or the start-up, whichever is longer (the measured boundary holds a start-up)."""
    return row["us"] - row["startup_us"] + max(row["startup_us"], boundary)


def test_a_zero_boundary_leaves_every_row_as_it_was():
    for call_host in ({}, {"dispatch": 1500.0, "combine": 800.0}):
        before = _all_rows(Host(call_host_us=call_host))
        after = _all_rows(Host(call_host_us=call_host, boundary_us={"dispatch": 0, "combine": 0}))
        assert before == after
        for r in before:
            assert r["boundary_us"] == 0
            mb = r["mb"] * 1e6
            assert r["gbps_pipelined"] == pytest.approx(
                mb / max(r["us"], r["host_us"]) / 1e3, rel=1e-12
            )


@pytest.mark.parametrize("key", ["cx7", "efa"])
@pytest.mark.parametrize("ep", [16, 64])
def test_a_boundary_adds_to_each_back_to_back_call_and_to_nothing_else(key, ep):
    nic = scale.presets()[key]
    bare = Host(call_host_us={"dispatch": 700.0, "combine": 500.0})
    for b_d, b_c in ((200.0, 150.0), (1.0, 1.0), (900.0, 900.0)):
        host = dataclasses.replace(bare, boundary_us={"dispatch": b_d, "combine": b_c})
        for op, b in (("dispatch", b_d), ("dispatch_fp8", b_d), ("combine", b_c)):
            a = predict(op, Shape(), ep // 8, nic, bare)
            r = predict(op, Shape(), ep // 8, nic, host)
            assert r["boundary_us"] == b
            # One call, its transfer and its terms do not change.
            for name in ("us", "gbps", "gbps_per_call", "terms_us", "startup_us", "host_us"):
                assert r[name] == a[name]
            mb = r["mb"] * 1e6
            want = mb / max(_b2b_us(r, b), r["host_us"]) / 1e3
            assert r["gbps_pipelined"] == pytest.approx(want, rel=1e-12)
            if b >= r["startup_us"] and r["us"] + b - r["startup_us"] >= r["host_us"]:
                # The boundary replaces the start-up: the transfer plus the boundary.
                assert r["gbps_pipelined"] == pytest.approx(
                    mb / (r["terms_us"][r["limit"]] + b) / 1e3, rel=1e-12
                )
                assert r["gbps_pipelined"] < a["gbps_pipelined"]
            if b <= r["startup_us"]:  # within the start-up the row already has
                assert r["gbps_pipelined"] == a["gbps_pipelined"]


def test_a_host_path_longer_than_the_gpu_time_hides_the_boundary():
    nic = scale.presets()["cx7"]
    host = Host(call_host_us={"dispatch": 5000.0, "combine": 5000.0})
    bounded = dataclasses.replace(host, boundary_us={"dispatch": 300.0, "combine": 300.0})
    r = predict("dispatch", Shape(), 2, nic, bounded)
    assert r["us"] + 300.0 < 5000.0  # the host path is the longer one
    assert r["gbps_pipelined"] == pytest.approx(r["mb"] * 1e6 / 5000.0 / 1e3, rel=1e-12)
    assert r["gbps_pipelined"] == predict("dispatch", Shape(), 2, nic, host)["gbps_pipelined"]


def _pipelined_row(rank: int, us: float, busy: float, short: float, long_: float) -> dict:
    wire = {"busy_us": busy, "idle_short_us": short, "idle_long_us": long_, "gaps_long": 2.0}
    return {"rank": rank, "op": "pipelined", "us": us, "link_gbps": 50.0, "wire": wire}


def _small_run(tmp_path, pipelined: list[dict]) -> str:
    """A bench internode JSON of 2 x 2 ranks: one timed dispatch, one combine and ``pipelined``."""
    meta = dict(tokens=4096, hidden=7168, experts=256, topk=8, sms=24, world=4, ranks_per_node=2)
    timed = dict(rank=0, threads=2, writes=1800.0, cmds_per_s=4e5, link_gbps=50.0, latency_us=3.0)
    rows = [
        dict(timed, op="dispatch", chunk=20, gbps=25.0, rdma_mb=58.8, host_us=1000.0),
        dict(timed, op="combine", chunk=12, gbps=28.0, rdma_mb=58.7, host_us=600.0),
        {"rank": 0, "op": "pipelined", "us": 1283.0, "intranode_ref": True},  # no wire: not used
        *pipelined,
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    return str(path)


def _scale_json(tmp_path, argv: list[str]) -> dict:
    out = tmp_path / "scale.json"
    common = ["bench", "scale", "--ep", "16,64", "--nics", "cx7", "--json", str(out)]
    assert cli.main(common + argv) == 0
    return json.loads(out.read_text())


def test_from_json_takes_half_the_pipelined_pairs_steady_idle_as_each_calls_boundary(tmp_path):
    # Three ranks' pairs: steady pair time less the wire's busy time and its short gaps, per pair
    # 380, 400 and 420 µs; the long gaps (600) also hold the pause between timed runs.
    rows = [
        _pipelined_row(0, 2850.0, 2390.0, 80.0, 600.0),
        _pipelined_row(1, 2850.0, 2360.0, 90.0, 600.0),
        _pipelined_row(2, 2850.0, 2350.0, 80.0, 600.0),
    ]
    res = _scale_json(tmp_path, ["--from-json", _small_run(tmp_path, rows)])
    assert res["from_json"]["boundary_us"] == {"dispatch": 200.0, "combine": 200.0}
    assert len(res["rows"]) == 2 * 3
    for r in res["rows"]:
        assert r["boundary_us"] == 200.0
        assert r["host_us"] == (600.0 if r["op"] == "combine" else 1000.0)
        mb = r["mb"] * 1e6
        want = mb / max(_b2b_us(r, 200.0), r["host_us"]) / 1e3
        assert r["gbps_pipelined"] == pytest.approx(want, rel=1e-12)


def test_an_explicit_boundary_wins_over_the_runs(tmp_path):
    run = _small_run(tmp_path, [_pipelined_row(0, 2850.0, 2390.0, 60.0, 600.0)])
    res = _scale_json(tmp_path, ["--from-json", run, "--boundary-us", "120,80"])
    assert res["from_json"]["boundary_us"] == {"dispatch": 200.0, "combine": 200.0}
    assert res["host"]["boundary_us"] == {"dispatch": 120.0, "combine": 80.0}
    for r in res["rows"]:
        assert r["boundary_us"] == (80.0 if r["op"] == "combine" else 120.0)


def test_a_run_without_a_wire_trace_gives_no_boundary(tmp_path):
    res = _scale_json(tmp_path, ["--from-json", _small_run(tmp_path, [])])
    assert res["from_json"]["boundary_us"] == {} and res["host"]["boundary_us"] == {}
    assert all(r["boundary_us"] == 0 for r in res["rows"])
    # The committed 4x H100 run has pipelined rows, none with a wire trace.
    cal = scale.calibrate(scale.load_run(os.path.join(RESULTS, "internode-h100-2x2.json")))
    assert cal["boundary_us"] == {}


def test_the_committed_2x2_runs_boundary_is_its_pairs_steady_idle_between_calls():
    path = os.path.join(RESULTS, "internode-h200-2x2-8bbd037.json")
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["op"] == "pipelined" and "wire" in r]
    assert len(rows) == 4 * 2 * 3  # ranks x deliveries x line rates
    pairs = sorted(r["us"] - r["wire"]["busy_us"] - r["wire"]["idle_short_us"] for r in rows)
    median = (pairs[11] + pairs[12]) / 2
    cal = scale.calibrate(scale.load_run(path))
    assert cal["boundary_us"]["dispatch"] == cal["boundary_us"]["combine"]
    assert cal["boundary_us"]["dispatch"] == pytest.approx(median / 2, rel=1e-12)
    for r in rows:
        w = r["wire"]
        # The trace's time per pair exceeds the steady pair: its long gaps hold more than the
        # boundaries (the pause between timed runs).
        assert w["busy_us"] + w["idle_short_us"] + w["idle_long_us"] > r["us"]


@pytest.mark.parametrize("link", [25.0, 50.0])
def test_with_its_boundary_the_model_comes_within_5_percent_of_the_runs_pipelined_pairs(link):
    path = os.path.join(RESULTS, "internode-h200-2x2-8bbd037.json")
    with open(path) as f:
        run = json.load(f)
    cal = scale.calibrate(scale.load_run(path))
    nic = scale.presets(link, 3.0)["ipc"]
    shape = Shape(ranks_per_node=2, max_nodes=0)  # the run's: 2 x 2, uniform routing
    host = Host(proxy_threads=2, boundary_us=cal["boundary_us"])
    pair = [predict(op, shape, 2, nic, host) for op in ("dispatch", "combine")]
    us = sum(p["mb"] * 1e6 / p["gbps_pipelined"] / 1e3 for p in pair)  # the pair back to back
    model = sum(p["mb"] for p in pair) * 1e6 / us / 1e3
    for r in run["rows"]:
        if r["op"] == "pipelined" and r.get("link_gbps") == link:
            assert model == pytest.approx(r["gbps"], rel=0.05)
            assert model > r["gbps"]  # the short gaps within calls are not in the model


@pytest.mark.parametrize("value", ["300", "-1,300", "a,b", "300,", "1,2,3", "nan,1"])
def test_a_bad_boundary_names_the_value_and_the_form(value):
    parser = argparse.ArgumentParser()
    scale.add_arguments(parser)
    args = parser.parse_args([f"--boundary-us={value}"])
    want = f"--boundary-us={value!r}: give DISPATCH,COMBINE >= 0, e.g. 200,200"
    with pytest.raises(InvalidInputError, match=re.escape(want)):
        scale.model(args)


def test_the_proxy_floor_counts_the_pipelined_pairs_of_a_run():
    """Single calls idle the proxies through their host paths; pairs back to back do not, so
    the commands/s floor per thread is the best of every row, the pairs' included, and with it
    the model at the run's settings is bound by the line, not by the proxies."""
    path = os.path.join(RESULTS, "internode-h200-2x1.json")
    with open(path) as f:
        rows = json.load(f)["rows"]
    per_thread = [r["cmds_per_s"] / r["threads"] for r in rows if "cmds_per_s" in r]
    pairs = [
        r["cmds_per_s"] / r["threads"]
        for r in rows
        if r["op"] == "pipelined" and "cmds_per_s" in r  # not the intranode reference
    ]
    assert pairs and max(pairs) == max(per_thread)
    run = scale.load_run(path)
    cal = scale.calibrate(run)
    assert cal["cmds_per_s_per_thread_loop"] == pytest.approx(max(per_thread))
    assert cal["cmds_per_s_per_thread_floor"] >= cal["cmds_per_s_per_thread_loop"]
    host = Host(proxy_threads=2, cmds_per_s_per_thread=cal["cmds_per_s_per_thread_loop"])
    for r in scale.check_run(run, {"run": host}):
        if r["link_gbps"] == 50.0 and r["op"] in ("dispatch", "combine"):
            assert r["run_limit"] == "line", r


def test_the_proxy_floor_counts_the_commands_of_a_call_over_its_transfer_time():
    """Every command of a call is posted while its kernels move the rows, so the modelled
    commands per call over the measured transfer time (queued where the run has it) are a floor
    of what the proxy threads did; over the timed loop the host paths idle them. On the 2 x 1
    run that floor is the higher one, and with it the model calls every op at 50 GB/s, FP8
    included, bound by the line, as the run's transfer times are (>= 0.88 of it)."""
    path = os.path.join(RESULTS, "internode-h200-2x1.json")
    run = scale.load_run(path)
    cal = scale.calibrate(run)
    head = cal["head_per_chunk"]
    rates = []
    for r in run["rows"]:
        us = r.get("xq_us") or r.get("xfer_us")
        if not us or not r.get("link_gbps"):
            continue
        op = scale._base_op(r["op"])
        shape, nodes = scale._run_shape(run["meta"], op, int(r["chunk"]))
        t = scale.traffic(op, shape, nodes, head["combine" if op == "combine" else "dispatch"])
        rates.append(t.commands / (us * 1e-6) / r["threads"])
        assert r["xq_line" if r.get("xq_us") else "xfer_line"] > 0.5, r
    assert rates and cal["cmds_per_s_per_thread_transfer"] == pytest.approx(max(rates))
    assert cal["cmds_per_s_per_thread_floor"] == pytest.approx(max(rates))
    assert max(rates) > cal["cmds_per_s_per_thread_loop"]
    host = Host(proxy_threads=2, cmds_per_s_per_thread=cal["cmds_per_s_per_thread_floor"])
    at_50 = [r for r in scale.check_run(run, {"run": host}) if r["link_gbps"] == 50.0]
    assert {r["op"] for r in at_50} >= {"dispatch", "dispatch_fp8", "combine"}
    assert all(r["run_limit"] == "line" for r in at_50), at_50

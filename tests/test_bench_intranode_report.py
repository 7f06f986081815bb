"""``bench intranode``'s report: each op's ratio to DeepEP per run and their median
(``--repeat``); the per-rank CPU probe it records beside the host times."""

from __future__ import annotations

import argparse

import pytest

from uccl_ep_megatron.bench.intranode import add_arguments, run
from uccl_ep_megatron.bench.intranode_report import (
    merge,
    print_repeats,
    print_table,
    ratio_medians,
)


def _result(world: int, ratios: dict[str, float]) -> dict:
    ours = {"impl": "ours", "copy": "ldst", "sms": 12}
    rows = [{"op": op, **ours, "vs_deepep": v} for op, v in ratios.items()]
    rows.append({"op": "dispatch_bf16", "impl": "deepep", "copy": "-", "sms": 24})
    rows.append({"op": "no_peer", **ours})  # no DeepEP row for it
    return {"world": world, "rows": rows}


def test_ratio_medians_per_rank_count_and_op(capsys):
    results = [
        _result(2, {"dispatch_bf16": 0.9, "combine_bf16": 0.7}),
        _result(4, {"dispatch_bf16": 0.6}),
        _result(2, {"dispatch_bf16": 0.7, "combine_bf16": 0.8}),
        _result(4, {"dispatch_bf16": 0.5}),
        _result(2, {"dispatch_bf16": 1.1, "combine_bf16": 0.75}),
    ]
    got = {(s["world"], s["op"]): s for s in ratio_medians(results)}
    assert set(got) == {(2, "dispatch_bf16"), (2, "combine_bf16"), (4, "dispatch_bf16")}
    assert got[2, "dispatch_bf16"]["ratios"] == [0.9, 0.7, 1.1]  # run order kept
    assert got[2, "dispatch_bf16"]["median"] == pytest.approx(0.9)
    assert got[2, "combine_bf16"]["median"] == pytest.approx(0.75)
    assert got[4, "dispatch_bf16"]["median"] == pytest.approx(0.55)  # even count: the mean of two
    print_repeats(ratio_medians(results))
    out = capsys.readouterr().out
    assert " 2 ranks dispatch_bf16" in out and "0.90 0.70 1.10  median 0.90" in out
    print_repeats([])
    assert capsys.readouterr().out == ""


def test_repeat_must_be_positive():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="--repeat=0"):
        run(parser.parse_args(["--repeat", "0", "--num-gpus", "1"]))


def _rank_result(rank: int, probe: list[float]) -> dict:
    timing = {"device_us": [100.0 + rank, 90.0], "host_us": [50.0, 60.0 + rank]}
    return {
        "world": 2,
        "tokens": 8,
        "hidden": 128,
        "experts": 4,
        "topk": 2,
        "device": "gpu",
        "deepep": False,
        "deepep_sms": 0,
        "recv_bytes": 4096,
        "cross_bytes": 2048,
        "floor_Bps": 1e9,
        "agreement": {},
        "kernels": [],
        "timings": [{"op": "dispatch_bf16", "impl": "ours", "copy": "tma", "sms": 12, **timing}],
        "cpu_probe_ms": probe,
    }


def test_merge_keeps_every_ranks_cpu_probe_and_the_table_prints_it(capsys):
    out = merge([_rank_result(0, [2.5, 2.45]), _rank_result(1, [4.1, 5.0])], shared=False)
    assert out["cpu_probe_ms"] == [[2.5, 2.45], [4.1, 5.0]]
    # Per iteration the slower rank: device 101, 90 -> median 95.5; host 50, 61 -> 55.5.
    assert out["rows"][0]["device_us"]["median"] == pytest.approx(95.5)
    assert out["rows"][0]["host_us"]["median"] == pytest.approx(55.5)
    print_table(out)
    text = capsys.readouterr().out
    assert "# CPU probe, ms before -> after" in text
    assert "rank 0 2.50 -> 2.45; rank 1 4.10 -> 5.00" in text

"""``bench intranode --repeat``: each op's ratio to DeepEP per run and their median."""

from __future__ import annotations

import argparse

import pytest

from uccl_ep_megatron.bench.intranode import add_arguments, run
from uccl_ep_megatron.bench.intranode_report import print_repeats, ratio_medians


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

"""``bench layer`` on CPU: flag checks and how per-rank measurements become the table's rows
(the measurement itself needs GPUs: ``tests/gpu/run_shared.sh`` runs it)."""

from __future__ import annotations

import argparse

import pytest

from uccl_ep_megatron.bench import layer
from uccl_ep_megatron.core.errors import InvalidInputError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    layer.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_deepseek_v3_and_every_variant():
    a = _args()
    assert (a.hidden, a.experts, a.topk, a.ffn, a.shared_ffn, a.tokens) == (
        7168,
        256,
        8,
        2048,
        2048,
        4096,
    )
    assert a.router == "deepseek"
    assert a.dispatchers.split(",") == list(layer.DISPATCHERS)
    assert a.expert_modules.split(",") == list(layer.EXPERT_MODULES)
    layer.check_args(a)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--dispatchers", "alltoall,nccl"], "--dispatchers 'alltoall,nccl'"),
        (["--expert-modules", "TEGroupedMLP"], "--expert-modules"),
        (["--topk", "9", "--experts", "8"], "--topk 9 exceeds --experts 8"),
        (["--experts", "60"], "multiple of 8 or --router softmax"),
        (["--tokens", "0"], "--tokens 0"),
        (["--capacity-factor", "-1"], "--capacity-factor -1.0: must be >= 0"),
    ],
)
def test_bad_flags_name_the_flag(argv, match):
    with pytest.raises(InvalidInputError, match=match):
        layer.check_args(_args(*argv))


def _rank(times: dict[str, list[float]], dispatch_ms: float, syncs: float) -> dict:
    extra = {
        name: dict(
            sync_calls=syncs if name.startswith("exact") else 0.0,
            dtoh_copies=0.0,
            dispatch_ms=dispatch_ms,
            combine_ms=2 * dispatch_ms,
            dropped=3.0 if name.startswith("sync-free") else 0.0,
            capacity=640 if name.startswith("sync-free") else None,
        )
        for name in times
    }
    return {"times": times, "extra": extra, "skipped": {"flex": "no deep_ep"}, "gpu": "H100"}


def test_merge_takes_the_slowest_rank_per_iteration_and_ratios_per_expert_module():
    r0 = {
        "alltoall/SequentialMLP": [10.0, 12.0, 11.0],
        "exact/SequentialMLP": [8.0, 9.0, 30.0],
        "alltoall/TorchGroupedMLP": [6.0, 6.0, 6.0],
        "sync-free/TorchGroupedMLP": [4.0, 4.0, 5.0],
    }
    r1 = {
        "alltoall/SequentialMLP": [11.0, 11.0, 11.0],
        "exact/SequentialMLP": [9.0, 8.0, 8.0],
        "alltoall/TorchGroupedMLP": [6.0, 7.0, 6.0],
        "sync-free/TorchGroupedMLP": [5.0, 4.0, 4.0],
    }
    out = layer.merge([_rank(r0, 1.0, 1.0), _rank(r1, 3.0, 5.0)], 2)
    rows = {r["variant"]: r for r in out["rows"]}
    assert rows["alltoall/SequentialMLP"]["median_ms"] == 11.0  # max per iteration: 11, 12, 11
    assert rows["exact/SequentialMLP"]["median_ms"] == 9.0  # 9, 9, 30
    assert rows["exact/SequentialMLP"]["speed_vs_alltoall"] == pytest.approx(11.0 / 9.0)
    grouped = rows["sync-free/TorchGroupedMLP"]
    assert grouped["speed_vs_alltoall"] == pytest.approx(6.0 / 5.0)  # against grouped alltoall
    assert grouped["dropped_pairs_per_layer"] == 6.0 and grouped["capacity"] == 640
    assert rows["exact/SequentialMLP"]["host_syncs_per_layer"] == 1.0  # rank 0's count
    assert rows["exact/SequentialMLP"]["dispatch_ms"] == 2.0  # mean over ranks
    assert out["skipped"] == {"flex": "no deep_ep"} and out["world"] == 2


def test_a_flex_dispatcher_megatron_core_cannot_build_is_skipped_with_the_reason(monkeypatch):
    from uccl_ep_megatron.bench import layer_worker

    built = []

    def dispatcher(name, layer_, a):
        if name == "flex":
            raise ValueError("Invalid backend: none")
        built.append((name, layer_))
        return object()

    monkeypatch.setattr(layer_worker, "_dispatcher", dispatcher)
    monkeypatch.setattr(layer_worker, "_flex_unavailable", lambda: None)
    monkeypatch.setattr(layer_worker, "_DispatchTimes", lambda disp: None)
    skipped: dict = {}
    out = layer_worker._variants(
        {"SequentialMLP": "L1", "TorchGroupedMLP": "L2"},
        {"dispatchers": "alltoall,flex,exact"},
        skipped,
    )
    assert sorted(out) == [
        "alltoall/SequentialMLP",
        "alltoall/TorchGroupedMLP",
        "exact/SequentialMLP",
        "exact/TorchGroupedMLP",
    ]
    assert "Invalid backend: none" in skipped["flex"]
    assert ("exact", "L2") in built


def test_a_uccl_ep_dispatcher_that_cannot_be_built_still_ends_the_run(monkeypatch):
    from uccl_ep_megatron.bench import layer_worker

    def dispatcher(name, layer_, a):
        raise RuntimeError(f"{name} broke")

    monkeypatch.setattr(layer_worker, "_dispatcher", dispatcher)
    monkeypatch.setattr(layer_worker, "_flex_unavailable", lambda: None)
    with pytest.raises(RuntimeError, match="exact broke"):
        layer_worker._variants({"SequentialMLP": "L1"}, {"dispatchers": "exact,flex"}, {})

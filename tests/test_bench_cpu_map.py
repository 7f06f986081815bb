"""The benches' CPU probe (the fastest of a few runs of a fixed loop) and their CPU speed map:
the probe on each CPU in turn (the calling thread pinned to it, its affinity restored after),
the CPUs that ran it slowly, and the line the benches print."""

from __future__ import annotations

import pytest

from uccl_ep_megatron.bench import common


def test_cpu_probe_is_the_fastest_of_its_loops_in_ms(monkeypatch):
    # Clock readings (ns) around each of three loops: 3.0, 2.0 and 2.5 ms.
    ticks = iter([0, 3_000_000, 10, 2_000_010, 20, 2_500_020])
    monkeypatch.setattr(common.time, "perf_counter_ns", lambda: next(ticks))
    assert common.cpu_probe_ms(repeats=3) == pytest.approx(2.0)


def _pinning(monkeypatch, allowed: set[int]) -> list[set[int]]:
    calls: list[set[int]] = []
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: set(allowed))
    monkeypatch.setattr(common.os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    return calls


def test_each_cpu_is_probed_pinned_to_it_and_the_affinity_is_restored(monkeypatch):
    calls = _pinning(monkeypatch, {3, 1, 2})
    speeds = iter([2.5, 5.0, 2.6])
    pinned_at_probe: list[set[int]] = []

    def probe() -> float:
        pinned_at_probe.append(calls[-1])
        return next(speeds)

    monkeypatch.setattr(common, "cpu_probe_ms", probe)
    assert common.cpu_map_ms() == {"cpus": [1, 2, 3], "ms": [2.5, 5.0, 2.6]}
    assert pinned_at_probe == [{1}, {2}, {3}]
    assert calls[-1] == {1, 2, 3}


def test_the_affinity_is_restored_when_a_probe_fails(monkeypatch):
    calls = _pinning(monkeypatch, {0, 1})

    def probe() -> float:
        raise KeyboardInterrupt

    monkeypatch.setattr(common, "cpu_probe_ms", probe)
    with pytest.raises(KeyboardInterrupt):
        common.cpu_map_ms()
    assert calls == [{0}, {0, 1}]


def test_slow_cpus_are_those_over_the_factor_times_the_fastest():
    cpu_map = {"cpus": [0, 1, 2, 3], "ms": [2.4, 3.1, 2.9, 5.0]}
    assert common.slow_cpus(cpu_map) == [1, 3]  # over 1.25 x 2.4 = 3.0 ms
    assert common.slow_cpus(cpu_map, factor=2.0) == [3]
    assert common.slow_cpus({"cpus": [5], "ms": [4.0]}) == []


def test_the_line_counts_slow_cpus_before_and_after():
    before = {"cpus": [0, 1, 2, 3], "ms": [2.4, 3.1, 2.9, 5.0]}
    after = {"cpus": [0, 1, 2, 3], "ms": [2.5, 2.6, 2.4, 2.7]}
    line = common.cpu_map_line(before, after)
    assert "2 of 4 before the run, 0 of 4 after" in line
    assert "(fastest 2.40 / 2.40 ms" in line

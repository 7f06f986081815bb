"""The benches' per-kernel figure: the median launch per call, robust to one slow call."""

from __future__ import annotations

import pytest

from uccl_ep_megatron.bench.timing import kernel_name, per_call_kernel_us


def test_one_slow_call_does_not_move_the_figure():
    # 5 calls of notify + dispatch; the 3rd notify waited 600 us for a late peer.
    notify = [30.0, 31.0, 630.0, 29.0, 30.5]
    launches = [(n, us) for i in range(5) for n, us in (("notify", notify[i]), ("dispatch", 540.0))]
    got = per_call_kernel_us(launches, calls=5)
    assert got == {"notify": pytest.approx(30.5), "dispatch": pytest.approx(540.0)}
    assert sum(notify) / 5 > 140  # what the mean said


def test_a_kernel_launched_twice_per_call_counts_both_launches():
    launches = [("copy", 10.0)] * 6 + [("kernel", 100.0)] * 3
    assert per_call_kernel_us(launches, calls=3) == {
        "copy": pytest.approx(20.0),
        "kernel": pytest.approx(100.0),
    }


def test_kernel_names_lose_namespaces_templates_and_arguments():
    full = "void uccl_ep::kernels::(anonymous namespace)::dispatch_kernel<int4, 8, true>(Params)"
    assert kernel_name(full) == "dispatch_kernel"

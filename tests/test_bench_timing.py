"""The benches' per-kernel figure: the median launch per call, robust to one slow call."""

from __future__ import annotations

import pathlib
import re

import pytest

from uccl_ep_megatron.bench.internode import _TRANSFER_KERNELS, transfer_kernels_us
from uccl_ep_megatron.bench.timing import kernel_name, per_call_kernel_us

REPO = pathlib.Path(__file__).resolve().parent.parent


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


def test_transfer_time_counts_the_row_moving_kernels_only():
    # 4 exact internode dispatches as the profiler lists them (2 ranks per node: the node barrier
    # follows the dispatch kernel); the 2nd dispatch waited 900 us for a late peer.
    per_call = [
        ("encode_row_kernel", 3.0),
        ("ncclDevKernel_AllGather_RING_LL", 20.0),
        ("header_read_kernel", 4.0),
        ("routing_check_kernel", 12.0),
        ("dispatch_tables_kernel", 35.0),
        ("dispatch_kernel", 1200.0),
        ("node_barrier_kernel", 8.0),
        ("poison_if_failed_kernel", 2.0),
    ]
    launches = []
    for i in range(4):
        for n, us in per_call:
            late = 900.0 if i == 1 and n == "dispatch_kernel" else 0.0
            launches.append((n, us + late))
    got = transfer_kernels_us(launches, calls=4)
    assert got == {
        "dispatch_kernel": pytest.approx(1200.0),
        "node_barrier_kernel": pytest.approx(8.0),
    }


def test_transfer_kernels_are_kernels_of_the_internode_sources():
    """Every name the transfer time counts is a ``__global__`` of csrc/kernels/internode (a
    renamed kernel would silently drop out of the figure)."""
    text = "".join(p.read_text() for p in (REPO / "csrc/kernels/internode").glob("*.cu"))
    defined = set(re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(", text))
    assert set(_TRANSFER_KERNELS) <= defined, set(_TRANSFER_KERNELS) - defined
    assert {"dispatch_kernel", "combine_kernel"} <= set(_TRANSFER_KERNELS)
    assert not {"dispatch_tables_kernel", "encode_row_kernel", "header_read_kernel"} & set(
        _TRANSFER_KERNELS
    )

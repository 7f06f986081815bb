"""GPU FIFO + proxy on the device: kernels push from many warps; the ipc transport moves real
GPU bytes between two endpoints (one process drives both; on a one-GPU machine both live on
GPU 0), or between two processes over CUDA IPC (sharing GPU 0 under MPS when there is one GPU),
with the reorder injector on and off. Verified byte-for-byte against the pattern each sending
warp wrote, counters exact."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch

from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint

try:  # the benchmark/test kernels: a separate extension, present in GPU builds only
    from uccl_ep_megatron.bench import _bench_C
except ImportError:
    _bench_C = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import NUM_GPUS, make_pool  # noqa: E402

# The two endpoints' GPUs: two GPUs where there are, else both on GPU 0.
GPUS = (0, 1 % max(NUM_GPUS, 1))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or _bench_C is None,
        reason="needs a GPU and a GPU build of uccl_ep_megatron",
    ),
]


def _expected(rank: int, warps: int, msgs: int, length: int, device) -> torch.Tensor:
    w = torch.arange(warps, device=device, dtype=torch.int64).view(-1, 1, 1)
    k = torch.arange(msgs, device=device, dtype=torch.int64).view(1, -1, 1)
    i = torch.arange(length, device=device, dtype=torch.int64).view(1, 1, -1)
    return ((rank * 131 + w * 71 + k * 13 + i * 7 + 1) & 0xFF).to(torch.uint8).flatten()


@pytest.mark.multigpu
@pytest.mark.parametrize("reorder", [False, True], ids=["inorder", "reorder"])
@pytest.mark.parametrize("channels,threads", [(1, 1), (2, 2), (4, 4), (8, 4), (8, 8)])
def test_two_gpu_ipc_traffic(channels, threads, reorder):
    blocks, warps_per_block, msgs, length = 8, 4, 16, 1024
    warps = blocks * warps_per_block
    area = warps * msgs * length
    regions = [torch.zeros(2 * area, dtype=torch.uint8, device=f"cuda:{GPUS[g]}") for g in range(2)]
    cfg = ProxyConfig(
        num_channels=channels,
        num_threads=threads,
        transport="ipc",
        ipc_reorder=reorder,
        ipc_seed=7,
        timeout_ms=20000,
        num_counters=2 * channels,
    )
    eps = [
        ProxyEndpoint(
            regions[g].data_ptr(), 2 * area, device=GPUS[g], rank=g, world_size=2, config=cfg
        )
        for g in range(2)
    ]
    infos = [e.local_info for e in eps]
    for e in eps:
        e.connect(infos)
    streams = [torch.cuda.Stream(device=GPUS[g]) for g in range(2)]
    for g in range(2):
        torch.cuda.synchronize(GPUS[g])  # the zero fill ran on the default stream
    try:
        for g in range(2):
            _bench_C.fifo_launch_traffic(
                eps[g].channels,
                blocks,
                warps_per_block,
                msgs,
                length,
                g,
                1 - g,
                regions[g].data_ptr(),
                GPUS[g],
                streams[g].cuda_stream,
            )
        deadline = time.monotonic() + 60
        while not all(s.query() for s in streams):
            for e in eps:
                e.check()
            assert time.monotonic() < deadline, "kernels did not finish within 60 s"
            time.sleep(0.001)
        for e in eps:
            e.check()
        for g in range(2):
            peer = 1 - g
            got = regions[g][area:]
            want = _expected(peer, warps, msgs, length, got.device)
            assert torch.equal(got, want), (
                f"GPU {g}: received bytes differ from rank {peer}'s pattern"
            )
            vals = eps[g].counter_values()
            per_channel = [
                sum(1 for w in range(warps) if w % channels == c) * msgs for c in range(channels)
            ]
            assert vals[peer * channels : (peer + 1) * channels] == per_channel
            st = eps[g].stats()
            assert st["writes_posted"] == warps * msgs
            assert st["barriers"] == warps
        if reorder:
            assert sum(e.stats()["held_out_of_order"] for e in eps) > 0
    finally:
        for e in eps:
            e.close()


def _gpu_dist_body(rank: int, world: int, reorder: bool) -> dict:
    """Two processes (own GPUs, or sharing GPU 0 under MPS): regions reached through CUDA IPC,
    bootstrap over the pool's group (the launcher set this rank's device)."""
    import torch.distributed as dist

    blocks, warps_per_block, msgs, length, channels = 4, 4, 8, 512, 4
    warps = blocks * warps_per_block
    area = warps * msgs * length
    device = torch.cuda.current_device()
    region = torch.zeros(2 * area, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    cfg = ProxyConfig(
        num_channels=channels,
        num_threads=2,
        transport="ipc",
        ipc_reorder=reorder,
        ipc_seed=3,
        timeout_ms=20000,
        num_counters=world * channels,
    )
    ep = ProxyEndpoint(region.data_ptr(), 2 * area, device=device, config=cfg)
    ep.connect()
    try:
        stream = torch.cuda.Stream()
        peer = (rank + 1) % world
        _bench_C.fifo_launch_traffic(
            ep.channels, blocks, warps_per_block, msgs, length, rank, peer,
            region.data_ptr(), device, stream.cuda_stream,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not stream.query():
            ep.check()
            assert time.monotonic() < deadline, "kernel did not finish within 60 s"
            time.sleep(0.001)
        ep.check()
        src = (rank - 1) % world
        assert torch.equal(region[area:], _expected(src, warps, msgs, length, region.device))
        return ep.stats()
    finally:
        dist.barrier()  # the peer may still copy into our region until it is done
        ep.close()


@pytest.mark.multigpu
@pytest.mark.parametrize("reorder", [False, True], ids=["inorder", "reorder"])
def test_two_processes_cuda_ipc(reorder):
    pool = make_pool(2)
    try:
        stats = pool.run(os.path.abspath(__file__), "_gpu_dist_body", reorder)
    finally:
        pool.close()
    for st in stats:
        assert st["writes_posted"] == 16 * 8 and st["atomics_applied"] == 16 * 8


@pytest.mark.parametrize("channels,threads", [(1, 1), (4, 2), (8, 4)])
def test_push_kernel_exactly_once_in_order(channels, threads):
    r = _bench_C.fifo_bench(0, channels, threads, 16, 8, 500, 256, 100, 60000)
    assert r["commands"] == 16 * 8 * 500
    assert r["order_errors"] == 0
    assert len(r["latency_ns"]) == 100 and min(r["latency_ns"]) > 0
    # The push is the first part of each round trip; a GPU read of host memory takes time too.
    assert len(r["push_ns"]) == 100
    assert all(0 <= p < t for p, t in zip(r["push_ns"], r["latency_ns"], strict=True))
    assert len(r["host_read_ns"]) == 100 and min(r["host_read_ns"]) > 0
    # One-way push -> poll on the host clock: positive, and (the poll comes before the pop, the
    # clock value was read at most one read before the push) within the round trip plus that
    # read. Compared at the median: a consumer preempted mid-sample leaves a stale clock value.
    hi, rd = r["push_to_poll_max_ns"], r["clock_read_ns"]
    assert len(hi) == len(rd) == 100 and min(hi) > 0 and min(rd) > 0
    bound = sorted(t + c for t, c in zip(r["latency_ns"], rd, strict=True))
    assert sorted(hi)[50] <= bound[50] + 500, (sorted(hi)[50], bound[50])


def test_small_ring_back_pressure():
    # Capacity 2 forces nearly every push through the full-ring path (head re-read over PCIe).
    r = _bench_C.fifo_bench(0, 2, 2, 4, 4, 300, 2, 10, 60000)
    assert r["order_errors"] == 0

"""Per-rank measurements of the multi-rank benchmarks: a collective call's device and host time
per iteration, its kernels' device time (torch.profiler), and the bandwidth the floor of a
call is computed from."""

from __future__ import annotations

import re
import statistics
import time

import torch
import torch.distributed as dist


def time_call(fn, iters: int, warmup: int, before=None, after=None) -> dict[str, list[float]]:
    """Per-iteration device (events) and host (CPU inside ``fn``) microseconds on this rank;
    every iteration starts together on all ranks (barrier after a device sync). ``before()``
    runs just ahead of each timed call's start event, ``after(t0_ns, t1_ns)`` right after its
    end event is recorded, with the ``perf_counter_ns`` stamps taken around ``fn``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before is not None:
            before()
        start.record()
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        end.record()
        if after is not None:
            after(t0, t1)
        end.synchronize()
        dev.append(start.elapsed_time(end) * 1e3)
        host.append((t1 - t0) / 1e3)
    return {"device_us": dev, "host_us": host}


def kernel_name(full: str) -> str:
    """``void ns::(anonymous namespace)::dispatch_kernel<int4, 8, true>(Params)`` ->
    ``dispatch_kernel``: the kernel's own name, without namespaces, templates or arguments."""
    name = full.replace("(anonymous namespace)::", "")
    name = re.sub(r"<.*", "", name.split("(")[0])
    return name.split("::")[-1].split()[-1] if name.strip() else full[:40]


def per_call_kernel_us(durations: list[tuple[str, float]], calls: int) -> dict[str, float]:
    """Device microseconds per call of each kernel, from the ``(name, us)`` of every launch of
    ``calls`` calls: the median launch times the launches per call, so one slow call (a peer
    late at a barrier, a clock change) does not move the figure as a mean would."""
    by_name: dict[str, list[float]] = {}
    for name, us in durations:
        by_name.setdefault(name, []).append(us)
    return {name: statistics.median(times) * len(times) / calls for name, times in by_name.items()}


def profile_kernels(fn, calls: int, rank: int) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (``per_call_kernel_us``), on
    rank 0 (every rank makes the calls: they are collective); empty on the other ranks."""
    torch.cuda.synchronize()
    dist.barrier()
    if rank != 0:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    durations = [
        (kernel_name(ev.name), ev.device_time)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]
    return per_call_kernel_us(durations, calls)


def floor_bandwidth(rank: int, world: int, shared: bool) -> float:
    """Bytes/s for the floor: NVLink peer copy (own GPUs, every rank to its right neighbour at
    once) or HBM device-to-device copy counting read + write (shared GPU, rank 0 alone)."""
    n = 256 << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    if shared:
        dst = torch.empty_like(src)
        scale = 2.0  # read + write
        if rank != 0:
            dist.barrier()
            dist.barrier()
            return 0.0
    else:
        dst = torch.empty(n, dtype=torch.uint8, device=f"cuda:{(rank + 1) % world}")
        scale = 1.0
    times = []
    for i in range(13):
        if not shared:
            dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    if shared:
        dist.barrier()
        dist.barrier()
    return scale * n / statistics.median(times)


__all__ = [
    "floor_bandwidth",
    "kernel_name",
    "per_call_kernel_us",
    "profile_kernels",
    "time_call",
]

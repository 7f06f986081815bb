"""Teardown never frees memory a peer still maps, and leaks nothing: ``Buffer.destroy()`` is
collective (close the peer mappings, barrier, free), so creating and destroying a kernels
``Buffer`` ``UCCL_EP_TEST_TEARDOWN_CYCLES`` times (default 1000) at 2 and 4 ranks raises no
error, leaves ``_C``'s allocation registry (own buffers, IPC mappings, status words) exactly
where it started, and does not shrink the GPU's free memory. ``Buffer.__del__`` (no collective
possible) closes the mappings but keeps the own buffer, which ``leaked_bytes`` accounts for."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import dispatch, nvl_bytes_for, pool_fixture  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

CYCLES = int(os.environ.get("UCCL_EP_TEST_TEARDOWN_CYCLES", "1000"))
BATCH = 50  # cycles per pool call, well inside one call's time limit
HIDDEN = 256  # small rows keep each cycle cheap; the Buffer gets the hint for them
# Free device memory may move by allocator and driver noise; a leak of one 2 MiB-granular
# buffer per cycle per rank would exceed this many times over.
FREE_TOLERANCE = 256 << 20


def _registry() -> dict:
    from uccl_ep_megatron import _C

    live = _C.live_allocations()
    return {k: live[k] for k in ("device_buffer", "ipc_mapping", "host_status")}


def _round_trip(buf, rank: int, world: int) -> None:
    """A dispatch and combine on ``buf``: every token goes to one rank, so combine gives x."""
    num_tokens, hidden = 32, HIDDEN
    idx = ((torch.arange(num_tokens, device="cuda") + rank) % world).view(-1, 1)
    x = torch.full((num_tokens, hidden), float(rank + 1), device="cuda").to(torch.bfloat16)
    x += torch.arange(num_tokens, device="cuda").to(torch.bfloat16).view(-1, 1)
    w = torch.ones(num_tokens, 1, device="cuda")
    lay = buf.get_dispatch_layout(idx, world)[:4]
    recv_x, _, _, _, handle, _ = dispatch(buf, x, lay, idx, w)
    out, _, _ = buf.combine(recv_x, handle)
    torch.cuda.synchronize()
    assert torch.equal(out, x), "dispatch + combine through a fresh Buffer did not return x"


def measure(rank: int, world: int) -> dict:
    """Registry counts and the GPU's free bytes, taken once every rank is idle."""
    import torch.distributed as dist

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()
    free = torch.cuda.mem_get_info()[0]
    dist.barrier()
    return {"registry": _registry(), "free": free}


def cycles_case(rank: int, world: int, n: int) -> None:
    from uccl_ep_megatron import Buffer

    for i in range(n):
        buf = Buffer(
            None, nvl_bytes_for(world, HIDDEN), 0, backend="kernels", explicitly_destroy=True
        )
        if i == 0:
            _round_trip(buf, rank, world)
        buf.destroy()
        buf.destroy()  # idempotent


def del_case(rank: int, world: int) -> dict:
    """A Buffer dropped without destroy(): mappings closed, own buffer kept and counted."""
    from uccl_ep_megatron import Buffer
    from uccl_ep_megatron.backends import ipc_buffer

    before, leaked = _registry(), ipc_buffer.leaked_bytes
    buf = Buffer(None, nvl_bytes_for(world, HIDDEN), 0, backend="kernels")
    size = buf._backend._ipc.sizes[rank]
    # The receive arena is registered memory peers map too: kept the same way.
    arena = buf._backend.recv_arena
    arena_bytes = arena.nbytes if arena.enabled else 0
    _round_trip(buf, rank, world)
    del buf, arena
    gc.collect()
    after = _registry()
    assert after["ipc_mapping"] == before["ipc_mapping"], (before, after)
    assert after["host_status"] == before["host_status"], (before, after)
    assert after["device_buffer"] == (
        before["device_buffer"][0] + 1 + (arena_bytes > 0),
        before["device_buffer"][1] + size + arena_bytes,
    ), (before, after)
    assert ipc_buffer.leaked_bytes == leaked + size + arena_bytes
    return {"size": size}


gpu_pool = pool_fixture([2, 4], needs_kernels=True)


def test_create_destroy_cycles_leak_nothing(gpu_pool):
    env = {"UCCL_EP_TIMEOUT_MS": "20000"}
    # The first batch loads kernels, creates streams and warms the allocators: measure after it.
    first = min(BATCH, CYCLES)
    gpu_pool.run(__file__, "cycles_case", first, env=env)
    base = gpu_pool.run(__file__, "measure", env=env)
    done = first
    while done < CYCLES:
        n = min(BATCH, CYCLES - done)
        gpu_pool.run(__file__, "cycles_case", n, env=env)
        done += n
    end = gpu_pool.run(__file__, "measure", env=env)
    for r, (b, e) in enumerate(zip(base, end, strict=True)):
        assert e["registry"] == b["registry"], f"rank {r}: _C allocations {b} -> {e}"
        assert e["free"] >= b["free"] - FREE_TOLERANCE, (
            f"rank {r}: free GPU memory fell by {(b['free'] - e['free']) >> 20} MiB over "
            f"{done - first} create/destroy cycles"
        )


def test_del_keeps_own_buffer_and_closes_mappings(gpu_pool):
    out = gpu_pool.run(__file__, "del_case", env={"UCCL_EP_TIMEOUT_MS": "20000"})
    assert all(o["size"] >= nvl_bytes_for(gpu_pool.world_size, HIDDEN) for o in out), out

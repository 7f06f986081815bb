"""A call whose wait times out never hands back uninitialised outputs: the kernels skip their
data movement, and a fill kernel on the call's stream then writes NaN rows, -1 ids and 0
dispatched weights (``poison_if_failed``), until the next call raises ``CommTimeoutError``
naming the wait (a barrier, or the combine's wait for a peer's chunk).

Outputs are allocated from zeroed memory here, so an output the fill missed reads 0, not NaN
(the other GPU tests poison with 0xFF, which would already look like NaN)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import (  # noqa: E402
    dispatch,
    fill_free_memory,
    nvl_bytes_for,
    pool_fixture,
    require_kernels,
)

pytestmark = [pytest.mark.gpu]

_keep: list[object] = []


def _zero_free_memory(stream) -> None:
    """Zero free caching-allocator memory of ``stream``, so fresh outputs start as 0."""
    fill_free_memory(stream, 0, large_bytes=1 << 26)
    torch.cuda.synchronize()


def test_poison_fills_only_when_status_is_set():
    from uccl_ep_megatron.backends.intranode.launch import poison_on_timeout
    from uccl_ep_megatron.core.errors import InvalidInputError

    c = require_kernels()
    st = c.host_status_alloc()
    try:
        stream = torch.cuda.current_stream().cuda_stream
        rows = torch.ones(37, 129, dtype=torch.bfloat16, device="cuda")  # odd byte count: tail
        fp8 = torch.ones(5, 7, device="cuda").to(torch.float8_e4m3fn)
        ids = torch.arange(12, dtype=torch.int64, device="cuda").view(4, 3)
        ids32 = torch.arange(12, dtype=torch.int32, device="cuda")
        w = torch.ones(4, 3, dtype=torch.float32, device="cuda")
        fills = ((rows, "nan"), (fp8, "nan"), (ids, "-1"), (ids32, "-1"), (w, "0"))
        saved = [t.clone() for t, _ in fills]
        poison_on_timeout(c, st, stream, *fills)
        torch.cuda.synchronize()
        for (t, _), s in zip(fills, saved, strict=True):
            assert torch.equal(t.view(torch.uint8), s.view(torch.uint8)), "filled while clear"
        c.host_status_record(st, [1, 0, 0, 0])  # what a timed-out wait records
        poison_on_timeout(c, st, stream, *fills)
        torch.cuda.synchronize()
        assert rows.isnan().all()
        assert fp8.float().isnan().all()
        assert (ids == -1).all() and (ids32 == -1).all()
        assert (w == 0).all()
        with pytest.raises(InvalidInputError, match="8-byte aligned"):
            c.poison_if_failed(st, [rows.data_ptr() + 2], [8], [0], stream)
    finally:
        c.host_status_free(st)


def _dispatched(world: int):
    """(Buffer, x, topk_idx, recv_x, recv_topk_weights, handle) of a 512-token top-1 dispatch
    that sends rows to every rank, on a Buffer kept for the session (peers may still write
    into it after a timeout)."""
    from uccl_ep_megatron import Buffer

    buf = Buffer(None, nvl_bytes_for(world, 4096), 0, backend="kernels")
    _keep.append(buf)
    num_tokens, hidden = 512, 4096
    idx = (torch.arange(num_tokens, device="cuda") % world).view(-1, 1)
    w = torch.rand(num_tokens, 1, device="cuda")
    x = torch.randn(num_tokens, hidden, device="cuda").to(torch.bfloat16)
    lay = buf.get_dispatch_layout(idx, world)[:4]
    recv_x, _, recv_w, _, handle, _ = dispatch(buf, x, lay, idx, w)
    return buf, x, idx, recv_x, recv_w, handle


def poison_case(rank: int, world: int, op: str) -> str:
    """All ranks dispatch once; then rank 0 alone runs ``op`` (cached dispatch or combine),
    times out, and must get poisoned outputs; its next call raises CommTimeoutError."""
    import torch.distributed as dist

    from uccl_ep_megatron.core.errors import CommTimeoutError

    buf, x, idx, recv_x, recv_w, handle = _dispatched(world)
    torch.cuda.synchronize()
    assert not recv_x.isnan().any()
    dist.barrier()
    if rank != 0:
        dist.barrier()
        return "idle"
    _zero_free_memory(buf.get_comm_stream())
    _zero_free_memory(torch.cuda.current_stream())
    if op == "cached_dispatch":
        out = buf.dispatch(x, handle=handle)[0]
        outs = [out]
    else:
        out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
        outs = [out, out_w]
    torch.cuda.synchronize()
    for t in outs:
        assert t.numel() > 0 and t.float().isnan().all(), f"{op}: output not poisoned: {t}"
    try:
        buf.get_dispatch_layout(idx, world)
    except CommTimeoutError as exc:
        assert "waiting for rank" in str(exc), str(exc)
    else:
        raise AssertionError(f"the call after a timed-out {op} did not raise")
    dist.barrier()
    return "poisoned"


class _DeviceWord:
    """One int64 of device memory at ``ptr``, for torch.as_tensor (CUDA array interface)."""

    def __init__(self, ptr: int):
        self.__cuda_array_interface__ = {
            "shape": (1,),
            "typestr": "<i8",
            "data": (ptr, False),
            "version": 3,
        }


def stalled_peer_case(rank: int, world: int) -> str:
    """Rank 1 passes the combine's entry barrier but never pushes its rows back: its barrier
    flag in rank 0's control region (slot 1 of the uint64 flags at offset 0) is forged past
    any sequence, after one full dispatch + combine left its call header there. Rank 0's
    reducers must then time out waiting for rank 1's first chunk, at the "combine receive"
    site (not at the entry barrier), its outputs poisoned; its next call raises."""
    import torch.distributed as dist

    from uccl_ep_megatron.core.errors import CommTimeoutError

    buf, _, idx, recv_x, recv_w, handle = _dispatched(world)
    out, _, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    dist.barrier()
    if rank != 0:
        dist.barrier()
        return "idle"
    own = buf._backend._buffers[rank]
    torch.as_tensor(_DeviceWord(own + 8), device="cuda").fill_(1 << 62)  # rank 1 "arrived"
    torch.cuda.synchronize()
    _zero_free_memory(buf.get_comm_stream())
    _zero_free_memory(torch.cuda.current_stream())
    out, out_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w)
    torch.cuda.synchronize()
    for t in (out, out_w):
        assert t.numel() > 0 and t.float().isnan().all(), f"combine output not poisoned: {t}"
    try:
        buf.get_dispatch_layout(idx, world)
    except CommTimeoutError as exc:
        message = str(exc)
    else:
        raise AssertionError("the call after a stalled combine did not raise")
    dist.barrier()
    return message


gpu_pool = pool_fixture(2, needs_kernels=True)


@pytest.mark.multigpu
@pytest.mark.parametrize("op", ["cached_dispatch", "combine"])
def test_timed_out_call_returns_poisoned_outputs(gpu_pool, op):
    out = gpu_pool.run(__file__, "poison_case", op, env={"UCCL_EP_TIMEOUT_MS": "2000"})
    assert out == ["poisoned", "idle"], out


@pytest.mark.multigpu
def test_combine_stalled_peer_times_out_at_the_chunk_wait(gpu_pool):
    out = gpu_pool.run(__file__, "stalled_peer_case", env={"UCCL_EP_TIMEOUT_MS": "2000"})
    assert out[1] == "idle", out
    assert "combine receive" in out[0] and "waiting for rank 1" in out[0], out

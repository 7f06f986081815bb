"""Helpers shared by the GPU tests: rank pools on one or more GPUs (ranks share a GPU under
CUDA MPS when there are more ranks than GPUs), poisoned allocations, exact comparison with a
readable mismatch, and a dispatch call from a layout."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_counts(var: str, default: str) -> list[int]:
    """Rank counts from env ``var`` (comma-separated), e.g. ``UCCL_EP_TEST_RANKS=2,4``."""
    return [int(v) for v in os.environ.get(var, default).split(",") if v.strip()]


def nvl_bytes_for(world: int, hidden: int, element_size: int = 2) -> int:
    """The smallest ``num_nvl_bytes`` a Buffer of ``world`` ranks accepts for this hidden size
    with the default configs (DeepEP's size hints)."""
    from uccl_ep_megatron import Buffer

    hidden_bytes = hidden * max(element_size, 2)
    return max(
        cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
        for cfg in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world))
    )


def make_pool(world: int):
    """A pool of ``world`` ranks on this machine's GPUs, or a skip saying what is missing."""
    from dist_utils import DistPool

    from uccl_ep_megatron.cluster.local import mps_available

    if NUM_GPUS == 0:
        pytest.skip("needs a GPU")
    if world > NUM_GPUS and not mps_available():
        pytest.skip(f"{world} ranks on {NUM_GPUS} GPU(s) share GPUs: needs CUDA MPS")
    return DistPool(world, gpus=NUM_GPUS)


def poison(buf, byte: int = 0xFF) -> None:
    """Fill free caching-allocator memory of the comm stream, its large-block pool and its
    small-block pool (allocations up to 1 MiB), with ``byte``: 0xFF gives NaN / -1 patterns;
    0x7F gives values that are neither NaN, -1 nor 0, where a test must tell the kernels' own
    poison fill from leftovers."""
    with torch.cuda.stream(buf.get_comm_stream()):
        large = torch.empty(3 << 28, dtype=torch.uint8, device="cuda")
        small = [torch.empty(1 << 19, dtype=torch.uint8, device="cuda") for _ in range(64)]
        for p in (large, *small):
            p.fill_(byte)
        del large, small


def assert_same(name: str, a, b) -> None:
    """``a`` and ``b`` are equal bit for bit (FP8 compared as bytes), or both None."""
    if a is None or b is None:
        assert a is None and b is None, f"{name}: {a is None=} {b is None=}"
        return
    if isinstance(a, list):
        assert a == b, f"{name}: {a} != {b}"
        return
    if a.device != b.device:  # the oracle of a gloo pool hands back CPU tensors in handles
        a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    if a.dtype.itemsize == 1 and a.is_floating_point():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: mismatch at {bad} ({int((a != b).sum())} elements)")


def dispatch(buf, x, layout, topk_idx, topk_w, **kw):
    """``buf.dispatch`` with the four layout tensors of ``get_dispatch_layout``."""
    per_rank, per_rdma, per_expert, in_rank = layout
    return buf.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=topk_w,
        **kw,
    )

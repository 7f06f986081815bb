"""Launch helpers shared with the internode backend: a combine's inputs and outputs, the layout
kernel and the poisoning of a failed call's outputs. (The intranode dispatch and combine fold
their poisoning into their own ``_C`` calls, and ``_C.intranode_exact_rows`` reads the staging
sizes off the rank prefix matrix.)"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from uccl_ep_megatron.core.errors import InvalidInputError

_COMBINE_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


@dataclass
class CombineTensors:
    """A GPU combine's inputs made ready for the kernels and its freshly allocated outputs."""

    x: torch.Tensor  # contiguous
    dtype_code: int  # the kernels' code of x.dtype
    weights: torch.Tensor | None  # top-k weights as contiguous float32
    biases: list[torch.Tensor]  # contiguous, x's dtype, at most 2
    out: torch.Tensor  # [num_tokens, hidden], x's dtype
    out_weights: torch.Tensor | None  # [num_tokens, num_topk] float32


def prepare_combine(
    x: torch.Tensor,
    topk_weights: torch.Tensor | None,
    bias: tuple[torch.Tensor, ...],
    num_tokens: int,
    who: str,
) -> CombineTensors:
    """Checks a combine's dtypes (``who`` names the backend in errors) and allocates its outputs."""
    if x.dtype not in _COMBINE_DTYPES:
        raise InvalidInputError(
            f"combine: x.dtype={x.dtype}; {who} combines bfloat16, float16 or float32 rows"
        )
    if len(bias) > 2:
        raise InvalidInputError(f"combine: {len(bias)} bias tensors; at most 2 are supported")
    for i, b in enumerate(bias):
        if b.dtype != x.dtype:
            raise InvalidInputError(
                f"combine: bias[{i}].dtype={b.dtype} differs from x.dtype={x.dtype}; {who} adds "
                f"bias in x's dtype: pass bias.to({x.dtype})"
            )
    x = x.contiguous()
    dev = x.device
    weights = out_w = None
    if topk_weights is not None:
        weights = topk_weights.to(torch.float32).contiguous()
        out_w = torch.empty(num_tokens, weights.shape[1], dtype=torch.float32, device=dev)
    return CombineTensors(
        x=x,
        dtype_code=_COMBINE_DTYPES[x.dtype],
        weights=weights,
        biases=[b.contiguous() for b in bias],
        out=torch.empty(num_tokens, x.shape[1], dtype=x.dtype, device=dev),
        out_weights=out_w,
    )


@functools.cache
def _fill_pattern(dtype: torch.dtype, value: str) -> int:
    """``float(value)`` in ``dtype``, its bytes repeated to 8 (little-endian): the kernel's
    word. ``value`` is text ("nan", "-1", "0") so the cache can key on it (NaN != NaN)."""
    raw = torch.tensor([float(value)], dtype=dtype).view(torch.uint8).tolist()
    return int.from_bytes(bytes(raw * (8 // len(raw))), "little")


def poison_on_timeout(
    c: Any, status: int, stream: int, *fills: tuple[torch.Tensor | None, str]
) -> None:
    """After a call's last kernel, on its stream: when a wait of the call timed out (the
    kernels then skipped their data movement), fill each ``(tensor, value)`` with ``value``
    (NaN for rows, -1 for ids, 0 for dispatched weights), so no caller reads uninitialised
    memory before the next call raises ``CommTimeoutError``. Tensors are fresh contiguous
    outputs; a ``None`` or empty one is skipped."""
    live = [(t, v) for t, v in fills if t is not None and t.numel() > 0]
    if not live:
        return
    c.poison_if_failed(
        status=status,
        ptrs=[t.data_ptr() for t, _ in live],
        bytes=[t.numel() * t.element_size() for t, _ in live],
        patterns=[_fill_pattern(t.dtype, v) for t, v in live],
        stream=stream,
    )


def warm_poison(c: Any, status: int, device: torch.device) -> None:
    """Loads the poison kernel now (a no-op launch: the status is clear). Under CUDA lazy
    loading a kernel's first launch holds the context lock until the GPU drains; first
    launched behind a kernel that waits on proxies' copies, it would stall them."""
    with torch.cuda.device(device):
        probe = torch.empty(1, dtype=torch.int64, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        poison_on_timeout(c, status, stream, (probe, "-1"))
        torch.cuda.synchronize(device)


def launch_layout(
    c: Any, topk_idx: torch.Tensor, num_experts: int, num_ranks: int, stream: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout kernel: (tokens per rank, tokens per expert, is_token_in_rank [T, R])."""
    topk_idx = topk_idx.contiguous()
    dev = topk_idx.device
    per_rank = torch.empty(num_ranks, dtype=torch.int32, device=dev)
    per_expert = torch.empty(num_experts, dtype=torch.int32, device=dev)
    in_rank = torch.empty(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=dev)
    c.dispatch_layout_call(stream, topk_idx, per_rank, per_expert, in_rank)
    return per_rank, per_expert, in_rank


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as contiguous int32, without a copy (or a launch) when it already is."""
    if t.dtype == torch.int32 and t.is_contiguous():
        return t
    return t.to(torch.int32).contiguous()

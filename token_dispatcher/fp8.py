"""FP8 dispatch for training (``--moe-uccl-ep-fp8-dispatch``): tokens travel as E4M3 with one
float32 scale per 128 channels, as DeepSeek-V3 dispatches them, and arrive dequantized in the
layer's dtype for the experts (no FP8 expert GEMM without Transformer Engine).

Only the forward dispatch is FP8. Its backward, like the combine and its backward, moves bf16:
the gradient passes the quantization unchanged (straight through), so every gradient is the
bf16 one of the dequantized input.

Scales follow DeepEP's convention (``per_token_cast_to_fp8`` of its tests): ``scale = amax /
448`` per 128-channel block (amax floored at 1e-4) and ``x ~= x_e4m3 * scale``. Exactly, in
float32: ``x_e4m3 = e4m3(x * (448 * (1 / amax)))`` (what torch computes for ``x * (448 /
amax)``) and ``scale = amax * fl(1 / 448)``. On a GPU the FP8 row kernels of ``_C``
(``csrc/kernels/fp8.cu``: one pass each way) compute that bit for bit; elsewhere torch's ops do
(``quantize_reference`` / ``dequantize_reference``, also the kernels' test oracle).
"""

from __future__ import annotations

from typing import Any

import torch
from uccl_ep_megatron.token_dispatcher.permute_fused import _DTYPE_CODES, _c, fused_available

from uccl_ep_megatron.api.buffer import Buffer
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import InvalidInputError

BLOCK = 128
E4M3_MAX = 448.0


def _check_hidden(hidden: int) -> None:
    if hidden % BLOCK:
        raise InvalidInputError(f"FP8 dispatch needs hidden % {BLOCK} == 0, got hidden={hidden}")


def _kernels(t: torch.Tensor, dtype: torch.dtype) -> Any:
    """``_C`` when its FP8 row kernels can take ``t`` (a GPU tensor; ``dtype`` bf16, fp16 or
    fp32), else None. They are bound with the fused permute kernels (``fused_available``)."""
    if dtype not in _DTYPE_CODES or not fused_available(t.device):
        return None
    return _c()


def quantize_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` in torch's ops (the CPU path, and the GPU kernels' oracle)."""
    tokens, hidden = x.shape
    _check_hidden(hidden)
    blocks = x.float().view(tokens, hidden // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp_min(1e-4)
    x_fp8 = (blocks * (amax.reciprocal() * E4M3_MAX).unsqueeze(2)).to(torch.float8_e4m3fn)
    return x_fp8.view(tokens, hidden), (amax * (1.0 / E4M3_MAX)).contiguous()


def dequantize_reference(
    x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`dequantize` in torch's ops."""
    tokens, hidden = x_fp8.shape
    blocks = x_fp8.float().view(tokens, hidden // BLOCK, BLOCK) * scales.unsqueeze(2)
    return blocks.view(tokens, hidden).to(dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H]`` -> ``(x_e4m3 [T, H], scales float32 [T, H / 128])`` (module doc).

    Raises:
        InvalidInputError: H is not a multiple of 128.
    """
    tokens, hidden = x.shape
    _check_hidden(hidden)
    c = _kernels(x, x.dtype)
    if c is None:
        return quantize_reference(x)
    x = x.contiguous()
    out = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(tokens, hidden // BLOCK, dtype=torch.float32, device=x.device)
    c.quantize_fp8(
        x=x.data_ptr(),
        dtype=_DTYPE_CODES[x.dtype],
        rows=tokens,
        hidden=hidden,
        out=out.data_ptr(),
        scales=scales.data_ptr(),
        stream=torch.cuda.current_stream(x.device).cuda_stream,
    )
    return out, scales


def dequantize(
    x_fp8: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    bound: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse of :func:`quantize`, in ``dtype``. ``bound``: an int32 ``[1]`` device tensor
    of live rows (a sync-free dispatch's ``handle.recv_count``); on the kernels, the rows at or
    past it are not written (the torch ops compute every row)."""
    tokens, hidden = x_fp8.shape
    _check_hidden(hidden)
    c = _kernels(x_fp8, dtype)
    if c is None or x_fp8.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32:
        return dequantize_reference(x_fp8, scales, dtype)
    x_fp8, scales = x_fp8.contiguous(), scales.contiguous()
    if x_fp8.data_ptr() % 4:
        x_fp8 = x_fp8.clone()  # the kernel reads the codes a word at a time
    out = torch.empty(tokens, hidden, dtype=dtype, device=x_fp8.device)
    c.dequantize_fp8(
        x=x_fp8.data_ptr(),
        scales=scales.data_ptr(),
        rows=tokens,
        hidden=hidden,
        dtype=_DTYPE_CODES[dtype],
        bound=_bound_ptr(bound, x_fp8.device),
        out=out.data_ptr(),
        stream=torch.cuda.current_stream(x_fp8.device).cuda_stream,
    )
    return out


def _bound_ptr(bound: torch.Tensor | None, device: torch.device) -> int:
    if bound is None:
        return 0
    if bound.dtype != torch.int32 or bound.numel() != 1 or bound.device != device:
        raise InvalidInputError(
            f"bound must be an int32 [1] tensor on {device} (handle.recv_count), got "
            f"{bound.dtype} {tuple(bound.shape)} on {bound.device}"
        )
    return bound.data_ptr()


class _Fp8Dispatch(torch.autograd.Function):
    """``ops.dispatch`` with the rows sent in FP8; backward combines bf16 gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_idx: torch.Tensor,
        buffer: Buffer,
        num_experts: int,
        num_worst_tokens: int,
        config: Config | None,
    ):
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(
            topk_idx, num_experts
        )
        (recv_fp8, recv_scales), recv_idx, recv_w, counts, handle, _ = buffer.dispatch(
            quantize(x),
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_worst_tokens=num_worst_tokens,
            config=config,
        )
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        ctx.x_meta = (x.shape[1], x.dtype, x.device)
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        ctx.fp8_bytes = recv_fp8.numel() + recv_scales.numel() * 4
        # Sync-free: the rows past the received ones are padding, which nothing reads.
        bound = getattr(handle, "recv_count", None) if num_worst_tokens else None
        recv_x = dequantize(recv_fp8, recv_scales, x.dtype, bound)
        return recv_x, recv_idx, recv_w, counts, handle

    @staticmethod
    def backward(ctx: Any, grad_x, _grad_idx, grad_w, _grad_counts, _grad_handle):
        (recv_idx,) = ctx.saved_tensors
        if grad_w is not None:
            grad_w = torch.where(recv_idx >= 0, grad_w, 0.0).float()
        if grad_x is None:
            hidden, dtype, device = ctx.x_meta
            rows = ctx.handle.num_worst_tokens or ctx.handle.num_recv_tokens
            grad_x = torch.zeros(rows, hidden, dtype=dtype, device=device)
        grad_in, grad_topk_w, _ = ctx.buffer.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=grad_w, config=ctx.config
        )
        return grad_in, grad_topk_w, None, None, None, None, None


def dispatch_fp8(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    num_worst_tokens: int = 0,
    config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], Any]:
    """Differentiable layout + FP8 dispatch: the returns of ``ops.dispatch`` with ``recv_x``
    dequantized to ``x.dtype``; gradients flow to ``x`` (straight through the quantization)
    and ``topk_weights``, in ``x.dtype``."""
    return _Fp8Dispatch.apply(
        x, topk_weights, topk_idx, buffer, num_experts, num_worst_tokens, config
    )


__all__ = [
    "BLOCK",
    "dequantize",
    "dequantize_reference",
    "dispatch_fp8",
    "quantize",
    "quantize_reference",
]

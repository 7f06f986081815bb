"""Autograd-aware dispatch and combine.

The backward of each is the opposite collective reusing the forward ``handle``:
dispatch's backward combines the gradients of the received rows (and of the received top-k
weights) back into the source tokens; combine's backward is a cached dispatch of the gradient.
Both work with any ``Buffer`` backend, so the same graph runs on the kernels and on the
reference oracle.

``async_finish=True`` runs each call as Megatron's DeepEP path (``fused_a2a.py``) runs DeepEP's:
on the Buffer's communication stream, after an event recorded on the caller's stream
(``previous_event``), and the caller's stream then waits for the call's event, so the outputs
are ready on the stream that called, in forward and in backward. Under Megatron's EP overlap
schedule that stream is its communication stream, which runs beside the other micro-batch's
compute. ``async_finish=False`` makes synchronous calls, which the ``kernels`` backend runs on
the caller's stream itself (no events; less host time: ``api/streams.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from uccl_ep_megatron.api.buffer import Buffer
from uccl_ep_megatron.backends.base import DispatchHandle
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.events import EventOverlap, capture


def _before(async_finish: bool) -> EventOverlap | None:
    """The ``previous_event`` of an asynchronous call: the current stream's work so far (what
    DeepEP's ``EventOverlap(EventHandle())`` records); ``None`` for a synchronous one."""
    return capture() if async_finish else None


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_idx: torch.Tensor,
        buffer: Buffer,
        num_experts: int,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Config | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ):
        previous = _before(async_finish)
        per_rank, per_rdma, per_expert, in_rank, event = buffer.get_dispatch_layout(
            topk_idx,
            num_experts,
            previous_event=previous,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        recv_x, recv_idx, recv_w, counts, handle, after = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens,
            config=config,
            previous_event=event if async_finish else None,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        # Autograd hands the outputs to the next node on the current stream: join them to it.
        after.current_stream_wait()
        ctx.async_finish, ctx.allocate = async_finish, allocate_on_comm_stream
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        ctx.x_meta = (x.shape[1], x.dtype, x.device)
        ctx.save_for_backward(recv_idx)
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, counts, handle

    @staticmethod
    def backward(ctx: Any, grad_x, _grad_idx, grad_w, _grad_counts, _grad_handle):
        (recv_idx,) = ctx.saved_tensors
        if grad_w is not None:
            # Slots whose expert lives elsewhere were zeroed in forward: no gradient flows back.
            grad_w = torch.where(recv_idx >= 0, grad_w, 0.0).float()
        if grad_x is None:
            hidden, dtype, device = ctx.x_meta
            rows = ctx.handle.num_worst_tokens or ctx.handle.num_recv_tokens
            grad_x = torch.zeros(rows, hidden, dtype=dtype, device=device)
        grad_in, grad_topk_w, after = ctx.buffer.combine(
            grad_x.contiguous(),
            ctx.handle,
            topk_weights=grad_w,
            config=ctx.config,
            previous_event=_before(ctx.async_finish),
            async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate,
        )
        after.current_stream_wait()
        return grad_in, grad_topk_w, None, None, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        handle: DispatchHandle,
        buffer: Buffer,
        config: Config | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ):
        combined, _, after = buffer.combine(
            x,
            handle,
            config=config,
            previous_event=_before(async_finish),
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        after.current_stream_wait()
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        ctx.async_finish, ctx.allocate = async_finish, allocate_on_comm_stream
        return combined

    @staticmethod
    def backward(ctx: Any, grad_combined: torch.Tensor):
        grad_x, *_, after = ctx.buffer.dispatch(
            grad_combined.contiguous(),
            handle=ctx.handle,
            config=ctx.config,
            previous_event=_before(ctx.async_finish),
            async_finish=ctx.async_finish,
            allocate_on_comm_stream=ctx.allocate,
        )
        after.current_stream_wait()
        return grad_x, None, None, None, None, None


def dispatch(
    buffer: Buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    *,
    expert_alignment: int = 1,
    num_worst_tokens: int = 0,
    config: Config | None = None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int], DispatchHandle]:
    """Differentiable layout + dispatch.

    Gradients flow to ``x`` and ``topk_weights``. With ``async_finish`` the layout and the
    dispatch (and in backward the combine) run on the Buffer's communication stream, ordered
    after the current stream's work by an event, as Megatron's DeepEP path runs them (see the
    module docstring); either way the outputs are joined to the current stream before this
    returns, since autograd hands them on there. ``allocate_on_comm_stream``: as in
    ``Buffer.dispatch``.

    Returns:
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)``
        with the semantics of ``Buffer.dispatch``.
    """
    return _Dispatch.apply(
        x,
        topk_weights,
        topk_idx,
        buffer,
        num_experts,
        expert_alignment,
        num_worst_tokens,
        config,
        async_finish,
        allocate_on_comm_stream,
    )


def combine(
    buffer: Buffer,
    x: torch.Tensor,
    handle: DispatchHandle,
    *,
    config: Config | None = None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> torch.Tensor:
    """Differentiable combine: sums the rows back into source tokens; gradient flows to ``x``.
    ``async_finish`` as in ``dispatch`` (forward and backward)."""
    return _Combine.apply(x, handle, buffer, config, async_finish, allocate_on_comm_stream)

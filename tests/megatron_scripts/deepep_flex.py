"""Megatron's and Primus-Turbo's DeepEP paths on the ``deep_ep`` drop-in.

Run with ``torchrun --nproc-per-node 2 -m uccl_ep_megatron.run --deep-ep-compat deepep_flex.py``
on CPU (gloo, reference backend). Checks dispatch -> combine against the closed form, forward
and backward, for:

1. megatron-core's ``fused_a2a`` (``FusedDispatch`` / ``FusedCombine``, as the flex dispatcher
   calls them: ``async_finish=True``, ``allocate_on_comm_stream=True``, ``previous_event``);
2. the calls Primus-Turbo's ``DEEP_EP`` backend makes (``PRIMUS_TURBO_MOE_DISPATCH_COMBINE_BACKEND
   =DEEP_EP``; ``primus_turbo/pytorch/kernels/moe/moe_dispatch_combine_impl.py``), which needs
   ROCm to import, re-enacted step for step: ``Buffer.set_num_sms``, both configs' size hints
   (RDMA hint inside ``try``), the ``is_intranode`` signature probe, events from
   ``deep_ep.utils``, layout then dispatch with ``num_worst_tokens=0``, cached re-dispatch by
   ``handle``, combine with float ``topk_weights``.

Reports one JSON object per rank.
"""

import datetime
import inspect
import json
import os

import torch
import torch.distributed as dist

os.environ.setdefault("UCCL_EP_BACKEND", "reference")
# A bounded timeout: a dead peer fails the run instead of hanging it.
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank, world = dist.get_rank(), dist.get_world_size()

import deep_ep  # noqa: E402  served by uccl_ep_megatron
from megatron.core.transformer.moe import fused_a2a  # noqa: E402

import uccl_ep_megatron  # noqa: E402

assert deep_ep.Buffer is uccl_ep_megatron.Buffer
assert fused_a2a.HAVE_DEEP_EP and fused_a2a.fused_dispatch is not None

num_experts, topk, tokens, hidden = 4 * world, 2, 12, 32
g = torch.Generator().manual_seed(rank)
x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
idx = torch.stack([torch.randperm(num_experts, generator=g)[:topk] for _ in range(tokens)])
probs = torch.rand(tokens, topk, generator=g).requires_grad_(True)
group = dist.group.WORLD
recv_x, recv_idx, recv_probs, tokens_per_expert, handle = fused_a2a.fused_dispatch(
    x, idx, probs, num_experts, group, async_finish=True, allocate_on_comm_stream=True
)
# "Experts": weight every received row by the sum of its local probabilities.
weight = torch.where(recv_idx >= 0, recv_probs, 0.0).sum(-1, keepdim=True)
out, _ = fused_a2a.fused_combine(
    recv_x * weight, group, handle, async_finish=True, allocate_on_comm_stream=True
)
expected = x.detach() * probs.detach().sum(-1, keepdim=True)
torch.testing.assert_close(out.detach(), expected, atol=1e-5, rtol=1e-5)
out.sum().backward()
torch.testing.assert_close(x.grad, probs.detach().sum(-1, keepdim=True).expand_as(x))
torch.testing.assert_close(probs.grad, x.detach().sum(-1, keepdim=True).expand_as(probs))

# ---- 2. Primus-Turbo's DEEP_EP backend -----------------------------------------------------
BufferClass = deep_ep.Buffer
BufferClass.set_num_sms(24)
hidden_bytes = x.size(1) * max(x.element_size(), 2)
num_nvl_bytes = num_rdma_bytes = 0
for cfg in (BufferClass.get_dispatch_config(world), BufferClass.get_combine_config(world)):
    num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world), num_nvl_bytes)
    try:
        num_rdma_bytes = max(cfg.get_rdma_buffer_size_hint(hidden_bytes, world), num_rdma_bytes)
    except (RuntimeError, AttributeError):
        pass
param = inspect.signature(BufferClass).parameters.get("is_intranode")
kwargs = {"is_intranode": world <= 8} if param is not None and param.default is False else {}
turbo_buffer = BufferClass(group, num_nvl_bytes, num_rdma_bytes, **kwargs)
EventOverlapClass, EventHandleClass = deep_ep.utils.EventOverlap, deep_ep.utils.EventHandle
x2 = x.detach() * 2
previous_event = EventOverlapClass(EventHandleClass())
per_rank, per_rdma, per_expert, in_rank, event = turbo_buffer.get_dispatch_layout(
    idx, num_experts, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True
)
recv_x2, recv_idx2, recv_w2, tpe2, handle2, after = turbo_buffer.dispatch(
    x2,
    topk_idx=idx,
    topk_weights=probs.detach(),
    num_tokens_per_rank=per_rank,
    num_tokens_per_rdma_rank=per_rdma,
    is_token_in_rank=in_rank,
    num_tokens_per_expert=per_expert,
    previous_event=event,
    async_finish=True,
    allocate_on_comm_stream=True,
    num_worst_tokens=0,
)
after.current_stream_wait()
assert list(tpe2) == tokens_per_expert.tolist(), (list(tpe2), tokens_per_expert.tolist())
torch.testing.assert_close(recv_x2, recv_x.detach() * 2)
torch.testing.assert_close(recv_idx2, recv_idx)
# Cached re-dispatch with the handle (the backend's second branch).
recv_again, _, _, _, _, after = turbo_buffer.dispatch(
    x2,
    handle=handle2,
    previous_event=EventOverlapClass(EventHandleClass()),
    async_finish=True,
    allocate_on_comm_stream=True,
)
after.current_stream_wait()
torch.testing.assert_close(recv_again, recv_x2)
weight2 = torch.where(recv_idx2 >= 0, recv_w2, 0.0).sum(-1, keepdim=True)
combined, combined_w, after = turbo_buffer.combine(
    recv_x2 * weight2,
    handle=handle2,
    topk_weights=recv_w2.float(),
    previous_event=EventOverlapClass(EventHandleClass()),
    async_finish=True,
    allocate_on_comm_stream=True,
)
after.current_stream_wait()
torch.testing.assert_close(combined, x2 * probs.detach().sum(-1, keepdim=True))
torch.testing.assert_close(combined_w, probs.detach())  # each weight summed back once
result = json.dumps({"rank": rank, "ok": True, "tokens_per_expert": tokens_per_expert.tolist()})
out_dir = os.environ.get("RESULT_DIR")
if out_dir:  # one file per rank: the ranks' stdout lines may interleave
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write(result)
else:
    print(result)
dist.destroy_process_group()

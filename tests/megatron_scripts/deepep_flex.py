"""Megatron's own DeepEP path (fused_a2a, as the flex dispatcher calls it) on the drop-in.

Run with ``torchrun --nproc-per-node 2 -m uccl_ep_megatron.run --deep-ep-compat deepep_flex.py``
on CPU (gloo, reference backend). Checks dispatch -> combine of Megatron's FusedDispatch /
FusedCombine against the closed form and reports one JSON object per rank.
"""

import datetime
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
result = json.dumps({"rank": rank, "ok": True, "tokens_per_expert": tokens_per_expert.tolist()})
out_dir = os.environ.get("RESULT_DIR")
if out_dir:  # one file per rank: the ranks' stdout lines may interleave
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write(result)
else:
    print(result)
dist.destroy_process_group()

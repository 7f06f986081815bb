"""One Megatron ``MoELayer`` under the dispatcher the command line selects, against references.

Run as Megatron-LM is run, through the plugin's entry point (CPU: gloo, ``reference`` backend;
``--device cuda``: NCCL, one GPU per rank):

    torchrun --nproc-per-node 2 -m uccl_ep_megatron.run --deep-ep-compat \
        moe_layer_equivalence.py --moe-token-dispatcher-type flex \
        --moe-flex-dispatcher-backend deepep [--moe-router-dtype fp64] \
        [--moe-router-padding-for-quantization] [--reference allgather]

The flags are parsed by an argparse parser that declares them the way Megatron-LM does (with
hard-coded ``choices``), so the plugin's argument hooks are exercised too. Every layer is built
from the same ``TransformerConfig`` fields, bar the dispatcher, with identical weights, and runs
forward and backward on identical inputs. Compared with the first layer (the one under test):

* each ``--reference`` dispatcher's layer (megatron-core's own ``allgather`` on CPU; on a GPU
  also ``alltoall``), outputs and every gradient (input, router, experts);
* a layer-free oracle computed here from the router's own decisions: each token's output is
  the probability-weighted sum of its chosen experts applied to it (all ranks' tokens, so the
  experts of every EP rank are checked).

On CPU, ``torch.cuda.current_device()`` (where megatron-core's router and ``allgather``
dispatcher put tensors) answers the CPU; everything else is megatron-core's own code.

``moe_router_padding_for_quantization`` needs FP8/FP4, which need Transformer Engine to build a
config; as in Megatron-LM's FP8 runs the recipe is set on the built config (``fp8_recipe``
delayed: alignment 16). Nothing runs in FP8: the local experts ignore the recipe.

Writes ``rank{N}.json`` to ``RESULT_DIR`` (or prints it): dispatcher classes, Buffer backend,
``tokens_per_expert``, worst differences. Exits non-zero on any mismatch.
"""

import dataclasses
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from megatron_lm_014 import parser_014

from uccl_ep_megatron.megatron_plugin import add_arguments

parser, group = parser_014()
group.add_argument("--moe-flex-dispatcher-backend", default="deepep")
group.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
group.add_argument("--moe-router-padding-for-quantization", action="store_true")
parser.add_argument("--reference", action="append", default=[])
parser.add_argument("--tokens", type=int, default=24)
parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
parser.add_argument("--tol", type=float, default=1e-5, help="max abs difference allowed")
# A script of one's own passes the plugin's flags as Megatron-LM's extra_args_provider would.
add_arguments(parser)
args = parser.parse_args()

os.environ.setdefault("UCCL_EP_BACKEND", "reference")
cuda = args.device == "cuda"
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
else:
    # megatron-core allocates on torch.cuda.current_device() (the router moves its weight
    # there, allgather allocates its output there); on CPU that device is the CPU.
    torch.cuda.current_device = lambda: "cpu"
dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=90))
rank, world = dist.get_rank(), dist.get_world_size()

from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel.layers import (  # noqa: E402
    ColumnParallelLinear,
    RowParallelLinear,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.mlp import MLPSubmodules  # noqa: E402
from megatron.core.transformer.moe.experts import SequentialMLP  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
if cuda:
    model_parallel_cuda_manual_seed(123)
FIELDS = {f.name for f in dataclasses.fields(TransformerConfig)}
HIDDEN, EXPERTS, TOPK = 32, 4 * world, 2
dtype = torch.float64 if args.moe_router_dtype == "fp64" else torch.float32


def build(dispatcher: str) -> MoELayer:
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=16,
        add_bias_linear=False,
        use_cpu_initialization=not cuda,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=world,
        moe_router_load_balancing_type="none",
    )
    if args.moe_router_dtype is not None:
        kwargs["moe_router_dtype"] = args.moe_router_dtype
    if dispatcher == "flex" and "moe_flex_dispatcher_backend" in FIELDS:
        kwargs["moe_flex_dispatcher_backend"] = args.moe_flex_dispatcher_backend
    elif dispatcher == "flex":  # 0.14/0.15 name the DeepEP backend with a switch
        kwargs["moe_enable_deepep"] = True
    config = TransformerConfig(**kwargs)
    if args.moe_router_padding_for_quantization:
        for name in ("moe_router_padding_for_quantization", "moe_router_padding_for_fp8"):
            if name in FIELDS:
                setattr(config, name, True)
        config.fp8, config.fp8_recipe = "e4m3", "delayed"
    experts = ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    layer = MoELayer(config, MoESubmodules(experts=experts), layer_number=1)
    return layer.cuda() if cuda else layer


def run(layer: MoELayer, x: torch.Tensor, grad_out: torch.Tensor):
    """Forward + backward; returns output, input grad, param grads and the router's decisions."""
    decisions = {}

    def keep(_module, _inputs, output):
        probs, routing_map = output
        decisions["probs"], decisions["map"] = probs.detach(), routing_map.detach()

    hook = layer.router.register_forward_hook(keep)
    x = x.clone().requires_grad_(True)
    out, bias = layer(x)
    hook.remove()
    assert bias is None
    (out * grad_out).sum().backward()
    grads = {
        n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        for n, p in layer.named_parameters()
    }
    tpe = getattr(layer.token_dispatcher, "tokens_per_expert", None)
    if tpe is None and hasattr(layer.token_dispatcher, "_comm_manager"):
        tpe = layer.token_dispatcher._comm_manager.tokens_per_expert
    return out.detach(), x.grad.detach(), grads, decisions, tpe


def worst(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


tested_type = args.moe_token_dispatcher_type
torch.manual_seed(1000 + rank)  # experts differ per EP rank; router identical after broadcast
layers = {tested_type: build(tested_type)}
for name in args.reference:
    layers[name] = build(name)
    layers[name].load_state_dict(layers[tested_type].state_dict())
for p in layers[tested_type].router.parameters():  # the router is replicated over EP
    dist.broadcast(p.data, src=0)
for name in args.reference:
    layers[name].router.load_state_dict(layers[tested_type].router.state_dict())

device = torch.device("cuda" if cuda else "cpu")
g = torch.Generator().manual_seed(77 + rank)
x = torch.randn(args.tokens // 2, 2, HIDDEN, generator=g).to(device)
grad_out = torch.randn(x.shape, generator=g).to(device)
results = {name: run(layer, x, grad_out) for name, layer in layers.items()}
out, x_grad, grads, decisions, tpe = results[tested_type]
# --moe-uccl-ep-metrics: every layer's dispatcher was timed, forward and backward.
from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics  # noqa: E402

metrics = dispatch_metrics.collect().summary() if dispatch_metrics.is_enabled() else None
report = {
    "rank": rank,
    "megatron_core": __import__("megatron.core", fromlist=["x"]).__version__,
    "dispatcher": type(layers[tested_type].token_dispatcher).__name__,
    "deep_ep_module": getattr(sys.modules.get("deep_ep"), "__doc__", None),
    "tokens_per_expert": [int(t) for t in tpe] if tpe is not None else None,
    "metrics": metrics,
    "instrumented": {
        name: bool(getattr(lay.token_dispatcher, "_dispatch_metrics_instrumented", False))
        for name, lay in layers.items()
    },
    "checks": {},
}
failures = []


def check(name: str, a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    diff = worst(a, b)
    report["checks"][name] = diff
    if a.shape != b.shape or not diff <= tol:
        failures.append(f"{name}: shapes {tuple(a.shape)} vs {tuple(b.shape)}, max diff {diff}")


TOL = args.tol
for name in args.reference:
    r_out, r_x_grad, r_grads, r_decisions, _ = results[name]
    check(f"{name}/routing_map", decisions["map"].int(), r_decisions["map"].int(), 0)
    check(f"{name}/output", out, r_out, TOL)
    check(f"{name}/input_grad", x_grad, r_x_grad, TOL)
    for pname, grad in grads.items():
        check(f"{name}/grad/{pname}", grad, r_grads[pname], TOL)

# Oracle without any dispatcher, differentiable end to end: every rank's tokens (the router's
# own probabilities, recomputed here from a copy of the input) through this rank's experts,
# summed over ranks with autograd-aware all-reduces, so the input, router and expert gradients
# of the whole layer come out of plain autograd.
layer = layers[tested_type]
layer.zero_grad(set_to_none=True)
ref_x = x.clone().requires_grad_(True)
flat_x = ref_x.reshape(-1, HIDDEN)
tokens = flat_x.shape[0]
probs, routing_map = layer.router(ref_x)
probs = probs.reshape(tokens, EXPERTS)
routing_map = routing_map.reshape(tokens, EXPERTS)
slots_x = torch.zeros(world, tokens, HIDDEN, device=device, dtype=flat_x.dtype)
slots_p = torch.zeros(world, tokens, EXPERTS, device=device, dtype=probs.dtype)
slots_x = slots_x.index_copy(0, torch.tensor([rank], device=device), flat_x[None])
slots_p = slots_p.index_copy(0, torch.tensor([rank], device=device), probs[None])
all_x = dist_fn.all_reduce(slots_x)
all_p = dist_fn.all_reduce(slots_p)
all_m = torch.zeros(world, tokens, EXPERTS, device=device, dtype=torch.int32)
all_m[rank] = routing_map.int()
dist.all_reduce(all_m)
local = EXPERTS // world
contrib = torch.zeros(world, tokens, HIDDEN, device=device, dtype=flat_x.dtype)
for le in range(local):
    e = rank * local + le
    for src in range(world):
        sel = all_m[src][:, e].nonzero().flatten()
        if sel.numel():
            y, _ = layer.experts.local_experts[le](all_x[src][sel], all_p[src][sel, e])
            contrib = contrib.index_put((torch.full_like(sel, src), sel), y.to(contrib.dtype), True)
ref_out = dist_fn.all_reduce(contrib)[rank].reshape(x.shape)
(ref_out * grad_out).sum().backward()
check("oracle/routing_map", decisions["map"].int(), routing_map.int(), 0)
check("oracle/output", out, ref_out.detach(), TOL)
check("oracle/input_grad", x_grad, ref_x.grad, TOL)
for pname, param in layer.named_parameters():
    ref_grad = param.grad if param.grad is not None else torch.zeros_like(param)
    check(f"oracle/grad/{pname}", grads[pname], ref_grad, TOL)
zero = sorted(n for n, grad in grads.items() if not grad.abs().sum() > 0)
if zero:
    failures.append(f"gradients are all zero for {zero}: the comparison would prove nothing")
probs_dtype = {"fp64": torch.float64, "fp32": torch.float32}.get(args.moe_router_dtype)
if probs_dtype is not None and decisions["probs"].dtype != probs_dtype:
    failures.append(f"router probs are {decisions['probs'].dtype}, expected {probs_dtype}")
if args.moe_router_padding_for_quantization and tpe is not None:
    if any(int(t) % 16 for t in tpe):
        failures.append(f"tokens_per_expert {list(map(int, tpe))} not padded to 16")
report["ok"] = not failures
report["failures"] = failures
text = json.dumps(report)
out_dir = os.environ.get("RESULT_DIR")
if out_dir:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        f.write(text)
else:
    print(text)
ps.destroy_model_parallel()
dist.destroy_process_group()
sys.exit(1 if failures else 0)

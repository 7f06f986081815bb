"""One Megatron MoE layer, built the same way by ``bench layer`` and the GPU tests
(``tests/gpu/test_megatron_gpu.py``, ``tests/gpu/test_dispatcher_modes_gpu.py``), so that
dispatchers are compared on identical layers: same config apart from the dispatcher, weights
copied from one to the other, Megatron's ``SequentialMLP`` experts or ``TorchGroupedMLP``
(PyTorch's grouped_mm), no Transformer Engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LayerShape:
    """The MoE block: sizes and router.

    Attributes:
        hidden: model width.
        num_experts: routed experts (all ranks together).
        topk: experts per token.
        ffn: FFN width of one expert (SwiGLU when ``gated``).
        shared_ffn: FFN width of the shared expert; 0 = none.
        deepseek_router: DeepSeek-V3's router (sigmoid scores with expert bias, 8 groups of which
            4 are kept, scaling 2.5); otherwise Megatron's default softmax top-k.
        gated: SwiGLU experts (``gated_linear_unit`` with SiLU); otherwise GeLU.
    """

    hidden: int
    num_experts: int
    topk: int
    ffn: int
    shared_ffn: int = 0
    deepseek_router: bool = False
    gated: bool = True


# DeepSeek-V3's MoE block.
DEEPSEEK_V3 = LayerShape(7168, 256, 8, 2048, shared_ffn=2048, deepseek_router=True)
# Issue 14's workload (hidden 2048, 64 experts, top-8; the FFN width was not recorded there).
ISSUE14 = LayerShape(2048, 64, 8, 2048)


def layer_config(shape: LayerShape, dispatcher: str, ep: int, **overrides: Any) -> Any:
    """The layer's ``TransformerConfig`` (BF16, fp32 router, no aux loss) plus ``overrides``."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs: dict[str, Any] = dict(
        num_layers=1,
        hidden_size=shape.hidden,
        num_attention_heads=max(1, shape.hidden // 128),
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.topk,
        moe_ffn_hidden_size=shape.ffn,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        gated_linear_unit=shape.gated,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        expert_model_parallel_size=ep,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=False,
    )
    if shape.gated:
        kwargs["activation_func"] = F.silu
    if shape.shared_ffn:
        kwargs["moe_shared_expert_intermediate_size"] = shape.shared_ffn
    if shape.deepseek_router:
        kwargs.update(
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_num_groups=8,
            moe_router_group_topk=4,
            moe_router_topk_scaling_factor=2.5,
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


EXPERTS = ("SequentialMLP", "TorchGroupedMLP")


def build_layer(
    shape: LayerShape, dispatcher: str, ep: int, experts: str = "SequentialMLP", **overrides: Any
) -> Any:
    """A ``MoELayer`` on the current CUDA device (Megatron's model parallel state must be set);
    ``experts`` is one of ``EXPERTS``."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if experts not in EXPERTS:
        raise ValueError(f"experts {experts!r}: use one of {EXPERTS}")
    spec = get_moe_module_spec(use_te=False, num_experts=shape.num_experts, moe_grouped_gemm=False)
    # A ModuleSpec up to megatron-core 0.18, a functools.partial of MoELayer from 0.19.
    submodules = spec.submodules if hasattr(spec, "submodules") else spec.keywords["submodules"]
    if experts == "TorchGroupedMLP":
        from uccl_ep_megatron.token_dispatcher.grouped_experts import with_grouped_experts

        submodules = with_grouped_experts(submodules)
    config = layer_config(shape, dispatcher, ep, **overrides)
    return MoELayer(config, submodules, layer_number=1).cuda()


def copy_weights(src: Any, dst: Any) -> None:
    """Give ``dst`` the parameters and buffers (expert bias ...) of ``src``. From a
    ``SequentialMLP`` layer to a ``TorchGroupedMLP`` one the experts' weights are stacked."""
    from uccl_ep_megatron.token_dispatcher.grouped_experts import TorchGroupedMLP

    state = src.state_dict()
    grouped = isinstance(dst.experts, TorchGroupedMLP) and not isinstance(
        src.experts, TorchGroupedMLP
    )
    if grouped:
        state = {k: v for k, v in state.items() if not k.startswith("experts.")}
    result = dst.load_state_dict(state, strict=not grouped)
    unexpected = [k for k in result.missing_keys if not (grouped and k.startswith("experts."))]
    if unexpected or result.unexpected_keys:
        raise RuntimeError(f"layers differ: {result}")
    if grouped:
        dst.experts.load_sequential_state(src.experts)
    buffers = dict(dst.named_buffers())
    for name, buf in src.named_buffers():
        if name in buffers:
            buffers[name].copy_(buf)


def expert_grads(layer: Any) -> dict[str, torch.Tensor]:
    """The experts' weight gradients as stacked ``[L, out, in]`` tensors (``fc1``, ``fc2``),
    whichever expert module the layer has."""
    experts = layer.experts
    if hasattr(experts, "weight1"):
        return {"fc1": experts.weight1.grad, "fc2": experts.weight2.grad}

    def grad(w: torch.Tensor) -> torch.Tensor:  # an expert that got no row may have none
        return w.grad if w.grad is not None else torch.zeros_like(w)

    return {
        name: torch.stack(
            [grad(getattr(e, f"linear_{name}").weight) for e in experts.local_experts]
        )
        for name in ("fc1", "fc2")
    }


def fwd_bwd(layer: Any, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of ``layer`` on a fresh leaf copy of ``x``: (output, input grad)."""
    x = x.detach().clone().requires_grad_(True)
    out, bias = layer(x)
    if bias is not None:
        raise RuntimeError("the MoE layer returned a bias; build it with add_bias_linear=False")
    out.backward(grad)
    return out.detach(), x.grad.detach()


# Runtime calls that make the host wait for the GPU, and device copies the host waits on.
SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "hipStreamSynchronize",
    "hipDeviceSynchronize",
    "hipEventSynchronize",
)


def _profiled_syncs(fn: Any, repeat: int) -> tuple[int, int]:
    from torch.profiler import ProfilerActivity, profile

    from uccl_ep_megatron.backends.intranode.status import host_waits

    torch.cuda.synchronize()
    waits = host_waits()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
    syncs, copies = host_waits() - waits, 0
    for event in prof.events():
        name = event.name
        if name in SYNC_CALLS:
            syncs += 1
        elif "Memcpy DtoH" in name or "Memcpy DeviceToHost" in name:
            copies += 1
    return syncs, copies


def count_host_syncs(fn: Any, repeat: int = 1) -> dict[str, float]:
    """Host syncs per call of ``fn`` under ``torch.profiler``: runtime synchronize calls plus
    uccl_ep's host waits on mapped memory (``host_waits``: an exact dispatch's count read), and
    device-to-host copies (``Memcpy DtoH`` on the device timeline, each of which a host read
    such as ``.item()``/``.tolist()`` waits for). Averaged over ``repeat`` calls, less what a
    profiled no-op records: on a GPU every variant, ``alltoall`` included,
    showed one sync per profiled run beyond its per-layer count."""
    base_syncs, base_copies = _profiled_syncs(lambda: None, 1)
    syncs, copies = _profiled_syncs(fn, repeat)
    return {
        "sync_calls": max(0, syncs - base_syncs) / repeat,
        "dtoh_copies": max(0, copies - base_copies) / repeat,
    }

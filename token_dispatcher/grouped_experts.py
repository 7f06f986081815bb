"""``TorchGroupedMLP``: Megatron-Core's routed experts on PyTorch's grouped GEMM.

Where Transformer Engine is missing, megatron-core offers ``SequentialMLP`` (one GEMM pair per
local expert, launched from Python, and a ``tokens_per_expert.tolist()``) or the legacy
``GroupedMLP`` (the ``grouped_gemm`` package, gone from 0.17). This module runs all local
experts in two ``torch.nn.functional.grouped_mm`` calls (``torch._grouped_mm`` on releases
without the public name), bf16, with its autograd. It takes the dispatcher's expert-major rows
and per-expert counts as a CPU or GPU tensor: GPU counts become offsets on the GPU; CPU counts
(host data already) are copied up from pinned memory without a wait, so sync-free dispatch
stays sync-free.

Weights are stored as Megatron's ``SequentialMLP`` experts hold theirs, stacked: ``weight1``
``[L, F (x2 with GLU), H]`` (``linear_fc1.weight`` of each expert), ``weight2`` ``[L, H, F]``
(``linear_fc2.weight``); ``load_sequential_state`` copies a ``SequentialMLP``'s weights in. The
math is ``MLP.forward``'s unfused path: fc1, GLU (gate half first), times the routing
probability in fp32, cast back, fc2. On GPUs the SwiGLU and the probability run as one fused
kernel each way (``csrc/kernels/glu.h``) with the torch ops' roundings; rows past the last
segment (sync-free padding) are skipped. Expert tensor parallelism is not supported (ETP must be 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from uccl_ep_megatron.token_dispatcher.permute_fused import _c, fused_available

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError

NAME = "TorchGroupedMLP"


def _grouped_mm_fn() -> Any:
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.cache
def _probe(device_type: str, index: int | None) -> str | None:
    """A small grouped GEMM forward and backward with the forward's weight layout, checked
    against plain matmuls: the answer to "does grouped_mm run here", asked once per device."""
    fn = _grouped_mm_fn()
    if fn is None:
        return f"torch {torch.__version__} has no grouped_mm (needs torch >= 2.8)"
    device = torch.device(device_type, index)
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(24, 16, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(2, 16, 16, device=device, generator=g).to(torch.bfloat16)
        w.requires_grad_(True)
        offs = torch.tensor([8, 24], dtype=torch.int32, device=device)
        out = fn(a, w.transpose(1, 2), offs=offs)  # [G, N, K] weights, as TorchGroupedMLP's
        out.backward(torch.ones_like(out))
        ref = torch.cat([a[:8].float() @ w[0].float().t(), a[8:].float() @ w[1].float().t()])
        ref_grad = torch.stack([a[:8].float().sum(0), a[8:].float().sum(0)])
        ref_grad = ref_grad.unsqueeze(1).expand(2, 16, 16)
        if not torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-1) or not torch.allclose(
            w.grad.float(), ref_grad, rtol=2e-2, atol=2e-1
        ):
            return f"grouped_mm on {device} gives wrong results"
    except (RuntimeError, NotImplementedError) as exc:
        return f"grouped_mm does not run on {device} with bf16: {exc}"
    return None


def grouped_mm_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why ``TorchGroupedMLP`` cannot run on ``device`` (default: the current CUDA device, else
    the CPU), or ``None`` when it can. Checked once per device by a small bf16 grouped GEMM
    compared against plain matmuls."""
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else "cpu"
        )
    device = torch.device(device)
    index = device.index if device.type != "cpu" else None
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _probe(device.type, index)


def group_offsets(tokens_per_expert: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """int32 end offsets of the expert segments on ``device``, without waiting for the GPU.

    GPU counts are summed there. CPU counts are host data: their sum is checked against ``rows``
    and the offsets go up through pinned memory with a non-blocking copy.
    """
    if tokens_per_expert.device.type != "cpu":
        return torch.cumsum(tokens_per_expert.to(device), 0, dtype=torch.int32)
    offs = torch.cumsum(tokens_per_expert.to(torch.int64), 0)
    total = int(offs[-1]) if offs.numel() else 0
    if total != rows:
        raise InvalidInputError(
            f"tokens_per_expert sums to {total} but the experts got {rows} rows; pass the "
            "dispatcher's rows and counts of the same forward"
        )
    offs = offs.to(torch.int32)
    if device.type == "cuda":
        offs = offs.pin_memory().to(device, non_blocking=True)
    return offs


def _glu_kernel_fits(cfg: Any, h: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether ``_GluProbs`` computes what ``_activation``'s torch ops would: SwiGLU with no
    clamp or offset, bf16 rows of 16-byte multiples on a GPU with the kernels, float32 probs."""
    return (
        cfg.gated_linear_unit
        and cfg.activation_func is F.silu
        and getattr(cfg, "activation_func_clamp_value", None) is None
        and not getattr(cfg, "glu_linear_offset", 0.0)
        and h.is_cuda
        and h.dtype == torch.bfloat16
        and h.dim() == 2
        and h.shape[1] % 16 == 0
        and h.is_contiguous()
        and h.data_ptr() % 16 == 0
        and probs.dtype == torch.float32
        and probs.shape == (h.shape[0],)
        and fused_available(h.device)
    )


def _glu_launch_args(h: torch.Tensor, offs: torch.Tensor) -> dict[str, int]:
    """The kernels' shared arguments: the last offset's address (the live-row bound), the row
    count and width, and the current stream."""
    return dict(
        bound=offs.data_ptr() + offs.element_size() * (offs.numel() - 1),
        rows=h.shape[0],
        ffn=h.shape[1] // 2,
        stream=torch.cuda.current_stream(h.device).cuda_stream,
    )


class _GluProbs(torch.autograd.Function):
    """``_activation``'s SwiGLU times the probabilities on the fused kernels
    (``csrc/kernels/glu.h``): the torch ops' bf16 roundings in one pass each way, and rows at or
    past the last offset (sync-free mode's padding) left zero instead of computed."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, probs: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        probs = probs.contiguous()
        offs = offs.to(torch.int32).contiguous()
        out = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
        _c().glu_probs_forward(
            h=h.data_ptr(), probs=probs.data_ptr(), out=out.data_ptr(), **_glu_launch_args(h, offs)
        )
        ctx.save_for_backward(h, probs, offs)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        h, probs, offs = ctx.saved_tensors
        grad_out = grad_out.to(h.dtype).contiguous()
        grad_h = torch.empty_like(h)
        grad_probs = torch.empty_like(probs)
        _c().glu_probs_backward(
            grad_out=grad_out.data_ptr(),
            h=h.data_ptr(),
            probs=probs.data_ptr(),
            grad_h=grad_h.data_ptr(),
            grad_probs=grad_probs.data_ptr(),
            **_glu_launch_args(h, offs),
        )
        return grad_h, grad_probs, None


def _init_weight(weight: torch.Tensor, init_method: Any, partition_dim: int, on_gpu: bool) -> None:
    from megatron.core.tensor_parallel.layers import (
        _initialize_affine_weight_gpu,
        set_tensor_model_parallel_attributes,
    )

    if on_gpu:  # under the expert-parallel RNG, as megatron-core's expert weights
        _initialize_affine_weight_gpu(
            weight, init_method, partition_dim=partition_dim, is_expert=True
        )
        return
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
    with torch.no_grad():
        init_method(weight)


class TorchGroupedMLP(MegatronModule):
    """Routed experts on ``grouped_mm`` (see the module docstring).

    Built by ``MoELayer`` like megatron-core's expert modules:
    ``TorchGroupedMLP(num_local_experts, config, submodules=None, pg_collection=..., name=...)``.

    Raises:
        UnsupportedError: grouped_mm cannot run here, expert TP > 1, biases, an activation
            other than SiLU/GeLU, or widths that are not multiples of 8 (16 bytes of bf16).
    """

    def __init__(
        self,
        num_local_experts: int,
        config: Any,
        submodules: Any = None,
        pg_collection: Any = None,
        name: str | None = None,
        model_comm_pgs: Any = None,
    ) -> None:
        # ``name``: megatron-core 0.19+ passes the module's dotted name to every expert module;
        # 0.14 names the process groups ``model_comm_pgs``.
        super().__init__(config=config)
        self.module_name = name
        pg_collection = pg_collection if pg_collection is not None else model_comm_pgs
        self.num_local_experts = num_local_experts
        on_gpu = torch.cuda.is_available() and not config.use_cpu_initialization
        device = torch.cuda.current_device() if on_gpu else "cpu"
        self._check(config, pg_collection, device)
        self.ep_group = getattr(pg_collection, "ep", None)
        self.dp_group = getattr(pg_collection, "expt_dp", None)
        ffn = config.moe_ffn_hidden_size
        fc1_out = ffn * (2 if config.gated_linear_unit else 1)
        kw = dict(dtype=config.params_dtype, device=device)
        self.weight1 = torch.nn.Parameter(
            torch.empty(num_local_experts, fc1_out, config.hidden_size, **kw)
        )
        self.weight2 = torch.nn.Parameter(
            torch.empty(num_local_experts, config.hidden_size, ffn, **kw)
        )
        if config.perform_initialization:
            _init_weight(self.weight1, config.init_method, 1, on_gpu)
            _init_weight(self.weight2, config.output_layer_init_method, 2, on_gpu)
        expert_parallel = config.expert_model_parallel_size > 1
        for w in (self.weight1, self.weight2):
            # Megatron's DDP reduces expert weights over the expert-data-parallel group only.
            w.allreduce = not expert_parallel

    def _check(self, config: Any, pg_collection: Any, device: Any) -> None:
        why = grouped_mm_unavailable(
            torch.device("cuda", device) if isinstance(device, int) else device
        )
        if why is not None:
            raise UnsupportedError(f"{NAME}: {why}; use SequentialMLP (or TEGroupedMLP with TE)")
        etp = getattr(getattr(pg_collection, "expt_tp", None), "size", lambda: 1)()
        if etp != 1 or config.expert_tensor_parallel_size not in (None, 1):
            raise UnsupportedError(
                f"{NAME} runs whole experts: expert tensor parallel size must be 1, got "
                f"{config.expert_tensor_parallel_size}"
            )
        if config.add_bias_linear:
            raise UnsupportedError(f"{NAME} has no biases: set add_bias_linear=False")
        if config.activation_func not in (F.silu, F.gelu):
            raise UnsupportedError(
                f"{NAME}: activation {config.activation_func!r}; use silu (SwiGLU) or gelu"
            )
        for name in ("hidden_size", "moe_ffn_hidden_size"):
            if getattr(config, name) % 8:
                raise UnsupportedError(
                    f"{NAME}: {name}={getattr(config, name)} must be a multiple of 8 (grouped_mm "
                    "needs 16-byte rows of bf16)"
                )
        if config.params_dtype != torch.bfloat16:
            raise UnsupportedError(
                f"{NAME} runs bf16 weights; params_dtype is {config.params_dtype}"
            )

    def _activation(
        self, h: torch.Tensor, probs: torch.Tensor, offs: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.config
        if offs is not None and _glu_kernel_fits(cfg, h, probs):
            return _GluProbs.apply(h, probs, offs)
        if cfg.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            clamp = getattr(cfg, "activation_func_clamp_value", None)
            if clamp is not None:
                gate = gate.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            offset = getattr(cfg, "glu_linear_offset", 0.0)
            h = cfg.activation_func(gate) * (linear + offset if offset else linear)
        else:
            h = cfg.activation_func(h)
        return (h * probs.unsqueeze(-1)).to(h.dtype)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """``(rows [R, H], tokens_per_expert [L], probs [R])`` -> ``(out [R, H], None)``."""
        x = permuted_local_hidden_states
        if x.dtype != torch.bfloat16:
            raise UnsupportedError(f"{NAME} runs bf16 activations, got {x.dtype}")
        if tokens_per_expert.numel() != self.num_local_experts:
            raise InvalidInputError(
                f"tokens_per_expert has {tokens_per_expert.numel()} entries for "
                f"{self.num_local_experts} local experts"
            )
        if self.config.moe_apply_probs_on_input:
            x = (permuted_probs.unsqueeze(-1) * x).to(x.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        if x.shape[0] == 0:  # no row here: plain matmuls keep the graph (zero gradients)
            h = self._activation(x @ self.weight1[0].t(), permuted_probs)
            return h @ self.weight2[0].t(), None
        mm = _grouped_mm_fn()
        offs = group_offsets(tokens_per_expert, x.shape[0], x.device)
        h = mm(x, self.weight1.transpose(1, 2), offs=offs)
        h = self._activation(h, permuted_probs, offs)
        return mm(h, self.weight2.transpose(1, 2), offs=offs), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed weight-gradient pass)."""

    # ---- checkpoints and weight exchange ------------------------------------------------------
    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None
    ):
        """Both weights sharded along the expert axis over the EP group (global expert order),
        replicated over the expert-data-parallel group."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        ep_size = self.ep_group.size() if self.ep_group is not None else 1
        dp_rank = self.dp_group.rank() if self.dp_group is not None else 0
        axis = len(sharded_offsets)
        out = {}
        for name in ("weight1", "weight2"):
            key = f"{prefix}{name}"
            out[key] = ShardedTensor.from_rank_offsets(
                key,
                getattr(self, name),
                *sharded_offsets,
                (axis, ep_rank, ep_size),
                replica_id=(0, 0, dp_rank),
                prepend_axis_num=axis,
            )
        return out

    @torch.no_grad()
    def load_sequential_state(self, sequential: Any) -> None:
        """Copy the weights of a ``SequentialMLP`` with the same experts (tests, conversion)."""
        experts = list(sequential.local_experts)
        if len(experts) != self.num_local_experts:
            raise InvalidInputError(
                f"SequentialMLP has {len(experts)} experts, this module {self.num_local_experts}"
            )
        for i, expert in enumerate(experts):
            self.weight1[i].copy_(expert.linear_fc1.weight)
            self.weight2[i].copy_(expert.linear_fc2.weight)


def experts_spec() -> Any:
    """The ``ModuleSpec`` of the experts of an MoE layer spec: ``TorchGroupedMLP``."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=TorchGroupedMLP)


def with_grouped_experts(submodules: Any) -> Any:
    """``MoESubmodules`` with the experts replaced by ``TorchGroupedMLP`` (others kept)."""
    return dataclasses.replace(submodules, experts=experts_spec())


def _moe_submodules_holder(mlp: Any) -> tuple[Any, str] | None:
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    # A ModuleSpec up to megatron-core 0.18, a functools.partial of MoELayer from 0.19.
    if isinstance(getattr(mlp, "submodules", None), MoESubmodules):
        return mlp, "submodules"
    keywords = getattr(mlp, "keywords", None)
    if isinstance(keywords, dict) and isinstance(keywords.get("submodules"), MoESubmodules):
        return keywords, "submodules"
    return None


def use_grouped_experts(block_spec: Any) -> int:
    """Point every MoE layer of a decoder block spec (or of one layer spec) at
    ``TorchGroupedMLP``, in place; returns the number of MoE layer specs changed."""
    layers = getattr(block_spec, "layer_specs", None) or [block_spec]
    changed = 0
    for layer in layers:
        holder = _moe_submodules_holder(getattr(getattr(layer, "submodules", None), "mlp", None))
        if holder is None:
            continue
        obj, key = holder
        if isinstance(obj, dict):
            obj[key] = with_grouped_experts(obj[key])
        else:
            setattr(obj, key, with_grouped_experts(getattr(obj, key)))
        changed += 1
    return changed


__all__ = [
    "NAME",
    "TorchGroupedMLP",
    "experts_spec",
    "group_offsets",
    "grouped_mm_unavailable",
    "use_grouped_experts",
    "with_grouped_experts",
]

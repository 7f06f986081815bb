"""Parameter counts and model FLOPs of a recipe's architecture (DeepSeek-V3 family).

Counted from the architecture, layer by layer, the way the weights are laid out in the
released DeepSeek-V3 checkpoint:

- attention: MLA (``q_a`` + norm + ``q_b`` or a plain ``q`` projection, ``kv_a`` + norm,
  ``kv_b``, ``o``) or standard multi-head / grouped-query attention (``qkv`` + ``o``);
- MLP: SwiGLU (3 matrices) or GELU (2), dense (``ffn_hidden_size``) in the first
  ``first_k_dense_layers`` layers, MoE in the rest: router (+ expert bias), routed experts,
  shared expert;
- RMSNorm/LayerNorm weights, input embedding, output head (untied) and final norm;
- MTP: per depth an ``eh_proj`` (2h -> h), two input norms, one MoE transformer layer and a
  final norm; embedding and output head are shared with the main model (Megatron's layout).

Totals exclude MTP, as published ("671B total"); ``mtp_params`` is reported separately.
Active parameters are those one token's forward pass multiplies with: every weight except the
routed experts not selected (``num_experts - topk`` per MoE layer) and the input embedding
table (a lookup, not a matmul).

Model FLOPs per token (training = forward + backward = 3x forward; a multiply-add = 2 FLOPs):
every matmul above (MLA projections, MLP/expert GEMMs with top-k routed + shared experts,
router, logits), plus causal attention scores: QK^T and AV average ``seq_length / 2`` keys per
query (``2 * heads * (qk_dim + v_dim) * seq/2``), plus MTP (``eh_proj``, its layer, its
logits). Norms, softmax, rotary and the loss are not counted (they are not matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of one architecture (integers, not rounded)."""

    attention_per_layer: int
    dense_mlp_per_layer: int
    moe_per_layer_total: int
    moe_per_layer_active: int
    embedding: int
    output: int
    total: int
    active: int
    mtp_params: int


def _g(model: dict[str, Any], key: str, default: int = 0) -> int:
    v = model.get(key)
    return int(default if v is None else v)


def attention_params(model: dict[str, Any]) -> int:
    """Weights of one attention block (projections and MLA's latent norms)."""
    h = _g(model, "hidden_size")
    heads = _g(model, "num_attention_heads")
    if model.get("multi_latent_attention"):
        q_lora = _g(model, "q_lora_rank")
        kv_lora = _g(model, "kv_lora_rank")
        nope = _g(model, "qk_head_dim")
        rope = _g(model, "qk_pos_emb_head_dim")
        v = _g(model, "v_head_dim")
        q_out = heads * (nope + rope)
        q = h * q_lora + q_lora + q_lora * q_out if q_lora else h * q_out
        kv = h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v)
        return q + kv + heads * v * h
    head_dim = _g(model, "kv_channels") or h // heads
    groups = _g(model, "num_query_groups") or heads
    return h * head_dim * (heads + 2 * groups) + heads * head_dim * h


def _mlp(model: dict[str, Any], ffn: int) -> int:
    h = _g(model, "hidden_size")
    return (3 if model.get("swiglu") else 2) * h * ffn


def param_counts(model: dict[str, Any]) -> ParamCounts:
    """Parameter counts of a recipe's ``model`` section (see the module docstring)."""
    h = _g(model, "hidden_size")
    layers = _g(model, "num_layers")
    if h <= 0 or layers <= 0:
        raise InvalidInputError(f"model needs hidden_size and num_layers > 0, got {h}, {layers}")
    norm = h  # RMSNorm weight; LayerNorm adds a bias
    if model.get("normalization") == "LayerNorm":
        norm = 2 * h
    attn = attention_params(model)
    experts = _g(model, "num_experts")
    dense_layers = _g(model, "first_k_dense_layers") if experts else layers
    moe_layers = layers - dense_layers
    dense = attn + _mlp(model, _g(model, "ffn_hidden_size")) + 2 * norm
    moe_total = moe_active = 0
    if experts:
        expert = _mlp(model, _g(model, "moe_ffn_hidden_size"))
        shared = _mlp(model, _g(model, "moe_shared_expert_intermediate_size"))
        router = experts * h + (experts if model.get("moe_router_enable_expert_bias") else 0)
        base = attn + shared + router + 2 * norm
        moe_total = base + experts * expert
        moe_active = base + _g(model, "moe_router_topk") * expert
    vocab = _g(model, "vocab_size")
    embedding = vocab * h
    output = vocab * h if model.get("untie_embeddings_and_output_weights") else 0
    total = dense_layers * dense + moe_layers * moe_total + embedding + output + norm
    # A lookup row is touched, not multiplied: the input table is not "activated".
    active = dense_layers * dense + moe_layers * moe_active + (output or embedding) + norm
    mtp_layer = moe_total if experts else dense
    mtp = _g(model, "mtp_num_layers") * (2 * h * h + 2 * norm + mtp_layer + norm)
    return ParamCounts(
        attention_per_layer=attn,
        dense_mlp_per_layer=dense - attn - 2 * norm,
        moe_per_layer_total=moe_total,
        moe_per_layer_active=moe_active,
        embedding=embedding,
        output=output,
        total=total,
        active=active,
        mtp_params=mtp,
    )


def _attention_flops(model: dict[str, Any], seq: int) -> int:
    """Forward FLOPs of one attention block for one token (projections + causal core)."""
    heads = _g(model, "num_attention_heads")
    if model.get("multi_latent_attention"):
        qk = _g(model, "qk_head_dim") + _g(model, "qk_pos_emb_head_dim")
        v = _g(model, "v_head_dim")
        # The latent norms are elementwise; only the projection matrices are matmuls.
        proj = attention_params(model) - _g(model, "q_lora_rank") - _g(model, "kv_lora_rank")
    else:
        qk = v = _g(model, "kv_channels") or _g(model, "hidden_size") // heads
        proj = attention_params(model)
    # Causal mask: on average a query attends to seq/2 keys.
    core = 2 * heads * (qk + v) * seq // 2
    return 2 * proj + core


def _layer_flops(model: dict[str, Any], moe: bool, seq: int) -> int:
    h = _g(model, "hidden_size")
    f = _attention_flops(model, seq)
    if not moe:
        return f + 2 * _mlp(model, _g(model, "ffn_hidden_size"))
    experts = _g(model, "num_experts")
    f += 2 * h * experts  # router logits
    f += 2 * _g(model, "moe_router_topk") * _mlp(model, _g(model, "moe_ffn_hidden_size"))
    f += 2 * _mlp(model, _g(model, "moe_shared_expert_intermediate_size"))
    return f


def forward_flops_per_token(model: dict[str, Any], seq_length: int | None = None) -> int:
    """Forward model FLOPs of one token at ``seq_length`` (default: the model's)."""
    seq = int(seq_length or _g(model, "seq_length"))
    layers = _g(model, "num_layers")
    experts = _g(model, "num_experts")
    dense_layers = _g(model, "first_k_dense_layers") if experts else layers
    h = _g(model, "hidden_size")
    logits = 2 * h * _g(model, "vocab_size")
    f = dense_layers * _layer_flops(model, False, seq)
    f += (layers - dense_layers) * _layer_flops(model, bool(experts), seq)
    f += logits
    mtp = _g(model, "mtp_num_layers")
    f += mtp * (2 * (2 * h) * h + _layer_flops(model, bool(experts), seq) + logits)
    return f


def training_flops_per_token(model: dict[str, Any], seq_length: int | None = None) -> int:
    """Forward + backward model FLOPs of one token (3x forward: dX and dW each cost one)."""
    return 3 * forward_flops_per_token(model, seq_length)


def tflops_per_gpu(
    model: dict[str, Any], tokens_per_s: float, num_gpus: int, seq_length: int | None = None
) -> float:
    """Achieved model TFLOP/s per GPU at a global throughput of ``tokens_per_s``."""
    if num_gpus <= 0:
        raise InvalidInputError(f"num_gpus must be >= 1, got {num_gpus}")
    return training_flops_per_token(model, seq_length) * tokens_per_s / num_gpus / 1e12


# Dense BF16 peak TFLOP/s per GPU (vendor datasheets, no sparsity), matched in order against
# torch.cuda.get_device_name(): more specific names first ("H200" before "H20", "PCIe" first).
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H800", 989.4),
    ("H20", 148.0),
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.1),
    ("MI355X", 2516.6),
    ("MI325X", 1307.4),
    ("MI300X", 1307.4),
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """Dense BF16 peak of the GPU called ``device_name`` (``None`` when not in the table)."""
    for key, peak in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return peak
    return None


def mfu(tflops_per_gpu_achieved: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model TFLOP/s per GPU / the GPU's peak (a fraction)."""
    if peak_tflops is None:
        return None
    if not peak_tflops > 0:
        raise InvalidInputError(f"peak TFLOP/s must be > 0, got {peak_tflops}")
    return tflops_per_gpu_achieved / peak_tflops


__all__ = [
    "PEAK_BF16_TFLOPS",
    "ParamCounts",
    "attention_params",
    "forward_flops_per_token",
    "mfu",
    "param_counts",
    "peak_bf16_tflops",
    "tflops_per_gpu",
    "training_flops_per_token",
]

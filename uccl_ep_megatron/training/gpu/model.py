"""The recipe as a megatron-core model: expert path, ``TransformerConfig`` and ``GPTModel``.

The model is built from Transformer Engine's layer specs when TE is installed and from the
local (plain PyTorch) ones otherwise; megatron-core spots that assume TE are patched for the
local path (``without_transformer_engine``), and its core attention runs on PyTorch's fused
``scaled_dot_product_attention`` (``sdpa_core_attention``).
"""

from __future__ import annotations

from typing import Any

import torch

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError

# ---- experts ------------------------------------------------------------------------------
EXPERT_PATHS = ("TEGroupedMLP", "TorchGroupedMLP", "GroupedMLP", "SequentialMLP")
#: The recipe value (``model.moe_experts``) that lets ``expert_path`` choose.
AUTO_EXPERTS = "auto"


def expert_path(requested: str | None = None) -> tuple[str, str]:
    """The expert implementation to build, and why.

    ``requested`` (a recipe's ``model.moe_experts``) is one of ``EXPERT_PATHS`` or ``auto``
    (``None``). Auto picks the fastest one here: ``TEGroupedMLP`` (Transformer Engine's grouped
    GEMM) when TE imports; else ``TorchGroupedMLP`` (PyTorch's grouped_mm, bf16) when it runs
    on this GPU; else megatron-core's legacy ``GroupedMLP`` where the release still has it
    (0.14-0.16) and ``grouped_gemm`` is installed; else ``SequentialMLP``, the slowest.

    Raises:
        InvalidInputError: an unknown name.
        UnsupportedError: the requested path cannot run here (the message says why).
    """
    if requested not in (None, AUTO_EXPERTS, *EXPERT_PATHS):
        raise InvalidInputError(
            f"model.moe_experts {requested!r}: use {AUTO_EXPERTS!r} or one of {list(EXPERT_PATHS)}"
        )
    missing = _missing_reasons()
    if requested not in (None, AUTO_EXPERTS):
        if missing.get(requested):
            raise UnsupportedError(f"model.moe_experts {requested}: {missing[requested]}")
        return requested, "chosen by the recipe (model.moe_experts)"
    why = {
        "TEGroupedMLP": "Transformer Engine is installed: its grouped GEMM",
        "TorchGroupedMLP": "no Transformer Engine; PyTorch's grouped_mm runs here (bf16)",
        "GroupedMLP": "no Transformer Engine or grouped_mm; megatron-core's legacy grouped GEMM",
    }
    for path in EXPERT_PATHS[:-1]:
        if not missing.get(path):
            return path, why[path]
    return (
        "SequentialMLP",
        "one GEMM pair per local expert, the slowest path ("
        + "; ".join(f"{p}: {missing[p]}" for p in EXPERT_PATHS[:-1])
        + ")",
    )


def _missing_reasons() -> dict[str, str | None]:
    """Expert path -> why it cannot run here (``None``: it can)."""
    import dataclasses
    import importlib.util

    from megatron.core.transformer.transformer_config import TransformerConfig

    from uccl_ep_megatron.token_dispatcher.grouped_experts import grouped_mm_unavailable

    te = importlib.util.find_spec("transformer_engine") is not None
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    legacy = "moe_use_legacy_grouped_gemm" in fields
    torch_why = "no CUDA GPU" if not torch.cuda.is_available() else grouped_mm_unavailable()
    if legacy and importlib.util.find_spec("grouped_gemm") is None:
        legacy_why = "the grouped_gemm package is not installed"
    elif not legacy:
        legacy_why = "gone from this megatron-core (0.17+)"
    else:
        legacy_why = None
    return {
        "TEGroupedMLP": None if te else "Transformer Engine is not installed",
        "TorchGroupedMLP": torch_why,
        "GroupedMLP": legacy_why,
        "SequentialMLP": None,
    }


def expert_config(path: str) -> dict[str, Any]:
    """``TransformerConfig`` fields that select ``path`` (one of ``EXPERT_PATHS``).

    ``TorchGroupedMLP`` is not a megatron-core option: the config asks for ``SequentialMLP``'s
    local spec and ``build_model`` swaps the experts' module in the spec.
    """
    if path not in EXPERT_PATHS:
        raise InvalidInputError(f"expert path {path!r}: use one of {list(EXPERT_PATHS)}")
    if path in ("SequentialMLP", "TorchGroupedMLP"):
        return {"moe_grouped_gemm": False}
    if path == "GroupedMLP":
        import dataclasses

        from megatron.core.transformer.transformer_config import TransformerConfig

        if "moe_use_legacy_grouped_gemm" not in {
            f.name for f in dataclasses.fields(TransformerConfig)
        }:
            raise UnsupportedError(
                "GroupedMLP (legacy grouped GEMM) is gone from this megatron-core (0.17+): use "
                "TorchGroupedMLP, TEGroupedMLP (Transformer Engine) or SequentialMLP"
            )
        return {"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True}
    return {"moe_grouped_gemm": True}


# ---- model --------------------------------------------------------------------------------
def transformer_config(recipe, par: dict[str, int], dispatcher: str, experts: str | None = None):
    """The recipe as a megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for MLA).

    ``experts`` is one of ``EXPERT_PATHS`` (default: ``expert_path()``'s choice).
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m = recipe.model
    dense = int(m.get("first_k_dense_layers") or 0)
    kwargs: dict[str, Any] = dict(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        kv_channels=m.get("kv_channels"),
        num_query_groups=m.get("num_query_groups"),
        tensor_model_parallel_size=par["tp"],
        pipeline_model_parallel_size=par["pp"],
        expert_model_parallel_size=par["ep"],
        expert_tensor_parallel_size=par["etp"],
        context_parallel_size=par["cp"],
        sequence_parallel=bool(recipe.parallelism.get("sequence_parallel")) and par["tp"] > 1,
        normalization=m.get("normalization") or "RMSNorm",
        layernorm_epsilon=float(m.get("norm_epsilon") or 1e-6),
        gated_linear_unit=bool(m.get("swiglu")),
        activation_func=torch.nn.functional.silu if m.get("swiglu") else torch.nn.functional.gelu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(m.get("init_method_std") or 0.02),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # Fused kernels that need Apex/Transformer Engine stay off: plain PyTorch is enough.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        mtp_num_layers=m.get("mtp_num_layers"),
        mtp_loss_scaling_factor=float(m.get("mtp_loss_scaling_factor") or 0.1),
    )
    if m.get("num_experts"):
        kwargs.update(
            num_moe_experts=m["num_experts"],
            moe_layer_freq=[0] * dense + [1] * (m["num_layers"] - dense),
            moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
            moe_shared_expert_intermediate_size=m.get("moe_shared_expert_intermediate_size"),
            moe_router_topk=m["moe_router_topk"],
            moe_router_num_groups=m.get("moe_router_num_groups"),
            moe_router_group_topk=m.get("moe_router_group_topk"),
            moe_router_score_function=m.get("moe_router_score_function") or "softmax",
            moe_router_enable_expert_bias=bool(m.get("moe_router_enable_expert_bias")),
            moe_router_bias_update_rate=float(m.get("moe_router_bias_update_rate") or 1e-3),
            moe_router_topk_scaling_factor=m.get("moe_router_topk_scaling_factor"),
            moe_router_load_balancing_type=m.get("moe_router_load_balancing_type") or "aux_loss",
            moe_aux_loss_coeff=float(m.get("moe_aux_loss_coeff") or 0.0),
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=dispatcher,
            **expert_config(experts or expert_path()[0]),
        )
    if m.get("multi_latent_attention"):
        return MLATransformerConfig(
            **kwargs,
            multi_latent_attention=True,
            # For MLA this is DeepSeek-V3's RMSNorm on the q and kv latents (q_a/kv_a_layernorm).
            qk_layernorm=True,
            q_lora_rank=m.get("q_lora_rank"),
            kv_lora_rank=m["kv_lora_rank"],
            qk_head_dim=m["qk_head_dim"],
            qk_pos_emb_head_dim=m["qk_pos_emb_head_dim"],
            v_head_dim=m["v_head_dim"],
            rope_type="rope",
            rotary_base=float(m.get("rotary_base") or 10000),
        )
    return TransformerConfig(**kwargs)


def sdpa_core_attention():
    """The local path's core attention on PyTorch's ``scaled_dot_product_attention``.

    Without Transformer Engine megatron-core's local specs use ``DotProductAttention``: the
    scores of every head as a ``[b * heads, s, s]`` tensor, a separate softmax, a second bmm,
    all of it again in backward. This module takes its place (same constructor and forward
    arguments, MLA's ``k_channels``/``v_channels`` included) and runs PyTorch's fused attention
    (flash, cuDNN or memory-efficient kernels, whichever fits the head dims; causal work
    skipped). Masks follow Transformer Engine's attention: with the causal mask type the given
    mask is not read (it is the causal one); any other type applies ``attention_mask`` (True
    = masked out). GQA's key/value groups go to SDPA as they are. The softmax scale is MLA's
    ``softmax_scale``, else 1/sqrt(query head dim), as ``DotProductAttention``'s.
    """
    import contextlib

    import torch.nn.functional as F
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule

    class SdpaCoreAttention(MegatronModule):
        def __init__(
            self,
            config: Any,
            layer_number: int,
            attn_mask_type: Any,
            attention_type: str,
            attention_dropout: float | None = None,
            softmax_scale: float | None = None,
            k_channels: int | None = None,
            v_channels: int | None = None,
            cp_comm_type: str | None = None,
            pg_collection: Any = None,
            **_: Any,
        ) -> None:
            super().__init__(config=config)
            if config.context_parallel_size != 1:
                raise UnsupportedError(
                    "context parallelism needs Transformer Engine's attention; set "
                    "parallelism.context_parallel_size to 1"
                )
            if getattr(config, "window_size", None) is not None:
                raise UnsupportedError(
                    f"window_size {config.window_size} (sliding-window attention) needs "
                    "Transformer Engine's attention"
                )
            if getattr(config, "softmax_type", "vanilla") != "vanilla":
                raise UnsupportedError(
                    f"softmax_type {config.softmax_type!r} needs Transformer Engine's attention"
                )
            self.attn_mask_type = attn_mask_type
            self.softmax_scale = softmax_scale
            self.dropout = (
                config.attention_dropout if attention_dropout is None else attention_dropout
            )

        def forward(
            self,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            attn_mask_type: Any = None,
            attention_bias: torch.Tensor | None = None,
            packed_seq_params: Any = None,
        ) -> torch.Tensor:
            if packed_seq_params is not None or attention_bias is not None:
                raise UnsupportedError(
                    "packed sequences and attention bias need Transformer Engine's attention"
                )
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            causal = mask_type == AttnMaskType.causal
            mask = None if causal or attention_mask is None else ~attention_mask
            # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            dropout = self.dropout if self.training else 0.0
            # Dropout draws from the model-parallel RNG, as DotProductAttention's does.
            rng = contextlib.nullcontext()
            if dropout > 0 and not self.config.sequence_parallel:
                rng = tensor_parallel.get_cuda_rng_tracker().fork()
            with rng:
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    dropout_p=dropout,
                    is_causal=causal,
                    scale=self.softmax_scale,
                    enable_gqa=k.shape[1] != q.shape[1],
                )
            # [b, heads, s, v_dim] -> [s, b, heads * v_dim]
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    return SdpaCoreAttention


def without_transformer_engine() -> bool:
    """Make megatron-core 0.16's MoE and MLA code run where Transformer Engine is missing.

    Two spots assume TE: ``moe_utils.router_gating_linear`` reads the module global
    ``te_general_gemm``, which is only defined when TE imports (a ``NameError`` in every
    router's forward otherwise); ``multi_latent_attention`` sets ``HAVE_TE`` when its TE
    extension module imports (it does without TE, leaving ``TELinear`` None) and then calls
    ``isinstance(x, None)``. Without TE both have a plain-PyTorch path; this selects it.
    0.20 (Megatron-LM main) builds no MTP layer without TE: it asks whether ``eh_proj`` is an
    inference-optimized linear with an ``isinstance`` against TE placeholders (``TypeError``);
    the plugin's answer (``False``: such layers need TE) is put in (``_fix_mtp_without_te``).

    Returns:
        ``True`` when TE is missing (and the module globals were set), else ``False``.
    """
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    from uccl_ep_megatron.megatron_plugin.model import _fix_mtp_without_te

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False
    _fix_mtp_without_te()
    return True


def _patch_core_attention(layer_specs) -> None:
    """Every self-attention of the local specs (MLA's too) on ``sdpa_core_attention``."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    sdpa = sdpa_core_attention()
    for spec in layer_specs:
        attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = sdpa


def build_model(recipe, config, experts: str | None = None):
    """``GPTModel`` (and MTP when the recipe has it): Transformer Engine's layer specs when it
    is installed, the local ones otherwise; ``experts="TorchGroupedMLP"`` puts the grouped_mm
    experts into every MoE layer (MTP's included)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    m = recipe.model
    # With Transformer Engine the whole block uses its layers (TEGroupedMLP needs them); the
    # local specs otherwise.
    use_te = not without_transformer_engine()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    if not use_te:
        _patch_core_attention(block.layer_specs)
    if experts == "TorchGroupedMLP":
        from uccl_ep_megatron.token_dispatcher.grouped_experts import use_grouped_experts

        use_grouped_experts(block)
    mtp = None
    if m.get("mtp_num_layers"):
        mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=use_te)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=m["vocab_size"],
        max_sequence_length=int(m.get("max_position_embeddings") or m["seq_length"]),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not m.get("untie_embeddings_and_output_weights"),
        position_embedding_type=m.get("position_embedding_type") or "rope",
        rotary_base=int(m.get("rotary_base") or 10000),
        mtp_block_spec=mtp,
    )


__all__ = [
    "AUTO_EXPERTS",
    "EXPERT_PATHS",
    "build_model",
    "expert_config",
    "expert_path",
    "transformer_config",
    "without_transformer_engine",
]

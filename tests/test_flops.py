"""Parameter counts against DeepSeek-V3's published totals; FLOPs against a hand derivation."""

from __future__ import annotations

import pytest

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.telemetry.flops import (
    forward_flops_per_token,
    param_counts,
    tflops_per_gpu,
    training_flops_per_token,
)
from uccl_ep_megatron.training.recipes import load_recipe

# A tiny DeepSeek-V3-shaped config whose numbers are derived by hand below.
SMALL = {
    "num_layers": 3,
    "first_k_dense_layers": 1,
    "hidden_size": 64,
    "ffn_hidden_size": 96,
    "num_attention_heads": 4,
    "multi_latent_attention": True,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_head_dim": 8,
    "qk_pos_emb_head_dim": 4,
    "v_head_dim": 8,
    "num_experts": 8,
    "moe_ffn_hidden_size": 16,
    "moe_shared_expert_intermediate_size": 16,
    "moe_router_topk": 2,
    "moe_router_enable_expert_bias": True,
    "mtp_num_layers": 1,
    "vocab_size": 100,
    "seq_length": 32,
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "normalization": "RMSNorm",
}


def test_small_config_parameters_by_hand():
    # MLA: q_a 64*32 + q_norm 32 + q_b 32*4*(8+4) + kv_a 64*(16+4) + kv_norm 16
    #      + kv_b 16*4*(8+8) + o 4*8*64
    attn = 2048 + 32 + 1536 + 1280 + 16 + 1024 + 2048
    assert attn == 7984
    swiglu_expert = 3 * 64 * 16  # 3072
    dense_layer = attn + 3 * 64 * 96 + 2 * 64  # + SwiGLU MLP + two RMSNorms
    moe_total = attn + 8 * swiglu_expert + swiglu_expert + 8 * 64 + 8 + 2 * 64
    moe_active = attn + 2 * swiglu_expert + swiglu_expert + 8 * 64 + 8 + 2 * 64
    emb = out = 100 * 64
    c = param_counts(SMALL)
    assert c.attention_per_layer == 7984
    assert c.moe_per_layer_total == moe_total == 36280
    assert c.total == dense_layer + 2 * moe_total + emb + out + 64 == 111968
    # Active: no unselected experts, no input embedding table (a lookup).
    assert c.active == dense_layer + 2 * moe_active + out + 64 == 68704
    # MTP: eh_proj 2h->h, enorm+hnorm, one MoE layer, its final norm.
    assert c.mtp_params == 2 * 64 * 64 + 2 * 64 + moe_total + 64 == 44664


def test_small_config_flops_by_hand():
    seq = 32
    # Attention: matmul weights (no latent norms) x 2, plus causal QK^T and AV over seq/2 keys.
    attn = 2 * (7984 - 32 - 16) + 2 * 4 * ((8 + 4) + 8) * seq // 2
    assert attn == 18432
    dense = attn + 2 * 3 * 64 * 96
    moe = attn + 2 * 64 * 8 + 2 * 2 * 3 * 64 * 16 + 2 * 3 * 64 * 16  # router, top-2, shared
    logits = 2 * 64 * 100
    mtp = 2 * (2 * 64) * 64 + moe + logits
    fwd = dense + 2 * moe + logits + mtp
    assert fwd == 210944
    assert forward_flops_per_token(SMALL) == fwd
    assert training_flops_per_token(SMALL) == 3 * fwd
    # Attention grows with the sequence; nothing else does.
    assert forward_flops_per_token(SMALL, 64) - fwd == 4 * 2 * 4 * 20 * 16
    assert tflops_per_gpu(SMALL, tokens_per_s=1e6, num_gpus=2) == pytest.approx(
        3 * fwd * 1e6 / 2 / 1e12
    )
    with pytest.raises(InvalidInputError, match="num_gpus"):
        tflops_per_gpu(SMALL, 1.0, 0)


def test_deepseek_v3_published_totals():
    c = param_counts(load_recipe("deepseek-v3/full").model)
    # "671B total parameters" (main model, MTP excluded): within 1%.
    assert abs(c.total - 671e9) / 671e9 < 0.01
    # "37B activated for each token", a figure rounded to whole billions: our count (every
    # matmul weight a token passes through, without the input embedding lookup table) is
    # 36.63B, i.e. it rounds to 37B; it is 1.01% below 37.0B.
    assert round(c.active / 1e9) == 37
    assert abs(c.active - 37e9) / 37e9 < 0.0102
    # Hugging Face: 685B = 671B main model + 14B MTP module (which stores its own copy of the
    # embedding and output head; megatron-core shares them).
    # Ours: 13.46B and 684.49B (the checkpoint also stores FP8 block scales, ~0.04B).
    mtp_hf = c.mtp_params + c.embedding + c.output
    assert abs(mtp_hf - 14e9) < 0.6e9
    assert abs(c.total + mtp_hf - 685e9) / 685e9 < 0.01


def test_downscale_is_379b():
    c = param_counts(load_recipe("deepseek-v3/downscale-32l").model)
    assert abs(c.total - 379e9) / 379e9 < 0.01
    assert c.mtp_params == 0


def test_standard_attention_counts():
    m = dict(SMALL, multi_latent_attention=False, kv_channels=16, num_query_groups=2)
    # q: 4 heads x 16, k and v: 2 groups x 16 each, o: 4*16 -> 64
    assert param_counts(m).attention_per_layer == 64 * 16 * (4 + 2 * 2) + 4 * 16 * 64

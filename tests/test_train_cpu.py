"""`uccl-ep-megatron train` on a machine without a GPU: the CPU smoke run, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from uccl_ep_megatron.cli import main
from uccl_ep_megatron.telemetry.metrics import read_jsonl
from uccl_ep_megatron.training.cpu import SmokeShapes, route, smoke_shapes
from uccl_ep_megatron.training.job import NO_GPU_MESSAGE
from uccl_ep_megatron.training.recipes import load_recipe

KEYS = {
    "loss",
    "step_time_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "tflops_per_gpu",
    "dispatch_time_ms",
    "combine_time_ms",
    "dispatch_host_ms",
    "combine_host_ms",
    "dispatch_gbps",
    "combine_gbps",
    "expert_load_imbalance",
}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One CLI run of the default recipe, shared by the checks below (it takes seconds)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: train would not run the CPU smoke")
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["train", "--iters", "6", "--run-dir", str(run_dir)])
    return rc, out.getvalue(), run_dir


def test_smoke_says_training_needs_a_gpu(smoke_run):
    rc, out, _ = smoke_run
    assert rc == 0
    assert NO_GPU_MESSAGE in out
    assert "Training itself needs a GPU" in out


def test_smoke_jsonl_metrics(smoke_run):
    _, _, run_dir = smoke_run
    records = read_jsonl(run_dir)
    assert [r["step"] for r in records] == list(range(1, 7))
    shapes = smoke_shapes(load_recipe().model)
    for r in records:
        assert KEYS <= set(r)
        assert all(r[k] is not None and r[k] >= 0 for k in KEYS)
        # tokens/s is consistent with the step time and the 2 ranks' tokens
        expect = shapes.tokens_per_rank * 2 / r["step_time_s"]
        assert r["tokens_per_s"] == pytest.approx(expect, rel=1e-6)
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / 2, rel=1e-9)
        assert r["tflops_per_gpu"] == pytest.approx(
            3 * shapes.forward_flops_per_token() * r["tokens_per_s_per_gpu"] / 1e12, rel=1e-6
        )
        # max/mean of top-8 loads over 64 experts is >= 1 and bounded by 64 (all on one)
        assert 1.0 <= r["expert_load_imbalance"] <= 64.0
        assert r["dispatch_time_ms"] > 0 and r["combine_time_ms"] > 0
        # On the CPU there is no device clock: both columns hold the same wall time (mean of
        # the 2 ranks), and GB/s is the received bytes over it.
        assert r["dispatch_host_ms"] == pytest.approx(r["dispatch_time_ms"], rel=1e-12)
        assert r["combine_host_ms"] == pytest.approx(r["combine_time_ms"], rel=1e-12)
    # The MoE layer learns through dispatch -> experts -> combine and its autograd backward.
    assert records[-1]["loss"] < 0.98 * records[0]["loss"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["recipe"] == "deepseek-v3/quick" and config["world_size"] == 2


def test_smoke_offline_wandb_run_reads_back(smoke_run):
    wandb = pytest.importorskip("wandb")
    del wandb
    from uccl_ep_megatron.telemetry.metrics import read_wandb_offline

    _, _, run_dir = smoke_run
    (wandb_dir,) = sorted((run_dir / "wandb").glob("offline-run-*"))
    stored = read_wandb_offline(wandb_dir)
    records = read_jsonl(run_dir)
    assert len(stored["history"]) == len(records)
    for row, rec in zip(stored["history"], records, strict=True):
        assert row["_step"] == rec["step"]
        for key in KEYS:
            assert row[key] == pytest.approx(rec[key], rel=1e-12), key
    assert stored["config"]["recipe"] == "deepseek-v3/quick"
    assert stored["config"]["mode"] == "cpu-smoke"
    assert stored["summary"]["backend"] == "reference"


def test_route_is_group_limited_and_normalized():
    s = SmokeShapes(
        hidden=8,
        moe_ffn=4,
        shared_ffn=4,
        num_experts=16,
        topk=4,
        num_groups=4,
        group_topk=2,
        score_function="sigmoid",
        topk_scaling=2.5,
        tokens_per_rank=5,
    )
    torch.manual_seed(0)
    logits = torch.randn(50, 16)
    idx, w = route(logits, torch.zeros(16), s)
    groups = idx // 4
    assert all(len(set(g.tolist())) <= 2 for g in groups)  # at most group_topk groups
    assert torch.allclose(w.sum(-1), torch.full((50,), 2.5))
    # Independent reference: best 2 groups by the sum of their top-2 sigmoid scores.
    scores = torch.sigmoid(logits)
    for t in range(50):
        gsc = [sorted(scores[t, 4 * g : 4 * g + 4].tolist())[-2:] for g in range(4)]
        best = sorted(range(4), key=lambda g: -sum(gsc[g]))[:2]
        allowed = [e for g in best for e in range(4 * g, 4 * g + 4)]
        want = sorted(allowed, key=lambda e: -scores[t, e].item())[:4]
        assert set(idx[t].tolist()) == set(want)
    # A large bias on one expert makes it selected everywhere, but its weight is unchanged.
    bias = torch.zeros(16)
    bias[5] = 100.0
    idx_b, _ = route(logits, bias, s)
    assert (idx_b == 5).any(-1).all()


def test_bad_train_input(tmp_path, capsys):
    assert main(["train", "--recipe", "nope/none"]) == 2
    assert "unknown recipe" in capsys.readouterr().err
    assert main(["train", "--data-path", str(tmp_path / "corpus_text_document")]) == 2
    err = capsys.readouterr().err
    assert "corpus_text_document.bin does not exist" in err
    assert main(["train", "--set", "parallelism.expert_model_parallel_size=3"]) == 2
    assert "does not divide num_experts 64" in capsys.readouterr().err
    assert main(["train", "--iters", "0"]) == 2
    assert "--iters 0" in capsys.readouterr().err
    assert main(["train", "--compare", "--dispatcher", "alltoall"]) == 2
    assert "includes the dispatcher of the run itself (alltoall)" in capsys.readouterr().err
    assert main(["train", "--compare", "flex,nccl"]) == 2
    assert "compare with one or more of alltoall, flex" in capsys.readouterr().err
    assert main(["train", "--peak-tflops", "0"]) == 2
    assert "--peak-tflops 0" in capsys.readouterr().err


def test_default_run_is_the_short_recipe():
    """`train` with no arguments: 20 iterations of 32 x 2048 tokens, no checkpoint, on 4+ GPUs;
    on 1-3 GPUs the proxy model on 16 x 1024 tokens; the CPU smoke scales the default down."""
    from uccl_ep_megatron.training.recipes import SMALL_RECIPE, default_recipe

    r = load_recipe()
    assert r.name == "deepseek-v3/quick"
    assert r.training["train_iters"] == 20 and r.training["save_interval"] == 0
    assert r.training["global_batch_size"] * r.model["seq_length"] == 32 * 2048
    for gpus in (4, 8):
        assert r.resolved_parallelism(gpus)["ep"] == gpus
    assert [default_recipe(g) for g in (0, 1, 2, 3, 4, 8)] == (
        [r.name] + [SMALL_RECIPE] * 3 + [r.name] * 2
    )
    small = load_recipe(SMALL_RECIPE)
    assert small.training["train_iters"] == 20 and small.training["save_interval"] == 0
    assert small.training["global_batch_size"] * small.model["seq_length"] == 16 * 1024
    proxy = load_recipe("deepseek-v3/proxy")
    same = ("num_layers", "hidden_size", "num_experts", "moe_router_topk", "vocab_size")
    assert all(small.model[k] == proxy.model[k] for k in same)  # the proxy's model, shorter
    for gpus in (1, 2, 4, 8):  # one node, any GPU count
        assert small.resolved_parallelism(gpus)["ep"] == gpus


def _fake_run(run_dir, dispatcher, tokens_per_s, losses, mfu=True, exchange_ms=None):
    """A finished run's files as MetricsLogger writes them (the table's input); with
    ``exchange_ms``, each of the four dispatch/combine device columns holds a quarter of it."""
    from uccl_ep_megatron.telemetry.metrics import MetricsLogger

    config = {"dispatcher": dispatcher, "experts": "SequentialMLP", "world_size": 1}
    with MetricsLogger(run_dir, config, use_wandb=False) as logger:
        for step, loss in enumerate(losses, 1):
            record = dict(loss=loss, tokens_per_s=tokens_per_s * step, step_time_s=1.0 / step)
            record["tflops_per_gpu"] = tokens_per_s * step / 1000
            if mfu:
                record["mfu"] = record["tflops_per_gpu"] / 989.4
            if exchange_ms is not None:
                for kind in ("dispatch", "combine", "dispatch_backward", "combine_backward"):
                    record[f"{kind}_time_ms"] = exchange_ms / 4
            logger.log(step, record)


def test_results_table_rows_and_ratio(tmp_path):
    from rich.console import Console

    from uccl_ep_megatron.training.job import results_table

    _fake_run(tmp_path / "a", "uccl_ep", 1000.0, [12.0, 11.9, 11.8, 11.7, 11.6])
    _fake_run(
        tmp_path / "b", "alltoall", 500.0, [12.0, 11.9, 11.8, 11.7, 11.5], mfu=False, exchange_ms=45
    )
    console = Console(width=220, record=True)  # print_results' width in a log
    console.print(results_table([tmp_path / "a", tmp_path / "b"], warmup_steps=3))
    text = console.export_text()
    # Steps 4 and 5 are averaged: tokens/s 4500 vs 2250, TFLOP/s 4.5 vs 2.25.
    assert "4,500" in text and "2,250" in text and "4.5" in text
    assert f"{100 * 4.5 / 989.4:.1f}%" in text and "n/a" in text  # MFU when the peak is known
    assert "12.0000 -> 11.6000" in text and "12.0000 -> 11.5000" in text
    # The second run's step: (1/4 + 1/5) / 2 s = 225 ms, 45 of them exchange: 225 / 180.
    alltoall_row = next(line for line in text.splitlines() if "alltoall" in line)
    assert "45.00 (1.250x)" in alltoall_row
    ratio_row = next(line for line in text.splitlines() if "ratio" in line)
    assert "2.000" in ratio_row  # tokens/s and TFLOP/s of the first run over the second
    with pytest.raises(Exception, match="metrics.jsonl does not exist"):
        results_table([tmp_path / "missing"])


def test_peak_table_and_mfu():
    from uccl_ep_megatron.core.errors import InvalidInputError
    from uccl_ep_megatron.telemetry.flops import mfu, peak_bf16_tflops

    assert peak_bf16_tflops("NVIDIA H200") == 989.4
    assert peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_bf16_tflops("NVIDIA H20") == 148.0  # not H200's
    assert peak_bf16_tflops("AMD Instinct MI300X") == 1307.4
    assert peak_bf16_tflops("cpu (test)") is None
    assert mfu(98.94, 989.4) == pytest.approx(0.1)
    assert mfu(50.0, None) is None
    with pytest.raises(InvalidInputError, match="peak"):
        mfu(1.0, 0.0)


def test_list_recipes(capsys):
    assert main(["train", "--list-recipes"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("deepseek-v3/full "))
    assert "671.03B" in line and "36.63B" in line


# ---- the GPU job's CPU-testable parts (need megatron-core) ---------------------------------
@pytest.mark.megatron
def test_transformer_config_from_the_proxy_recipe():
    pytest.importorskip("megatron.core")
    from uccl_ep_megatron.training.gpu import transformer_config

    r = load_recipe("deepseek-v3/proxy")
    par = r.resolved_parallelism(2)
    cfg = transformer_config(r, par, "alltoall")
    m = r.model
    assert type(cfg).__name__ == "MLATransformerConfig"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (6, 1024, 16)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.v_head_dim) == (
        m["q_lora_rank"],
        m["kv_lora_rank"],
        128,
        128,
    )
    assert cfg.moe_layer_freq == [0, 1, 1, 1, 1, 1]
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_router_group_topk) == (64, 8, 4)
    assert cfg.moe_router_score_function == "sigmoid" and cfg.moe_router_enable_expert_bias
    assert cfg.expert_model_parallel_size == 2 and cfg.mtp_num_layers == 1
    assert cfg.moe_token_dispatcher_type == "alltoall" and cfg.gated_linear_unit


@pytest.mark.megatron
@pytest.mark.parametrize(
    "q_heads,kv_heads,qk_dim,v_dim,mask_kind,scale",
    [
        (4, 4, 16, 16, "causal", None),  # MHA
        (4, 4, 24, 16, "causal", 0.3),  # MLA: q/k wider than v, MLA's softmax scale
        (8, 2, 16, 16, "causal", None),  # GQA
        (4, 4, 16, 16, "padding", None),  # a given mask, True = masked out
    ],
)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_sdpa_core_attention_equals_attention_math(
    q_heads, kv_heads, qk_dim, v_dim, mask_kind, scale, device
):
    """The local path's core attention against softmax(q k^T * scale + mask) v in float64,
    forward and input gradients, in megatron-core's [s, b, heads, dim] layout: float32 on the
    CPU, bf16 on a GPU (its fused kernels)."""
    pytest.importorskip("megatron.core")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from uccl_ep_megatron.training.gpu.model import sdpa_core_attention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=q_heads, attention_dropout=0.0
    )
    mask_type = AttnMaskType.causal if mask_kind == "causal" else AttnMaskType.padding
    attn = sdpa_core_attention()(cfg, 1, mask_type, "self", softmax_scale=scale)
    s, b = 7, 3
    g = torch.Generator().manual_seed(q_heads * 100 + qk_dim + v_dim)
    q, k, v = (
        torch.randn(s, b, heads, dim, generator=g).to(device, dtype).requires_grad_(True)
        for heads, dim in ((q_heads, qk_dim), (kv_heads, qk_dim), (kv_heads, v_dim))
    )
    if mask_kind == "causal":  # what GPT batches carry; read as the causal mask type
        masked = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        given = torch.zeros(1, 1, s, s, dtype=torch.bool)  # not read with the causal type
    else:
        masked = torch.rand(b, 1, s, s, generator=g) < 0.3
        masked[..., 0] = False  # every query keeps a key
        given = masked
    out = attn(q, k, v, given.to(device))
    assert out.shape == (s, b, q_heads * v_dim) and out.dtype == dtype
    grad = torch.randn(out.shape, generator=g)
    (out.float() * grad.to(device)).sum().backward()

    qd, kd, vd = (t.detach().cpu().double().requires_grad_(True) for t in (q, k, v))
    rep = q_heads // kv_heads
    kk = kd.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
    vv = vd.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
    scores = qd.permute(1, 2, 0, 3) @ kk.transpose(-1, -2) * (scale or qk_dim**-0.5)
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1)
    ref = (probs @ vv).permute(2, 0, 1, 3).reshape(s, b, -1)
    (ref * grad.double()).sum().backward()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.double().cpu(), ref, **tol)
    for got, want in ((q, qd), (k, kd), (v, vd)):
        torch.testing.assert_close(got.grad.double().cpu(), want.grad, **tol)


@pytest.mark.megatron
def test_sdpa_core_attention_refuses_what_it_does_not_compute():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from uccl_ep_megatron.core.errors import UnsupportedError
    from uccl_ep_megatron.training.gpu.model import sdpa_core_attention

    cfg = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, window_size=(16, 0)
    )
    with pytest.raises(UnsupportedError, match=r"window_size \(16, 0\)"):
        sdpa_core_attention()(cfg, 1, AttnMaskType.causal, "self")


@pytest.mark.megatron
def test_expert_path_choice_and_config():
    pytest.importorskip("megatron.core")
    import dataclasses
    import importlib.util

    from megatron.core.transformer.transformer_config import TransformerConfig

    from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
    from uccl_ep_megatron.training.gpu import expert_config, expert_path, transformer_config
    from uccl_ep_megatron.training.gpu.model import EXPERT_PATHS
    from uccl_ep_megatron.training.recipe_schema import MOE_EXPERTS

    assert MOE_EXPERTS == ("auto", *EXPERT_PATHS)
    name, why = expert_path()
    assert expert_path("auto") == (name, why)
    if importlib.util.find_spec("transformer_engine") is not None:
        assert name == "TEGroupedMLP"
    elif importlib.util.find_spec("grouped_gemm") is None and not torch.cuda.is_available():
        # never silently: the reason names what each faster path lacks
        assert name == "SequentialMLP" and "slowest" in why and "TorchGroupedMLP: no CUDA" in why
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedError, match="moe_experts TorchGroupedMLP: no CUDA GPU"):
            expert_path("TorchGroupedMLP")
    with pytest.raises(InvalidInputError, match="moe_experts 'FastMLP'"):
        expert_path("FastMLP")
    assert expert_path("SequentialMLP") == (
        "SequentialMLP",
        "chosen by the recipe (model.moe_experts)",
    )
    assert expert_config("SequentialMLP") == {"moe_grouped_gemm": False}
    assert expert_config("TorchGroupedMLP") == {"moe_grouped_gemm": False}
    assert expert_config("TEGroupedMLP") == {"moe_grouped_gemm": True}
    legacy = "moe_use_legacy_grouped_gemm" in {
        f.name for f in dataclasses.fields(TransformerConfig)
    }
    if legacy:  # megatron-core 0.14-0.16
        assert expert_config("GroupedMLP")["moe_use_legacy_grouped_gemm"]
    else:
        with pytest.raises(UnsupportedError, match="GroupedMLP"):
            expert_config("GroupedMLP")
    with pytest.raises(InvalidInputError, match="expert path"):
        expert_config("FastMLP")
    r = load_recipe()
    cfg = transformer_config(r, r.resolved_parallelism(1), "alltoall", "SequentialMLP")
    assert cfg.moe_grouped_gemm is False


@pytest.mark.megatron
def test_token_windows_over_an_indexed_dataset(tmp_path):
    pytest.importorskip("megatron.core")
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from uccl_ep_megatron.training.gpu import TokenWindows
    from uccl_ep_megatron.training.job import check_data_path

    prefix = str(tmp_path / "corpus_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=n) for n in (5, 17, 1, 30, 9, 12)]
    for d in docs:
        builder.add_document(d, [len(d)])
    builder.finalize(prefix + ".idx")
    check_data_path(prefix)  # both files exist now
    stream = np.concatenate(docs)
    w = TokenWindows(prefix, seq_length=7)
    assert len(w) == len(stream) // 8
    for i in range(len(w) + 2):  # wraps around after the last full window
        j = i % len(w)
        assert np.array_equal(w[i], stream[8 * j : 8 * j + 8])


@pytest.mark.megatron
def test_synthetic_batches_are_per_rank_and_resumable():
    pytest.importorskip("megatron.core")
    from uccl_ep_megatron.training.gpu import batches

    r = load_recipe(overrides={"model": {"seq_length": 16, "max_position_embeddings": 16}})
    par = r.resolved_parallelism(2)  # DP 2, micro-batch 2, 4 micro-batches per rank
    cpu = torch.device("cpu")
    a = batches(r, par, 0, 0, None, cpu)
    first = [next(a) for _ in range(par["num_microbatches"] + 1)]
    b = first[0]
    assert b["tokens"].shape == (2, 16) and b["labels"].shape == (2, 16)
    assert b["attention_mask"].shape == (1, 1, 16, 16) and bool(b["attention_mask"][0, 0, 0, 1])
    assert int(b["tokens"].max()) < r.model["vocab_size"]
    assert torch.equal(b["labels"][:, :-1], b["tokens"][:, 1:])  # next-token targets
    other = next(batches(r, par, 1, 0, None, cpu))
    assert not torch.equal(other["tokens"], b["tokens"])  # data-parallel ranks differ
    resumed = next(batches(r, par, 0, 1, None, cpu))  # starting at iteration 1
    assert torch.equal(resumed["tokens"], first[par["num_microbatches"]]["tokens"])


def test_gpu_relaunch_command_parses_back_to_the_same_options(tmp_path):
    """`train` outside torchrun restarts itself under torch.distributed.run with these args."""
    from uccl_ep_megatron.cli import build_parser
    from uccl_ep_megatron.training.job import TrainOptions, _relaunch_args

    opts = TrainOptions(
        recipe="deepseek-v3/proxy",
        overrides=["training.micro_batch_size=1"],
        dispatcher="alltoall",
        iters=9,
        data_path="/data/c_text_document",
        checkpoint_dir=str(tmp_path / "ck"),
        save_interval=3,
        peak_tflops=900.0,
        resume=False,
        use_wandb=False,
    )
    args = _relaunch_args(opts, tmp_path / "run")
    assert args[:3] == ["-m", "uccl_ep_megatron.cli", "train"]
    ns = build_parser().parse_args(args[2:])
    assert (ns.recipe, ns.dispatcher, ns.iters, ns.save_interval) == (
        "deepseek-v3/proxy",
        "alltoall",
        9,
        3,
    )
    assert ns.overrides == ["training.micro_batch_size=1"] and ns.run_dir == str(tmp_path / "run")
    assert ns.data_path == "/data/c_text_document" and not ns.resume and not ns.use_wandb
    assert ns.peak_tflops == 900.0 and not ns.compare  # each job of --compare is one run


_BUILD_ON_CPU = r"""
import contextlib, json, os, sys, torch, torch.distributed as dist
# megatron-core allocates on torch.cuda.current_device(); pointing it at the CPU lets this
# CPU-only machine build and run the real model (nothing else is replaced).
torch.cuda.current_device = lambda: "cpu"
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
from uccl_ep_megatron.telemetry.flops import param_counts
from uccl_ep_megatron.training.recipes import load_recipe
from uccl_ep_megatron.training.gpu import batches, build_model, forward_step, transformer_config
small = dict(hidden_size=256, num_attention_heads=4, kv_channels=64, num_layers=3,
             ffn_hidden_size=512, num_experts=16, moe_ffn_hidden_size=64,
             moe_shared_expert_intermediate_size=64, vocab_size=1000, seq_length=32,
             max_position_embeddings=32)
if sys.argv[1] == "deepseek-v3/proxy":
    small.update(q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16,
                 v_head_dim=32, first_k_dense_layers=1)
r = load_recipe(sys.argv[1], {"model": small,
                              "parallelism": {"pipeline_model_parallel_size": 1,
                                              "decoder_first_pipeline_num_layers": None,
                                              "decoder_last_pipeline_num_layers": None,
                                              "expert_model_parallel_size": 1},
                              "training": {"micro_batch_size": 1, "global_batch_size": 1},
                              "cluster": {"nodes": 1, "gpus_per_node": 1}})
par = r.resolved_parallelism(1)
cfg = transformer_config(r, par, "allgather")
cfg.use_cpu_initialization, cfg.params_dtype, cfg.bf16 = True, torch.float32, False
cfg.pipeline_dtype = torch.float32
model = build_model(r, cfg)
out, loss_fn = forward_step(batches(r, par, 0, 0, None, torch.device("cpu")), model)
total, tokens, _ = loss_fn(out)
total.backward()
c = param_counts(r.model)
print(json.dumps({
    "built": sum(p.numel() for p in model.parameters()),
    "flops_total": c.total, "flops_mtp": c.mtp_params,
    "moe_layers": r.num_moe_layers + int(r.model.get("mtp_num_layers") or 0),
    "experts": r.model["num_experts"], "loss": float(total / tokens),
    "no_grad": sum(p.grad is None for p in model.parameters()),
}))
"""


@pytest.mark.megatron
@pytest.mark.parametrize("recipe", ["deepseek-v3/proxy", "deepseek-v3/downscale-32l"])
def test_megatron_core_model_matches_flops_counts(recipe, tmp_path):
    """The model train builds (MLA or MHA, MoE, MTP) has exactly flops.py's parameters."""
    pytest.importorskip("megatron.core")
    import math

    # -P and a cwd outside the checkout: the child imports the installed package (with its
    # token_dispatcher), never the source tree.
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _BUILD_ON_CPU, recipe, str(tmp_path / "pg_init")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # megatron-core keeps the expert-score bias as a buffer, flops.py counts it as a weight.
    expected = got["flops_total"] + got["flops_mtp"] - got["moe_layers"] * got["experts"]
    assert got["built"] == expected
    assert got["no_grad"] == 0  # every parameter got a gradient (MTP and router included)
    assert abs(got["loss"] - math.log(1000)) < 0.5  # untrained: about ln(vocab)


# The GPU job's loop (megatron-core DDP, optimizer, LR schedule, forward_backward_func, probes,
# metrics, dist-checkpoint save and resume) run on this CPU machine: megatron-core's CUDA
# placement calls are pointed at the CPU and NCCL at gloo. Everything else is the real code.
_TRAIN_ON_CPU = r"""
import contextlib, os, sys, time, torch, torch.distributed as dist
torch.cuda.current_device = lambda: "cpu"
torch.cuda.set_device = lambda *a, **k: None
torch.cuda.synchronize = lambda *a, **k: None
class _Event:
    def __init__(self, enable_timing=False): self.t = None
    def record(self, *a): self.t = time.perf_counter()
    def elapsed_time(self, other): return (other.t - self.t) * 1e3
    def synchronize(self): pass
torch.cuda.Event = _Event
class _Stream:  # CPU work runs in program order: there is never anything to wait for
    def wait_event(self, event): pass
    def wait_stream(self, stream): pass
torch.cuda.current_stream = lambda *a, **k: _Stream()  # megatron-core 0.19's DDP asks for it
torch.cuda.get_device_name = lambda *a, **k: "cpu (test)"
torch.nn.Module.cuda = lambda self, *a, **k: self
def _on_cpu(fn):
    def wrapped(*a, **k):
        if k.get("device") == "cuda": k["device"] = "cpu"
        return fn(*a, **k)
    return wrapped
torch.zeros, torch.tensor = _on_cpu(torch.zeros), _on_cpu(torch.tensor)
_type = torch.Tensor.type
def _cuda_type(self, *a, **k):  # the Megatron optimizer insists on torch.cuda.* parameters
    r = _type(self, *a, **k)
    if a or k or r.startswith("torch.cuda"):
        return r
    return r.replace("torch.", "torch.cuda.", 1)
torch.Tensor.type = _cuda_type
_init = dist.init_process_group
dist.init_process_group = lambda backend=None, **k: _init("gloo", **k)
from megatron.core.tensor_parallel import random as R
R.model_parallel_cuda_manual_seed = lambda seed, *a, **k: torch.manual_seed(seed)
R.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()

def main():
    import uccl_ep_megatron.training.gpu.loop as T
    from uccl_ep_megatron.training.job import TrainOptions, load
    batches = T.batches
    T.batches = lambda r, p, d, s, dp, dev: batches(r, p, d, s, dp, torch.device("cpu"))
    modes = set(sys.argv[4].split(",")) if len(sys.argv) > 4 else set()
    fp32 = "fp32" in modes
    if "grouped" in modes:
        # The CPU stands in for the GPU here, so "does grouped_mm run?" is asked of the CPU.
        import uccl_ep_megatron.training.gpu.model as M
        from uccl_ep_megatron.token_dispatcher.grouped_experts import grouped_mm_unavailable
        reasons = M._missing_reasons
        M._missing_reasons = lambda: {**reasons(), "TorchGroupedMLP": grouped_mm_unavailable("cpu")}
    if fp32:  # exact comparisons: no bf16 rounding anywhere
        import megatron.core.transformer.module as module
        module.Float16Module = lambda config, m: m
        make_config = T.transformer_config
        def transformer_config(*a, **k):
            c = make_config(*a, **k)
            c.bf16, c.params_dtype, c.pipeline_dtype = False, torch.float32, torch.float32
            return c
        T.transformer_config = transformer_config
    small = ["seq_length=32", "max_position_embeddings=32", "hidden_size=128",
             "num_attention_heads=4", "q_lora_rank=32", "kv_lora_rank=16", "qk_head_dim=16",
             "qk_pos_emb_head_dim=8", "v_head_dim=16", "kv_channels=16", "ffn_hidden_size=256",
             "moe_ffn_hidden_size=32", "moe_shared_expert_intermediate_size=32", "vocab_size=512",
             "num_layers=3", "num_experts=16", "moe_router_topk=4", "moe_router_num_groups=4",
             "moe_router_group_topk=2"]
    dist_world = int(os.environ["WORLD_SIZE"])
    dist_world = int(os.environ["WORLD_SIZE"])
    opts = TrainOptions(
        iters=int(sys.argv[2]), run_dir=sys.argv[1], use_wandb=False, peak_tflops=100.0,
        overrides=["model." + s for s in small]
        + ["training.global_batch_size=%d" % (2 * dist_world), "training.micro_batch_size=2"]
        # Not fp32: save at the last iteration only (any interval above the iterations does).
        + (["training.save_interval=0"] if fp32 else ["training.save_interval=1000"])
        + (["dispatcher.fp8_dispatch=true"] if "fp8" in modes else [])
        + (["dispatcher.sync_free=true"] if "syncfree" in modes else [])
        + (["parallelism.use_distributed_optimizer=true"] if "distopt" in modes else [])
        + (["training.save_interval=2"] if "save2" in modes else []),
    )
    sys.exit(T.train_megatron(load(opts), opts, sys.argv[3]))

if __name__ == "__main__":
    main()
"""


def _torchrun_train(
    tmp_path: Path, run: Path, iters: int, modes: str, check: bool = True
) -> subprocess.CompletedProcess:
    """``_TRAIN_ON_CPU`` on 2 CPU ranks under torch.distributed.run with the uccl_ep dispatcher
    and ``modes``; the return code is asserted unless ``check`` is off. TORCHDYNAMO_DISABLE:
    megatron-core's torch.compile'd helpers would spend most of a test compiling CPU kernels."""
    script = tmp_path / "train_on_cpu.py"
    if not script.exists():
        script.write_text(_TRAIN_ON_CPU)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(script), str(run), str(iters), "uccl_ep", modes],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TORCHDYNAMO_DISABLE="1"),
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _skip_without_cpu_grouped_mm() -> None:
    from uccl_ep_megatron.token_dispatcher.grouped_experts import grouped_mm_unavailable

    if grouped_mm_unavailable("cpu") is not None:
        pytest.skip(f"no CPU grouped_mm: {grouped_mm_unavailable('cpu')}")


@pytest.mark.megatron
def test_megatron_train_loop_saves_and_resumes_on_cpu(tmp_path):
    pytest.importorskip("megatron.core")
    pytest.importorskip("psutil")  # megatron-core's checkpoint writer needs it
    import os
    import socket

    script = tmp_path / "train_on_cpu.py"
    script.write_text(_TRAIN_ON_CPU)
    run = tmp_path / "run"

    def train(iters: int, dispatcher: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # TORCHDYNAMO_DISABLE: megatron-core's torch.compile'd helpers would spend most of
        # this test compiling CPU kernels; eager mode runs the same math.
        env = dict(
            os.environ,
            TORCHDYNAMO_DISABLE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
        proc = subprocess.run(
            [sys.executable, str(script), str(run), str(iters), dispatcher],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "parameters: megatron-core model" in proc.stdout
        # The closing table (rich): one row for this run, with the expert path and MFU.
        assert "uccl-ep-megatron train" in proc.stdout and "MFU" in proc.stdout
        assert "SequentialMLP" in proc.stdout and dispatcher in proc.stdout
        # Without Transformer Engine the slowest expert path is said out loud.
        assert "experts: SequentialMLP" in proc.stderr and "slowest" in proc.stderr

    train(2, "allgather")  # megatron-core's own dispatcher; saves at its last iteration
    records = read_jsonl(run)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert abs(r["loss"] - 6.238) < 0.5  # about ln(512) untrained
        assert r["tokens_per_s"] == pytest.approx(2 * 32 / r["step_time_s"], rel=1e-6)
        assert r["dispatch_time_ms"] > 0 and r["expert_load_imbalance"] >= 1.0
        assert r["dispatch_host_ms"] > 0 and r["combine_host_ms"] > 0
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 100.0, rel=1e-9)
    ckpt = run / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "2"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["model_params_built"] == summary["model_params_expected"]
    assert summary["experts"] == "SequentialMLP" and summary["peak_bf16_tflops"] == 100.0

    # Resume from iteration 2 with the uccl_ep dispatcher (plugin + Buffer, reference backend):
    # the checkpoint does not depend on the dispatcher.
    train(3, "uccl_ep")
    assert [r["step"] for r in read_jsonl(run)] == [1, 2, 3]
    config = json.loads((run / "config.json").read_text())
    assert config["start_iteration"] == 2 and config["dispatcher"] == "uccl_ep"
    assert json.loads((run / "summary.json").read_text())["buffer_backends"] == "reference"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "3"


@pytest.mark.megatron
def test_uccl_ep_dispatcher_trains_exactly_like_megatron_allgather_on_cpu(tmp_path):
    """EP=2 over 2 gloo ranks, fp32: the uccl_ep dispatcher (plugin + Buffer, reference
    backend) gives the same losses as megatron-core's allgather dispatcher, step for step
    (forward, backward through dispatch/combine, optimizer step), from the same init and data."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("uccl_ep_megatron.token_dispatcher")

    script = tmp_path / "train_on_cpu.py"
    script.write_text(_TRAIN_ON_CPU)
    losses = {}
    for dispatcher in ("allgather", "uccl_ep", "uccl_ep fp8"):
        run = tmp_path / dispatcher.replace(" ", "_")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                str(script),
                str(run),
                "2",
                dispatcher.split()[0],
                "fp32,fp8" if "fp8" in dispatcher else "fp32",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, TORCHDYNAMO_DISABLE="1"),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses[dispatcher] = [r["loss"] for r in read_jsonl(run)]
    assert len(losses["uccl_ep"]) == 2
    assert losses["uccl_ep"] == pytest.approx(losses["allgather"], rel=1e-6, abs=1e-6)
    # FP8 dispatch: the same run within E4M3's rounding, and visibly not the fp32 one (the
    # second step also sees the first step's FP8-rounded gradients through the optimizer).
    fp8 = losses["uccl_ep fp8"]
    assert fp8 == pytest.approx(losses["uccl_ep"], rel=1e-2) and fp8 != losses["uccl_ep"]
    config = json.loads((tmp_path / "uccl_ep_fp8" / "config.json").read_text())
    assert config["fp8_dispatch"] is True


@pytest.mark.megatron
def test_distributed_optimizer_checkpoint_resumes_the_same_training_on_cpu(tmp_path):
    """2 ranks (EP=2, DP=2), bf16, megatron-core's distributed optimizer: a 4-iteration run
    saves at iterations 2 and 4; a second run resumed from the iteration-2 checkpoint gives
    the same third and fourth losses. The fourth follows the third step's update, made from
    the reloaded Adam moments and step count (and the reloaded schedule): a fresh optimizer
    state would give another. Where megatron-core cannot reload such a checkpoint (before
    0.16, without Apex or Transformer Engine), the job refuses at start with the versions and
    the fixes."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("psutil")
    import shutil

    from megatron.core import package_info
    from megatron.core.optimizer import distrib_optimizer

    def train(run, iters: int) -> subprocess.CompletedProcess:
        return _torchrun_train(tmp_path, run, iters, "distopt,save2", check=False)

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    old = (int(package_info.MAJOR), int(package_info.MINOR)) < (0, 16)
    if old and not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        proc = train(whole, 4)
        assert proc.returncode != 0
        assert "cannot reload a distributed optimizer's checkpoint" in proc.stderr
        assert "megatron-core >= 0.16" in proc.stderr
        return
    proc = train(whole, 4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The second run starts from the first one's iteration-2 checkpoint (same schedule length).
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        whole / "checkpoints" / "iter_0000002", resumed / "checkpoints" / "iter_0000002"
    )
    (resumed / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    proc = train(resumed, 4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((resumed / "config.json").read_text())["start_iteration"] == 2
    want = {r["step"]: r["loss"] for r in read_jsonl(whole)}
    got = {r["step"]: r["loss"] for r in read_jsonl(resumed)}
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [3, 4]
    assert [got[3], got[4]] == pytest.approx([want[3], want[4]], rel=1e-6, abs=1e-6)
    assert want[4] != want[3]  # the steps moved the weights


@pytest.mark.megatron
def test_train_loop_picks_grouped_experts_and_checkpoints_them_on_cpu(tmp_path):
    """Without Transformer Engine, where grouped_mm runs (the CPU standing in for the GPU), the
    default recipe's ``moe_experts: auto`` builds TorchGroupedMLP in every MoE layer (MTP's
    too: the parameter count matches flops.py), trains it through the uccl_ep dispatcher in
    bf16, saves its expert-sharded weights and resumes from them; only one rank talks."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("psutil")
    _skip_without_cpu_grouped_mm()
    run = tmp_path / "run"

    def train(iters: int) -> subprocess.CompletedProcess:
        return _torchrun_train(tmp_path, run, iters, "grouped")

    proc = train(2)
    assert (
        "experts TorchGroupedMLP" in proc.stdout and "uccl_ep (exact, BF16 dispatch)" in proc.stdout
    )
    assert "slowest" not in proc.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["experts"] == "TorchGroupedMLP" and summary["dispatch_mode"] == "exact"
    assert summary["model_params_built"] == summary["model_params_expected"]
    assert all(abs(r["loss"] - 6.238) < 0.5 for r in read_jsonl(run))
    # One closing table, from rank 0 (rank 1 prints nothing of its own).
    assert proc.stdout.count("parameters: megatron-core model") == 1
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    train(3)  # resumes from the saved expert weights (EP=2: each rank loads its own experts)
    assert [r["step"] for r in read_jsonl(run)] == [1, 2, 3]
    assert json.loads((run / "config.json").read_text())["start_iteration"] == 2


@pytest.mark.megatron
def test_train_loop_runs_dropless_sync_free_like_exact_on_cpu(tmp_path):
    """``dispatcher.sync_free`` (no capacity) with the grouped experts: the recipe's flag
    reaches every MoE layer's dispatcher, the closing table and summary name the mode, and
    the losses equal exact mode's (nothing dropped, the same rows)."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("psutil")
    _skip_without_cpu_grouped_mm()
    exact, free = tmp_path / "exact", tmp_path / "free"
    _torchrun_train(tmp_path, exact, 2, "grouped")
    proc = _torchrun_train(tmp_path, free, 2, "grouped,syncfree")
    assert "uccl_ep (sync-free dropless, BF16 dispatch)" in proc.stdout, proc.stdout[-2000:]
    summary = json.loads((free / "summary.json").read_text())
    assert summary["dispatch_mode"] == "sync-free dropless"
    losses = [[r["loss"] for r in read_jsonl(run)] for run in (exact, free)]
    assert len(losses[0]) == 2 and losses[0] == losses[1], losses

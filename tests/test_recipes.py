"""Recipes: every recipe loads and validates; bad input fails with a clear error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.training.recipes import (
    DEFAULT_RECIPE,
    list_recipes,
    load_recipe,
    parse_override,
)

EXPECTED = {
    "deepseek-v3/full",
    "deepseek-v3/downscale-32l",
    "deepseek-v3/mi300x-thor2",
    "deepseek-v3/h200-efa",
    "deepseek-v3/h100-cx7",
    "deepseek-v3/h200-cx7",
    "deepseek-v3/proxy",
    "deepseek-v3/quick",
    "deepseek-v3/small",
}


def test_all_expected_recipes_are_installed():
    assert EXPECTED <= set(list_recipes())
    assert DEFAULT_RECIPE == "deepseek-v3/quick"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recipe_loads_and_fits_its_cluster(name):
    r = load_recipe(name)
    par = r.resolved_parallelism(r.world_size())
    world = r.world_size()
    assert par["tp"] * par["pp"] * par["cp"] * par["dp"] == world
    assert par["pp"] * par["etp"] * par["ep"] * par["expert_dp"] == world
    assert r.model["num_experts"] % par["ep"] == 0
    gb, mb = r.training["global_batch_size"], r.training["micro_batch_size"]
    assert par["num_microbatches"] * mb * par["dp"] == gb


def test_deepseek_v3_architecture_matches_the_release():
    m = load_recipe("deepseek-v3/full").model
    assert (m["num_layers"], m["hidden_size"], m["num_attention_heads"]) == (61, 7168, 128)
    assert (m["q_lora_rank"], m["kv_lora_rank"]) == (1536, 512)
    assert (m["qk_head_dim"], m["qk_pos_emb_head_dim"], m["v_head_dim"]) == (128, 64, 128)
    assert (m["first_k_dense_layers"], m["ffn_hidden_size"]) == (3, 18432)
    assert (
        m["num_experts"],
        m["moe_ffn_hidden_size"],
        m["moe_shared_expert_intermediate_size"],
    ) == (
        256,
        2048,
        2048,
    )
    assert (m["moe_router_topk"], m["moe_router_num_groups"], m["moe_router_group_topk"]) == (
        8,
        8,
        4,
    )
    assert m["moe_router_score_function"] == "sigmoid" and m["moe_router_enable_expert_bias"]
    assert (m["mtp_num_layers"], m["vocab_size"], m["seq_length"]) == (1, 129280, 4096)


def test_platform_presets():
    thor = load_recipe("deepseek-v3/mi300x-thor2")
    assert thor.model["num_layers"] == 32 and thor.cluster["nic_preset"] == "thor2"
    assert (thor.cluster["gpu"], thor.cluster["nodes"], thor.cluster["gpus_per_node"]) == (
        "MI300X",
        16,
        8,
    )
    assert thor.dispatcher_env()["UCCL_IB_MAX_INFLIGHT_BYTES"] == "1572864"
    efa = load_recipe("deepseek-v3/h200-efa")
    assert (efa.cluster["gpu"], efa.cluster["nic_preset"]) == ("H200", "efa")
    assert efa.training["precision"] == "fp8"
    assert load_recipe("deepseek-v3/h100-cx7").cluster["nic_preset"] == "cx7-ib"


def test_proxy_recipe_fits_one_node_and_resolves_ep_to_the_gpus_present():
    r = load_recipe()
    assert r.name == DEFAULT_RECIPE and r.cluster["nodes"] == 1
    assert r.resolved_parallelism(2)["ep"] == 2
    assert r.resolved_parallelism(8)["ep"] == 8
    assert r.resolved_parallelism(1)["ep"] == 1


def test_megatron_args_render_the_recipe():
    args = load_recipe("deepseek-v3/full").megatron_args(1024)
    joined = " ".join(args)
    assert "--num-layers 61" in joined and "--multi-latent-attention" in joined
    assert args[args.index("--moe-layer-freq") + 1] == "([0]*3+[1]*58)"
    assert args[args.index("--expert-model-parallel-size") + 1] == "64"
    assert args[args.index("--moe-token-dispatcher-type") + 1] == "uccl_ep"
    assert args[args.index("--moe-uccl-ep-num-sms") + 1] == "24"
    alt = load_recipe("deepseek-v3/full").megatron_args(1024, dispatcher="alltoall")
    assert alt[alt.index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert "--moe-uccl-ep-num-sms" not in alt
    # moe_experts: auto leaves the expert module to Megatron-LM; no flag of ours leaks.
    assert "--moe-experts" not in args
    assert "--moe-uccl-ep-fp8-dispatch" not in args and "--moe-grouped-gemm" not in args


def test_megatron_args_carry_grouped_experts_and_fp8_dispatch():
    r = load_recipe(
        "deepseek-v3/full",
        {"model": {"moe_experts": "TorchGroupedMLP"}, "dispatcher": {"fp8_dispatch": True}},
    )
    args = r.megatron_args(1024)
    assert "--moe-uccl-ep-grouped-experts" in args and "--moe-uccl-ep-fp8-dispatch" in args
    assert "--moe-experts" not in args and "--moe-grouped-gemm" not in args
    alt = r.megatron_args(1024, dispatcher="alltoall")
    assert "--moe-uccl-ep-fp8-dispatch" not in alt  # an option of the uccl_ep dispatcher
    te = load_recipe("deepseek-v3/full", {"model": {"moe_experts": "TEGroupedMLP"}})
    assert "--moe-grouped-gemm" in te.megatron_args(1024)
    with pytest.raises(InvalidInputError, match="moe_experts"):
        load_recipe("deepseek-v3/full", {"model": {"moe_experts": "FastMLP"}})
    with pytest.raises(InvalidInputError, match="fp8_dispatch scales every 128 channels"):
        load_recipe(
            "deepseek-v3/proxy",
            {"model": {"hidden_size": 1000}, "dispatcher": {"fp8_dispatch": True}},
        )


def test_megatron_args_carry_sync_free_and_refuse_host_count_experts():
    r = load_recipe(
        "deepseek-v3/proxy",
        {"model": {"moe_experts": "TorchGroupedMLP"}, "dispatcher": {"sync_free": True}},
    )
    assert "--moe-uccl-ep-sync-free" in r.megatron_args(2)
    assert "--moe-uccl-ep-sync-free" not in r.megatron_args(2, dispatcher="alltoall")
    with pytest.raises(InvalidInputError, match="sync_free packs the experts' rows on the GPU"):
        load_recipe(
            "deepseek-v3/proxy",
            {"model": {"moe_experts": "SequentialMLP"}, "dispatcher": {"sync_free": True}},
        )


def _write(tmp_path: Path, data: dict, name: str = "r") -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _proxy_dict(**changes) -> dict:
    base = {"base": "deepseek-v3/proxy"}
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        base.setdefault(section, {})[key] = value
    return base


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(
        InvalidInputError, match="unknown recipe 'deepseek-v3/prox'.*deepseek-v3/proxy"
    ):
        load_recipe("deepseek-v3/prox")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"parallelism__expert_model_parallel_size": 3}, "does not divide num_experts 64"),
        ({"model__moe_router_num_groups": 7}, "moe_router_num_groups 7 does not divide"),
        ({"model__moe_router_topk": 65}, "exceeds num_experts"),
        ({"model__num_layrs": 4}, "unknown key model.num_layrs .*did you mean 'num_layers'"),
        ({"training__precision": "fp4"}, r"precision = 'fp4' must be one of"),
        ({"training__global_batch_size": 15}, "not a multiple of micro_batch_size"),
        ({"cluster__nic_preset": "infinband"}, "nic_preset 'infinband' is unknown"),
        ({"parallelism__tensor_model_parallel_size": 3}, "does not divide num_attention_heads"),
        ({"model__hidden_size": "big"}, "must be a int"),
        ({"training__lr": float("nan")}, r"training.lr = nan must be a finite number"),
        ({"training__lr": 0.0}, r"training.lr = 0.0 must be in \(0, 1\]"),
        ({"training__adam_beta1": 7.5}, r"adam_beta1 = 7.5 must be in \[0, 1\)"),
        ({"training__min_lr": 0.5}, "min_lr 0.5 exceeds lr"),
        ({"model__norm_epsilon": float("inf")}, "must be a finite number"),
        ({"dispatcher__num_sms": 3}, "num_sms = 3 must be an even number"),
        ({"dispatcher__proxy_threads": 0}, r"proxy_threads = 0 must be in \[1, 64\]"),
    ],
)
def test_bad_recipes_fail_clearly(tmp_path, changes, message):
    with pytest.raises(InvalidInputError, match=message):
        load_recipe(_write(tmp_path, _proxy_dict(**changes)))


def test_recipe_cluster_must_fit_when_resolved(tmp_path):
    r = load_recipe(_write(tmp_path, _proxy_dict(cluster__gpus_per_node=3)))
    with pytest.raises(InvalidInputError, match="global_batch_size 16 is not divisible"):
        r.resolved_parallelism(r.world_size())


def test_world_size_must_fit_the_parallelism():
    r = load_recipe("deepseek-v3/full")
    with pytest.raises(InvalidInputError, match="not divisible by TP\\*PP\\*CP"):
        r.resolved_parallelism(24)
    with pytest.raises(InvalidInputError, match="PP\\*ETP\\*EP"):
        r.resolved_parallelism(16 * 8)  # PP 16 x EP 64 needs 1024 ranks


def test_uneven_pipeline_split_is_checked(tmp_path):
    data = {"base": "deepseek-v3/full", "parallelism": {"decoder_last_pipeline_num_layers": 3}}
    with pytest.raises(InvalidInputError, match="do not split evenly"):
        load_recipe(_write(tmp_path, data))


def test_base_cycle_is_reported(tmp_path):
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(InvalidInputError, match="inherits from itself"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_overrides_and_recipe_path_env(tmp_path, monkeypatch):
    assert parse_override("training.train_iters=7") == {"training": {"train_iters": 7}}
    with pytest.raises(InvalidInputError, match="section.key=value"):
        parse_override("train_iters=7")
    r = load_recipe("deepseek-v3/proxy", {"training": {"train_iters": 7}})
    assert r.training["train_iters"] == 7
    (tmp_path / "team").mkdir()
    (tmp_path / "team" / "mine.yaml").write_text("base: deepseek-v3/proxy\ndescription: mine\n")
    monkeypatch.setenv("UCCL_EP_RECIPE_PATH", str(tmp_path))
    assert "team/mine" in list_recipes()
    assert load_recipe("team/mine").description == "mine"


def test_topk_beyond_what_uccl_ep_moves_is_rejected():
    with pytest.raises(InvalidInputError, match="= 40 routed copies per token"):
        load_recipe("deepseek-v3/full", {"model": {"moe_router_topk": 40}})
    r = load_recipe(
        "deepseek-v3/full", {"model": {"moe_router_topk": 40}, "dispatcher": {"type": "alltoall"}}
    )
    assert r.model["moe_router_topk"] == 40


def test_overrides_get_the_same_checks():
    for text, needle in (("training.lr=.nan", "finite"), ("training.adam_beta1=7.5", "[0, 1)")):
        with pytest.raises(InvalidInputError, match=re.escape(needle)):
            load_recipe("deepseek-v3/proxy", parse_override(text))


def test_yaml_alias_bomb_is_refused_at_once(tmp_path):
    import time

    levels = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        levels.append(f"{cur}: &{cur} [" + ", ".join([f"*{prev}"] * 10) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(levels) + "\n")
    t0 = time.monotonic()
    with pytest.raises(InvalidInputError, match="aliases"):
        load_recipe(str(path))
    with pytest.raises(InvalidInputError, match="aliases"):
        parse_override("training.lr=[&a 1, *a]")
    assert time.monotonic() - t0 < 5

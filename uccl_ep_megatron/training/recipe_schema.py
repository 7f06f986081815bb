"""The recipe schema and its checks: every key's type, requiredness, allowed values and range.

``check(name, data)`` validates a merged recipe mapping (``recipes.validate`` builds the
``Recipe`` after it); each failure is an ``InvalidInputError`` naming the recipe, the key, the
value and the fix.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_BOOL = (bool,)
#: The value that lets a parallelism size follow the world size.
AUTO = "auto"
#: ``model.moe_experts``: ``auto`` or one of ``training.gpu.model.EXPERT_PATHS`` (kept equal by
#: a test; this module does not import megatron-core).
MOE_EXPERTS = ("auto", "TEGroupedMLP", "TorchGroupedMLP", "GroupedMLP", "SequentialMLP")

# section -> key -> (accepted types, required, allowed values or None).
# ``None`` as a value is accepted for every optional key (YAML ``null`` = "not set").
_SCHEMA: dict[str, dict[str, tuple[tuple[type, ...], bool, tuple[Any, ...] | None]]] = {
    "model": {
        "num_layers": (_INT, True, None),
        "hidden_size": (_INT, True, None),
        "ffn_hidden_size": (_INT, True, None),
        "num_attention_heads": (_INT, True, None),
        "kv_channels": (_INT, False, None),
        "num_query_groups": (_INT, False, None),
        "multi_latent_attention": (_BOOL, False, None),
        "q_lora_rank": (_INT, False, None),
        "kv_lora_rank": (_INT, False, None),
        "qk_head_dim": (_INT, False, None),
        "qk_pos_emb_head_dim": (_INT, False, None),
        "v_head_dim": (_INT, False, None),
        "first_k_dense_layers": (_INT, False, None),
        "num_experts": (_INT, False, None),
        "moe_ffn_hidden_size": (_INT, False, None),
        "moe_shared_expert_intermediate_size": (_INT, False, None),
        "moe_router_topk": (_INT, False, None),
        "moe_router_num_groups": (_INT, False, None),
        "moe_router_group_topk": (_INT, False, None),
        "moe_router_score_function": (_STR, False, ("softmax", "sigmoid")),
        "moe_router_enable_expert_bias": (_BOOL, False, None),
        "moe_router_bias_update_rate": (_NUM, False, None),
        "moe_router_topk_scaling_factor": (_NUM, False, None),
        "moe_router_load_balancing_type": (
            _STR,
            False,
            ("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
        ),
        "moe_aux_loss_coeff": (_NUM, False, None),
        "moe_experts": (_STR, False, MOE_EXPERTS),
        "mtp_num_layers": (_INT, False, None),
        "mtp_loss_scaling_factor": (_NUM, False, None),
        "vocab_size": (_INT, True, None),
        "seq_length": (_INT, True, None),
        "max_position_embeddings": (_INT, False, None),
        "rotary_base": (_INT, False, None),
        "normalization": (_STR, False, ("RMSNorm", "LayerNorm")),
        "norm_epsilon": (_NUM, False, None),
        "swiglu": (_BOOL, False, None),
        "untie_embeddings_and_output_weights": (_BOOL, False, None),
        "position_embedding_type": (_STR, False, ("rope", "learned_absolute", "none")),
        "init_method_std": (_NUM, False, None),
    },
    "parallelism": {
        "tensor_model_parallel_size": (_INT, True, None),
        "pipeline_model_parallel_size": (_INT, True, None),
        "virtual_pipeline_model_parallel_size": (_INT, False, None),
        "decoder_first_pipeline_num_layers": (_INT, False, None),
        "decoder_last_pipeline_num_layers": (_INT, False, None),
        "expert_model_parallel_size": (_INT + _STR, True, None),
        "expert_tensor_parallel_size": (_INT, False, None),
        "context_parallel_size": (_INT, False, None),
        "sequence_parallel": (_BOOL, False, None),
        "use_distributed_optimizer": (_BOOL, False, None),
    },
    "training": {
        "micro_batch_size": (_INT, True, None),
        "global_batch_size": (_INT, True, None),
        "train_iters": (_INT, True, None),
        "lr": (_NUM, True, None),
        "min_lr": (_NUM, False, None),
        "lr_warmup_iters": (_INT, False, None),
        "lr_decay_style": (_STR, False, ("constant", "linear", "cosine")),
        "weight_decay": (_NUM, False, None),
        "adam_beta1": (_NUM, False, None),
        "adam_beta2": (_NUM, False, None),
        "clip_grad": (_NUM, False, None),
        "precision": (_STR, True, ("bf16", "fp8")),
        "fp8_recipe": (_STR, False, ("delayed", "tensorwise", "blockwise", "mxfp8")),
        "seed": (_INT, False, None),
        "log_interval": (_INT, False, None),
        "save_interval": (_INT, False, None),
    },
    "dispatcher": {
        "type": (_STR, True, ("uccl_ep", "alltoall", "flex")),
        "num_sms": (_INT, False, None),
        "proxy_threads": (_INT, False, None),
        "transport": (_STR, False, ("auto", "verbs", "ipc")),
        "max_inflight_bytes": (_INT, False, None),
        "max_inflight_normal": (_INT, False, None),
        "fp8_dispatch": (_BOOL, False, None),
        "sync_free": (_BOOL, False, None),
    },
    "cluster": {
        "gpu": (_STR, True, None),
        "gpus_per_node": (_INT, True, None),
        "nodes": (_INT, True, None),
        "nic_preset": (_STR, True, None),
        "container_image": (_STR, False, None),
    },
}
_TOP_LEVEL = ("description", "base", *_SCHEMA)

# section.key -> (low, high, low excluded, high excluded) of numbers the schema types allow but
# training cannot use (None: unbounded). Every float must also be finite.
_RANGES: dict[tuple[str, str], tuple[float | None, float | None, bool, bool]] = {
    ("model", "norm_epsilon"): (0, 1, True, True),
    ("model", "init_method_std"): (0, 1, True, False),
    ("model", "moe_router_bias_update_rate"): (0, 1, False, False),
    ("model", "moe_router_topk_scaling_factor"): (0, None, True, False),
    ("model", "moe_aux_loss_coeff"): (0, None, False, False),
    ("model", "mtp_loss_scaling_factor"): (0, None, False, False),
    ("training", "lr"): (0, 1, True, False),
    ("training", "min_lr"): (0, 1, False, False),
    ("training", "weight_decay"): (0, 1, False, False),
    ("training", "adam_beta1"): (0, 1, False, True),
    ("training", "adam_beta2"): (0, 1, False, True),
    ("training", "clip_grad"): (0, None, False, False),
    ("dispatcher", "proxy_threads"): (1, 64, False, False),
}


def _check_sections(name: str, data: dict[str, Any]) -> None:
    for key in data:
        if key not in _TOP_LEVEL:
            close = difflib.get_close_matches(str(key), _TOP_LEVEL, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise InvalidInputError(
                f"recipe {name!r}: unknown section {key!r}{hint}; "
                f"sections are {', '.join(_TOP_LEVEL)}"
            )
    for section, fields in _SCHEMA.items():
        values = data.get(section)
        if not isinstance(values, dict):
            raise InvalidInputError(
                f"recipe {name!r}: section {section!r} is missing or not a mapping; "
                f"it needs at least: {', '.join(k for k, f in fields.items() if f[1])}"
            )
        for key in values:
            if key not in fields:
                close = difflib.get_close_matches(str(key), fields, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise InvalidInputError(
                    f"recipe {name!r}: unknown key {section}.{key}{hint}; "
                    f"known keys: {', '.join(fields)}"
                )
        for key, (types, required, allowed) in fields.items():
            value = values.get(key)
            where = f"recipe {name!r}: {section}.{key}"
            if value is None:
                if required:
                    raise InvalidInputError(f"{where} is required but not set")
                continue
            if isinstance(value, bool) and bool not in types:
                raise InvalidInputError(f"{where} = {value!r} must be a {types[0].__name__}")
            if not isinstance(value, types):
                want = " or ".join(t.__name__ for t in types)
                raise InvalidInputError(f"{where} = {value!r} must be a {want}")
            if isinstance(value, str) and str in types and int in types and value != AUTO:
                raise InvalidInputError(f"{where} = {value!r} must be an int or 'auto'")
            if allowed is not None and value not in allowed:
                raise InvalidInputError(f"{where} = {value!r} must be one of {list(allowed)}")
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise InvalidInputError(f"{where} = {value} must be >= 0")
            if isinstance(value, float) and not math.isfinite(value):
                raise InvalidInputError(f"{where} = {value} must be a finite number")
            bounds = _RANGES.get((section, key))
            if bounds is not None and not isinstance(value, bool):
                _check_range(where, value, *bounds)


def _check_range(
    where: str, value: float, low: float | None, high: float | None, low_open: bool, high_open: bool
) -> None:
    below = low is not None and (value <= low if low_open else value < low)
    above = high is not None and (value >= high if high_open else value > high)
    if below or above:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + str(low)
        hi = "inf)" if high is None else str(high) + (")" if high_open else "]")
        raise InvalidInputError(f"{where} = {value} must be in {lo}, {hi}")


def _positive(name: str, section: str, values: dict[str, Any], keys: Iterable[str]) -> None:
    for key in keys:
        v = values.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v == 0:
            raise InvalidInputError(f"recipe {name!r}: {section}.{key} must be >= 1, got 0")


def _check_model(name: str, m: dict[str, Any]) -> None:
    where = f"recipe {name!r}: model"
    _positive(name, "model", m, ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
    if m.get("multi_latent_attention"):
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if not m.get(key):
                raise InvalidInputError(
                    f"{where}.{key} is required when multi_latent_attention is true"
                )
    elif not m.get("kv_channels") and m["hidden_size"] % m["num_attention_heads"]:
        raise InvalidInputError(
            f"{where}.hidden_size {m['hidden_size']} is not divisible by num_attention_heads "
            f"{m['num_attention_heads']}; set kv_channels explicitly"
        )
    dense = int(m.get("first_k_dense_layers") or 0)
    if dense > m["num_layers"]:
        raise InvalidInputError(
            f"{where}.first_k_dense_layers {dense} exceeds num_layers {m['num_layers']}"
        )
    experts = m.get("num_experts")
    if not experts:
        return
    for key in ("moe_ffn_hidden_size", "moe_router_topk"):
        if not m.get(key):
            raise InvalidInputError(f"{where}.{key} is required when num_experts is set")
    topk = m["moe_router_topk"]
    if topk > experts:
        raise InvalidInputError(f"{where}.moe_router_topk {topk} exceeds num_experts {experts}")
    groups = m.get("moe_router_num_groups")
    if groups:
        if experts % groups:
            raise InvalidInputError(
                f"{where}.moe_router_num_groups {groups} does not divide num_experts {experts}"
            )
        group_topk = m.get("moe_router_group_topk")
        if not group_topk or group_topk > groups:
            raise InvalidInputError(
                f"{where}.moe_router_group_topk {group_topk!r} must be in 1..{groups} "
                "(moe_router_num_groups) when groups are set"
            )
        if topk > group_topk * (experts // groups):
            raise InvalidInputError(
                f"{where}.moe_router_topk {topk} exceeds the experts of the selected groups "
                f"({group_topk} groups x {experts // groups} experts)"
            )


def _check_parallelism(name: str, m: dict[str, Any], p: dict[str, Any]) -> None:
    where = f"recipe {name!r}: parallelism"
    _positive(
        name,
        "parallelism",
        p,
        (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_tensor_parallel_size",
            "context_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "expert_model_parallel_size",
        ),
    )
    tp = p["tensor_model_parallel_size"]
    if m["num_attention_heads"] % tp:
        raise InvalidInputError(
            f"{where}.tensor_model_parallel_size {tp} does not divide num_attention_heads "
            f"{m['num_attention_heads']}"
        )
    ep = p["expert_model_parallel_size"]
    experts = int(m.get("num_experts") or 0)
    if isinstance(ep, int) and ep > 1 and (not experts or experts % ep):
        raise InvalidInputError(
            f"{where}.expert_model_parallel_size {ep} does not divide num_experts {experts}; "
            f"use a divisor of {experts}"
        )
    pp = p["pipeline_model_parallel_size"]
    vpp = int(p.get("virtual_pipeline_model_parallel_size") or 1)
    first = p.get("decoder_first_pipeline_num_layers")
    last = p.get("decoder_last_pipeline_num_layers")
    layers = m["num_layers"]
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = layers - int(first or 0) - int(last or 0)
    if pp == 1 and (first is not None or last is not None):
        raise InvalidInputError(
            f"{where}: decoder_first/last_pipeline_num_layers need pipeline_model_parallel_size > 1"
        )
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0):
        raise InvalidInputError(
            f"{where}: first/last stage layers ({first}, {last}) do not add up to "
            f"num_layers {layers}"
        )
    if middle_stages and middle_layers % (middle_stages * vpp):
        raise InvalidInputError(
            f"{where}: {middle_layers} decoder layers do not split evenly over {middle_stages} "
            f"pipeline stages x {vpp} virtual stages; set decoder_first/last_pipeline_num_layers "
            "or change pipeline_model_parallel_size"
        )


def _check_training(name: str, t: dict[str, Any]) -> None:
    _positive(name, "training", t, ("micro_batch_size", "global_batch_size", "train_iters"))
    if t.get("min_lr") is not None and t["min_lr"] > t["lr"]:
        raise InvalidInputError(
            f"recipe {name!r}: training.min_lr {t['min_lr']} exceeds lr {t['lr']}"
        )
    if t["global_batch_size"] % t["micro_batch_size"]:
        raise InvalidInputError(
            f"recipe {name!r}: training.global_batch_size {t['global_batch_size']} is not a "
            f"multiple of micro_batch_size {t['micro_batch_size']}"
        )


def _check_dispatcher(name: str, d: dict[str, Any], m: dict[str, Any], p: dict[str, Any]) -> None:
    from uccl_ep_megatron.core.config import MAX_TOPK

    sms = d.get("num_sms")
    if sms is not None and (sms < 2 or sms % 2):
        raise InvalidInputError(
            f"recipe {name!r}: dispatcher.num_sms = {sms} must be an even number >= 2 (each "
            "channel of the kernels uses a send and a receive SM)"
        )
    if d.get("fp8_dispatch") and m["hidden_size"] % 128:
        raise InvalidInputError(
            f"recipe {name!r}: dispatcher.fp8_dispatch scales every 128 channels; "
            f"model.hidden_size {m['hidden_size']} is not a multiple of 128"
        )
    experts = m.get("moe_experts") or "auto"
    if d.get("sync_free") and experts not in ("auto", "TorchGroupedMLP"):
        raise InvalidInputError(
            f"recipe {name!r}: dispatcher.sync_free packs the experts' rows on the GPU, and "
            f"model.moe_experts {experts} reads its counts on the host: use TorchGroupedMLP "
            "(or auto where Transformer Engine is absent), or leave dispatcher.sync_free off"
        )
    copies = int(m.get("moe_router_topk") or 0) * int(p.get("expert_tensor_parallel_size") or 1)
    if d["type"] == "uccl_ep" and copies > MAX_TOPK:
        raise InvalidInputError(
            f"recipe {name!r}: model.moe_router_topk x parallelism.expert_tensor_parallel_size "
            f"= {copies} routed copies per token; the uccl_ep dispatcher moves at most "
            f"{MAX_TOPK}: lower them or use dispatcher.type alltoall"
        )


def _check_cluster(name: str, c: dict[str, Any]) -> None:
    _positive(name, "cluster", c, ("gpus_per_node", "nodes"))
    from uccl_ep_megatron.cluster.launch import nic_presets

    presets = nic_presets()
    if c["nic_preset"] not in presets:
        raise InvalidInputError(
            f"recipe {name!r}: cluster.nic_preset {c['nic_preset']!r} is unknown; "
            f"presets: {', '.join(sorted(presets))}"
        )


def check(name: str, data: dict[str, Any]) -> None:
    """Check a merged recipe mapping against the schema (raises ``InvalidInputError``)."""
    _check_sections(name, data)
    _check_model(name, data["model"])
    _check_parallelism(name, data["model"], data["parallelism"])
    _check_training(name, data["training"])
    _check_dispatcher(name, data["dispatcher"], data["model"], data["parallelism"])
    _check_cluster(name, data["cluster"])


__all__ = ["AUTO", "MOE_EXPERTS", "check"]

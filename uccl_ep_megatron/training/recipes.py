"""Training recipes: load, merge and validate the YAML files under ``recipes/``.

A recipe is a YAML mapping with six sections. Keys of ``model``, ``parallelism`` and
``training`` are Megatron-LM argument names (``num_layers`` is ``--num-layers``), so a recipe
renders 1:1 into a Megatron command line and into a megatron-core ``TransformerConfig``:

- ``model``: architecture (DeepSeek-V3: MLA, dense + MoE layers, group-limited routing, MTP).
- ``parallelism``: TP / PP / VPP / EP / ETP / CP and the uneven first/last pipeline stages.
- ``training``: batch sizes, optimizer, precision (``bf16`` or ``fp8``), iterations.
- ``dispatcher``: ``uccl_ep`` knobs (SMs, proxy threads, transport, inflight caps).
- ``cluster``: GPU kind, GPUs per node, default node count, NIC preset, container image.
- ``description`` / ``base``: free text, and the name of a recipe this one overrides.

``base`` merges recursively (the child's scalars win), so platform recipes only restate what
differs from the architecture they build on. Every key is checked against the schema below
on load; a typo or an impossible setting raises :class:`InvalidInputError` naming the recipe,
the key, the value and the fix, before anything is launched.
"""

from __future__ import annotations

import copy
import difflib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.core.paths import data_dirs

#: Name of the recipe ``uccl-ep-megatron train`` runs when no ``--recipe`` is given.
DEFAULT_RECIPE = "deepseek-v3/quick"

#: Extra recipe folders, ``os.pathsep``-separated, searched before the built-in ones.
RECIPE_PATH_ENV = "UCCL_EP_RECIPE_PATH"

_INT = (int,)
_NUM = (int, float)
_STR = (str,)
_BOOL = (bool,)
_AUTO = "auto"

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


class _RecipeLoader(yaml.SafeLoader):
    """``SafeLoader`` without aliases: a few lines of nested aliases (a "billion laughs" file)
    expand to billions of nodes; recipes share values through ``base:`` instead."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                "YAML aliases (*name) are not allowed in recipes; inherit with base: instead",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader subclass: no arbitrary objects


def recipe_dirs() -> list[Path]:
    """Folders searched for recipes, in order.

    ``$UCCL_EP_RECIPE_PATH`` (``os.pathsep``-separated) first, then the recipes installed with
    the package (``uccl_ep_megatron/data/recipes``), then ``recipes/`` of a source checkout.
    """
    dirs = [Path(p) for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if p]
    dirs += data_dirs("recipes")
    return [d for d in dirs if d.is_dir()]


def list_recipes() -> list[str]:
    """Names of every recipe found in :func:`recipe_dirs` (``family/name``), sorted."""
    names: set[str] = set()
    for d in recipe_dirs():
        for f in d.rglob("*.yaml"):
            names.add(f.relative_to(d).with_suffix("").as_posix())
    return sorted(names)


def _find(name: str) -> Path:
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate
    for d in recipe_dirs():
        f = d / f"{name}.yaml"
        if f.is_file():
            return f
    known = list_recipes()
    close = difflib.get_close_matches(name, known, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise InvalidInputError(
        f"unknown recipe {name!r}.{hint} Known recipes: {', '.join(known) or '(none found)'}; "
        f"or pass a path to a .yaml file, or add a folder to ${RECIPE_PATH_ENV}."
    )


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _load_raw(name: str, chain: tuple[str, ...] = ()) -> tuple[dict[str, Any], Path]:
    path = _find(name)
    if name in chain:
        raise InvalidInputError(
            f"recipe {name!r} inherits from itself through base: {' -> '.join((*chain, name))}; "
            "remove the cycle."
        )
    try:
        data = _load_yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"recipe {name!r} ({path}) is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidInputError(
            f"recipe {name!r} ({path}) must be a YAML mapping of sections, "
            f"got {type(data).__name__}"
        )
    base = data.pop("base", None)
    if base is None:
        return data, path
    if not isinstance(base, str):
        raise InvalidInputError(f"recipe {name!r}: base must be a recipe name, got {base!r}")
    parent, _ = _load_raw(base, (*chain, name))
    parent.pop("description", None)
    return _merge(parent, data), path


@dataclass(frozen=True)
class Recipe:
    """A validated training recipe (see the module docstring for the sections)."""

    name: str
    description: str
    model: dict[str, Any]
    parallelism: dict[str, Any]
    training: dict[str, Any]
    dispatcher: dict[str, Any]
    cluster: dict[str, Any]
    source: Path

    @property
    def num_moe_layers(self) -> int:
        """Decoder layers with an MoE MLP (all but the first ``first_k_dense_layers``)."""
        if not self.model.get("num_experts"):
            return 0
        return self.model["num_layers"] - int(self.model.get("first_k_dense_layers") or 0)

    def world_size(self, nodes: int | None = None) -> int:
        """GPUs of the job: ``nodes`` (default ``cluster.nodes``) x ``cluster.gpus_per_node``."""
        return int(nodes or self.cluster["nodes"]) * int(self.cluster["gpus_per_node"])

    def resolved_parallelism(self, world_size: int) -> dict[str, int]:
        """Parallel sizes for ``world_size`` ranks, with ``auto`` resolved and DP derived.

        ``expert_model_parallel_size: auto`` takes the largest EP that divides both the number
        of experts and ``world_size / (pp * etp)``.

        Raises:
            InvalidInputError: the world size does not fit the recipe's parallelism.
        """
        p = self.parallelism
        tp = int(p["tensor_model_parallel_size"])
        pp = int(p["pipeline_model_parallel_size"])
        cp = int(p.get("context_parallel_size") or 1)
        etp = int(p.get("expert_tensor_parallel_size") or 1)
        model_parallel = tp * pp * cp
        if world_size <= 0 or world_size % model_parallel:
            raise InvalidInputError(
                f"recipe {self.name!r}: world size {world_size} is not divisible by "
                f"TP*PP*CP = {tp}*{pp}*{cp} = {model_parallel}; use a multiple of {model_parallel} "
                "GPUs (nodes x gpus_per_node) or change the recipe's parallelism."
            )
        dp = world_size // model_parallel
        ep = p["expert_model_parallel_size"]
        num_experts = int(self.model.get("num_experts") or 0)
        if ep == _AUTO:
            room = world_size // (pp * etp) if world_size % (pp * etp) == 0 else 1
            ep = max(e for e in range(1, room + 1) if room % e == 0 and num_experts % e == 0)
        ep = int(ep)
        if world_size % (pp * etp * ep):
            raise InvalidInputError(
                f"recipe {self.name!r}: world size {world_size} is not divisible by "
                f"PP*ETP*EP = {pp}*{etp}*{ep} = {pp * etp * ep}; pick EP so that it divides "
                f"{world_size // (pp * etp) if world_size % (pp * etp) == 0 else world_size}."
            )
        mb = int(self.training["micro_batch_size"])
        gb = int(self.training["global_batch_size"])
        if gb % (mb * dp):
            raise InvalidInputError(
                f"recipe {self.name!r}: global_batch_size {gb} is not divisible by "
                f"micro_batch_size*DP = {mb}*{dp} = {mb * dp} at world size {world_size}; "
                f"use a multiple of {mb * dp}."
            )
        return {
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "ep": ep,
            "etp": etp,
            "dp": dp,
            "expert_dp": world_size // (pp * etp * ep),
            "vpp": int(p.get("virtual_pipeline_model_parallel_size") or 1),
            "num_microbatches": gb // (mb * dp),
        }

    def megatron_args(self, world_size: int, dispatcher: str | None = None) -> list[str]:
        """The recipe as Megatron-LM ``pretrain_gpt.py`` arguments for ``world_size`` ranks.

        Args:
            world_size: total ranks; resolves ``expert_model_parallel_size: auto``.
            dispatcher: token dispatcher override (``uccl_ep``, ``alltoall`` or ``flex``).
        """
        par = self.resolved_parallelism(world_size)
        args: list[str] = []

        def put(key: str, value: Any) -> None:
            if value is None or value is False:
                return
            flag = "--" + key.replace("_", "-")
            args.extend([flag] if value is True else [flag, str(value)])

        model = dict(self.model)
        dense = int(model.pop("first_k_dense_layers", 0) or 0)
        if model.get("num_experts"):
            moe = model["num_layers"] - dense
            put("moe_layer_freq", f"([0]*{dense}+[1]*{moe})" if dense else 1)
        if model.pop("swiglu", False):
            put("swiglu", True)
        if model.get("multi_latent_attention"):
            # Megatron's MLA builds DeepSeek-V3's latent RMSNorms only with this flag.
            put("qk_layernorm", True)
        for key, value in model.items():
            put(key, value)
        p = dict(self.parallelism)
        p["expert_model_parallel_size"] = par["ep"]
        for key, value in p.items():
            put(key, value)
        t = dict(self.training)
        precision = t.pop("precision")
        fp8_recipe = t.pop("fp8_recipe", None)
        put("bf16", True)
        if precision == "fp8":
            put("fp8_format", "e4m3")
            put("fp8_recipe", fp8_recipe or "blockwise")
        for key, value in t.items():
            put(key, value)
        kind = dispatcher or self.dispatcher["type"]
        if kind == "flex":
            put("moe_token_dispatcher_type", "flex")
            put("moe_flex_dispatcher_backend", "deepep")
        else:
            put("moe_token_dispatcher_type", kind)
        if kind == "uccl_ep" and self.dispatcher.get("num_sms"):
            put("moe_uccl_ep_num_sms", self.dispatcher["num_sms"])
        put("tokenizer_type", "NullTokenizer")
        return args

    def dispatcher_env(self) -> dict[str, str]:
        """Environment variables that carry the ``dispatcher`` knobs to the C++ core."""
        d = self.dispatcher
        env = {}
        if d.get("proxy_threads"):
            env["UCCL_EP_NUM_PROXY_THREADS"] = str(d["proxy_threads"])
        if d.get("transport") and d["transport"] != "auto":
            env["UCCL_EP_TRANSPORT"] = str(d["transport"])
        if d.get("max_inflight_bytes") is not None:
            env["UCCL_IB_MAX_INFLIGHT_BYTES"] = str(d["max_inflight_bytes"])
        if d.get("max_inflight_normal") is not None:
            env["UCCL_IB_MAX_INFLIGHT_NORMAL"] = str(d["max_inflight_normal"])
        return env


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
            if isinstance(value, str) and str in types and int in types and value != _AUTO:
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


def validate(name: str, data: dict[str, Any], source: Path) -> Recipe:
    """Check a merged recipe mapping against the schema and build a :class:`Recipe`.

    Raises:
        InvalidInputError: naming the recipe, the key, the value and the fix.
    """
    _check_sections(name, data)
    _check_model(name, data["model"])
    _check_parallelism(name, data["model"], data["parallelism"])
    _check_training(name, data["training"])
    _check_dispatcher(name, data["dispatcher"], data["model"], data["parallelism"])
    _check_cluster(name, data["cluster"])
    recipe = Recipe(
        name=name,
        description=str(data.get("description") or ""),
        model=dict(data["model"]),
        parallelism=dict(data["parallelism"]),
        training=dict(data["training"]),
        dispatcher=dict(data["dispatcher"]),
        cluster=dict(data["cluster"]),
        source=source,
    )
    # Whether a world size fits (the recipe's own cluster for `launch`, the GPUs present for
    # `train`) is checked where the world size is known: resolved_parallelism().
    return recipe


def load_recipe(name: str | None = None, overrides: dict[str, Any] | None = None) -> Recipe:
    """Load, merge (``base``) and validate a recipe.

    Args:
        name: ``family/name`` as listed by :func:`list_recipes`, or a path to a YAML file.
            Default: :data:`DEFAULT_RECIPE`.
        overrides: nested mapping merged over the file (e.g. ``{"training": {"train_iters": 5}}``).

    Raises:
        InvalidInputError: unknown recipe, bad YAML, unknown key, wrong type or impossible
            parallelism.
    """
    name = name or DEFAULT_RECIPE
    data, path = _load_raw(name)
    if overrides:
        data = _merge(data, overrides)
    return validate(name, data, path)


def parse_override(text: str) -> dict[str, Any]:
    """Parse ``section.key=value`` (value as YAML) into a nested override mapping.

    Raises:
        InvalidInputError: the text is not of that form.
    """
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise InvalidInputError(
            f"override {text!r} must look like section.key=value, e.g. training.train_iters=20"
        )
    dotted, raw = text.split("=", 1)
    section, key = dotted.split(".", 1)
    try:
        value = _load_yaml(raw)
    except yaml.YAMLError as exc:
        raise InvalidInputError(f"override {text!r}: value is not valid YAML: {exc}") from exc
    return {section: {key: value}}


__all__ = [
    "DEFAULT_RECIPE",
    "RECIPE_PATH_ENV",
    "Recipe",
    "list_recipes",
    "load_recipe",
    "parse_override",
    "recipe_dirs",
    "validate",
]

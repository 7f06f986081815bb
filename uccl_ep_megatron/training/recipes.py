"""Training recipes: load, merge and validate (``recipe_schema``) the YAML files under ``recipes/``.

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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.core.paths import data_dirs
from uccl_ep_megatron.training import recipe_schema

#: Name of the recipe ``uccl-ep-megatron train`` runs when no ``--recipe`` is given.
DEFAULT_RECIPE = "deepseek-v3/quick"
#: ``DEFAULT_RECIPE`` needs this many GPUs (of 80 GB); with fewer the default is ``SMALL_RECIPE``.
DEFAULT_RECIPE_MIN_GPUS = 4
SMALL_RECIPE = "deepseek-v3/small"


def default_recipe(gpus: int) -> str:
    """The recipe ``train`` runs without ``--recipe`` on ``gpus`` GPUs (0: the CPU smoke, which
    scales any recipe down): ``DEFAULT_RECIPE``, or ``SMALL_RECIPE`` on 1 to 3 GPUs."""
    return SMALL_RECIPE if 0 < gpus < DEFAULT_RECIPE_MIN_GPUS else DEFAULT_RECIPE


#: Extra recipe folders, ``os.pathsep``-separated, searched before the built-in ones.
RECIPE_PATH_ENV = "UCCL_EP_RECIPE_PATH"


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
        if ep == recipe_schema.AUTO:
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
        experts = model.pop("moe_experts", None)
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
        if kind == "uccl_ep" and self.dispatcher.get("fp8_dispatch"):
            put("moe_uccl_ep_fp8_dispatch", True)
        if kind == "uccl_ep" and self.dispatcher.get("sync_free"):
            put("moe_uccl_ep_sync_free", True)
        # model.moe_experts: auto leaves Megatron-LM's choice (its --transformer-impl decides).
        if experts in ("TEGroupedMLP", "GroupedMLP"):
            put("moe_grouped_gemm", True)
            put("moe_use_legacy_grouped_gemm", experts == "GroupedMLP")
        elif experts == "TorchGroupedMLP":
            put("moe_uccl_ep_grouped_experts", True)
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


def validate(name: str, data: dict[str, Any], source: Path) -> Recipe:
    """Check a merged recipe mapping against the schema and build a :class:`Recipe`.

    Raises:
        InvalidInputError: naming the recipe, the key, the value and the fix.
    """
    recipe_schema.check(name, data)
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
    "DEFAULT_RECIPE_MIN_GPUS",
    "SMALL_RECIPE",
    "default_recipe",
    "RECIPE_PATH_ENV",
    "Recipe",
    "list_recipes",
    "load_recipe",
    "parse_override",
    "recipe_dirs",
    "validate",
]

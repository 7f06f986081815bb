"""The megatron-core patches: ``uccl_ep`` in the config field's ``Literal``, ``MoELayer`` building
a ``UcclEpTokenDispatcher``, and the Transformer Engine name 0.14-0.16 miss without TE."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import typing
from collections.abc import Iterator
from typing import Any

from uccl_ep_megatron.core.errors import UnsupportedError
from uccl_ep_megatron.megatron_plugin.arguments import (
    _megatron_lm_args,
    options_from_megatron_args,
)
from uccl_ep_megatron.megatron_plugin.state import (
    _DEST,
    DISPATCHER_TYPE,
    _lock,
    _state,
    buffer_cache,
)
from uccl_ep_megatron.megatron_plugin.versions import _missing
from uccl_ep_megatron.token_dispatcher.options import get_options, set_options

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _megatron_api(version: str) -> dict[str, Any]:
    """What the patches touch, looked up before any of them is applied.

    Raises:
        UnsupportedError: naming the missing API.
    """
    try:
        from megatron.core.transformer.moe import moe_layer
        from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError as exc:
        raise _missing(f"importable MoE modules ({exc})", version) from exc
    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}.get(_DEST)
    if field is None:
        raise _missing(f"TransformerConfig field {_DEST!r}", version)
    if not hasattr(moe_layer, "MoEFlexTokenDispatcher"):
        raise _missing("megatron.core.transformer.moe.moe_layer.MoEFlexTokenDispatcher", version)
    if getattr(moe_layer, "MoELayer", None) is None:
        raise _missing("megatron.core.transformer.moe.moe_layer.MoELayer", version)
    if not callable(getattr(MoETokenDispatcher, "token_dispatch", None)):
        raise _missing("MoETokenDispatcher.token_dispatch", version)
    return {"config_cls": TransformerConfig, "field": field, "moe_layer": moe_layer}


def _extend_literal_field(api: dict[str, Any]) -> None:
    """0.16+: add ``uccl_ep`` to the ``Literal`` type of the config field."""
    config_cls, field = api["config_cls"], api["field"]
    if typing.get_origin(field.type) is not typing.Literal:
        return
    values = typing.get_args(field.type)
    if DISPATCHER_TYPE in values:
        return
    extended = typing.Literal[(*values, DISPATCHER_TYPE)]
    _state["literal"] = (field, field.type, config_cls.__annotations__.get(_DEST))
    field.type = extended
    config_cls.__annotations__[_DEST] = extended


@contextlib.contextmanager
def _flex_branch_builds_uccl_ep(moe_layer_module: Any, config: Any) -> Iterator[None]:
    from uccl_ep_megatron.token_dispatcher.dispatcher import UcclEpTokenDispatcher

    flex_cls = moe_layer_module.MoEFlexTokenDispatcher
    moe_layer_module.MoEFlexTokenDispatcher = functools.partial(
        UcclEpTokenDispatcher, buffers=buffer_cache()
    )
    config.moe_token_dispatcher_type = "flex"
    try:
        yield
    finally:
        config.moe_token_dispatcher_type = DISPATCHER_TYPE
        moe_layer_module.MoEFlexTokenDispatcher = flex_cls


def _with_grouped_experts(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``MoELayer``'s ``submodules`` argument with ``TorchGroupedMLP`` experts when the
    ``grouped_experts`` option is on and the spec holds a local expert module (``SequentialMLP``
    or the legacy ``GroupedMLP``); Transformer Engine's experts are left alone."""
    if not get_options().grouped_experts:
        return args, kwargs
    from megatron.core.transformer.moe import experts as experts_module
    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from uccl_ep_megatron.token_dispatcher.grouped_experts import with_grouped_experts

    submodules = args[0] if args else kwargs.get("submodules")
    if not isinstance(submodules, MoESubmodules):
        return args, kwargs
    spec = submodules.experts  # a ModuleSpec, or (0.17+) a functools.partial of the class
    experts = getattr(spec, "module", None) or getattr(spec, "func", None) or spec
    # The legacy GroupedMLP is gone from megatron-core 0.17.
    local = [getattr(experts_module, n, None) for n in ("SequentialMLP", "GroupedMLP")]
    if experts is None or experts not in local:
        return args, kwargs
    _log_once(
        "uccl_ep plugin: MoE experts run on TorchGroupedMLP (PyTorch grouped_mm) instead of "
        f"{experts.__name__} (--moe-uccl-ep-grouped-experts)"
    )
    if args:
        return (with_grouped_experts(submodules), *args[1:]), kwargs
    return args, {**kwargs, "submodules": with_grouped_experts(submodules)}


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def _time_dispatcher(layer: Any) -> None:
    """With ``--moe-uccl-ep-metrics``: record, and time the layer's dispatcher whatever its
    type, forward and backward (``telemetry.dispatch.instrument``, labelled by the layer's
    number); hook Megatron-LM's training log to report it (``telemetry.megatron_lm.install``)."""
    if not get_options().metrics or getattr(layer, "token_dispatcher", None) is None:
        return
    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics

    dispatch_metrics.enable(True)
    dispatch_metrics.instrument(layer.token_dispatcher, lambda: layer.layer_number or 0)
    _hook_training_log()


@functools.cache
def _hook_training_log() -> bool:
    """``telemetry.megatron_lm.install()``, tried once per process; a training log the hook
    cannot read leaves the metrics unreported, and training goes on."""
    from uccl_ep_megatron.telemetry import megatron_lm

    try:
        return megatron_lm.install()
    except UnsupportedError as exc:
        log.warning("--moe-uccl-ep-metrics: the metrics stay unreported: %s", exc)
        return False


def _patch_moe_layer(api: dict[str, Any], version: str) -> None:
    moe_layer_module = api["moe_layer"]
    moe_layer_cls = moe_layer_module.MoELayer
    original_init = moe_layer_cls.__init__
    # Only labels our metrics by layer: a release without it loses the labels, nothing else.
    original_set_layer_number = getattr(moe_layer_cls, "set_layer_number", None)

    @functools.wraps(original_init)
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        megatron_args = _megatron_lm_args()
        if megatron_args is not None:
            changes = options_from_megatron_args(megatron_args)
            if changes:
                set_options(**changes)
        args, kwargs = _with_grouped_experts(args, kwargs)
        if getattr(config, _DEST, None) != DISPATCHER_TYPE:
            original_init(self, config, *args, **kwargs)
            _time_dispatcher(self)
            return
        from uccl_ep_megatron.token_dispatcher.dispatcher import UcclEpTokenDispatcher

        with _lock, _flex_branch_builds_uccl_ep(moe_layer_module, config):
            original_init(self, config, *args, **kwargs)
        if not isinstance(self.token_dispatcher, UcclEpTokenDispatcher):
            raise _missing(
                "MoELayer constructor that builds its flex dispatcher through "
                f"moe_layer.MoEFlexTokenDispatcher (it built {type(self.token_dispatcher)!r})",
                version,
            )
        if self.layer_number is not None:
            self.token_dispatcher.layer_number = self.layer_number
        self.token_dispatcher.set_experts(self.experts)
        _time_dispatcher(self)

    _state["moe_layer"] = (moe_layer_cls, original_init, original_set_layer_number)
    moe_layer_cls.__init__ = __init__
    if original_set_layer_number is None:
        return

    @functools.wraps(original_set_layer_number)
    def set_layer_number(self, layer_number: int) -> None:
        original_set_layer_number(self, layer_number)
        if hasattr(self.token_dispatcher, "options"):  # ours: label its metrics by layer
            self.token_dispatcher.layer_number = layer_number

    moe_layer_cls.set_layer_number = set_layer_number


#: The dispatcher whose name ``uccl_ep`` takes in ``TransformerConfig.__post_init__`` when an
#: overlap flag is on (see ``_patch_config_checks``).
OVERLAP_CHECKED_AS = "alltoall"


def _overlap_checked(config: Any) -> bool:
    """A ``uccl_ep`` config with an overlap whose check lists the dispatchers it accepts: the
    EP overlap, or the shared-expert overlap where megatron-core's ``flex`` offers it."""
    if getattr(config, _DEST, None) != DISPATCHER_TYPE:
        return False
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return True
    from uccl_ep_megatron.token_dispatcher.dispatcher import flex_overlaps_shared_experts

    return bool(getattr(config, "moe_shared_expert_overlap", False)) and (
        flex_overlaps_shared_experts()
    )


def _patch_config_checks(api: dict[str, Any]) -> None:
    """Let ``--overlap-moe-expert-parallel-comm`` (and, where ``flex`` offers it,
    ``--moe-shared-expert-overlap``) accept ``uccl_ep``.

    ``TransformerConfig.__post_init__`` asserts that the EP overlap runs with ``alltoall`` or
    ``flex`` (0.19+: the shared-expert overlap too), lists inside the method that cannot be
    extended. For such a ``uccl_ep`` config the checks run with the type read as ``alltoall``,
    and ``uccl_ep`` is put back afterwards. ``alltoall``'s other checks hold for ``uccl_ep``
    too; ``flex``'s would refuse padding to capacity, which ``uccl_ep`` supports. Any other
    config is untouched (where ``flex`` refuses the shared-expert overlap, so does megatron-core
    for ``uccl_ep``).
    """
    config_cls = api["config_cls"]
    original = config_cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args: Any, **kwargs: Any) -> None:
        if not _overlap_checked(self):
            original(self, *args, **kwargs)
            return
        setattr(self, _DEST, OVERLAP_CHECKED_AS)
        try:
            original(self, *args, **kwargs)
        finally:
            if getattr(self, _DEST) == OVERLAP_CHECKED_AS:
                setattr(self, _DEST, DISPATCHER_TYPE)

    _state["post_init"] = (config_cls, original)
    config_cls.__post_init__ = __post_init__


def _define_missing_te_names() -> None:
    """megatron-core 0.14-0.16 without Transformer Engine: let the router GEMM fall back to torch.

    ``moe_utils`` imports ``te_general_gemm`` from Transformer Engine inside ``try`` but its
    router GEMM (``router_gating_linear``) tests ``te_general_gemm is not None`` even when
    the import failed, a ``NameError`` on every MoE router forward on GPU. Defining the name
    as ``None`` selects megatron-core's own torch path; nothing changes when TE is present
    (0.17+ define the name themselves).
    """
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _state["te_general_gemm"] = moe_utils


def _not_an_inference_linear(module: Any) -> bool:
    """Without Transformer Engine no inference-optimized linear exists (they subclass TE's)."""
    return False


def _fix_mtp_without_te() -> None:
    """megatron-core 0.20 (Megatron-LM main) without Transformer Engine: let MTP layers build.

    ``MultiTokenPredictionLayer`` asks ``is_inference_column_parallel_linear(eh_proj)``, an
    ``isinstance`` against the inference-optimized linears; those subclass Transformer Engine's
    classes, which are ``MagicMock`` placeholders without it, so the check raises ``TypeError``
    and no MTP model builds. Where those names are not classes, the check the MTP module uses
    answers ``False`` (the truth: such layers need TE); nothing changes where they are classes.
    """
    try:
        from megatron.core.tensor_parallel import inference_layers
        from megatron.core.transformer import multi_token_prediction as mtp
    except ImportError:  # releases without them
        return
    check = getattr(mtp, "is_inference_column_parallel_linear", None)
    names = ("InferenceColumnParallelLinear", "InferenceLayerNormColumnParallelLinear")
    classes = [getattr(inference_layers, n, None) for n in names]
    if check is None or all(isinstance(c, type) for c in classes):
        return
    mtp.is_inference_column_parallel_linear = _not_an_inference_linear
    _state["mtp_inference_check"] = (mtp, check)

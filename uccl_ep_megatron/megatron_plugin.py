"""The ``uccl_ep`` value of Megatron's ``--moe-token-dispatcher-type``.

``install()`` (idempotent, version-checked) does three things:

1. **Config**: megatron-core 0.16 types ``TransformerConfig.moe_token_dispatcher_type`` as a
   ``Literal``; ``uccl_ep`` is added to it (0.14/0.15 type it ``str``; nothing to add).
2. **Arguments**: any argparse parser that later defines ``--moe-token-dispatcher-type``
   with a ``choices`` list (Megatron-LM 0.14/0.15 hard-code it in
   ``megatron/training/arguments.py``; 0.16 generates it from the ``Literal``) accepts
   ``uccl_ep``, and gets the dispatcher's own flags in the same group:
   ``--moe-uccl-ep-num-sms``, ``--moe-uccl-ep-num-proxy-threads``,
   ``--moe-uccl-ep-transport``, ``--moe-uccl-ep-backend``, ``--moe-uccl-ep-metrics``.
3. **Model**: ``MoELayer`` builds a ``UcclEpTokenDispatcher`` when its config says
   ``uccl_ep``. Its constructor branches on the type string and rejects unknown values, so
   for such a layer the ``flex`` branch is pointed at our class for the duration of the call.
   On megatron-core 0.16 without Transformer Engine, the router GEMM's missing TE name is
   defined as ``None`` so the router runs at all (see ``_define_missing_te_names``).

Call it before Megatron parses arguments: ``python -m uccl_ep_megatron.run script.py ...``
does, as does ``uccl-ep-megatron train``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import threading
import typing
from collections.abc import Iterator
from typing import Any

from uccl_ep_megatron.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.token_dispatcher.options import (
    BACKENDS,
    TRANSPORTS,
    UcclEpOptions,
    get_options,
    set_options,
)

log = logging.getLogger(__name__)

DISPATCHER_TYPE = "uccl_ep"
SUPPORTED_VERSIONS = ("0.14", "0.15", "0.16")
_DEST = "moe_token_dispatcher_type"

_lock = threading.RLock()
_state: dict[str, Any] = {}  # what install() changed, so uninstall() can restore it


# ---- version ------------------------------------------------------------------------------
def megatron_core_version() -> str:
    """The installed megatron-core version string.

    Raises:
        UnsupportedError: megatron-core cannot be imported.
    """
    try:
        from megatron.core import package_info
    except ImportError as exc:
        raise UnsupportedError(
            "megatron-core is not importable: `pip install 'megatron-core>=0.14,<0.17'` (or put "
            f"Megatron-LM's directory on PYTHONPATH); the uccl_ep plugin needs it ({exc})"
        ) from exc
    return str(package_info.__version__)


def check_version(version: str) -> str:
    """``major.minor`` of ``version`` if supported.

    Raises:
        UnsupportedError: naming the supported versions.
    """
    parts = version.split(".")
    minor = ".".join(parts[:2])
    if minor not in SUPPORTED_VERSIONS:
        raise UnsupportedError(
            f"megatron-core {version} is not supported by the uccl_ep plugin; supported: "
            f"{', '.join(SUPPORTED_VERSIONS)} (pip install 'megatron-core>=0.14,<0.17')"
        )
    return minor


# ---- argparse -------------------------------------------------------------------------------
class _OptionAction(argparse.Action):
    """Stores the value and forwards it to the dispatcher options (validated there)."""

    def __init__(self, *args: Any, option: str, **kwargs: Any) -> None:
        self.option = option
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        value = True if self.nargs == 0 else values
        try:
            set_options(**{self.option: value})
        except InvalidInputError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, value)


def _add_plugin_arguments(container: Any) -> None:
    """The dispatcher's flags, added next to ``--moe-token-dispatcher-type``."""
    existing = container._option_string_actions  # shared by a parser and its groups
    defaults = UcclEpOptions()
    flags: list[tuple[str, dict[str, Any]]] = [
        (
            "--moe-uccl-ep-num-sms",
            dict(
                option="num_sms",
                type=int,
                default=defaults.num_sms,
                help="uccl_ep: SMs (CUs) the dispatch/combine kernels may use (even).",
            ),
        ),
        (
            "--moe-uccl-ep-num-proxy-threads",
            dict(
                option="num_proxy_threads",
                type=int,
                default=None,
                help="uccl_ep: CPU proxy threads per GPU (sets UCCL_EP_NUM_PROXY_THREADS).",
            ),
        ),
        (
            "--moe-uccl-ep-transport",
            dict(
                option="transport",
                choices=TRANSPORTS,
                default=None,
                help="uccl_ep: proxy transport (sets UCCL_EP_TRANSPORT).",
            ),
        ),
        (
            "--moe-uccl-ep-backend",
            dict(
                option="backend",
                choices=BACKENDS,
                default=None,
                help="uccl_ep: Buffer backend (default UCCL_EP_BACKEND, else auto).",
            ),
        ),
        (
            "--moe-uccl-ep-metrics",
            dict(
                option="metrics",
                nargs=0,
                default=False,
                help="uccl_ep: record per-layer dispatch/combine time, tokens per expert, bytes.",
            ),
        ),
    ]
    for flag, kwargs in flags:
        if flag not in existing:
            container.add_argument(flag, action=_OptionAction, **kwargs)


def _patched_add_argument(original):
    @functools.wraps(original)
    def add_argument(self, *args: Any, **kwargs: Any):
        action = original(self, *args, **kwargs)
        if (
            getattr(action, "dest", None) == _DEST
            and action.choices is not None
            and DISPATCHER_TYPE not in action.choices
        ):
            action.choices = [*action.choices, DISPATCHER_TYPE]
            _add_plugin_arguments(self)
        return action

    return add_argument


def _install_argparse() -> None:
    if "add_argument" in _state:
        return
    original = argparse._ActionsContainer.add_argument
    _state["add_argument"] = original
    argparse._ActionsContainer.add_argument = _patched_add_argument(original)


# ---- megatron-core ----------------------------------------------------------------------------
def _extend_literal_field() -> None:
    """0.16+: add ``uccl_ep`` to the ``Literal`` type of the config field."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}.get(_DEST)
    if field is None:
        raise UnsupportedError(
            f"TransformerConfig has no field {_DEST!r}; this megatron-core is not supported "
            f"(supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    if typing.get_origin(field.type) is not typing.Literal:
        return
    values = typing.get_args(field.type)
    if DISPATCHER_TYPE in values:
        return
    extended = typing.Literal[(*values, DISPATCHER_TYPE)]
    _state["literal"] = (field, field.type, TransformerConfig.__annotations__.get(_DEST))
    field.type = extended
    TransformerConfig.__annotations__[_DEST] = extended


@contextlib.contextmanager
def _flex_branch_builds_uccl_ep(moe_layer_module: Any, config: Any) -> Iterator[None]:
    from uccl_ep_megatron.token_dispatcher.dispatcher import UcclEpTokenDispatcher

    flex_cls = moe_layer_module.MoEFlexTokenDispatcher
    moe_layer_module.MoEFlexTokenDispatcher = UcclEpTokenDispatcher
    config.moe_token_dispatcher_type = "flex"
    try:
        yield
    finally:
        config.moe_token_dispatcher_type = DISPATCHER_TYPE
        moe_layer_module.MoEFlexTokenDispatcher = flex_cls


def _patch_moe_layer() -> None:
    from megatron.core.transformer.moe import moe_layer as moe_layer_module

    moe_layer_cls = moe_layer_module.MoELayer
    if not hasattr(moe_layer_module, "MoEFlexTokenDispatcher"):
        raise UnsupportedError(
            "megatron.core.transformer.moe.moe_layer has no MoEFlexTokenDispatcher; this "
            f"megatron-core is not supported (supported: {', '.join(SUPPORTED_VERSIONS)})"
        )
    original_init = moe_layer_cls.__init__
    original_set_layer_number = moe_layer_cls.set_layer_number

    @functools.wraps(original_init)
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        if getattr(config, _DEST, None) != DISPATCHER_TYPE:
            original_init(self, config, *args, **kwargs)
            return
        with _lock, _flex_branch_builds_uccl_ep(moe_layer_module, config):
            original_init(self, config, *args, **kwargs)
        if self.layer_number is not None:
            self.token_dispatcher.layer_number = self.layer_number

    @functools.wraps(original_set_layer_number)
    def set_layer_number(self, layer_number: int) -> None:
        original_set_layer_number(self, layer_number)
        if hasattr(self.token_dispatcher, "options"):  # ours: label its metrics by layer
            self.token_dispatcher.layer_number = layer_number

    _state["moe_layer"] = (moe_layer_cls, original_init, original_set_layer_number)
    moe_layer_cls.__init__ = __init__
    moe_layer_cls.set_layer_number = set_layer_number


def _define_missing_te_names() -> None:
    """megatron-core 0.16 without Transformer Engine: let the router's GEMM fall back to torch.

    ``moe_utils`` imports ``te_general_gemm`` from Transformer Engine inside ``try`` but its
    router GEMM (``router_gating_linear``) tests ``te_general_gemm is not None`` even when
    the import failed, a ``NameError`` on every MoE router forward on GPU. Defining the name
    as ``None`` selects megatron-core's own torch path; nothing changes when TE is present.
    """
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
        _state["te_general_gemm"] = moe_utils


def _install_megatron() -> str:
    if "megatron_version" in _state:
        return _state["megatron_version"]
    version = megatron_core_version()
    check_version(version)
    _extend_literal_field()
    _define_missing_te_names()
    _patch_moe_layer()
    _state["megatron_version"] = version
    log.info("uccl_ep plugin installed into megatron-core %s", version)
    return version


# ---- public API --------------------------------------------------------------------------------
def install(
    *,
    num_sms: int | None = None,
    num_proxy_threads: int | None = None,
    transport: str | None = None,
    backend: str | None = None,
    metrics: bool | None = None,
    deep_ep_compat: bool = False,
) -> str:
    """Make ``--moe-token-dispatcher-type uccl_ep`` work in this process.

    Args:
        num_sms, num_proxy_threads, transport, backend, metrics: dispatcher options (see
            ``token_dispatcher.options.UcclEpOptions``); ``None`` keeps the current value.
            Command-line flags parsed later override them.
        deep_ep_compat: also serve ``import deep_ep`` from this package (see
            ``uccl_ep_megatron.deep_ep_compat``); must happen before Megatron is imported.

    Returns:
        The megatron-core version patched.

    Raises:
        UnsupportedError: megatron-core missing or of an unsupported version (the message
            names the supported ones).
    """
    changes = {
        k: v
        for k, v in dict(
            num_sms=num_sms,
            num_proxy_threads=num_proxy_threads,
            transport=transport,
            backend=backend,
            metrics=metrics,
        ).items()
        if v is not None
    }
    with _lock:
        if changes:
            set_options(**changes)
        if deep_ep_compat:
            from uccl_ep_megatron import deep_ep_compat as compat

            compat.install()
        _install_argparse()
        return _install_megatron()


def is_installed() -> bool:
    """Whether ``install()`` has patched megatron-core in this process."""
    return "megatron_version" in _state


def uninstall() -> None:
    """Undo ``install()`` (argparse, config field, ``MoELayer``); options are kept."""
    with _lock:
        if "add_argument" in _state:
            argparse._ActionsContainer.add_argument = _state.pop("add_argument")
        if "literal" in _state:
            from megatron.core.transformer.transformer_config import TransformerConfig

            field, field_type, annotation = _state.pop("literal")
            field.type = field_type
            if annotation is not None:
                TransformerConfig.__annotations__[_DEST] = annotation
        if "moe_layer" in _state:
            cls, init, set_layer_number = _state.pop("moe_layer")
            cls.__init__ = init
            cls.set_layer_number = set_layer_number
        if "te_general_gemm" in _state:
            delattr(_state.pop("te_general_gemm"), "te_general_gemm")
        _state.pop("megatron_version", None)


__all__ = [
    "DISPATCHER_TYPE",
    "SUPPORTED_VERSIONS",
    "check_version",
    "get_options",
    "install",
    "is_installed",
    "megatron_core_version",
    "uninstall",
]

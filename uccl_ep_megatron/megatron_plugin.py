"""The ``uccl_ep`` value of Megatron's ``--moe-token-dispatcher-type``.

``install()`` (idempotent, version-checked, all-or-nothing) does three things:

1. **Config**: megatron-core 0.16+ types ``TransformerConfig.moe_token_dispatcher_type`` as a
   ``Literal``; ``uccl_ep`` is added to it (0.14/0.15 type it ``str``; nothing to add).
2. **Arguments**: any argparse parser that later defines ``--moe-token-dispatcher-type``
   (Megatron-LM 0.14/0.15 hard-code its ``choices`` in ``megatron/training/arguments.py``;
   0.16+ generate them from the ``Literal``) accepts ``uccl_ep``, and gets the dispatcher's own
   flags in the same group: ``--moe-uccl-ep-num-sms``, ``--moe-uccl-ep-num-proxy-threads``,
   ``--moe-uccl-ep-transport``, ``--moe-uccl-ep-backend``, ``--moe-uccl-ep-metrics``,
   ``--moe-uccl-ep-capacity-factor``, ``--moe-uccl-ep-drop-log-interval``.
3. **Model**: ``MoELayer`` builds a ``UcclEpTokenDispatcher`` when its config says
   ``uccl_ep``. Its constructor branches on the type string and rejects unknown values, so
   for such a layer the ``flex`` branch is pointed at our class for the duration of the call.
   Every layer gets the ``BufferCache`` this install made (``buffer_cache()``), so the layers
   share one ``Buffer`` per group.
   Values of the flags above found in Megatron-LM's global arguments are applied first: Primus
   (and anything else that fills Megatron's namespace without argparse) never runs the flags'
   actions. On megatron-core 0.14-0.16 without Transformer Engine, the router GEMM's missing TE
   name is defined as ``None`` so the router runs at all (see ``_define_missing_te_names``).

Versions: the releases in ``TESTED_VERSIONS`` are tested (CI and device); a newer one is tried
with an ``UntestedVersionWarning``, and ``install()`` fails only where an API the plugin needs
is missing, naming it. An older one is refused. A failed ``install()`` leaves nothing patched.

Call it before Megatron parses arguments: ``python -m uccl_ep_megatron.run script.py ...``
does, as does ``uccl-ep-megatron train``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import os
import re
import sys
import threading
import typing
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.token_dispatcher.options import (
    BACKENDS,
    ENV_OPTIONS,
    TRANSPORTS,
    UcclEpOptions,
    get_options,
    restore_options,
    set_options,
)

if TYPE_CHECKING:
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

log = logging.getLogger(__name__)

DISPATCHER_TYPE = "uccl_ep"
TESTED_VERSIONS = ("0.14", "0.15", "0.16", "0.17", "0.18", "0.19")
_DEST = "moe_token_dispatcher_type"
_INSTALL_HINT = "pip install 'megatron-core>=0.14'"

_lock = threading.RLock()
_state: dict[str, Any] = {}  # what install() changed, so uninstall() can restore it


class UntestedVersionWarning(UserWarning):
    """megatron-core is newer than the newest release in ``TESTED_VERSIONS``."""


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
            f"megatron-core is not importable: `{_INSTALL_HINT}` (or put Megatron-LM's "
            f"directory on PYTHONPATH); the uccl_ep plugin needs it ({exc})"
        ) from exc
    return str(package_info.__version__)


def _major_minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedError(
            f"megatron-core version {version!r} is not of the form MAJOR.MINOR[...]; "
            f"reinstall it ({_INSTALL_HINT})"
        )
    return int(match.group(1)), int(match.group(2))


def check_version(version: str) -> str:
    """``major.minor`` of ``version``; warns when it is newer than every tested release.

    Raises:
        UnsupportedError: older than the oldest tested release (the message names them).
    """
    got = _major_minor(version)
    tested = [_major_minor(v) for v in TESTED_VERSIONS]
    minor = f"{got[0]}.{got[1]}"
    if got < tested[0]:
        raise UnsupportedError(
            f"megatron-core {version} is older than the uccl_ep plugin supports; tested: "
            f"{', '.join(TESTED_VERSIONS)} ({_INSTALL_HINT})"
        )
    if got > tested[-1]:
        warnings.warn(
            f"megatron-core {version} is newer than the newest release the uccl_ep plugin was "
            f"tested with ({TESTED_VERSIONS[-1]}); trying it. Report problems with the version.",
            UntestedVersionWarning,
            stacklevel=3,
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
            apply_process_env(set_options(**{self.option: value}))
        except InvalidInputError as exc:
            raise argparse.ArgumentError(self, str(exc)) from None
        setattr(namespace, self.dest, value)


def apply_process_env(options: UcclEpOptions) -> None:
    """Export the options the C++ proxy reads from its environment registry
    (``UCCL_EP_NUM_PROXY_THREADS``, ``UCCL_EP_TRANSPORT``): the plugin configures the training
    process from its flags, before any ``Buffer`` exists. The dispatcher itself never writes
    the environment."""
    os.environ.update(options.env())


def _plugin_flags() -> list[tuple[str, dict[str, Any]]]:
    """(flag, add_argument kwargs); defaults are ``None`` = "keep the current option"."""
    defaults = UcclEpOptions()
    return [
        (
            "--moe-uccl-ep-num-sms",
            dict(
                option="num_sms",
                type=int,
                help=f"uccl_ep: SMs (CUs) the dispatch/combine kernels may use (even; default "
                f"{defaults.num_sms}).",
            ),
        ),
        (
            "--moe-uccl-ep-num-proxy-threads",
            dict(
                option="num_proxy_threads",
                type=int,
                help="uccl_ep: CPU proxy threads per GPU (sets UCCL_EP_NUM_PROXY_THREADS).",
            ),
        ),
        (
            "--moe-uccl-ep-transport",
            dict(
                option="transport",
                choices=TRANSPORTS,
                help="uccl_ep: proxy transport (sets UCCL_EP_TRANSPORT).",
            ),
        ),
        (
            "--moe-uccl-ep-backend",
            dict(
                option="backend",
                choices=BACKENDS,
                help="uccl_ep: Buffer backend (default UCCL_EP_BACKEND, else auto).",
            ),
        ),
        (
            "--moe-uccl-ep-metrics",
            dict(
                option="metrics",
                nargs=0,
                help="uccl_ep: record per-layer dispatch/combine time, tokens per expert, bytes.",
            ),
        ),
        (
            "--moe-uccl-ep-capacity-factor",
            dict(
                option="capacity_factor",
                type=float,
                help="uccl_ep: sync-free mode with this per-expert capacity factor (pairs past "
                "the capacity are dropped and counted); default: exact mode unless "
                "--moe-expert-capacity-factor with --moe-pad-expert-input-to-capacity is set.",
            ),
        ),
        (
            "--moe-uccl-ep-drop-log-interval",
            dict(
                option="drop_log_interval",
                type=int,
                help=f"uccl_ep: sync-free mode logs dropped pairs every N forward passes "
                f"(default {defaults.drop_log_interval}; 0 = never).",
            ),
        ),
    ]


# Megatron-LM argument name (argparse dest) -> dispatcher option.
ARG_OPTIONS = {flag[2:].replace("-", "_"): kwargs["option"] for flag, kwargs in _plugin_flags()}


def _add_plugin_arguments(container: Any) -> None:
    """The dispatcher's flags, added next to ``--moe-token-dispatcher-type``."""
    existing = container._option_string_actions  # shared by a parser and its groups
    for flag, kwargs in _plugin_flags():
        if flag not in existing:
            container.add_argument(flag, action=_OptionAction, default=None, **kwargs)


def _patched_add_argument(original):
    @functools.wraps(original)
    def add_argument(self, *args: Any, **kwargs: Any):
        action = original(self, *args, **kwargs)
        if getattr(action, "dest", None) == _DEST:
            # 0.14/0.15 hard-code the choices; 0.16+ take them from the (extended) Literal.
            if action.choices is not None and DISPATCHER_TYPE not in action.choices:
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


def options_from_megatron_args(args: Any) -> dict[str, Any]:
    """The dispatcher options set in a Megatron-LM argument namespace (``None`` = unset).

    Raises:
        InvalidInputError: a value is invalid (the message names the argument).
    """
    changes = {}
    for dest, option in ARG_OPTIONS.items():
        value = getattr(args, dest, None)
        if value is not None:
            changes[option] = value
    if changes:
        try:
            UcclEpOptions(**{**dataclasses.asdict(get_options()), **changes})
        except InvalidInputError as exc:
            names = ", ".join(
                f"{d}={getattr(args, d)!r}" for d, o in ARG_OPTIONS.items() if o in changes
            )
            raise InvalidInputError(f"Megatron arguments {names}: {exc}") from None
    return changes


def _megatron_lm_args() -> Any:
    """Megatron-LM's global arguments when its training loop has set them, else ``None``.

    Read from ``sys.modules`` only: importing ``megatron.training`` here would pull in the
    whole training stack (and fails on Python < 3.12 from megatron-core 0.18 on).
    """
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


# ---- megatron-core ----------------------------------------------------------------------------
def _missing(what: str, version: str) -> UnsupportedError:
    return UnsupportedError(
        f"megatron-core {version} has no {what}, which the uccl_ep plugin needs; it was tested "
        f"with {', '.join(TESTED_VERSIONS)}. Use one of those, or "
        "--moe-token-dispatcher-type flex with --moe-flex-dispatcher-backend deepep and "
        "`python -m uccl_ep_megatron.run --deep-ep-compat`"
    )


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


def _patch_moe_layer(api: dict[str, Any], version: str) -> None:
    moe_layer_module = api["moe_layer"]
    moe_layer_cls = moe_layer_module.MoELayer
    original_init = moe_layer_cls.__init__
    # Only labels our metrics by layer: a release without it loses the labels, nothing else.
    original_set_layer_number = getattr(moe_layer_cls, "set_layer_number", None)

    @functools.wraps(original_init)
    def __init__(self, config, *args: Any, **kwargs: Any) -> None:
        if getattr(config, _DEST, None) != DISPATCHER_TYPE:
            original_init(self, config, *args, **kwargs)
            return
        from uccl_ep_megatron.token_dispatcher.dispatcher import UcclEpTokenDispatcher

        megatron_args = _megatron_lm_args()
        if megatron_args is not None:
            changes = options_from_megatron_args(megatron_args)
            if changes:
                apply_process_env(set_options(**changes))
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


def _install_megatron() -> str:
    if "megatron_version" in _state:
        return _state["megatron_version"]
    version = megatron_core_version()
    check_version(version)
    api = _megatron_api(version)
    _extend_literal_field(api)
    _define_missing_te_names()
    _patch_moe_layer(api, version)
    _state["megatron_version"] = version
    log.info("uccl_ep plugin installed into megatron-core %s", version)
    return version


def _undo(keys: set[str]) -> None:
    """Reverse the patches recorded under ``keys`` in ``_state``."""
    if "add_argument" in keys:
        argparse._ActionsContainer.add_argument = _state.pop("add_argument")
    if "literal" in keys:
        from megatron.core.transformer.transformer_config import TransformerConfig

        field, field_type, annotation = _state.pop("literal")
        field.type = field_type
        if annotation is not None:
            TransformerConfig.__annotations__[_DEST] = annotation
    if "moe_layer" in keys:
        cls, init, set_layer_number = _state.pop("moe_layer")
        cls.__init__ = init
        if set_layer_number is not None:
            cls.set_layer_number = set_layer_number
    if "te_general_gemm" in keys:
        delattr(_state.pop("te_general_gemm"), "te_general_gemm")
    if "megatron_version" in keys:
        _state.pop("megatron_version")
    if "buffers" in keys:
        _state.pop("buffers").clear()


# ---- public API --------------------------------------------------------------------------------
def install(
    *,
    num_sms: int | None = None,
    num_proxy_threads: int | None = None,
    transport: str | None = None,
    backend: str | None = None,
    metrics: bool | None = None,
    capacity_factor: float | None = None,
    deep_ep_compat: bool = False,
) -> str:
    """Make ``--moe-token-dispatcher-type uccl_ep`` work in this process.

    All or nothing: when it raises, argparse, megatron-core, the dispatcher options, the
    environment they export and the ``deep_ep`` module are as they were before the call.

    Args:
        num_sms, num_proxy_threads, transport, backend, metrics, capacity_factor: dispatcher
            options (see
            ``token_dispatcher.options.UcclEpOptions``); ``None`` keeps the current value.
            Command-line flags parsed later override them.
        deep_ep_compat: also serve ``import deep_ep`` from this package (see
            ``uccl_ep_megatron.deep_ep_compat``); must happen before Megatron is imported.

    Returns:
        The megatron-core version patched.

    Raises:
        UnsupportedError: megatron-core missing, older than the tested releases, or lacking
            an API the plugin needs (the message names it). A newer, untested release only
            warns (``UntestedVersionWarning``).
        InvalidInputError: an invalid option value.
    """
    changes = {
        k: v
        for k, v in dict(
            num_sms=num_sms,
            num_proxy_threads=num_proxy_threads,
            transport=transport,
            backend=backend,
            metrics=metrics,
            capacity_factor=capacity_factor,
        ).items()
        if v is not None
    }
    with _lock:
        before = set(_state)
        saved_options = get_options()
        saved_env = {name: os.environ.get(name) for name in ENV_OPTIONS.values()}
        compat = None
        if deep_ep_compat:
            import uccl_ep_megatron.deep_ep_compat as compat
        compat_was_installed = compat is not None and compat.is_installed()
        try:
            if changes:
                apply_process_env(set_options(**changes))
            if compat is not None:
                compat.install()
            _install_argparse()
            return _install_megatron()
        except BaseException:
            _undo(set(_state) - before)
            restore_options(saved_options)
            for name, value in saved_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            if compat is not None and not compat_was_installed:
                compat.uninstall()
            raise


def buffer_cache() -> BufferCache:
    """The ``BufferCache`` shared by the ``uccl_ep`` layers this process builds (made on first
    use; ``uninstall()`` drops it, and its buffers once no layer holds them)."""
    # Imported here: the plugin must import without torch.distributed's Buffer machinery.
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

    with _lock:
        cache = _state.get("buffers")
        if cache is None:
            cache = _state["buffers"] = BufferCache()
        return cache


def is_installed() -> bool:
    """Whether ``install()`` has patched megatron-core in this process."""
    return "megatron_version" in _state


def uninstall() -> None:
    """Undo ``install()`` (argparse, config field, ``MoELayer``); options are kept."""
    with _lock:
        _undo(set(_state))


__all__ = [
    "ARG_OPTIONS",
    "DISPATCHER_TYPE",
    "TESTED_VERSIONS",
    "UntestedVersionWarning",
    "apply_process_env",
    "buffer_cache",
    "check_version",
    "get_options",
    "install",
    "is_installed",
    "megatron_core_version",
    "options_from_megatron_args",
    "uninstall",
]

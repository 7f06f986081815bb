"""The dispatcher's Megatron-LM flags (``--moe-uccl-ep-*``) and ``uccl_ep`` among the choices of
``--moe-token-dispatcher-type``.

``add_arguments`` is a Megatron-LM ``extra_args_provider``. Where Megatron-LM's
``megatron.training.arguments`` exists, ``install()`` chains it into that module's
``parse_args`` as the module is imported (an import hook on that one module), so unmodified
entry scripts get the flags through Megatron's own mechanism and argparse is left alone.
Elsewhere (no Megatron-LM training package: stand-in scripts, other frameworks) the remaining
fallback wraps ``argparse``'s ``add_argument``; it acts only on a parser that defines
``--moe-token-dispatcher-type``. ``uninstall()`` undoes either. Values are also read back from
Megatron-LM's global arguments where nothing ran the flags' actions (Primus)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.abc
import importlib.util
import inspect
import sys
from typing import Any

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.megatron_plugin.state import _DEST, DISPATCHER_TYPE, _state
from uccl_ep_megatron.token_dispatcher.options import (
    BACKENDS,
    TRANSPORTS,
    UcclEpOptions,
    get_options,
    set_options,
)


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
                help="record per-layer dispatch/combine time of every MoE dispatcher (forward and "
                "backward), tokens per expert, bytes.",
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
            "--moe-uccl-ep-sync-free",
            dict(
                option="sync_free",
                nargs=0,
                help="uccl_ep: sync-free mode (no host sync per layer); without a capacity factor "
                "it drops nothing, its expert rows bounded by what a rank can receive (needs "
                "--moe-uccl-ep-grouped-experts).",
            ),
        ),
        (
            "--moe-uccl-ep-grouped-experts",
            dict(
                option="grouped_experts",
                nargs=0,
                help="MoE layers of local (non-Transformer-Engine) specs run their experts on "
                "PyTorch's grouped_mm (TorchGroupedMLP, bf16) instead of SequentialMLP, with "
                "any dispatcher.",
            ),
        ),
        (
            "--moe-uccl-ep-fp8-dispatch",
            dict(
                option="fp8_dispatch",
                nargs=0,
                help="uccl_ep: dispatch tokens in FP8 (E4M3, a float32 scale per 128 channels), "
                "dequantized for the experts; combine and gradients stay bf16.",
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


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM ``extra_args_provider``: ``uccl_ep`` joins the choices of
    ``--moe-token-dispatcher-type`` (where the parser defines it with fixed choices) and the
    ``--moe-uccl-ep-*`` flags are added. Pass it to ``pretrain(..., extra_args_provider=...)``
    in a script of your own; ``install()`` chains it into Megatron-LM's ``parse_args``."""
    action = parser._option_string_actions.get("--moe-token-dispatcher-type")
    if action is not None and action.choices is not None and DISPATCHER_TYPE not in action.choices:
        action.choices = [*action.choices, DISPATCHER_TYPE]
    if not any(flag in parser._option_string_actions for flag, _ in _plugin_flags()):
        _add_plugin_arguments(parser.add_argument_group(title="uccl_ep dispatcher"))
    return parser


#: The Megatron-LM module whose ``parse_args`` gets ``add_arguments`` chained in.
MEGATRON_LM_ARGUMENTS = "megatron.training.arguments"


def _megatron_lm_present() -> bool:
    """Whether Megatron-LM's training package is installed (found without importing it: its
    ``__init__`` pulls in the whole training stack)."""
    parent = MEGATRON_LM_ARGUMENTS.rsplit(".", 1)[0]
    try:
        return importlib.util.find_spec(parent) is not None
    except (ImportError, ValueError):
        return False


def _chain_parse_args(module: Any) -> None:
    """Make ``module.parse_args`` run ``add_arguments`` after any provider the caller passes,
    and ``module.add_megatron_arguments`` (0.17+: what ``parse_args`` and Primus' argument
    builder call to fill a parser) end with it."""
    original = module.parse_args
    signature = inspect.signature(original)
    if "extra_args_provider" not in signature.parameters:
        _install_argparse()  # not the parse_args this hook knows: the fallback serves it
        return
    builder = getattr(module, "add_megatron_arguments", None)
    if callable(builder):

        @functools.wraps(builder)
        def add_megatron_arguments(parser, *args: Any, **kwargs: Any):
            parser = builder(parser, *args, **kwargs)
            return add_arguments(parser) if "parse_args_hook" in _state else parser

        module.add_megatron_arguments = add_megatron_arguments
        _state["add_megatron_arguments_original"] = (module, builder)

    @functools.wraps(original)
    def parse_args(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        other = bound.arguments.get("extra_args_provider")
        if "parse_args_hook" in _state:  # installed: chain ours in

            def provider(parser):
                return add_arguments(other(parser) if other is not None else parser)

            bound.arguments["extra_args_provider"] = provider
        return original(*bound.args, **bound.kwargs)

    module.parse_args = parse_args
    _state["parse_args_original"] = (module, original)


class _Loader(importlib.abc.Loader):
    """The module's own loader, then ``_chain_parse_args`` on the fresh module."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _chain_parse_args(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename ... of the real loader
        return getattr(self.inner, name)


class _ParseArgsHook(importlib.abc.MetaPathFinder):
    """Finds ``MEGATRON_LM_ARGUMENTS`` through the other finders and wraps its loader."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MEGATRON_LM_ARGUMENTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def _install_arguments() -> None:
    """Chain ``add_arguments`` into Megatron-LM's ``parse_args`` (now if its module is already
    imported, else when it is), or, without Megatron-LM, wrap argparse's ``add_argument``."""
    if "parse_args_hook" in _state or "add_argument" in _state:
        return
    if not _megatron_lm_present():
        _install_argparse()
        return
    hook = _ParseArgsHook()
    _state["parse_args_hook"] = hook
    module = sys.modules.get(MEGATRON_LM_ARGUMENTS)
    if module is not None:
        _chain_parse_args(module)
    else:
        sys.meta_path.insert(0, hook)


def _uninstall_arguments() -> None:
    hook = _state.pop("parse_args_hook", None)
    if hook is not None and hook in sys.meta_path:
        sys.meta_path.remove(hook)
    saved = _state.pop("parse_args_original", None)
    if saved is not None:
        module, original = saved
        module.parse_args = original
    saved = _state.pop("add_megatron_arguments_original", None)
    if saved is not None:
        module, original = saved
        module.add_megatron_arguments = original
    if "add_argument" in _state:
        argparse._ActionsContainer.add_argument = _state.pop("add_argument")


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

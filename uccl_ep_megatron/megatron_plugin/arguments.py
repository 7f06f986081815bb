"""The dispatcher's Megatron-LM flags (``--moe-uccl-ep-*``): added next to
``--moe-token-dispatcher-type`` by a patched ``argparse`` ``add_argument``, and read back from
Megatron-LM's global arguments where nothing ran their actions (Primus)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
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

"""The ``uccl_ep`` value of Megatron's ``--moe-token-dispatcher-type``.

``install()`` (idempotent, version-checked, all-or-nothing) does four things:

1. **Config**: megatron-core 0.16+ types ``TransformerConfig.moe_token_dispatcher_type`` as a
   ``Literal``; ``uccl_ep`` is added to it (0.14/0.15 type it ``str``; nothing to add).
2. **Arguments**: Megatron-LM's ``parse_args`` (``megatron/training/arguments.py``; 0.14/0.15
   hard-code the flag's ``choices``, 0.16+ generate them from the ``Literal``) gets
   ``add_arguments`` chained in as its ``extra_args_provider`` when that module is imported, so
   ``--moe-token-dispatcher-type`` accepts ``uccl_ep`` and the dispatcher's own flags exist;
   without Megatron-LM's training package, a parser that defines the flag gets them through a
   wrapped argparse ``add_argument`` (``arguments`` says more). The flags:
   ``--moe-uccl-ep-num-sms``, ``--moe-uccl-ep-num-proxy-threads``, ``--moe-uccl-ep-backend``,
   ``--moe-uccl-ep-metrics``, ``--moe-uccl-ep-capacity-factor``, ``--moe-uccl-ep-sync-free``,
   ``--moe-uccl-ep-drop-log-interval``, ``--moe-uccl-ep-grouped-experts``,
   ``--moe-uccl-ep-fp8-dispatch``.
3. **Model**: ``MoELayer`` builds a ``UcclEpTokenDispatcher`` when its config says
   ``uccl_ep``. Its constructor branches on the type string and rejects unknown values, so
   for such a layer the ``flex`` branch is pointed at our class for the duration of the call.
   Every layer gets the ``BufferCache`` this install made (``buffer_cache()``), so the layers
   share one ``Buffer`` per group. With ``--moe-uccl-ep-grouped-experts`` (option
   ``grouped_experts``) every MoE layer whose spec holds a local expert module (no Transformer
   Engine) builds ``TorchGroupedMLP`` (PyTorch's grouped_mm) instead, whatever its dispatcher.
   Values of the flags above found in Megatron-LM's global arguments are applied first: Primus
   (and anything else that fills Megatron's namespace without argparse) never runs the flags'
   actions. On megatron-core 0.14-0.16 without Transformer Engine, the router GEMM's missing TE
   name is defined as ``None`` so the router runs at all (see ``_define_missing_te_names``);
   on 0.20 without TE, MTP layers build (``_fix_mtp_without_te``).
4. **EP overlap**: ``--overlap-moe-expert-parallel-comm`` accepts ``uccl_ep``:
   ``TransformerConfig.__post_init__``'s overlap check, which lists ``alltoall`` and ``flex``,
   reads a ``uccl_ep`` config with the overlap on as ``alltoall`` (``_patch_config_checks``);
   the dispatcher then runs dispatch and combine asynchronously on its Buffer's communication
   stream, as the ``flex`` dispatcher's DeepEP path does. Where megatron-core's ``flex``
   overlaps the shared expert (0.19+), ``--moe-shared-expert-overlap`` is accepted likewise.

Versions: the releases in ``TESTED_VERSIONS`` are tested (CI and device); a newer one is tried
with an ``UntestedVersionWarning``, and ``install()`` fails only where an API the plugin needs
is missing, naming it. An older one is refused. A failed ``install()`` leaves nothing patched.

Call it before Megatron parses arguments: ``python -m uccl_ep_megatron.run script.py ...``
does, as does ``uccl-ep-megatron train``.

The package: this module installs and undoes; ``state`` holds what was changed and the buffer
cache, ``versions`` the version policy, ``arguments`` the flags (2.), ``model`` the
megatron-core patches (1., 3., 4.).
"""

from __future__ import annotations

import logging

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.megatron_plugin.arguments import (
    ARG_OPTIONS,
    _install_arguments,
    _uninstall_arguments,
    add_arguments,
    options_from_megatron_args,
)
from uccl_ep_megatron.megatron_plugin.model import (
    _define_missing_te_names,
    _extend_literal_field,
    _fix_mtp_without_te,
    _megatron_api,
    _patch_config_checks,
    _patch_moe_layer,
)
from uccl_ep_megatron.megatron_plugin.state import (
    _DEST,
    DISPATCHER_TYPE,
    _lock,
    _state,
    buffer_cache,
)
from uccl_ep_megatron.megatron_plugin.versions import (
    TESTED_VERSIONS,
    UntestedVersionWarning,
    check_version,
    megatron_core_version,
)
from uccl_ep_megatron.token_dispatcher.options import (
    get_options,
    restore_options,
    set_options,
)

log = logging.getLogger(__name__)


def _install_megatron() -> str:
    if "megatron_version" in _state:
        return _state["megatron_version"]
    version = megatron_core_version()
    check_version(version)
    api = _megatron_api(version)
    _extend_literal_field(api)
    _define_missing_te_names()
    _fix_mtp_without_te()
    _patch_config_checks(api)
    _patch_moe_layer(api, version)
    _state["megatron_version"] = version
    log.info("uccl_ep plugin installed into megatron-core %s", version)
    return version


def _undo(keys: set[str]) -> None:
    """Reverse the patches recorded under ``keys`` in ``_state``."""
    if keys & {
        "add_argument",
        "parse_args_hook",
        "parse_args_original",
        "add_megatron_arguments_original",
    }:
        _uninstall_arguments()
    if "literal" in keys:
        from megatron.core.transformer.transformer_config import TransformerConfig

        field, field_type, annotation = _state.pop("literal")
        field.type = field_type
        if annotation is not None:
            TransformerConfig.__annotations__[_DEST] = annotation
    if "post_init" in keys:
        cls, original = _state.pop("post_init")
        cls.__post_init__ = original
    if "moe_layer" in keys:
        cls, init, set_layer_number = _state.pop("moe_layer")
        cls.__init__ = init
        if set_layer_number is not None:
            cls.set_layer_number = set_layer_number
    if "te_general_gemm" in keys:
        delattr(_state.pop("te_general_gemm"), "te_general_gemm")
    if "mtp_inference_check" in keys:
        module, check = _state.pop("mtp_inference_check")
        module.is_inference_column_parallel_linear = check
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
    sync_free: bool | None = None,
    grouped_experts: bool | None = None,
    fp8_dispatch: bool | None = None,
    deep_ep_compat: bool = False,
) -> str:
    """Make ``--moe-token-dispatcher-type uccl_ep`` work in this process.

    All or nothing: when it raises, argparse, megatron-core, the dispatcher options, the
    environment they export and the ``deep_ep`` module are as they were before the call.

    Args:
        num_sms, num_proxy_threads, transport, backend, metrics, capacity_factor,
            sync_free, grouped_experts, fp8_dispatch: dispatcher options (see
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
        InvalidInputError: an invalid option value (``metrics`` and ``deep_ep_compat`` must
            be ``True`` or ``False``: a string such as ``"no"`` would read as true).
    """
    for name, value, optional in (
        ("metrics", metrics, True),
        ("deep_ep_compat", deep_ep_compat, False),
    ):
        if not isinstance(value, bool) and not (optional and value is None):
            raise InvalidInputError(
                f"install({name}={value!r}): must be True or False"
                + (" (or None to keep the current value)" if optional else "")
            )
    changes = {
        k: v
        for k, v in dict(
            num_sms=num_sms,
            num_proxy_threads=num_proxy_threads,
            transport=transport,
            backend=backend,
            metrics=metrics,
            capacity_factor=capacity_factor,
            sync_free=sync_free,
            grouped_experts=grouped_experts,
            fp8_dispatch=fp8_dispatch,
        ).items()
        if v is not None
    }
    with _lock:
        before = set(_state)
        saved_options = get_options()
        compat = None
        if deep_ep_compat:
            import uccl_ep_megatron.deep_ep_compat as compat
        compat_was_installed = compat is not None and compat.is_installed()
        try:
            if changes:
                set_options(**changes)
            if compat is not None:
                compat.install()
            _install_arguments()
            return _install_megatron()
        except BaseException:
            _undo(set(_state) - before)
            restore_options(saved_options)
            if compat is not None and not compat_was_installed:
                compat.uninstall()
            raise


def is_installed() -> bool:
    """Whether ``install()`` has patched megatron-core in this process."""
    return "megatron_version" in _state


def uninstall() -> None:
    """Undo ``install()`` (argparse, config field, ``MoELayer``); options are kept."""
    with _lock:
        _undo(set(_state))


__all__ = [
    "ARG_OPTIONS",
    "add_arguments",
    "DISPATCHER_TYPE",
    "TESTED_VERSIONS",
    "UntestedVersionWarning",
    "buffer_cache",
    "check_version",
    "get_options",
    "install",
    "is_installed",
    "megatron_core_version",
    "options_from_megatron_args",
    "uninstall",
]

"""Opt-in DeepEP drop-in: expose ``uccl_ep_megatron.Buffer`` under the module name ``deep_ep``.

Off by default. When enabled, ``import deep_ep`` (and ``from deep_ep.utils import
EventOverlap, EventHandle``) returns a module backed by this package, so code written for
DeepEP's normal mode runs unchanged on it: Megatron-Core's ``flex`` dispatcher with the
``deepep`` backend (``megatron/core/transformer/moe/fused_a2a.py``) and Primus-Turbo's
``DEEP_EP`` backend. Only the high-throughput API exists; low-latency entry points and
``HybridEPBuffer`` do not, and importing them fails as it does without DeepEP.

Enable it before the code that imports ``deep_ep`` is imported (Megatron binds the names at
import time): ``python -m uccl_ep_megatron.run --deep-ep-compat script.py ...`` or
``uccl_ep_megatron.deep_ep_compat.install()`` first thing in the entry script.
"""

from __future__ import annotations

import importlib.util
import sys
import types

from uccl_ep_megatron.api.buffer import Buffer
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import UnsupportedError
from uccl_ep_megatron.core.events import EventOverlap, capture

MODULE_NAME = "deep_ep"
_MARKER = "__uccl_ep_megatron_compat__"


class EventHandle:
    """DeepEP's ``EventHandle()``: an event recorded on the current stream when constructed.

    Constructing it returns the recorded ``torch.cuda.Event`` (``None`` before CUDA is in
    use), which ``EventOverlap(EventHandle())`` wraps as ``previous_event``.
    """

    def __new__(cls):  # noqa: D102 - documented on the class
        return capture().event


def is_installed() -> bool:
    """Whether ``deep_ep`` currently resolves to this package."""
    mod = sys.modules.get(MODULE_NAME)
    return mod is not None and getattr(mod, _MARKER, False)


def install(replace_real: bool = False) -> types.ModuleType:
    """Register the ``deep_ep`` and ``deep_ep.utils`` modules backed by this package.

    Args:
        replace_real: also shadow a real DeepEP installation. Without it a real ``deep_ep``
            that is importable (or imported) is an error, so nobody swaps backends unaware.

    Returns:
        The ``deep_ep`` module object.

    Raises:
        UnsupportedError: a real DeepEP is present and ``replace_real`` is ``False``, or
            Megatron's ``fused_a2a`` was already imported (it would keep its old binding).
    """
    if is_installed():
        return sys.modules[MODULE_NAME]
    if not replace_real:
        real = sys.modules.get(MODULE_NAME)
        if real is not None or importlib.util.find_spec(MODULE_NAME) is not None:
            raise UnsupportedError(
                "a real DeepEP (deep_ep) is installed; the uccl_ep_megatron drop-in would "
                "shadow it. Pass replace_real=True (run: --deep-ep-compat-replace) to do so, "
                "or use --moe-token-dispatcher-type uccl_ep instead"
            )
    fused = sys.modules.get("megatron.core.transformer.moe.fused_a2a")
    if fused is not None and not getattr(fused, "HAVE_DEEP_EP", False):
        raise UnsupportedError(
            "megatron.core.transformer.moe.fused_a2a was imported before the deep_ep drop-in "
            "was installed and has no DeepEP binding; call deep_ep_compat.install() (or run "
            "with `python -m uccl_ep_megatron.run --deep-ep-compat`) before importing Megatron"
        )
    utils = types.ModuleType(MODULE_NAME + ".utils")
    utils.EventOverlap = EventOverlap
    utils.EventHandle = EventHandle
    setattr(utils, _MARKER, True)
    mod = types.ModuleType(MODULE_NAME)
    mod.__doc__ = "DeepEP normal-mode API served by uccl_ep_megatron (deep_ep_compat)."
    mod.Buffer = Buffer
    mod.Config = Config
    mod.EventOverlap = EventOverlap
    mod.utils = utils
    mod.__path__ = []  # a package, so `import deep_ep.utils` resolves through sys.modules
    setattr(mod, _MARKER, True)
    sys.modules[MODULE_NAME] = mod
    sys.modules[MODULE_NAME + ".utils"] = utils
    return mod


def uninstall() -> None:
    """Remove the drop-in modules (only if they are ours)."""
    if is_installed():
        del sys.modules[MODULE_NAME]
        sys.modules.pop(MODULE_NAME + ".utils", None)

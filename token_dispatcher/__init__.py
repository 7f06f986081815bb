"""Megatron-Core integration: the ``uccl_ep`` token dispatcher.

Ships as ``uccl_ep_megatron.token_dispatcher``. ``UcclEpTokenDispatcher`` needs megatron-core
and is imported on first use, so the options can be set without it.
"""

from __future__ import annotations

from typing import Any

from uccl_ep_megatron.token_dispatcher.options import (
    UcclEpOptions,
    get_options,
    reset_options,
    set_options,
)

__all__ = ["UcclEpOptions", "UcclEpTokenDispatcher", "get_options", "reset_options", "set_options"]


def __getattr__(name: str) -> Any:
    if name == "UcclEpTokenDispatcher":
        from uccl_ep_megatron.token_dispatcher.dispatcher import UcclEpTokenDispatcher

        return UcclEpTokenDispatcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

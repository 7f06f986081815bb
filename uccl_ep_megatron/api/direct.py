"""The direct lane of ``Buffer.dispatch`` and ``Buffer.combine``: a synchronous call of a
backend that ``runs_on_caller_stream`` (no ``async_finish``, no ``previous_event``, the
Buffer's device current) whose arguments match a key that passed every check before.

Such a call takes no comm-stream join, no agreement (the kernels agree inside their notify
step) and no check: the general path would build its checked arguments, a ``_Prepared``, two
closures and the stream hand-off only to find all of them empty. The lane builds the
backend's arguments from the key's hit and calls the backend; anything else (a first call of
a shape, a bad argument, another device, a handle of another Buffer) returns ``None`` and
takes the general path, which checks, agrees, raises on every rank alike or remembers the key.
``DirectCalls`` is a mixin of ``Buffer`` (``api/buffer.py``): ``self`` is the ``Buffer``.

Where the backend has one (``Backend.make_lane``), a dispatch whose signature took the
backend's one-call path before, and a combine without bias whose signature launched before,
skip even this Python: ``Buffer.dispatch`` and ``Buffer.combine`` hand their arguments to
the lane's binding (``_C.IntranodeLane``, ``csrc/bindings/intranode_lane.cc``), which matches
them, launches and returns the result, or returns None before any effect (this lane then takes
the call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from uccl_ep_megatron.api.validation import (
    DispatchInputs,
    XType,
    checked_key,
    combine_key,
    dispatch_args,
)
from uccl_ep_megatron.backends.base import DispatchHandle
from uccl_ep_megatron.core.config import Config


class DirectCalls:
    """The direct lane (a mixin: ``self`` is the ``Buffer``)."""

    def _direct_config(self, config: Config | None, op: str) -> Config | None:
        """``config`` as ``_check_config`` returns it, or None where that would build a
        default or raise (the general path does both)."""
        if config is None:
            return self._default_configs.get((op, self.num_sms))
        if type(config) is not Config:
            return None
        limit = self.max_num_sms
        if limit is not None and config.num_sms > limit:
            return None
        return config

    def _direct_stream(self) -> None:
        """Run on the caller's stream, after this Buffer's previous call (``_run``'s direct
        branch)."""
        raw = torch._C._cuda_getCurrentRawStream(self._device_index)
        if raw != self._last_raw:
            self._follow(raw, None)
        self._backend.caller_stream = raw

    def _dispatch_direct(
        self,
        x: XType,
        handle: DispatchHandle | None,
        given: DispatchInputs,
        config: Config | None,
    ) -> tuple[Any, ...] | None:
        """``dispatch``'s return value, or None: take the general path."""
        if torch._C._cuda_getDevice() != self._device_index:
            return None
        backend = self._backend
        config = self._direct_config(config, "dispatch")
        if config is None or backend.agrees_per_call or not backend.defers_id_check:
            return None
        key = checked_key(x, given, config)
        if key is None:
            return None
        if handle is not None:
            key = ("cached", key)
        check_ids = self._checked.get(key)
        if check_ids is None:
            return None
        args = self._remembered_args(x, handle, given, config, check_ids)
        if args is None:
            return None
        seq = self._next_call()
        self._direct_stream()
        self._direct_calls += 1
        return self._dispatch_returns(backend.dispatch(args), args, handle, seq)

    def _lane_rest(
        self, x: XType, given: DispatchInputs, config: Config | None, rest: list[Any]
    ) -> tuple[Any, ...]:
        """``dispatch``'s return value for a launch-ahead call that the lane's binding launched
        and whose readback is not a good call's (``rest``: [(reservation, (state, words),
        bound rows, seq)]): the backend judges it (``ahead_rest``)."""
        seq = rest[0][3]
        config = self._direct_config(config, "dispatch")
        x_data, x_scales = (x, None) if isinstance(x, torch.Tensor) else x
        args = dispatch_args(x_data, x_scales, given, config, False)
        result = self._backend.ahead_rest(args, rest)
        return self._dispatch_returns(result, args, None, seq)

    def _combine_direct(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: torch.Tensor | Sequence[torch.Tensor] | None,
        config: Config | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``combine``'s two tensors, or None: take the general path."""
        if (
            type(handle) is not DispatchHandle
            or handle.owner != self.uid
            or torch._C._cuda_getDevice() != self._device_index
        ):
            return None
        config = self._direct_config(config, "combine")
        if config is None or self._backend.agrees_per_call:
            return None
        rows = handle.num_worst_tokens or handle.num_recv_tokens
        key = combine_key(x, topk_weights, bias, config, rows, handle.is_token_in_rank.shape[0])
        if key is None or key not in self._checked:
            return None
        biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
        self._next_call()
        self._direct_stream()
        self._direct_calls += 1
        return self._backend.combine(x.contiguous(), handle, topk_weights, biases, config)

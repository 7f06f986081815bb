"""The argument checks of ``Buffer``: each raises a clear error naming the value and the fix.

``ArgumentChecks`` is a mixin of ``Buffer`` (``api/buffer.py``): the checks read the Buffer's
group, device, sizes and backend, set up by ``Buffer.__init__``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from uccl_ep_megatron.backends.agreement import describe_layout_bits
from uccl_ep_megatron.backends.base import (
    DispatchArgs,
    DispatchHandle,
    Layout,
    check_expert_ids,
)
from uccl_ep_megatron.core.config import (
    MAX_TOPK,
    Config,
    default_combine_config,
    default_dispatch_config,
)
from uccl_ep_megatron.core.errors import BufferTooSmallError, InvalidInputError, UcclEpError
from uccl_ep_megatron.core.events import EventOverlap

_TOPK_DTYPES = (torch.int64, torch.int32)

XType = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class DispatchInputs(NamedTuple):
    """The arguments of ``Buffer.dispatch`` that describe the routing, in its order: the one
    list the checks (``ArgumentChecks._dispatch_args``, ``checked_key``) and ``dispatch_args``
    take, with ``x``, the handle and the checked ``Config`` beside it. ``None`` where a
    cached dispatch takes the handle's layout."""

    num_tokens_per_rank: torch.Tensor | None
    num_tokens_per_rdma_rank: torch.Tensor | None
    is_token_in_rank: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    expert_alignment: int
    num_worst_tokens: int


class ArgumentChecks:
    """Checks of one rank's arguments, shared by ``Buffer``'s calls (a mixin: ``self`` is the
    ``Buffer``)."""

    def _check_alive(self) -> None:
        if self._destroyed:
            raise UcclEpError("this Buffer was destroyed; create a new Buffer")

    @staticmethod
    def _check_event(previous_event: Any) -> None:
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise InvalidInputError(
                f"previous_event={previous_event!r}: pass an EventOverlap (e.g. Buffer.capture())"
            )

    def _check_num_experts(self, num_experts: int) -> None:
        self._check_int("num_experts", num_experts, minimum=1)
        if num_experts % self.group_size:
            raise InvalidInputError(
                f"num_experts={num_experts} is not divisible by the {self.group_size} ranks of "
                "the group; use a multiple of the EP size"
            )

    @staticmethod
    def _check_int(name: str, value: Any, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise InvalidInputError(f"{name}={value!r}: must be an int >= {minimum}")

    def _check_tensor(self, name: str, t: Any, dims: int, rows: int | None = None) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        # The equality first (~0.1 us; a CUDA Buffer's device always names its index): the
        # exact test below costs ~1 us per tensor and only tells apart "cpu" and "cpu:0".
        dev = t.device
        if dev != self.device and (
            dev.type != self.device.type or (dev.type == "cuda" and dev.index != self.device.index)
        ):
            raise InvalidInputError(
                f"{name} is on {t.device} but this Buffer's group runs on {self.device}; "
                f"move it with .to({str(self.device)!r})"
            )
        if t.dim() != dims:
            raise InvalidInputError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
        if rows is not None and t.shape[0] != rows:
            raise InvalidInputError(
                f"{name} has {t.shape[0]} rows (shape {tuple(t.shape)}), expected {rows}"
            )

    def _check_config(self, config: Config | None, op: str) -> Config:
        if config is None:
            key = (op, self.num_sms)  # Buffer.set_num_sms changes the defaults
            config = self._default_configs.get(key)
            if config is None:
                # By this group's nodes (which BufferOptions.ranks_per_node may set), not the
                # environment's alone.
                make = default_dispatch_config if op == "dispatch" else default_combine_config
                config = make(self.group_size, self.num_sms, self.topology.ranks_per_node)
                if self.max_num_sms is not None and config.num_sms > self.max_num_sms:
                    config = dataclasses.replace(config, num_sms=self.max_num_sms)
                self._default_configs[key] = config
            return config
        if not isinstance(config, Config):
            raise InvalidInputError(f"config={config!r}: pass a uccl_ep_megatron.Config or None")
        if self.max_num_sms is not None and config.num_sms > self.max_num_sms:
            raise InvalidInputError(
                f"{op}: Config.num_sms={config.num_sms} but {self.gpu_sharers} ranks share "
                f"{self.device} and their kernels must all be resident at once: use num_sms <= "
                f"{self.max_num_sms} (Buffer.max_num_sms)"
            )
        return config

    def _check_buffer_size(self, x: torch.Tensor, hidden: int, config: Config) -> None:
        hidden_bytes = hidden * max(x.element_size(), 2)
        key = (hidden_bytes, config)  # the hints are fixed for this group: once per key
        if key in self._sizes_ok:
            return
        node = self.topology.ranks_per_node
        need_nvl = config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size, node)
        if self.num_nvl_bytes < need_nvl and x.element_size() > 2:
            need_16 = config.get_nvl_buffer_size_hint(hidden * 2, self.group_size, node)
            if self.num_nvl_bytes >= need_16:  # the dtype, not the hidden size, is what fails
                raise BufferTooSmallError(
                    f"x.dtype={x.dtype} ({x.element_size()} bytes per element): this Buffer "
                    f"(num_nvl_bytes={self.num_nvl_bytes}) holds rows of hidden={hidden} in "
                    f"2-byte dtypes such as bfloat16, not in {x.dtype}, which needs "
                    f"{need_nvl}. Pass x in bfloat16 (e.g. the dtype of the dispatch), or "
                    f"create the Buffer with num_nvl_bytes >= "
                    f"Config.get_nvl_buffer_size_hint({hidden_bytes}, {self.group_size})"
                )
        if self.num_nvl_bytes < need_nvl:
            raise BufferTooSmallError(
                f"Buffer has num_nvl_bytes={self.num_nvl_bytes} but hidden={hidden} "
                f"({x.dtype}) with this config needs {need_nvl}; create the Buffer with "
                f"num_nvl_bytes >= Config.get_nvl_buffer_size_hint({hidden_bytes}, "
                f"{self.group_size})"
            )
        need_rdma = config.get_rdma_buffer_size_hint(hidden_bytes, self.group_size, node)
        if self.num_rdma_bytes < need_rdma:
            raise BufferTooSmallError(
                f"Buffer has num_rdma_bytes={self.num_rdma_bytes} but hidden={hidden} needs "
                f"{need_rdma} across {self.num_rdma_ranks} nodes; create the Buffer with "
                f"num_rdma_bytes >= Config.get_rdma_buffer_size_hint({hidden_bytes}, "
                f"{self.group_size})"
            )
        self._sizes_ok.add(key)

    def _check_handle(self, handle: Any) -> None:
        if not isinstance(handle, DispatchHandle):
            raise InvalidInputError(
                "handle must be the handle returned by Buffer.dispatch, got "
                f"{type(handle).__name__}"
            )
        if handle.owner != self.uid:
            raise InvalidInputError(
                f"this handle was made by another Buffer (#{handle.owner}), not this one "
                f"(#{self.uid}); pass the handle returned by this Buffer's dispatch"
            )

    def _split_x(self, x: XType) -> tuple[torch.Tensor, torch.Tensor | None]:
        scales = None
        if isinstance(x, tuple | list):
            if len(x) != 2:
                raise InvalidInputError(
                    f"FP8 x must be a pair (x_e4m3 [T, H], scales float32 [T, H/128]), got "
                    f"{len(x)} items"
                )
            x, scales = x
        self._check_tensor("x", x, dims=2)
        if x.dtype not in self._backend.x_dtypes:
            raise InvalidInputError(
                f"x.dtype={x.dtype} is not supported by the {self.backend} backend; use one of "
                f"{sorted(str(d) for d in self._backend.x_dtypes)} (FP8 as a (x, scales) tuple)"
            )
        is_fp8 = x.dtype.itemsize == 1
        if is_fp8 != (scales is not None):
            raise InvalidInputError(
                "FP8 x must come as a tuple (x_e4m3, scales) and only FP8 x takes scales; "
                f"got x.dtype={x.dtype} with{'out' if scales is None else ''} scales"
            )
        if scales is not None:
            num_tokens, hidden = x.shape
            if hidden % 128:
                raise InvalidInputError(f"FP8 x needs hidden % 128 == 0, got hidden={hidden}")
            self._check_tensor("scales", scales, dims=2, rows=num_tokens)
            check_dtype("scales", scales, (torch.float32,))
            if scales.shape[1] != hidden // 128:
                raise InvalidInputError(
                    f"scales has shape {tuple(scales.shape)}, expected "
                    f"[{num_tokens}, {hidden // 128}] (one float32 per 128 elements)"
                )
            scales = scales.contiguous()
        return x.contiguous(), scales

    def _check_topk_idx(
        self, topk_idx: Any, num_experts: int, num_tokens: int | None, check_range: bool = True
    ) -> bool:
        """Shape/dtype checks, and the id range now; returns True when the range is left to a
        backend that checks it at its own host sync (``defers_id_check``)."""
        self._check_tensor("topk_idx", topk_idx, dims=2, rows=num_tokens)
        check_dtype("topk_idx", topk_idx, _TOPK_DTYPES)
        if topk_idx.shape[1] > MAX_TOPK or topk_idx.shape[1] == 0:
            raise InvalidInputError(
                f"topk_idx has {topk_idx.shape[1]} columns; num_topk must be in 1..{MAX_TOPK}"
            )
        if not topk_idx.numel() or not check_range:
            return False
        if self._backend.defers_id_check:
            return True  # no host sync here: the backend checks at the sync it makes anyway
        lo, hi = torch.aminmax(topk_idx)
        check_expert_ids(int(lo), int(hi), num_experts)
        return False

    def _dispatch_args(
        self,
        x: torch.Tensor,
        x_scales: torch.Tensor | None,
        given: DispatchInputs,
    ) -> tuple[bool, torch.Tensor | None]:
        """Every check of a dispatch without a handle: ``check_ids`` for its ``DispatchArgs``
        (``dispatch_args``), and the routing checks still to run on every rank
        (``routing_check``) when the backend defers them to its call-header exchange."""
        (
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            _,
            _,
        ) = given
        num_tokens = x.shape[0]
        missing = [
            name
            for name, t in (
                ("num_tokens_per_rank", num_tokens_per_rank),
                ("is_token_in_rank", is_token_in_rank),
                ("num_tokens_per_expert", num_tokens_per_expert),
            )
            if t is None
        ]
        if missing:
            raise InvalidInputError(
                f"dispatch without a handle needs {', '.join(missing)}: pass the outputs of "
                "Buffer.get_dispatch_layout(topk_idx, num_experts)"
            )
        if (
            isinstance(topk_idx, torch.Tensor)
            and topk_idx.dim() == 2
            and topk_idx.shape[0] != num_tokens
        ):
            raise InvalidInputError(
                f"x has {num_tokens} rows (tokens) but topk_idx has {topk_idx.shape[0]}: every "
                "token of x needs its row of topk_idx (and of the layout get_dispatch_layout "
                "returned for it); pass the topk_idx of these tokens"
            )
        self._check_tensor("is_token_in_rank", is_token_in_rank, dims=2, rows=num_tokens)
        check_dtype("is_token_in_rank", is_token_in_rank, (torch.bool,))
        if is_token_in_rank.shape[1] != self.group_size:
            raise InvalidInputError(
                f"is_token_in_rank has {is_token_in_rank.shape[1]} columns but the group has "
                f"{self.group_size} ranks; was the layout computed for another group?"
            )
        self._check_tensor("num_tokens_per_rank", num_tokens_per_rank, dims=1, rows=self.group_size)
        self._check_tensor("num_tokens_per_expert", num_tokens_per_expert, dims=1)
        num_experts = num_tokens_per_expert.shape[0]
        self._check_num_experts(num_experts)
        if self.num_rdma_ranks > 1:
            if num_tokens_per_rdma_rank is None:
                raise InvalidInputError(
                    f"the group spans {self.num_rdma_ranks} nodes: pass num_tokens_per_rdma_rank "
                    "from get_dispatch_layout"
                )
            self._check_tensor(
                "num_tokens_per_rdma_rank",
                num_tokens_per_rdma_rank,
                dims=1,
                rows=self.num_rdma_ranks,
            )
        if (topk_idx is None) != (topk_weights is None):
            raise InvalidInputError("pass topk_idx and topk_weights together, or neither")
        check_ids = False
        if topk_idx is not None:
            check_ids = self._check_topk_idx(topk_idx, num_experts, num_tokens)
            self._check_tensor("topk_weights", topk_weights, dims=2, rows=num_tokens)
            check_dtype("topk_weights", topk_weights, (torch.float32,))
            if topk_weights.shape != topk_idx.shape:
                raise InvalidInputError(
                    f"topk_weights shape {tuple(topk_weights.shape)} != topk_idx shape "
                    f"{tuple(topk_idx.shape)}"
                )
        return self._routing_checks(given, num_experts, check_ids)

    def _routing_checks(
        self, given: DispatchInputs, num_experts: int, check_ids: bool
    ) -> tuple[bool, torch.Tensor | None]:
        """(``check_ids``, the routing checks still to run on every rank) of checked
        arguments: a backend that agrees per call checks the layout tensors against what
        ``topk_idx`` implies (or, without it, against ``is_token_in_rank``): wrong ones
        misdeliver rows or size outputs wrongly."""
        if not self._backend.agrees_per_call:
            return check_ids, None
        topk_idx = None if given.topk_idx is None else given.topk_idx.contiguous()
        layout = Layout(
            given.num_tokens_per_rank,
            given.num_tokens_per_rdma_rank,
            given.num_tokens_per_expert,
            given.is_token_in_rank,
        )
        checks = self._backend.routing_check(layout, topk_idx, num_experts)
        if self._backend.defers_id_check:
            return False, checks  # ids and layout travel in the call header
        bits = int(checks[2])
        if bits:
            raise InvalidInputError(describe_layout_bits(bits))
        return check_ids, None


def dispatch_args(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    given: DispatchInputs,
    config: Config,
    check_ids: bool,
) -> DispatchArgs:
    """The ``DispatchArgs`` of checked arguments (ids, weights and the token mask made
    contiguous; ``x`` and its scales are already)."""
    topk_idx, topk_weights = given.topk_idx, given.topk_weights
    num_tokens_per_expert = given.num_tokens_per_expert
    return DispatchArgs(
        x=x,
        x_scales=x_scales,
        topk_idx=None if topk_idx is None else topk_idx.contiguous(),
        topk_weights=None if topk_weights is None else topk_weights.contiguous(),
        is_token_in_rank=given.is_token_in_rank.contiguous(),
        num_tokens_per_rank=given.num_tokens_per_rank,
        num_tokens_per_rdma_rank=given.num_tokens_per_rdma_rank,
        num_tokens_per_expert=num_tokens_per_expert,
        num_experts=num_tokens_per_expert.shape[0],
        expert_alignment=given.expert_alignment,
        num_worst_tokens=given.num_worst_tokens,
        config=config,
        cached=None,
        check_ids=check_ids,
    )


def cached_args(
    x: torch.Tensor,
    x_scales: torch.Tensor | None,
    handle: DispatchHandle,
    expert_alignment: int,
    config: Config,
) -> DispatchArgs:
    """The ``DispatchArgs`` of a checked cached dispatch: the layout is the handle's."""
    return DispatchArgs(
        x=x,
        x_scales=x_scales,
        topk_idx=None,
        topk_weights=None,
        is_token_in_rank=handle.is_token_in_rank,
        num_tokens_per_rank=handle.num_tokens_per_rank,
        num_tokens_per_rdma_rank=None,
        num_tokens_per_expert=None,
        num_experts=0,
        expert_alignment=expert_alignment,
        num_worst_tokens=handle.num_worst_tokens,
        config=config,
        cached=handle,
    )


def _meta(t: Any) -> Any:
    """What the argument checks read of one argument: a tensor's class, device, shape and
    dtype; anything else's type."""
    if isinstance(t, torch.Tensor):
        return (type(t), t.device, t.shape, t.dtype)
    return type(t)


def checked_key(x: Any, given: DispatchInputs, config: Config) -> tuple[Any, ...] | None:
    """Everything the checks of a dispatch without a handle read (``_split_x``,
    ``_check_buffer_size``, ``_dispatch_args`` of a backend that defers its id and routing
    checks), or None for arguments no key covers. Two calls with one key pass or fail the
    same checks; a Buffer keeps the keys that passed and skips the checks for them (tens of
    microseconds of host time per call under MPS). ``config`` is a checked ``Config``."""
    per_rank, per_rdma, in_rank, per_expert, idx, weights, alignment, worst = given
    if type(alignment) is not int or type(worst) is not int:
        return None
    if isinstance(x, tuple | list):
        if len(x) != 2:
            return None
        xk: Any = (type(x), _meta(x[0]), _meta(x[1]))
    else:
        xk = _meta(x)
    return (
        xk,
        _meta(per_rank),
        _meta(per_rdma),
        _meta(in_rank),
        _meta(per_expert),
        _meta(idx),
        _meta(weights),
        alignment,
        worst,
        config,
    )


def combine_key(
    x: Any, topk_weights: Any, bias: Any, config: Config, rows: int, num_tokens: int
) -> tuple[Any, ...] | None:
    """What the checks of a combine read besides its handle (``checked_key`` for combine):
    ``rows`` the handle's received (or worst-case) rows, ``num_tokens`` its tokens."""
    if bias is None or isinstance(bias, torch.Tensor):
        bias_key: Any = _meta(bias)
    elif isinstance(bias, tuple | list) and len(bias) <= 2:
        bias_key = (type(bias), *(_meta(b) for b in bias))
    else:
        return None
    return ("combine", _meta(x), _meta(topk_weights), bias_key, config, rows, num_tokens)


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise InvalidInputError(
            f"{name}.dtype={t.dtype}; expected {' or '.join(str(d) for d in allowed)}"
        )

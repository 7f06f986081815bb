"""One ``Buffer`` call's checked arguments, its row of the call header, and the agreement.

Every rank checks its own arguments (``validation.py``) and builds its row of the call header;
``_agree`` exchanges the rows (``backends/agreement.py``) so that a call one rank rejects is
raised by every rank, instead of the others waiting for it in a collective. ``CallAgreement``
is a mixin of ``Buffer`` (``api/buffer.py``): ``self`` is the ``Buffer``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from uccl_ep_megatron.api.validation import (
    DispatchInputs,
    XType,
    cached_args,
    check_dtype,
    checked_key,
    combine_key,
    dispatch_args,
)
from uccl_ep_megatron.backends.agreement import (
    DTYPE_CODES,
    KIND_CACHED,
    KIND_COMBINE,
    KIND_DISPATCH,
    KIND_NAMES,
    Agreement,
    CallHeader,
    DispatchExperts,
    describe_error,
    error_code,
    peer_error,
)
from uccl_ep_megatron.backends.base import DispatchArgs, DispatchHandle
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.core.events import EventOverlap


@dataclasses.dataclass
class _Prepared:
    """One rank's checked arguments of a dispatch/combine and its row of the call header."""

    args: Any  # DispatchArgs, or combine's (x, topk_weights, biases, config)
    header: CallHeader | None  # None for a backend without a per-call exchange
    checks: torch.Tensor | None  # routing_check() words still to be checked on every rank
    counts: torch.Tensor | None  # [R] rows this rank sends to each rank (dispatch)
    num_tokens: int
    # What the call reads (recorded on the comm stream by an asynchronous call), made then.
    inputs: Callable[[], list[torch.Tensor]]
    # Recorded after the kernels that computed ``checks`` on the caller's stream: a call that
    # runs on the comm stream after ``previous_event`` alone must still wait for them.
    checks_ready: torch.cuda.Event | None = None
    # A non-cached dispatch's per-expert counts: its row carries them (no second exchange).
    experts: DispatchExperts | None = None


class CallAgreement:
    """Prepares each call and agrees on it with the peers (a mixin: ``self`` is the ``Buffer``)."""

    def _prepare_dispatch(
        self,
        seq: int,
        x: XType,
        handle: DispatchHandle | None,
        given: DispatchInputs,
        config: Config | None,
        previous_event: EventOverlap | None,
    ) -> _Prepared:
        """Every check of one rank's dispatch arguments, and its row of the call header."""
        self._check_event(previous_event)
        config = self._check_config(config, "dispatch")
        checks = None
        key: Any = None
        backend = self._backend
        after_event = previous_event is not None and previous_event.event is not None
        if backend.defers_id_check or (handle is not None and not backend.agrees_per_call):
            # The checks read only what the key holds: arguments that match a key that passed
            # once pass again (see checked_key), so they are built without running them. A
            # cached dispatch's handle is checked on every call (below); a backend that agrees
            # per call still launches its routing checks, which read the values.
            key = checked_key(x, given, config)
            if key is not None and handle is not None:
                key = ("cached", key)
        check_ids = self._checked.get(key) if key is not None else None
        if check_ids is not None:
            args = self._remembered_args(x, handle, given, config, check_ids)
            if args is not None:
                if handle is None and backend.agrees_per_call:
                    # Ids and layout travel in the call header: their checks still launch.
                    num_experts = given.num_tokens_per_expert.shape[0]
                    _, checks = self._routing_checks(given, num_experts, check_ids)
                return self._prepared(seq, args, handle, checks, after_event)
            # Otherwise a handle the checks below judge (they raise what is wrong with it).
        x_data, x_scales = self._split_x(x)
        num_tokens, hidden = x_data.shape
        self._check_buffer_size(x_data, hidden, config)
        self._check_int("expert_alignment", given.expert_alignment, minimum=1)
        self._check_int("num_worst_tokens", given.num_worst_tokens, minimum=0)
        if handle is not None:
            self._check_handle(handle)
            if given.topk_idx is not None or given.topk_weights is not None:
                raise InvalidInputError(
                    "cached dispatch (handle given) takes no topk_idx/topk_weights: the layout "
                    "comes from the handle; drop them or dispatch without a handle"
                )
            if num_tokens != handle.is_token_in_rank.shape[0]:
                raise InvalidInputError(
                    f"cached dispatch: x has {num_tokens} tokens but the handle was made for "
                    f"{handle.is_token_in_rank.shape[0]}"
                )
            args = cached_args(x_data, x_scales, handle, given.expert_alignment, config)
        else:
            check_ids, checks = self._dispatch_args(x_data, x_scales, given)
            args = dispatch_args(x_data, x_scales, given, config, check_ids)
        if key is not None:
            self._remember(key, args.check_ids)
        return self._prepared(seq, args, handle, checks, after_event)

    def _remembered_args(
        self,
        x: XType,
        handle: DispatchHandle | None,
        given: DispatchInputs,
        config: Config,
        check_ids: bool,
    ) -> DispatchArgs | None:
        """The ``DispatchArgs`` of a dispatch whose ``checked_key`` passed every check before
        (``check_ids``: the value remembered with it), or None for a handle the key does not
        cover: not this Buffer's, or made for another number of tokens."""
        x_data, x_scales = (x, None) if isinstance(x, torch.Tensor) else x
        x_data = x_data.contiguous()
        x_scales = None if x_scales is None else x_scales.contiguous()
        if handle is None:
            return dispatch_args(x_data, x_scales, given, config, check_ids)
        if (
            isinstance(handle, DispatchHandle)
            and handle.owner == self.uid
            and x_data.shape[0] == handle.is_token_in_rank.shape[0]
        ):
            return cached_args(x_data, x_scales, handle, given.expert_alignment, config)
        return None

    def _remember(self, key: Any, value: bool) -> None:
        """Keep a key whose arguments passed every check (``checked_key``, ``combine_key``)."""
        if len(self._checked) >= 64:  # shapes a caller used and dropped
            self._checked.clear()
        self._checked[key] = value

    def _prepared(
        self,
        seq: int,
        args: DispatchArgs,
        handle: DispatchHandle | None,
        checks: torch.Tensor | None,
        after_event: bool = False,
    ) -> _Prepared:
        """A checked dispatch's ``_Prepared``: its row of the call header and its inputs.
        ``after_event``: the call runs after ``previous_event`` alone, not after the caller's
        stream (``api/streams.py``), so it must wait for the checks' kernels by an event."""
        x_data, x_scales, config = args.x, args.x_scales, args.config
        header = None
        if self._backend.agrees_per_call:  # built only where it is exchanged (host time)
            header = CallHeader(
                kind=KIND_DISPATCH if handle is None else KIND_CACHED,
                seq=seq,
                dtype=DTYPE_CODES.get(x_data.dtype, 0),
                hidden=x_data.shape[1],
                num_scales=0 if x_scales is None else x_scales.shape[1],
                num_topk=0 if args.topk_idx is None else args.topk_idx.shape[1],
                num_experts=args.num_experts,
                handle_seq=0 if handle is None else handle.seq,
                num_sms=config.num_sms,
                rdma_send=config.num_max_rdma_chunked_send_tokens,
                rdma_recv=config.num_max_rdma_chunked_recv_tokens,
                num_worst_tokens=args.num_worst_tokens,
                buffer=self.comm.buffer_id,
            )
        counts = None if handle is not None else args.num_tokens_per_rank

        def inputs() -> list[torch.Tensor]:
            # Everything the kernels read (an asynchronous call records it on its stream).
            if handle is not None:
                return [t for t in (x_data, x_scales) if t is not None] + handle.device_tensors()
            read = (
                x_data,
                x_scales,
                args.topk_idx,
                args.topk_weights,
                args.is_token_in_rank,
                args.num_tokens_per_rank,
                args.num_tokens_per_rdma_rank,
                args.num_tokens_per_expert,
            )
            return [t for t in read if t is not None]

        ready = None
        # Otherwise the call runs on the caller's stream, or on the comm stream joined to it
        # after the checks were launched there: no event, record or wait (host time).
        if after_event and checks is not None and checks.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(checks.device))
        experts = None
        if handle is None and args.num_tokens_per_expert is not None:
            experts = DispatchExperts(args.num_tokens_per_expert, args.expert_alignment)
        return _Prepared(args, header, checks, counts, x_data.shape[0], inputs, ready, experts)

    def _prepare_combine(
        self,
        seq: int,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: torch.Tensor | Sequence[torch.Tensor] | None,
        config: Config | None,
        previous_event: EventOverlap | None,
    ) -> _Prepared:
        """Every check of one rank's combine arguments, and its row of the call header."""
        self._check_event(previous_event)
        config = self._check_config(config, "combine")
        self._check_handle(handle)
        expected_rows = handle.num_worst_tokens or handle.num_recv_tokens
        num_tokens = handle.is_token_in_rank.shape[0]
        key = None
        backend = self._backend
        if backend.defers_id_check or not backend.agrees_per_call:  # as in _prepare_dispatch
            key = combine_key(x, topk_weights, bias, config, expected_rows, num_tokens)
            if key is not None and key in self._checked:
                biases = () if bias is None else (bias,) if isinstance(bias, torch.Tensor) else bias
                return self._combine_prepared(
                    seq, x.contiguous(), handle, topk_weights, tuple(biases), config
                )
        self._check_tensor("x", x, dims=2, rows=expected_rows)
        if x.dtype not in self._backend.x_dtypes or x.dtype.itemsize == 1:
            raise InvalidInputError(
                f"combine: x.dtype={x.dtype} is not supported by the {self.backend} backend; "
                f"use one of {sorted(str(d) for d in self._backend.x_dtypes if d.itemsize > 1)}"
            )
        self._check_buffer_size(x, x.shape[1], config)
        if topk_weights is not None:
            self._check_tensor("topk_weights", topk_weights, dims=2, rows=expected_rows)
            check_dtype("topk_weights", topk_weights, (torch.float32,))
        biases: tuple[torch.Tensor, ...] = ()
        if bias is not None:
            biases = (bias,) if isinstance(bias, torch.Tensor) else tuple(bias)
            if len(biases) > 2:
                raise InvalidInputError(f"combine: bias takes at most 2 tensors, got {len(biases)}")
            for i, b in enumerate(biases):
                self._check_tensor(f"bias[{i}]", b, dims=2, rows=num_tokens)
                if b.shape[1] != x.shape[1]:
                    raise InvalidInputError(
                        f"combine: bias[{i}] has hidden {b.shape[1]}, x has {x.shape[1]}"
                    )
        if key is not None:
            self._remember(key, True)
        return self._combine_prepared(seq, x.contiguous(), handle, topk_weights, biases, config)

    def _combine_prepared(
        self,
        seq: int,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        biases: tuple[torch.Tensor, ...],
        config: Config,
    ) -> _Prepared:
        """A checked combine's ``_Prepared``: its row of the call header and its inputs."""
        header = None
        if self._backend.agrees_per_call:  # built only where it is exchanged (host time)
            header = CallHeader(
                kind=KIND_COMBINE,
                seq=seq,
                dtype=DTYPE_CODES.get(x.dtype, 0),
                hidden=x.shape[1],
                num_topk=0 if topk_weights is None else topk_weights.shape[1],
                handle_seq=handle.seq,
                num_bias=len(biases),
                num_sms=config.num_sms,
                rdma_send=config.num_max_rdma_chunked_send_tokens,
                rdma_recv=config.num_max_rdma_chunked_recv_tokens,
                buffer=self.comm.buffer_id,
            )

        def inputs() -> list[torch.Tensor]:
            weights = [topk_weights] if topk_weights is not None else []
            return [x, *biases, *weights, *handle.device_tensors()]

        num_tokens = handle.is_token_in_rank.shape[0]
        return _Prepared((x, topk_weights, biases, config), header, None, None, num_tokens, inputs)

    def _next_call(self) -> int:
        self._calls += 1
        return self._calls

    def _agree(
        self,
        kind: int,
        seq: int,
        prepared: _Prepared | None,
        error: BaseException | None,
        sync_free: bool = False,
    ) -> Agreement | None:
        """Exchange this rank's call header; raise what every rank raises, or return the rows.

        A rank whose own checks failed (``error``) still takes part, with the error flag set,
        so that every rank raises that error now instead of waiting for it in a collective.
        ``sync_free``: the call needs no host sizes; a backend that ``agrees_on_device`` then
        checks the rows on the GPU and raises a failure at the next host-visible point.
        """
        if not self._backend.agrees_per_call:
            # Kernels that agree on counts inside their notify step (docs/architecture.md):
            # nothing to exchange here. A rank whose own checks failed tells the peers through their
            # control regions, so their waits for this call stop at once and name it.
            if error is not None:
                self._backend.abort_peers(f"{KIND_NAMES[kind]} #{seq}", error)
                raise error
            return None
        call = f"{KIND_NAMES[kind]} #{seq}"
        buffer_id = self.comm.buffer_id  # which Buffer: peers in another one must not match
        if prepared is None:
            header = CallHeader(kind=kind, seq=seq, error=error_code(error), buffer=buffer_id)
            row = self._backend.encode_row(header)
        else:
            if prepared.checks_ready is not None:
                torch.cuda.current_stream(prepared.checks.device).wait_event(prepared.checks_ready)
            row = self._backend.encode_row(
                prepared.header,  # made with this Buffer's number (no copy per call)
                prepared.checks,
                prepared.counts,
                prepared.num_tokens,
                prepared.experts,
            )
        experts = None if prepared is None else prepared.experts
        if sync_free and self._backend.agrees_on_device:
            self._backend.exchange_header_async(row, call, experts)
            if error is not None:
                raise error
            return None
        agreed = Agreement.decode(self._backend.exchange_header(row, call, experts))
        if agreed.failed_ranks:
            texts = self._backend.gather_objects(
                describe_error(error) if error is not None else None, call
            )
            shared = peer_error(call, agreed, texts)
            if error is not None:
                raise shared from error
            raise shared
        agreed.check(call)
        if kind == KIND_DISPATCH:
            agreed.check_routing(call)
            agreed.check_worst_tokens(call)
        return agreed


def worst_of(handle: Any) -> int:
    """``num_worst_tokens`` of a handle (0 for anything that is not one)."""
    worst = getattr(handle, "num_worst_tokens", 0) if isinstance(handle, DispatchHandle) else 0
    return worst if isinstance(worst, int) else 0

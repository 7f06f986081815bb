"""``Buffer``: DeepEP's normal-mode (high-throughput) API on portable backends.

A DeepEP user switches by changing ``from deep_ep import Buffer`` to
``from uccl_ep_megatron import Buffer``. ``Buffer`` owns the group handshake, validates every
argument once (clear errors naming the value and the fix), runs the backend on a dedicated
communication stream, and hands back a ``handle`` that ``combine`` and cached ``dispatch``
reuse. The backend (``kernels`` or ``reference``) only moves bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.api.calls import CallAgreement, worst_of
from uccl_ep_megatron.api.direct import DirectCalls
from uccl_ep_megatron.api.streams import CommStream, cached_outputs, dispatch_outputs
from uccl_ep_megatron.api.topology import detect_placement, group_device, meet, sm_budget
from uccl_ep_megatron.api.validation import ArgumentChecks, DispatchInputs, XType
from uccl_ep_megatron.backends import create_backend
from uccl_ep_megatron.backends.agreement import KIND_CACHED, KIND_COMBINE, KIND_DISPATCH
from uccl_ep_megatron.backends.base import DispatchArgs, DispatchHandle, DispatchResult, Topology
from uccl_ep_megatron.core.config import (
    Config,
    default_combine_config,
    default_dispatch_config,
)
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.core.events import EventOverlap
from uccl_ep_megatron.core.events import capture as _capture
from uccl_ep_megatron.core.options import BufferOptions

log = logging.getLogger(__name__)

_uids = itertools.count(1)


class Buffer(DirectCalls, CallAgreement, ArgumentChecks, CommStream):
    """Expert-parallel dispatch/combine over ``group`` (DeepEP normal-mode API).

    Args:
        group: the EP process group (``None`` = the default group). Every rank of it must
            construct the ``Buffer`` (the constructor is collective, bounded by
            ``UCCL_EP_TIMEOUT_MS``: a rank that does not arrive is named in a
            ``CommTimeoutError`` on the others). Over gloo the Buffer runs its collectives on
            a group of its own, so a call that times out or is interrupted breaks only this
            Buffer, never ``group``; over NCCL it marks ``group`` unusable (see
            ``backends/agreement/group.py``).
        num_nvl_bytes: NVLink/xGMI buffer bytes; at least
            ``Buffer.get_dispatch_config(n).get_nvl_buffer_size_hint(hidden_bytes, n)``
            (and the combine hint) for the largest hidden size used.
        num_rdma_bytes: RDMA buffer bytes for multi-node groups (the RDMA size hints); 0 on
            one node.
        low_latency_mode: must be ``False``: only the high-throughput mode is provided.
        num_qps_per_rank: a positive int, accepted and unused: the proxy sets up its RDMA
            queue pairs itself (one per proxy thread, peer and channel group;
            ``UCCL_EP_NUM_PROXY_THREADS``).
        allow_nvlink_for_low_latency_mode: accepted and unused (low-latency mode only).
        allow_mnnvl: permission to use multi-node NVLink, accepted and unused: there is no
            MNNVL path, ranks on other nodes are reached through the internode path.
        use_fabric: must be ``False``: buffers are ``cudaMalloc``'d and shared through CUDA
            IPC handles within a node; fabric (MNNVL) memory handles are not implemented.
        explicitly_destroy: when ``True`` the caller must call ``destroy()``; otherwise
            resources are released when the object is garbage collected.
        enable_shrink: must be ``False``: DeepEP's shrink mode (masking failed ranks) belongs
            to its low-latency kernels, which are not provided.
        comm: an mpi4py communicator, used by DeepEP only when ``group`` is ``None``; here
            every collective runs over torch.distributed, so ``comm`` with ``group=None``
            raises ``UnsupportedError`` and ``comm`` next to a ``group`` is ignored.
        backend: ``"auto"``, ``"kernels"`` or ``"reference"``; ``None``: ``options.backend``,
            else ``UCCL_EP_BACKEND`` (default ``auto``: kernels when available, else reference).
        device: where the tensors live. ``None``: the current CUDA device for an NCCL group,
            and for a gloo group asked for ``backend="kernels"`` (the shared-GPU mode: ranks
            sharing a GPU under CUDA MPS, which NCCL refuses); the CPU for any other gloo
            group.
        options: the behaviour knobs (``BufferOptions``: bulk copies, launch-ahead, combine
            in place, receive arena, timeout, virtual nodes, the internode proxy); a field left
            ``None`` takes its environment variable's value. Resolved once, here: changing the
            environment later does not change this ``Buffer`` (``Buffer.options`` holds the
            values in use).
    """

    num_sms: int = 24

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
        *,
        backend: str | None = None,
        device: torch.device | str | int | None = None,
        options: BufferOptions | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidInputError(
                "Buffer needs an initialized torch.distributed default group; call "
                "torch.distributed.init_process_group(...) first"
            )
        _check_deep_ep_flags(group, low_latency_mode, use_fabric, enable_shrink, comm)
        self._check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"{name}={value!r}: must be a non-negative int")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.explicitly_destroy = explicitly_destroy
        self.uid = next(_uids)
        self.options = resolve_options(options, backend)
        backend_name = self.options.backend
        self.device = group_device(self.group, backend_name, device)
        # The int form for per-call stream lookups (a torch.device goes through slower checks).
        device_index = self.device.index
        if device_index is None:
            cuda = self.device.type == "cuda"
            device_index = torch.cuda.current_device() if cuda else -1
        # The bounded construction exchange (resolving the options above already validated
        # the registry: a bad UCCL_EP_* value raised before it), and the channel of this
        # Buffer's collectives.
        requested = self.options.ranks_per_node
        self.comm = meet(self.group, self.device, self.options.timeout_ms, requested)
        ranks_per_node, sharers = detect_placement(
            self.comm.peers, self.rank, self.device, requested
        )
        self.topology = Topology(self.rank, self.group_size, ranks_per_node)
        # Ranks sharing this GPU (under CUDA MPS) run their kernels side by side, and the
        # kernels of all ranks must be resident at once (they wait on each other).
        self.gpu_sharers = sharers
        self.max_num_sms = sm_budget(self.device, sharers)
        self._backend = create_backend(
            backend_name,
            self.group,
            self.topology,
            self.device,
            num_nvl_bytes,
            num_rdma_bytes,
            self.options,
        )
        self._backend.comm = self.comm
        if (
            self._backend.name == "reference"
            and self.device.type == "cuda"
            and dist.get_backend(self.group) == "gloo"
        ):
            raise InvalidInputError(
                f"the reference backend over a gloo group moves CPU tensors, not {self.device}; "
                "pass device='cpu', use an NCCL group, or backend='kernels' for the GPU kernels"
            )
        self._init_comm_stream(self.device, device_index)
        self._direct = self._backend.runs_on_caller_stream and self._comm_stream is not None
        # The direct lane of a dispatch and of a combine in one binding call, where the backend
        # has one (api/direct.py).
        self._lane = self._backend.make_lane(self.uid) if self._direct else None
        self._destroyed = False
        self._calls = 0  # dispatch/combine calls so far: the `seq` of the call header
        # Default configs per (op, Buffer.num_sms): they read the environment (ranks per
        # node), which is not worth tens of microseconds on every call.
        self._default_configs: dict[tuple[str, int], Config] = {}
        self._sizes_ok: set[tuple[int, Config]] = set()  # (hidden bytes, config) that fit
        # checked_key of dispatch arguments that passed every check -> their check_ids.
        self._checked: dict[tuple[Any, ...], bool] = {}
        self._direct_calls = 0  # calls the direct lane served (api/direct.py)

    # ---- properties and static helpers ---------------------------------------------------
    @property
    def backend(self) -> str:
        """Name of the backend in use (``kernels`` or ``reference``)."""
        return self._backend.name

    @property
    def num_rdma_ranks(self) -> int:
        """Number of (virtual) nodes in the group."""
        return self.topology.num_nodes

    @property
    def num_nvl_ranks(self) -> int:
        """Ranks per (virtual) node."""
        return self.topology.ranks_per_node

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SM budget of the default configs (even, as each channel uses two SMs)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise InvalidInputError(f"set_num_sms({new_num_sms!r}): must be a positive even int")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch ``Config`` for a group of ``num_ranks``."""
        return default_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine ``Config`` for a group of ``num_ranks``."""
        return default_combine_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def capture() -> EventOverlap:
        """An ``EventOverlap`` recorded now on the current stream (for ``previous_event``)."""
        return _capture()

    def get_comm_stream(self) -> torch.cuda.Stream | None:
        """The communication stream: where asynchronous calls run, and every call of the
        ``reference`` and internode backends (synchronous ``kernels`` calls run on the
        caller's stream, see ``dispatch``); ``None`` for a CPU (gloo) group."""
        self._check_alive()
        return self._comm_stream

    def get_combine_input(
        self, num_rows: int, hidden: int, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """An uninitialized ``[num_rows, hidden]`` tensor to write ``combine``'s ``x`` into (on
        the current stream), e.g. the experts' unpermuted output. With the ``kernels`` backend
        it lies in this rank's receive arena, so the ``combine`` that takes it is read in place
        by the peers instead of pushing its rows (``UCCL_EP_COMBINE_IN_PLACE``); it is an
        ordinary tensor otherwise (other backends, arena off or full, graph capture). Freed like
        any tensor; work on a third stream must be done before it dies. (A combine of an
        ordinary tensor copies it into the arena first, ``UCCL_EP_COMBINE_COPY_IN``; writing
        into this one saves that copy.)"""
        self._check_alive()
        comm = self._comm_stream
        # Combine runs on the comm stream, or (synchronous, see api/streams.py) on the
        # current one: 0 tells the backend so.
        t = self._backend.combine_input(
            num_rows, hidden, dtype, 0 if comm is None or self._direct else comm.cuda_stream
        )
        if t is None:
            t = torch.empty(num_rows, hidden, dtype=dtype, device=self.device)
        return t

    def destroy(self) -> None:
        """Release backend resources; collective: every rank of the group calls it (as with
        DeepEP), so no rank frees memory a peer still maps. Idempotent; the ``Buffer`` is
        unusable afterwards."""
        self._release(collective=True)

    def check_errors(self) -> None:
        """Raise an error that this Buffer's earlier GPU work recorded and no call has raised
        yet, e.g. a bad expert id or more than ``num_worst_tokens`` rows to some rank in a
        sync-free dispatch (``InvalidInputError`` naming the rank and value) or a timed-out
        wait (``CommTimeoutError``). Cheap: it reads the host-mapped status word and never
        synchronizes the GPU, so it sees only work that has finished; synchronize first to be
        sure a call is covered. Every rank's GPU records the same input error, so every rank
        raises it. Backends that raise at the call itself (``reference``) have nothing
        pending."""
        self._check_alive()
        self._backend.check_errors()

    def _release(self, collective: bool) -> None:
        if not self._destroyed:
            self._destroyed = True
            try:
                self._backend.destroy(collective)
            finally:
                self.comm.close()

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True) and not getattr(self, "_destroyed", True):
            try:
                # Peers may be anywhere (or gone): no collective here; see IpcBuffers.close.
                self._release(collective=False)
            except Exception:  # noqa: BLE001 - nothing sensible to do at interpreter teardown
                pass

    # ---- layout ----------------------------------------------------------------------------
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """Counts per rank / node / expert and the token->rank mask for ``topk_idx``.

        Args:
            topk_idx: ``[num_tokens, num_topk]`` int64 (or int32) global expert ids; -1 = none.
            num_experts: total experts, divisible by the group size.

        Returns:
            ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None on
            one node, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``.
        """
        self._check_alive()
        self._check_num_experts(num_experts)
        # Shapes and dtypes only: the id range is checked by dispatch, in the exchange every
        # rank takes part in, so a bad id on one rank is reported on all of them.
        self._check_topk_idx(topk_idx, num_experts, None, check_range=False)
        layout, event = self._run(
            lambda: self._backend.get_dispatch_layout(topk_idx, num_experts),
            lambda: [topk_idx],
            previous_event,
            async_finish,
            allocate_on_comm_stream,
        )
        return (*layout, event)

    # ---- dispatch --------------------------------------------------------------------------
    def dispatch(
        self,
        x: XType,
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[
        XType,
        torch.Tensor | None,
        torch.Tensor | None,
        list[int] | None,
        DispatchHandle | None,
        EventOverlap,
    ]:
        """Send each token once to every rank that hosts one of its experts.

        Received rows are grouped by source rank in rank order, each group in the source's
        token order. ``recv_topk_idx`` holds local expert ids (-1 for experts elsewhere) and
        ``recv_topk_weights`` their weights (0.0 where the id is -1).

        Args:
            x: ``[T, H]`` tensor, or an FP8 tuple ``(x_e4m3 [T, H], scales float32 [T, H/128])``.
            handle: a handle from this ``Buffer``'s earlier ``dispatch``: cached dispatch of a
                new ``x`` with the same layout (no top-k arguments then).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
            num_tokens_per_expert: the outputs of ``get_dispatch_layout``.
            topk_idx, topk_weights: ``[T, K]`` global expert ids (int64/int32, -1 = none) and
                float32 weights; both or neither.
            expert_alignment: round each local expert's received count up to a multiple.
            num_worst_tokens: when > 0, return exactly that many rows (padding: ids -1,
                weights 0, source index -1; the rows and FP8 scales are unspecified, as in
                DeepEP) and an empty count list; the ``kernels``
                backend then makes no host sync (the counts are ``handle.recv_count`` and
                ``handle.recv_tokens_per_expert`` on the GPU; errors found on the GPU are
                raised at the next call or ``check_errors()``) and can be captured in a CUDA
                graph.
            config: chunking/SM config; default ``Buffer.get_dispatch_config(group size)``.
            previous_event: wait for this event before starting instead of the current stream.
            async_finish: return an event to wait on instead of joining the current stream.
                A call with neither ``async_finish`` nor ``previous_event`` is synchronous:
                the ``kernels`` backend runs it on the current stream itself (the same order
                as the comm stream joined both ways, without the joins; see
                ``api/streams.py``); the other backends on the comm stream.
            allocate_on_comm_stream: accepted and ignored (on every call of every backend):
                outputs are allocated while the stream the call runs on is current (the comm
                stream, or the current stream of a synchronous ``kernels`` call) and recorded
                on the caller's stream, so they are safe to use and to free there. That is
                what DeepEP does with ``True``; with ``False`` DeepEP allocates them on the
                caller's stream instead, and it requires ``previous_event`` and
                ``async_finish`` for ``True``, which this ``Buffer`` does not.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
            handle, event)``; for cached dispatch ``(recv_x, None, None, None, None, event)``.
        """
        self._check_alive()
        given = DispatchInputs(
            num_tokens_per_rank,
            num_tokens_per_rdma_rank,
            is_token_in_rank,
            num_tokens_per_expert,
            topk_idx,
            topk_weights,
            expert_alignment,
            num_worst_tokens,
        )
        lane = self._lane
        if lane is not None and previous_event is None and not async_finish:
            done = lane.dispatch(self, x, handle, given, config)
            if done is not None:
                if len(done) == 6:
                    return done
                # Launched by the lane's binding, its counts for the backend to judge: handed
                # over in a list it empties (a call run again needs the bound's block back first).
                rest, done = [done], None
                return self._lane_rest(x, given, config, rest)
        if self._direct and previous_event is None and not async_finish:
            done = self._dispatch_direct(x, handle, given, config)
            if done is not None:
                return done
        kind = KIND_DISPATCH if handle is None else KIND_CACHED
        seq = self._next_call()
        prepared = None
        try:
            prepared = self._prepare_dispatch(seq, x, handle, given, config, previous_event)
            error = None
        except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is raised
            error = exc

        def run() -> DispatchResult:
            worst = num_worst_tokens if handle is None else worst_of(handle)
            sync_free = isinstance(worst, int) and worst > 0
            agreed = self._agree(kind, seq, prepared, error, sync_free)
            args = prepared.args
            if agreed is not None:
                args = dataclasses.replace(args, agreed=agreed)
            return self._backend.dispatch(args)

        # After a failed check the event may be what failed: run() raises before it matters.
        inputs, event_in = (list, None) if prepared is None else (prepared.inputs, previous_event)
        outputs = dispatch_outputs if handle is None else cached_outputs
        result, event = self._run(
            run, inputs, event_in, async_finish, allocate_on_comm_stream, outputs
        )
        return self._dispatch_returns(result, prepared.args, handle, seq, event)

    def _dispatch_returns(
        self,
        result: DispatchResult,
        args: DispatchArgs,
        handle: DispatchHandle | None,
        seq: int,
        event: EventOverlap | None = None,
    ) -> tuple[Any, ...]:
        """What ``dispatch`` returns for the backend's ``result`` of ``args`` (``event``: the
        call's, None for a synchronous call on the caller's stream)."""
        if event is None:
            event = EventOverlap(None)
        recv_x: XType = result.recv_x
        if args.x_scales is not None:
            recv_x = (result.recv_x, result.recv_x_scales)
        if handle is not None:
            return recv_x, None, None, None, None, event
        topk_idx = args.topk_idx
        new_handle = DispatchHandle(
            result.rank_prefix_matrix,
            args.is_token_in_rank,
            args.num_tokens_per_rank,
            result.recv_src_idx,
            result.num_recv_tokens,
            args.num_worst_tokens,
            0 if topk_idx is None else topk_idx.shape[1],
            result.state,
            self.uid,
            seq,
            result.recv_count,
            result.recv_tokens_per_expert,
        )
        return (
            recv_x,
            result.recv_topk_idx,
            result.recv_topk_weights,
            result.num_recv_tokens_per_expert,
            new_handle,
            event,
        )

    # ---- combine ---------------------------------------------------------------------------
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | Sequence[torch.Tensor] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Sum the rows each destination rank returns back into the source token.

        Args:
            x: ``[N_recv, H]`` rows in ``dispatch``'s receive layout (or ``num_worst_tokens``
                rows; padding rows are ignored).
            handle: the ``handle`` returned by this ``Buffer``'s ``dispatch``.
            topk_weights: ``[N_recv, K]`` float32 weights to sum likewise (optional).
            bias: up to two ``[T, H]`` tensors added to the result.
            config, previous_event, async_finish, allocate_on_comm_stream: as in ``dispatch``.

        Returns:
            ``(combined_x [T, H], combined_topk_weights [T, K] or None, event)``.
        """
        self._check_alive()
        lane = self._lane
        if lane is not None and previous_event is None and not async_finish:
            done = lane.combine(self, x, handle, topk_weights, bias, config)
            if done is not None:
                return done
        if self._direct and previous_event is None and not async_finish:
            done = self._combine_direct(x, handle, topk_weights, bias, config)
            if done is not None:
                return done[0], done[1], EventOverlap(None)
        seq = self._next_call()
        prepared = None
        try:
            prepared = self._prepare_combine(
                seq, x, handle, topk_weights, bias, config, previous_event
            )
            error = None
        except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is raised
            error = exc

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            self._agree(KIND_COMBINE, seq, prepared, error, worst_of(handle) > 0)
            x_, weights, biases, config_ = prepared.args
            return self._backend.combine(x_, handle, weights, biases, config_)

        inputs, event_in = (list, None) if prepared is None else (prepared.inputs, previous_event)
        (combined, combined_weights), event = self._run(
            run, inputs, event_in, async_finish, allocate_on_comm_stream
        )
        return combined, combined_weights, event


def _check_deep_ep_flags(
    group: Any, low_latency_mode: bool, use_fabric: bool, enable_shrink: bool, comm: Any
) -> None:
    """DeepEP constructor arguments that name modes this package does not provide."""
    if low_latency_mode:
        raise UnsupportedError(
            "low_latency_mode=True: uccl_ep_megatron provides only the high-throughput "
            "(normal) mode; construct Buffer with low_latency_mode=False"
        )
    if use_fabric:
        raise UnsupportedError(
            "use_fabric=True: buffers are cudaMalloc'd and shared through CUDA IPC handles "
            "within a node; fabric (MNNVL) memory handles are not implemented. Pass "
            "use_fabric=False"
        )
    if enable_shrink:
        raise UnsupportedError(
            "enable_shrink=True: DeepEP's shrink mode (masking failed ranks) belongs to its "
            "low-latency kernels, which uccl_ep_megatron does not provide; pass "
            "enable_shrink=False"
        )
    if comm is not None and group is None:
        raise UnsupportedError(
            "comm (an mpi4py communicator) without a group: uccl_ep_megatron runs every "
            "collective over torch.distributed; pass group= (e.g. the EP process group)"
        )


_BACKENDS = ("auto", "kernels", "reference")


def resolve_options(options: BufferOptions | None, backend: str | None) -> BufferOptions:
    """``options`` (``None``: all defaults) with the ``backend`` argument, every field resolved
    from the environment registry where it was left ``None``."""
    if options is None:
        options = BufferOptions()
    elif not isinstance(options, BufferOptions):
        raise InvalidInputError(
            f"options={options!r}: pass a uccl_ep_megatron.BufferOptions (or None)"
        )
    if backend is not None:
        if backend not in _BACKENDS:
            raise InvalidInputError(
                f"backend={backend!r} is unknown; use 'auto', 'kernels' or 'reference' "
                "(argument `backend=`, BufferOptions.backend or env UCCL_EP_BACKEND)"
            )
        if options.backend not in (None, backend):
            raise InvalidInputError(
                f"backend={backend!r} and BufferOptions(backend={options.backend!r}) disagree: "
                "pass one of them"
            )
        options = dataclasses.replace(options, backend=backend)
    return options.resolved()

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
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends import create_backend
from uccl_ep_megatron.backends.agreement import (
    DTYPE_CODES,
    KIND_CACHED,
    KIND_COMBINE,
    KIND_DISPATCH,
    KIND_NAMES,
    Agreement,
    CallHeader,
    describe_error,
    describe_layout_bits,
    encode_row,
    error_code,
    peer_error,
)
from uccl_ep_megatron.backends.base import (
    DispatchArgs,
    DispatchHandle,
    DispatchResult,
    Layout,
    Topology,
    check_expert_ids,
    routing_check,
)
from uccl_ep_megatron.config import (
    MAX_TOPK,
    Config,
    default_combine_config,
    default_dispatch_config,
    env_ranks_per_node,
)
from uccl_ep_megatron.errors import (
    BufferTooSmallError,
    InvalidInputError,
    UcclEpError,
    UnsupportedError,
)
from uccl_ep_megatron.event import EventOverlap
from uccl_ep_megatron.event import capture as _capture

log = logging.getLogger(__name__)

_TOPK_DTYPES = (torch.int64, torch.int32)
_uids = itertools.count(1)

XType = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class _Prepared:
    """One rank's checked arguments of a dispatch/combine and its row of the call header."""

    args: Any  # DispatchArgs, or combine's (x, topk_weights, biases, config)
    header: CallHeader | None  # None for a backend without a per-call exchange
    checks: torch.Tensor | None  # routing_check() words still to be checked on every rank
    counts: torch.Tensor | None  # [R] rows this rank sends to each rank (dispatch)
    num_tokens: int
    inputs: list[torch.Tensor]  # to record on the comm stream


class Buffer:
    """Expert-parallel dispatch/combine over ``group`` (DeepEP normal-mode API).

    Args:
        group: the EP process group (``None`` = the default group). Every rank of it must
            construct the ``Buffer`` (the constructor is collective).
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
        backend: ``"auto"``, ``"kernels"`` or ``"reference"``; ``None`` reads
            ``UCCL_EP_BACKEND`` (default ``auto``: kernels when available, else reference).
        device: where the tensors live. ``None``: the current CUDA device for an NCCL group,
            and for a gloo group asked for ``backend="kernels"`` (the shared-GPU mode: ranks
            sharing a GPU under CUDA MPS, which NCCL refuses); the CPU for any other gloo
            group.
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
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidInputError(
                "Buffer needs an initialized torch.distributed default group; call "
                "torch.distributed.init_process_group(...) first"
            )
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
        backend_name = backend or os.environ.get("UCCL_EP_BACKEND", "auto").strip() or "auto"
        self.device = _group_device(self.group, backend_name, device)
        # The int form for per-call stream lookups (a torch.device goes through slower checks).
        self._device_index = self.device.index
        if self._device_index is None:
            cuda = self.device.type == "cuda"
            self._device_index = torch.cuda.current_device() if cuda else -1
        ranks_per_node, sharers = _detect_placement(self.group, self.device)
        self.topology = Topology(self.rank, self.group_size, ranks_per_node)
        # Ranks sharing this GPU (under CUDA MPS) run their kernels side by side, and the
        # kernels of all ranks must be resident at once (they wait on each other).
        self.gpu_sharers = sharers
        self.max_num_sms = _sm_budget(self.device, sharers)
        self._backend = create_backend(
            backend_name, self.group, self.topology, self.device, num_nvl_bytes, num_rdma_bytes
        )
        if (
            self._backend.name == "reference"
            and self.device.type == "cuda"
            and dist.get_backend(self.group) == "gloo"
        ):
            raise InvalidInputError(
                f"the reference backend over a gloo group moves CPU tensors, not {self.device}; "
                "pass device='cpu', use an NCCL group, or backend='kernels' for the GPU kernels"
            )
        self._comm_stream = (
            torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        )
        self._destroyed = False
        self._calls = 0  # dispatch/combine calls so far: the `seq` of the call header
        # Default configs per (op, Buffer.num_sms): they read the environment (ranks per
        # node), which is not worth tens of microseconds on every call.
        self._default_configs: dict[tuple[str, int], Config] = {}
        self._sizes_ok: set[tuple[int, Config]] = set()  # (hidden bytes, config) that fit

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
        """The stream communication runs on; ``None`` for a CPU (gloo) group."""
        self._check_alive()
        return self._comm_stream

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
            self._backend.destroy(collective)

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
            (topk_idx,),
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
            num_worst_tokens: when > 0, return exactly that many rows (padding: zero rows,
                ids -1, weights 0, source index -1) and an empty count list; the ``kernels``
                backend then makes no host sync (the counts are ``handle.recv_count`` and
                ``handle.recv_tokens_per_expert`` on the GPU; errors found on the GPU are
                raised at the next call or ``check_errors()``) and can be captured in a CUDA
                graph.
            config: chunking/SM config; default ``Buffer.get_dispatch_config(group size)``.
            previous_event: wait for this event before starting instead of the current stream.
            async_finish: return an event to wait on instead of joining the current stream.
            allocate_on_comm_stream: accepted and ignored (on every call of every backend):
                outputs are always allocated while the communication stream is current and
                recorded on the caller's stream, so they are safe to use and to free there.
                That is what DeepEP does with ``True``; with ``False`` DeepEP allocates them on
                the caller's stream instead, and it requires ``previous_event`` and
                ``async_finish`` for ``True``, which this ``Buffer`` does not.

        Returns:
            ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
            handle, event)``; for cached dispatch ``(recv_x, None, None, None, None, event)``.
        """
        self._check_alive()
        kind = KIND_DISPATCH if handle is None else KIND_CACHED
        seq = self._next_call()
        prepared = None
        try:
            prepared = self._prepare_dispatch(
                seq,
                x,
                handle,
                num_tokens_per_rank,
                num_tokens_per_rdma_rank,
                is_token_in_rank,
                num_tokens_per_expert,
                topk_idx,
                topk_weights,
                expert_alignment,
                num_worst_tokens,
                config,
                previous_event,
            )
            error = None
        except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is raised
            error = exc

        def run() -> DispatchResult:
            worst = num_worst_tokens if handle is None else _worst_of(handle)
            sync_free = isinstance(worst, int) and worst > 0
            agreed = self._agree(kind, seq, prepared, error, sync_free)
            args = prepared.args
            if agreed is not None:
                args = dataclasses.replace(args, agreed=agreed)
            return self._backend.dispatch(args)

        # After a failed check the event may be what failed: run() raises before it matters.
        inputs, event_in = ([], None) if prepared is None else (prepared.inputs, previous_event)
        result, event = self._run(run, inputs, event_in, async_finish, allocate_on_comm_stream)
        args = prepared.args
        recv_x: XType = result.recv_x
        if args.x_scales is not None:
            recv_x = (result.recv_x, result.recv_x_scales)
        if handle is not None:
            return recv_x, None, None, None, None, event
        new_handle = DispatchHandle(
            rank_prefix_matrix=result.rank_prefix_matrix,
            is_token_in_rank=args.is_token_in_rank,
            num_tokens_per_rank=args.num_tokens_per_rank,
            recv_src_idx=result.recv_src_idx,
            num_recv_tokens=result.num_recv_tokens,
            num_worst_tokens=num_worst_tokens,
            num_topk=0 if topk_idx is None else topk_idx.shape[1],
            state=result.state,
            owner=self.uid,
            seq=seq,
            recv_count=result.recv_count,
            recv_tokens_per_expert=result.recv_tokens_per_expert,
        )
        return (
            recv_x,
            result.recv_topk_idx,
            result.recv_topk_weights,
            result.num_recv_tokens_per_expert,
            new_handle,
            event,
        )

    def _prepare_dispatch(
        self,
        seq: int,
        x: XType,
        handle: DispatchHandle | None,
        num_tokens_per_rank: torch.Tensor | None,
        num_tokens_per_rdma_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Config | None,
        previous_event: EventOverlap | None,
    ) -> _Prepared:
        """Every check of one rank's dispatch arguments, and its row of the call header."""
        self._check_event(previous_event)
        config = self._check_config(config, "dispatch")
        x_data, x_scales = self._split_x(x)
        num_tokens, hidden = x_data.shape
        self._check_buffer_size(x_data, hidden, config)
        self._check_int("expert_alignment", expert_alignment, minimum=1)
        self._check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        checks = None
        if handle is not None:
            self._check_handle(handle)
            if topk_idx is not None or topk_weights is not None:
                raise InvalidInputError(
                    "cached dispatch (handle given) takes no topk_idx/topk_weights: the layout "
                    "comes from the handle; drop them or dispatch without a handle"
                )
            if num_tokens != handle.is_token_in_rank.shape[0]:
                raise InvalidInputError(
                    f"cached dispatch: x has {num_tokens} tokens but the handle was made for "
                    f"{handle.is_token_in_rank.shape[0]}"
                )
            args = DispatchArgs(
                x=x_data,
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
        else:
            args, checks = self._dispatch_args(
                x_data,
                x_scales,
                num_tokens_per_rank,
                num_tokens_per_rdma_rank,
                is_token_in_rank,
                num_tokens_per_expert,
                topk_idx,
                topk_weights,
                expert_alignment,
                num_worst_tokens,
                config,
            )
        header = None
        if self._backend.agrees_per_call:  # built only where it is exchanged (host time)
            header = CallHeader(
                kind=KIND_DISPATCH if handle is None else KIND_CACHED,
                seq=seq,
                dtype=DTYPE_CODES.get(x_data.dtype, 0),
                hidden=hidden,
                num_scales=0 if x_scales is None else x_scales.shape[1],
                num_topk=0 if args.topk_idx is None else args.topk_idx.shape[1],
                num_experts=args.num_experts,
                handle_seq=0 if handle is None else handle.seq,
                num_sms=config.num_sms,
                rdma_send=config.num_max_rdma_chunked_send_tokens,
                rdma_recv=config.num_max_rdma_chunked_recv_tokens,
                num_worst_tokens=args.num_worst_tokens,
            )
        counts = None if handle is not None else args.num_tokens_per_rank
        inputs = [t for t in (x_data, x_scales, topk_idx, topk_weights) if t is not None]
        return _Prepared(args, header, checks, counts, num_tokens, inputs)

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
            self._agree(KIND_COMBINE, seq, prepared, error, _worst_of(handle) > 0)
            x_, weights, biases, config_ = prepared.args
            return self._backend.combine(x_, handle, weights, biases, config_)

        inputs, event_in = ([], None) if prepared is None else (prepared.inputs, previous_event)
        (combined, combined_weights), event = self._run(
            run, inputs, event_in, async_finish, allocate_on_comm_stream
        )
        return combined, combined_weights, event

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
        self._check_tensor("x", x, dims=2, rows=expected_rows)
        if x.dtype not in self._backend.x_dtypes or x.dtype.itemsize == 1:
            raise InvalidInputError(
                f"combine: x.dtype={x.dtype} is not supported by the {self.backend} backend; "
                f"use one of {sorted(str(d) for d in self._backend.x_dtypes if d.itemsize > 1)}"
            )
        self._check_buffer_size(x, x.shape[1], config)
        if topk_weights is not None:
            self._check_tensor("topk_weights", topk_weights, dims=2, rows=expected_rows)
            _check_dtype("topk_weights", topk_weights, (torch.float32,))
        num_tokens = handle.is_token_in_rank.shape[0]
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
        x = x.contiguous()
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
            )
        inputs = [x, *biases] + ([topk_weights] if topk_weights is not None else [])
        return _Prepared((x, topk_weights, biases, config), header, None, None, num_tokens, inputs)

    # ---- agreement between the ranks (backends/agreement.py) -----------------------------
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
            # Kernels that agree on counts inside their notify step (see DESIGN): nothing to
            # exchange here. A rank whose own checks failed tells the peers through their
            # control regions, so their waits for this call stop at once and name it.
            if error is not None:
                self._backend.abort_peers(f"{KIND_NAMES[kind]} #{seq}", error)
                raise error
            return None
        call = f"{KIND_NAMES[kind]} #{seq}"
        if prepared is None:
            header = CallHeader(kind=kind, seq=seq, error=error_code(error))
            row = encode_row(header, self.group_size, self.device)
        else:
            row = encode_row(
                prepared.header,
                self.group_size,
                self.device,
                prepared.checks,
                prepared.counts,
                prepared.num_tokens,
            )
        if sync_free and self._backend.agrees_on_device:
            self._backend.exchange_header_async(row, call)
            if error is not None:
                raise error
            return None
        agreed = Agreement.decode(self._backend.exchange_header(row, call))
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

    # ---- stream handling -------------------------------------------------------------------
    def _run(
        self,
        fn: Callable[[], Any],
        inputs: Sequence[torch.Tensor],
        previous_event: EventOverlap | None,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple[Any, EventOverlap]:
        """Run ``fn`` on the comm stream, ordered after the caller's work.

        Inputs are recorded on the comm stream and outputs on the caller's stream, so the
        caching allocator never recycles memory one stream still uses. ``fn`` allocates its
        outputs with the comm stream current whatever ``allocate_on_comm_stream`` says (see
        ``dispatch``).
        """
        self._check_event(previous_event)
        if self._comm_stream is None:
            return fn(), EventOverlap(None)
        compute = torch.cuda.current_stream(self._device_index)
        comm = self._comm_stream
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            out = fn()
        for t in inputs:
            if t.is_cuda:
                t.record_stream(comm)
        outputs = [t for t in _tensors(out) if t.is_cuda]
        for t in outputs:
            t.record_stream(compute)
        if async_finish:
            event = torch.cuda.Event()
            event.record(comm)
            return out, EventOverlap(event, [*inputs, *outputs])
        compute.wait_stream(comm)
        return out, EventOverlap(None)

    # ---- validation --------------------------------------------------------------------------
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
        if t.device.type != self.device.type or (
            self.device.type == "cuda" and t.device.index != self.device.index
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
            key = (op, Buffer.num_sms)  # Buffer.set_num_sms changes the defaults
            config = self._default_configs.get(key)
            if config is None:
                config = (
                    self.get_dispatch_config(self.group_size)
                    if op == "dispatch"
                    else self.get_combine_config(self.group_size)
                )
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
        key = (hidden_bytes, config)  # the hints read the environment: checked once per key
        if key in self._sizes_ok:
            return
        need_nvl = config.get_nvl_buffer_size_hint(hidden_bytes, self.group_size)
        if self.num_nvl_bytes < need_nvl:
            raise BufferTooSmallError(
                f"Buffer has num_nvl_bytes={self.num_nvl_bytes} but hidden={hidden} "
                f"({x.dtype}) with this config needs {need_nvl}; create the Buffer with "
                f"num_nvl_bytes >= Config.get_nvl_buffer_size_hint({hidden_bytes}, "
                f"{self.group_size})"
            )
        need_rdma = config.get_rdma_buffer_size_hint(hidden_bytes, self.group_size)
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
            _check_dtype("scales", scales, (torch.float32,))
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
        _check_dtype("topk_idx", topk_idx, _TOPK_DTYPES)
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
        num_tokens_per_rank: torch.Tensor | None,
        num_tokens_per_rdma_rank: torch.Tensor | None,
        is_token_in_rank: torch.Tensor | None,
        num_tokens_per_expert: torch.Tensor | None,
        topk_idx: torch.Tensor | None,
        topk_weights: torch.Tensor | None,
        expert_alignment: int,
        num_worst_tokens: int,
        config: Config,
    ) -> tuple[DispatchArgs, torch.Tensor | None]:
        """The checked ``DispatchArgs``, and the routing checks still to run on every rank
        (``routing_check``) when the backend defers them to its call-header exchange."""
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
        self._check_tensor("is_token_in_rank", is_token_in_rank, dims=2, rows=num_tokens)
        _check_dtype("is_token_in_rank", is_token_in_rank, (torch.bool,))
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
            _check_dtype("topk_weights", topk_weights, (torch.float32,))
            if topk_weights.shape != topk_idx.shape:
                raise InvalidInputError(
                    f"topk_weights shape {tuple(topk_weights.shape)} != topk_idx shape "
                    f"{tuple(topk_idx.shape)}"
                )
            topk_idx = topk_idx.contiguous()
            topk_weights = topk_weights.contiguous()
        checks = None
        if self._backend.agrees_per_call:
            # The layout tensors are checked against what topk_idx implies (or, without it,
            # against is_token_in_rank): wrong ones misdeliver rows or size outputs wrongly.
            given = Layout(
                num_tokens_per_rank,
                num_tokens_per_rdma_rank,
                num_tokens_per_expert,
                is_token_in_rank,
            )
            true = None
            if topk_idx is not None:
                true = self._backend.get_dispatch_layout(topk_idx, num_experts)
            checks = routing_check(given, true, topk_idx, self.topology)
            if self._backend.defers_id_check:
                check_ids = False  # ids and layout travel in the call header
            else:
                bits = int(checks[2])
                if bits:
                    raise InvalidInputError(describe_layout_bits(bits))
                checks = None
        args = DispatchArgs(
            x=x,
            x_scales=x_scales,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            is_token_in_rank=is_token_in_rank.contiguous(),
            num_tokens_per_rank=num_tokens_per_rank,
            num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
            num_tokens_per_expert=num_tokens_per_expert,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_worst_tokens=num_worst_tokens,
            config=config,
            cached=None,
            check_ids=check_ids,
        )
        return args, checks


def _check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise InvalidInputError(
            f"{name}.dtype={t.dtype}; expected {' or '.join(str(d) for d in allowed)}"
        )


def _worst_of(handle: Any) -> int:
    """``num_worst_tokens`` of a handle (0 for anything that is not one)."""
    worst = getattr(handle, "num_worst_tokens", 0) if isinstance(handle, DispatchHandle) else 0
    return worst if isinstance(worst, int) else 0


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside nested tuples/lists/NamedTuples (outputs to record on a stream).
    A sequence that starts with a plain number is taken as numbers only (a count list of
    hundreds of ints would otherwise cost ~200 us per dispatch to walk)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if not isinstance(obj, tuple | list) or (obj and isinstance(obj[0], int | float)):
        return []
    out: list[torch.Tensor] = []
    for item in obj:
        if isinstance(item, torch.Tensor):
            out.append(item)
        elif isinstance(item, tuple | list):
            out.extend(_tensors(item))
    return out


def _group_device(
    group: dist.ProcessGroup, backend_name: str, device: torch.device | str | int | None
) -> torch.device:
    """The device of the Buffer's tensors: the caller's ``device``, else the current CUDA
    device for NCCL groups and for gloo groups that ask for the GPU kernels (ranks sharing a
    GPU), else the CPU."""
    if device is not None:
        try:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError(f"device={device!r} is not a device ({exc})") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidInputError(f"device={device!r} but no GPU is visible; pass 'cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    group_backend = dist.get_backend(group)
    if group_backend == "gloo" and backend_name != "kernels":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if group_backend == "gloo":
            raise UnsupportedError(
                "backend='kernels' is unavailable: no GPU is visible; use backend='reference' "
                "on CPU"
            )
        raise InvalidInputError(
            f"the group uses the {group_backend!r} backend but no GPU is visible; use a gloo "
            "group on CPU"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _detect_placement(group: dist.ProcessGroup, device: torch.device) -> tuple[int, int]:
    """Ranks per (virtual) node, checked against where the ranks really run, and how many
    ranks of the group share this rank's GPU (1 unless ranks share GPUs under MPS).

    Ranks per node: ``UCCL_EP_RANKS_PER_NODE`` (virtual nodes) or ``LOCAL_WORLD_SIZE`` when
    set, else the count of ranks sharing rank 0's host. Nodes must be runs of consecutive ranks.
    """
    size = dist.get_world_size(group)
    gpu = None
    if device.type == "cuda":
        gpu = str(torch.cuda.get_device_properties(device).uuid)
    places: list[tuple[str, str | None] | None] = [None] * size
    dist.all_gather_object(places, (socket.gethostname(), gpu), group=group)
    hosts = [p[0] for p in places]
    me = places[dist.get_rank(group)]
    sharers = sum(1 for p in places if p == me) if gpu is not None else 1
    host_nodes = _contiguous_runs(hosts)
    if host_nodes is None:
        raise UnsupportedError(
            f"ranks of one host are not consecutive in the group ({hosts}); launch with ranks "
            "grouped by node (torchrun does this)"
        )
    from_env = env_ranks_per_node(size)
    if from_env is not None:
        if host_nodes % from_env:
            raise InvalidInputError(
                f"UCCL_EP_RANKS_PER_NODE/LOCAL_WORLD_SIZE={from_env} makes a node span two hosts "
                f"(each host has {host_nodes} consecutive ranks); use a divisor of that"
            )
        return from_env, sharers
    return host_nodes, sharers


def _sm_budget(device: torch.device, sharers: int) -> int | None:
    """The largest even SM count each of ``sharers`` ranks on one GPU may use; ``None`` when
    the GPU is not shared (no limit beyond the device's own)."""
    if device.type != "cuda" or sharers <= 1:
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(2, sms // sharers // 2 * 2)


def _contiguous_runs(hosts: list[str | None]) -> int | None:
    """Ranks per host when every host holds one run of equal length, else ``None``."""
    runs = [len(list(g)) for _, g in itertools.groupby(hosts)]
    if len(runs) != len(set(hosts)) or len(set(runs)) != 1:
        return None
    return runs[0]

"""``KernelsBackend``: the intranode kernels' host side (sizing, launch structs, teardown).

The package docstring (``backends/intranode/__init__.py``) describes the kernels' protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.agreement import error_code, pack_dispatch_header
from uccl_ep_megatron.backends.base import (
    Backend,
    DispatchArgs,
    DispatchHandle,
    DispatchResult,
    Layout,
    Topology,
)
from uccl_ep_megatron.backends.intranode.arena import RecvArena, RecvOutputs
from uccl_ep_megatron.backends.intranode.launch import (
    as_int32,
    launch_layout,
    prepare_combine,
    warm_poison,
)
from uccl_ep_megatron.backends.intranode.status import (
    CHECK_WORDS,
    check_all_ranks,
    describe_call,
    note_host_wait,
    status_error,
)
from uccl_ep_megatron.backends.ipc_buffer import IpcBuffers
from uccl_ep_megatron.core._c import load as load_c
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    UcclEpError,
    UnsupportedError,
)


@dataclass
class _State:
    """What combine and cached dispatch need from a dispatch (kept in the handle)."""

    # rank_prefix_matrix, row-major, on the host; None for a sync-free dispatch, whose
    # kernels read it from the device (the handle's rank_prefix_matrix).
    prefix_host: tuple[int, ...] | None
    send_pos: torch.Tensor  # [T, R] int32: position of token t among rows sent to rank r, -1
    # Rows of every rank's combine staging: exact, or num_worst_tokens when sync-free.
    combine_rows: int

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the handle's later calls read on the device (``DispatchHandle.device_tensors``)."""
        return (self.send_pos,)


@dataclass(slots=True)
class _Launch:
    """What the notify and dispatch launches of one dispatch call share."""

    ctx: Any  # _C.IntranodeContext (replaced after a regrow)
    stream: int
    x: torch.Tensor
    scales: torch.Tensor | None
    topk_idx: torch.Tensor | None
    topk_weights: torch.Tensor | None
    in_rank: torch.Tensor
    info: torch.Tensor  # [rank_prefix_matrix (R*R) | aligned rows per local expert]
    send_pos: torch.Tensor
    cached: bool
    num_sms: int
    experts_per_rank: int
    num_experts: int


class KernelsBackend(Backend):
    """Intranode dispatch/combine kernels for ranks of one node (up to 8)."""

    name = "kernels"
    requested_as = "'kernels'"
    defers_id_check = True
    runs_on_caller_stream = True
    x_dtypes = frozenset(
        {
            torch.bfloat16,
            torch.float16,
            torch.float32,
            torch.float8_e4m3fn,
            torch.float8_e4m3fnuz,
        }
    )

    @classmethod
    def unsupported_reason(cls, topology: Topology, device: torch.device) -> str | None:
        """Why these kernels cannot serve the group, or ``None`` when they can."""
        c = load_c()
        if not c.kernels_built():
            return "the _C extension was built without the GPU kernels"
        if device.type != "cuda":
            return f"tensors live on {device.type}"
        if topology.num_nodes > 1:
            return (
                f"the group spans {topology.num_nodes} nodes; the kernels backend provides the "
                "intranode (single-node) path only"
            )
        if topology.num_ranks > c.KERNELS_MAX_RANKS:
            return f"{topology.num_ranks} ranks exceed the {c.KERNELS_MAX_RANKS} of one node"
        return None

    def __init__(
        self,
        group: dist.ProcessGroup,
        topology: Topology,
        device: torch.device,
        num_nvl_bytes: int,
        num_rdma_bytes: int,
    ) -> None:
        super().__init__(group, topology, device, num_nvl_bytes, num_rdma_bytes)
        c = load_c()
        self._c = c
        self._status = 0
        self._destroyed = False
        # A CUDA graph captured a call: its kernels hold the buffer addresses, so no regrow.
        self._captured = False
        # An input error of a sync-free call was raised already (destroy() raises it otherwise).
        self._reported = False
        self._aborted: str | None = None  # the call this rank rejected (abort_peers)
        self._device_index = (
            device.index if device.index is not None else torch.cuda.current_device()
        )
        # This rank's last device-checked call: describe_call's arguments, put in words only
        # when an error quotes them (host time).
        self._last_call: tuple[Any, ...] = ("no call", None, 0, 0)
        self._headers: dict[tuple[Any, ...], int] = {}  # see _header
        # The control region is always there, so barriers work even before data fits.
        nbytes = max(int(num_nvl_bytes), int(c.KERNELS_DATA_OFFSET))
        self._ipc = IpcBuffers(
            c,
            group,
            topology.rank,
            device.index if device.index is not None else torch.cuda.current_device(),
            nbytes,
            list(range(topology.num_ranks)),
            keep_bytes=int(c.KERNELS_DATA_OFFSET),
        )
        with torch.cuda.device(self._device_index):  # its device flag lives on this GPU
            self._status = c.host_status_alloc()
        warm_poison(c, self._status, device)
        self._ctx: Any = None  # see _context
        self._ctx_grows = -1
        from uccl_ep_megatron.core.config import effective_env

        env = effective_env()
        self._timeout_ms = int(env["UCCL_EP_TIMEOUT_MS"])
        self._use_tma = bool(env["UCCL_EP_INTRANODE_TMA"])
        # Combine reads an arena-resident x where it lies (per rank, told to peers per call).
        self._combine_in_place = bool(env["UCCL_EP_COMBINE_IN_PLACE"])
        self._timeout_ns = self._timeout_ms * 1_000_000
        # Zero-copy receive: dispatch outputs carved from a registered arena (arena.py).
        self.recv_arena = RecvArena(
            c,
            group,
            topology.rank,
            self._device_index,
            int(env["UCCL_EP_RECV_ARENA_BYTES"]),
            topology.num_ranks,
        )
        # Launch-ahead of exact dispatches (see dispatch): every rank must take the same path
        # in every call, so it is on only where it is on for every rank.
        flags: list[Any] = [None] * topology.num_ranks
        dist.all_gather_object(flags, bool(env["UCCL_EP_LAUNCH_AHEAD"]), group=group)
        self._launch_ahead = all(flags)
        self._ahead_rows = 0  # the next call's bound (_note_counts): identical on every rank
        self.ahead_calls = 0  # exact dispatches served by launch-ahead
        self.ahead_reruns = 0  # launch-ahead calls that ran again with exact sizes
        self.combine_in_place_calls = 0  # combines whose x peers read in this rank's arena
        # Dispatches launched by one binding call (intranode_dispatch_begin; see dispatch).
        self.one_call_dispatches = 0

    # ---- helpers -----------------------------------------------------------------------
    @property
    def _buffers(self) -> list[int]:
        return self._ipc.ptrs

    @property
    def _buffer_bytes(self) -> int:
        # Staging must fit in every rank's buffer: the smallest one bounds a call.
        return min(self._ipc.sizes)

    def _fit(self, need: int, what: str, capturing: bool) -> None:
        """Grow every rank's buffer (collectively) when this call needs more than it holds."""
        if need <= self._buffer_bytes:
            return
        if capturing:
            raise BufferTooSmallError(
                f"{what} needs num_nvl_bytes >= {need} but the buffer holds "
                f"{self._buffer_bytes}, and it cannot grow while a CUDA graph is being captured "
                "(growing synchronizes the device and reallocates): run the same call once "
                "eagerly before capturing, or create the Buffer with num_nvl_bytes >= "
                f"{need}"
            )
        if self._captured:
            raise BufferTooSmallError(
                f"{what} needs num_nvl_bytes >= {need} but the buffer holds "
                f"{self._buffer_bytes}, and a CUDA graph captured from this Buffer still "
                "writes into the current one, so it cannot be reallocated: create the Buffer "
                f"with num_nvl_bytes >= {need}"
            )
        self._ipc.grow([need] * self.topology.num_ranks, what)

    def _context(self) -> Any:
        """The per-Buffer part of every launch (``_C.IntranodeContext``), built once and again
        after a regrow (its buffer list and size change then)."""
        grows = self._ipc.grows
        if self._ctx is None or self._ctx_grows != grows:
            self._ctx = self._c.IntranodeContext(
                self._buffers,
                self._buffer_bytes,
                self.topology.rank,
                self.topology.num_ranks,
                self._status,
                self._timeout_ns,
                self._use_tma,
                self.recv_arena.ptrs,
                self.recv_arena.sizes,
                self._combine_in_place,
            )
            self._ctx_grows = grows
        return self._ctx

    def _header(self, *fields: Any) -> int:
        """``pack_dispatch_header(*fields)``, packed once per distinct call shape (host time)."""
        word = self._headers.get(fields)
        if word is None:
            word = self._headers[fields] = pack_dispatch_header(*fields)
        return word

    def _stream(self) -> int:
        # The raw handle, without building a torch.cuda.Stream (host time).
        return torch._C._cuda_getCurrentRawStream(self._device_index)

    def _outputs(
        self,
        rows: int,
        x: torch.Tensor,
        num_scales: int,
        topk_idx: torch.Tensor | None,
        cached_src: torch.Tensor | None,
        capturing: bool,
        stream: int,
        later: bool = False,
    ) -> Any:
        """A dispatch's outputs for ``rows`` received rows of ``x``'s width and dtype (see
        ``RecvArena.outputs``), used on the caller's stream."""
        return self.recv_arena.outputs(
            rows,
            x.shape[1],
            x.dtype,
            num_scales,
            topk_idx,
            cached_src,
            x.device,
            capturing,
            stream,
            self.caller_stream or stream,
            later,
        )

    def note_stream(self, stream: int) -> None:
        self.recv_arena.note_stream(stream)

    def _capturing(self) -> bool:
        if torch.cuda.is_current_stream_capturing():
            self._captured = True
            return True
        return False

    def check_errors(self) -> None:
        self._check_status()

    def abort_peers(self, call: str, error: BaseException) -> None:
        """Post this rank's abort record into every peer's control region (see
        ``kAbortOffset``): peers waiting for this rank in ``call`` stop within microseconds and
        raise ``error``'s class with its message. The group's calls no longer match after this,
        so every Buffer of the group is unusable (as after a timeout)."""
        if self._destroyed or self._aborted is not None:
            return
        self._aborted = call
        reason = f"{call}: {type(error).__name__}: {error}"
        try:
            with torch.cuda.device(self.device):
                self._c.post_abort(
                    self._buffers, self.topology.rank, 1 << 8 | error_code(error), reason
                )
        except Exception as exc:  # noqa: BLE001 - the original error is what the caller sees
            error.add_note(f"uccl_ep: could not tell the peers ({exc}); they will time out")

    def _check_status(self) -> None:
        self._check_usable()
        words = self._c.host_status_read(self._status)
        if words[0]:
            raise self._status_error(*words)

    def _check_usable(self) -> None:
        """Raise when this backend was destroyed or this rank aborted a call (host flags)."""
        if self._destroyed:
            raise UcclEpError("the kernels backend was destroyed; create a new Buffer")
        if self._aborted is not None:
            raise UcclEpError(
                f"rank {self.topology.rank} rejected {self._aborted} and told its peers to stop; "
                "the group's calls no longer match, so this Buffer is unusable: create a new one"
            )

    def _status_error(self, code: int, a: int, b: int, extra: int) -> UcclEpError:
        """The exception the status words describe (``status.status_error``)."""
        c = self._c
        if code not in (c.STATUS_TIMEOUT, c.STATUS_PEER_ABORT):
            self._reported = True  # an input error: destroy() does not raise it a second time
        own = self.topology.rank
        return status_error(
            c,
            (code, a, b, extra),
            own,
            self._timeout_ms,
            describe_call(*self._last_call),
            lambda peer: c.read_abort(self._buffers[own], peer),
        )

    # ---- layout -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        self._check_status()
        per_rank, per_expert, in_rank = launch_layout(
            self._c, topk_idx, num_experts, self.topology.num_ranks, self._stream()
        )
        return Layout(per_rank, None, per_expert, in_rank)

    # ---- dispatch -----------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        # The status word is read by intranode_dispatch_begin, or below on the other path.
        self._check_usable()
        c = self._c
        num_ranks = self.topology.num_ranks
        x = args.x.contiguous()
        num_tokens, hidden = x.shape
        dev = x.device
        dtype = x.dtype
        cached = args.cached
        topk_idx = None if cached is not None else args.topk_idx
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        scales = args.x_scales
        num_scales = 0 if scales is None else scales.shape[1]
        num_experts = 0 if cached is not None else args.num_experts
        experts_per_rank = num_experts // num_ranks
        if experts_per_rank > c.KERNELS_MAX_LOCAL_EXPERTS:
            raise UnsupportedError(
                f"{experts_per_rank} experts per rank exceed the kernels' limit of "
                f"{c.KERNELS_MAX_LOCAL_EXPERTS}; use the reference backend"
            )
        worst = args.num_worst_tokens
        per_expert = None if cached is not None else as_int32(args.num_tokens_per_expert)
        # The call header every rank must agree on: read back with the counts (exact mode),
        # judged by notify (sync-free) or compared with its barrier (cached dispatch).
        header = self._header(dtype, hidden, num_scales, num_topk, num_experts)
        kind = "cached dispatch" if cached is not None else "dispatch"
        self._last_call = (kind, dtype, hidden, num_scales)
        ahead = self._ahead_rows if worst == 0 and cached is None else 0
        core = self.recv_arena.core
        rows = worst or ahead
        own_rows = send_rows = -1
        staging_rows = rows
        if cached is not None and worst == 0 and core is not None:
            # An exact cached dispatch: its sizes come from the handle's host matrix.
            rows, staging_rows, own_rows, send_rows, _ = c.intranode_exact_rows(
                cached.state.prefix_host, self.topology.rank, num_ranks
            )
        if rows > 0 and core is not None:
            # Rows known before notify (sync-free, launch-ahead, cached): one binding call looks
            # at the status word, the capture state and the staging size, reserves the block
            # (outputs, send_pos, info) and launches notify and the dispatch kernel. None: take
            # the step-by-step path below (it raises a set status word, handles a capture,
            # grows the staging or goes staged), which decides exactly as this call would have.
            stream = self._stream()
            ctx = self._context()
            weights = None if topk_idx is None else args.topk_weights
            reserved = c.intranode_dispatch_begin(
                ctx,
                stream,
                core,
                self.caller_stream or stream,
                x,
                scales,
                topk_idx,
                weights,
                args.is_token_in_rank,
                as_int32(args.num_tokens_per_rank),
                per_expert,
                None if cached is None else cached.state.send_pos,
                args.config.num_sms,
                experts_per_rank,
                args.expert_alignment,
                num_experts,
                rows,
                worst > 0,
                own_rows,
                send_rows,
                staging_rows,
                header,
            )
            if reserved is not None and cached is not None:
                self.one_call_dispatches += 1
                outs = RecvOutputs(None, True, [], reserved, dtype)
                outs.made()  # its info stays in the block, which the rows keep alive
                return self._cached_result(cached, outs, rows)
            if reserved is not None:
                self.one_call_dispatches += 1
                send_pos, info = reserved.aux()
                launch = _Launch(
                    ctx,
                    stream,
                    x,
                    scales,
                    topk_idx,
                    weights,
                    args.is_token_in_rank,
                    info,
                    send_pos,
                    False,
                    args.config.num_sms,
                    experts_per_rank,
                    num_experts,
                )
                outs = RecvOutputs(None, True, [], reserved, dtype)
                if worst > 0:
                    return self._dispatch_result(launch, outs.made(), [], None, worst, worst, True)
                result = self._ahead_result(launch, outs, ahead)
                if result is not None:
                    return result
                # Run again with exact sizes (notify writes send_pos and info afresh): into
                # tensors of their own, so that the bound's block goes back now instead of
                # living as long as the handle.
                del send_pos, info, outs, reserved
                launch.send_pos = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=dev)
                launch.info = torch.empty(
                    num_ranks * num_ranks + experts_per_rank, dtype=torch.int32, device=dev
                )
                self._notify(launch, args, per_expert, 0, header, None)
                return self._exact(launch, args, None)
        self._check_status()
        capturing = self._capturing()
        if capturing and worst == 0:
            raise UnsupportedError(
                "dispatch without num_worst_tokens reads the received counts back to the host, "
                "which a CUDA graph cannot capture: pass num_worst_tokens > 0 (sync-free mode)"
            )
        row_bytes = hidden * x.element_size()
        idx_size = topk_idx.element_size() if topk_idx is not None else 8
        if worst > 0:
            # Sync-free: staging for the worst case, sized from host-known values before
            # anything is launched (every rank passes the same num_worst_tokens).
            need = c.dispatch_staging_bytes(worst, row_bytes, num_scales, num_topk, idx_size)
            self._fit(need, f"dispatch of up to {worst} rows of {row_bytes} bytes", capturing)
        # Launch-ahead (exact calls): outputs and staging for the bound every rank holds alike,
        # without growing the buffer (a regrow is collective and synchronizes). Every rank must
        # decide alike, so from what the call header makes equal: ids sized as int64.
        if ahead > 0:
            need = c.dispatch_staging_bytes(ahead, row_bytes, num_scales, num_topk, 8)
            ahead = ahead if need <= self._buffer_bytes else 0
        stream = self._stream()
        # Sync-free and launch-ahead calls know their output sizes now: their outputs exist
        # before notify, which hands their place (the receive entry) to every peer with the
        # counts.
        outs = entry = None
        cached_src = None if cached is None else cached.recv_src_idx
        if worst > 0 or ahead > 0:
            # The block's tensors are made after the launches (host time then overlaps the
            # kernels instead of delaying them); a cached dispatch's at once (it reuses the
            # handle's source indices).
            rows = worst or ahead
            outs = self._outputs(
                rows, x, num_scales, topk_idx, cached_src, capturing, stream, later=True
            )
            entry = outs.entry
        if cached is None:
            send_pos = torch.empty(num_tokens, num_ranks, dtype=torch.int32, device=dev)
        else:
            send_pos = cached.state.send_pos
        # [rank_prefix_matrix (R*R) | aligned received rows per local expert]: the handle's
        # rank_prefix_matrix, recv_count and recv_tokens_per_expert are views of it.
        nrr = num_ranks * num_ranks
        info = torch.empty(nrr + experts_per_rank, dtype=torch.int32, device=dev)
        launch = _Launch(
            self._context(),
            stream,
            x,
            scales,
            topk_idx,
            None if topk_idx is None else args.topk_weights,
            args.is_token_in_rank,
            info,
            send_pos,
            cached is not None,
            args.config.num_sms,
            experts_per_rank,
            num_experts,
        )
        self._notify(launch, args, per_expert, worst, header, entry)
        if ahead > 0:
            # The data kernel goes now, right behind notify; it judges every rank's checks and
            # counts itself and skips the call on every rank alike when they fail or a rank
            # receives more than `ahead` rows. The host reads the counts while it runs.
            self._launch(launch, outs, ahead, -1, -1, ahead, True, judge=True)
            result = self._ahead_result(launch, outs, ahead)
            if result is not None:
                return result
            outs = None  # the bound's block goes back before the exact call takes its own
            self._notify(launch, args, per_expert, 0, header, None)
            return self._exact(launch, args, None)
        if worst > 0:
            self._launch(launch, outs, worst, -1, -1, worst, entry is not None)
            if cached is not None:
                return self._cached_result(cached, outs, worst)
            return self._dispatch_result(
                launch, outs.made(), [], None, worst, worst, outs.zero_copy
            )
        return self._exact(launch, args, outs)

    def _ahead_result(self, launch: _Launch, outs: Any, ahead: int) -> DispatchResult | None:
        """A launch-ahead call's result once the host has read its counts, or None when some
        rank receives more than ``ahead`` rows: every rank holds the same matrix, so every data
        kernel skipped the call and every rank runs it again with exact sizes (``_exact``,
        after notify again)."""
        c = self._c
        rank, num_ranks = self.topology.rank, self.topology.num_ranks
        prefix_host, expert_counts = self._read_counts(launch, num_ranks * num_ranks)
        num_recv, _, _, _, combine_rows = c.intranode_exact_rows(prefix_host, rank, num_ranks)
        if self._note_counts(prefix_host) > ahead:
            self.ahead_reruns += 1
            return None
        self.ahead_calls += 1
        if outs.tensors is None:  # reserved: tensors of exactly the received rows
            tensors = outs.made(num_recv)
        else:  # staged (the arena was full): views of them
            tensors = tuple(None if t is None else t[:num_recv] for t in outs.tensors)
        return self._dispatch_result(
            launch, tensors, expert_counts, prefix_host, num_recv, combine_rows, outs.zero_copy
        )

    def _exact(self, launch: _Launch, args: DispatchArgs, outs: Any) -> DispatchResult:
        """An exact-size dispatch after its notify: the counts read back (the one host sync;
        a cached dispatch has them in its handle), then outputs of exactly the received rows
        (``outs`` when made already) and the data kernel."""
        c = self._c
        rank, num_ranks = self.topology.rank, self.topology.num_ranks
        cached = args.cached
        x = launch.x
        num_scales = 0 if launch.scales is None else launch.scales.shape[1]
        topk_idx = launch.topk_idx
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        row_bytes = x.shape[1] * x.element_size()
        idx_size = topk_idx.element_size() if topk_idx is not None else 8
        expert_counts: list[int] = []
        if cached is not None:
            prefix_host = cached.state.prefix_host
        else:
            # The one host sync (output sizes depend on it); every rank's checks ride along.
            prefix_host, expert_counts = self._read_counts(launch, num_ranks * num_ranks)
            self._note_counts(prefix_host)
        num_recv, staging_rows, own_rows, send_rows, combine_rows = c.intranode_exact_rows(
            prefix_host, rank, num_ranks
        )
        need = c.dispatch_staging_bytes(staging_rows, row_bytes, num_scales, num_topk, idx_size)
        # Every rank holds the same prefix matrix, so all decide the same here.
        self._fit(
            need, f"dispatch of up to {staging_rows} received rows of {row_bytes} bytes", False
        )
        launch.ctx = self._context()  # a regrow replaced the buffers
        cached_src = None if cached is None else cached.recv_src_idx
        if outs is None:
            outs = self._outputs(
                num_recv, x, num_scales, topk_idx, cached_src, False, launch.stream
            )
        self._launch(launch, outs, num_recv, own_rows, send_rows, staging_rows, False)
        if cached is not None:
            return self._cached_result(cached, outs, num_recv)
        return self._dispatch_result(
            launch, outs.made(), expert_counts, prefix_host, num_recv, combine_rows, outs.zero_copy
        )

    @staticmethod
    def _cached_result(cached: DispatchHandle, outs: Any, num_recv: int) -> DispatchResult:
        """A cached dispatch's result: its rows (and FP8 scales), the handle's layout."""
        recv_x, recv_scales = outs.tensors[:2]
        return DispatchResult(
            recv_x,
            recv_scales,
            None,
            None,
            [],
            cached.rank_prefix_matrix,
            cached.recv_src_idx,
            num_recv,
            cached.state,
            arena=outs.zero_copy,
        )

    def _notify(
        self,
        launch: _Launch,
        args: DispatchArgs,
        per_expert: torch.Tensor | None,
        worst: int,
        header: int,
        entry: list[int] | None,
    ) -> None:
        """Notify: the count exchange and entry barrier. Exact calls read the counts and
        every rank's checks back through mapped host memory (see check_all_ranks); sync-free
        notify judges them itself and records a failure in the status word. Notify scans the
        id range itself (no extra launches); ids are checked whenever given, so
        ``args.check_ids`` (the range is still unchecked) is always honoured."""
        cached = launch.cached
        self._c.intranode_notify_call(
            launch.ctx,
            launch.stream,
            as_int32(args.num_tokens_per_rank),
            per_expert,
            launch.info,
            launch.in_rank,
            None if cached else launch.send_pos,
            launch.topk_idx,
            not cached and worst == 0,
            launch.experts_per_rank,
            args.expert_alignment,
            worst,
            launch.num_experts,
            header,
            entry or [],
        )

    def _read_counts(self, launch: _Launch, nrr: int) -> tuple[tuple[int, ...], list[int]]:
        """The readback of an exact call's notify: (host prefix matrix, aligned received rows
        per local expert), after raising any rank's bad input on every rank."""
        c = self._c
        rank = self.topology.rank
        state, info_host = c.intranode_read_counts(launch.ctx, nrr + launch.experts_per_rank)
        note_host_wait()
        self._check_status()
        if state == -1:  # the status words were clear: cannot happen, but never hang
            raise UcclEpError(f"rank {rank}: the dispatch's notify barrier failed")
        if state == 0:
            raise CommTimeoutError(
                f"rank {rank}: the dispatch's notify kernel did not finish within "
                f"{2 * self._timeout_ms} ms (twice UCCL_EP_TIMEOUT_MS): earlier work on "
                "the stream is stuck; the GPU may need a process restart"
            )
        check_all_ranks(info_host[-CHECK_WORDS * self.topology.num_ranks :], launch.num_experts)
        return tuple(info_host[:nrr]), info_host[nrr : nrr + launch.experts_per_rank]

    def _note_counts(self, prefix_host: tuple[int, ...]) -> int:
        """The most rows any rank receives in this call (the prefix matrix's last row), and
        the launch-ahead bound of the next call from it: that plus 1/16 and 64 rows, rounded
        up to 64 (every rank holds the same matrix, so the same bound)."""
        R = self.topology.num_ranks
        most = max(prefix_host[R * (R - 1) :])
        if self._launch_ahead:
            self._ahead_rows = (most + most // 16 + 127) // 64 * 64
        return most

    def _launch(
        self,
        launch: _Launch,
        outs: Any,
        num_recv: int,
        own_rows: int,
        send_rows: int,
        staging_rows: int,
        entry_published: bool,
        judge: bool = False,
    ) -> None:
        """The dispatch kernel, then (same call) the poison fold: a failure inside this call
        is raised at the next one; until then the outputs say so. ``judge``: a launch-ahead
        call (the kernel judges every rank's checks and counts first)."""
        outputs = outs.tensors
        if outputs is None:  # a reservation: its tensors are made after this launch
            outputs = (outs.reservation, None, None, None, None)
        recv_x, recv_scales, recv_idx, recv_w, recv_src = outputs
        self._c.intranode_dispatch_call(
            launch.ctx,
            launch.stream,
            launch.x,
            launch.scales,
            launch.topk_idx,
            launch.topk_weights,
            launch.in_rank,
            launch.info,
            launch.send_pos,
            recv_x,
            recv_scales,
            recv_idx,
            recv_w,
            None if launch.cached else recv_src,
            launch.cached,
            launch.num_sms,
            launch.experts_per_rank,
            num_recv,
            own_rows,
            send_rows,
            staging_rows,
            outs.zero_copy,
            entry_published,
            judge,
            launch.num_experts,
        )

    def _dispatch_result(
        self,
        launch: _Launch,
        outputs: tuple[Any, ...],
        expert_counts: list[int],
        prefix_host: tuple[int, ...] | None,
        num_recv: int,
        combine_rows: int,
        zero_copy: bool,
    ) -> DispatchResult:
        """A non-cached dispatch's result; the handle's matrix and counts are views of
        notify's ``info``. ``zero_copy``: the outputs lie in the receive arena."""
        recv_x, recv_scales, recv_idx, recv_w, recv_src = outputs
        R, rank = self.topology.num_ranks, self.topology.rank
        nrr = R * R
        info = launch.info
        # One as_strided per view (slicing then viewing is two torch calls: host time).
        view = info.as_strided
        return DispatchResult(
            recv_x,
            recv_scales,
            recv_idx,
            recv_w,
            expert_counts,
            view((R, R), (R, 1), 0),
            recv_src,
            num_recv,
            _State(prefix_host, launch.send_pos, combine_rows),
            view((1,), (1,), nrr - R + rank),  # this rank's received rows: the last row's
            view((launch.experts_per_rank,), (1,), nrr),
            zero_copy,
        )

    # ---- combine ------------------------------------------------------------------------
    def combine_input(
        self, rows: int, hidden: int, dtype: torch.dtype, comm_stream: int
    ) -> torch.Tensor | None:
        # Written on the current stream (the block's earlier users are waited for there), read
        # by combine on the communication stream (comm_stream), or on the current one (0: a
        # synchronous call runs there): at death an event is recorded on each.
        if not self._combine_in_place or self._capturing():
            return None
        return self.recv_arena.combine_input(
            rows, hidden, dtype, self._stream(), comm_stream or self._stream()
        )

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # The status word is read by intranode_combine_call (or here after a bad argument).
        self._check_usable()
        c = self._c
        num_tokens = handle.is_token_in_rank.shape[0]
        try:
            t = prepare_combine(x, topk_weights, bias, num_tokens, "the kernels backend")
        except UcclEpError as exc:
            self._check_status()  # an earlier call's failure is raised first
            self.abort_peers("combine", exc)
            raise
        x, hidden = t.x, t.x.shape[1]
        state: _State = handle.state
        num_topk = 0 if topk_weights is None else topk_weights.shape[1]
        staging_rows = state.combine_rows
        row_bytes = hidden * x.element_size()
        need = c.combine_staging_bytes(staging_rows, row_bytes, num_topk)
        if need > self._buffer_bytes:
            self._check_status()
            self._fit(
                need,
                f"combine of up to {staging_rows} returned rows of {row_bytes} bytes",
                self._capturing(),
            )
        biases = t.biases
        num_bias = len(biases)
        extra = f"topk_weights columns={num_topk}, biases={num_bias}"
        self._last_call = ("combine", x.dtype, hidden, 0, extra)
        # Rows of x to return: the received count, or its bound in sync-free mode (the kernels
        # read the real count from the device matrix).
        done = c.intranode_combine_call(
            self._context(),
            self._stream(),
            x,
            t.weights,
            biases[0] if num_bias > 0 else None,
            biases[1] if num_bias > 1 else None,
            t.out,
            t.out_weights,
            handle.rank_prefix_matrix,
            state.send_pos,
            handle.num_recv_tokens,
            staging_rows,
            config.num_sms,
            # pack_combine_header's word: weights' columns as top-k, biases as experts.
            self._header(x.dtype, hidden, 0, num_topk, num_bias),
        )
        if done == c.COMBINE_STATUS_SET:  # nothing was launched
            self._check_status()
            raise UcclEpError(f"rank {self.topology.rank}: the status word was set, then cleared")
        if done & c.COMBINE_CAPTURED:
            self._captured = True  # its kernels hold the buffer addresses: no regrow from now
        self.combine_in_place_calls += done & c.COMBINED_IN_PLACE
        return t.out, t.out_weights

    # ---- teardown -----------------------------------------------------------------------
    def destroy(self, collective: bool = True) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        c = self._c
        pending = None
        try:
            self.recv_arena.close(collective, self._timeout_ms)
            self._ipc.close(collective, self._timeout_ms)
            # close() synchronized the device: the status words are final. An input error no
            # call has raised yet is raised now (after the release), as the contract says.
            words = c.host_status_read(self._status)
            if words[0] and words[0] != c.STATUS_TIMEOUT and not self._reported:
                pending = self._status_error(*words)
        finally:
            with torch.cuda.device(self.device):
                c.host_status_free(self._status)
        if pending is not None:
            raise pending

"""``KernelsBackend``: the intranode kernels' host side (sizing, launch structs, teardown).

The package docstring (``backends/intranode/__init__.py``) describes the kernels' protocol.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
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
    CombineTensors,
    as_int32,
    launch_layout,
    prepare_combine,
    warm_poison,
)
from uccl_ep_megatron.backends.intranode.status import (
    ABORT_HOST_GAVE_UP,
    ABORT_PEER_EXITED,
    ABORT_REJECTED,
    CHECK_WORDS,
    abort_word,
    check_all_ranks,
    describe_call,
    gave_up_reason,
    note_host_wait,
    peer_exited_error,
    peer_exited_reason,
    status_error,
)
from uccl_ep_megatron.backends.ipc_buffer import IpcBuffers
from uccl_ep_megatron.backends.liveness import PeerWatcher, process_identity, watch_peers
from uccl_ep_megatron.core._c import load as load_c
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    UcclEpError,
    UnsupportedError,
)
from uccl_ep_megatron.core.events import EventOverlap
from uccl_ep_megatron.core.options import BufferOptions

log = logging.getLogger(__name__)


@dataclass
class _State:
    """What combine and cached dispatch need from a dispatch (kept in the handle)."""

    # rank_prefix_matrix, row-major, on the host; None for a sync-free dispatch, whose
    # kernels read it from the device (the handle's rank_prefix_matrix).
    prefix_host: tuple[int, ...] | None
    send_pos: torch.Tensor  # [T, R] int32: position of token t among rows sent to rank r, -1
    # The dispatch's _C.DispatchRows: rows received (num_worst_tokens when sync-free) and the
    # rows of every rank's combine staging, which the combine takes back.
    rows: Any

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What the handle's later calls read on the device (``DispatchHandle.device_tensors``)."""
        return (self.send_pos,)


@dataclass(slots=True)
class _Call:
    """What the notify and dispatch launches of one step-by-step dispatch share."""

    ctx: Any  # _C.IntranodeContext (replaced after a regrow)
    launch: Any  # _C.DispatchLaunch of the call's layout (reused across calls)
    stream: int
    args: DispatchArgs  # the call's tensors, read by name in _C
    # [rank_prefix_matrix (R*R) | aligned rows per local expert]; None when `views` holds them
    info: torch.Tensor | None
    send_pos: torch.Tensor | None  # None until a launch-ahead call's counts came (_ahead_result)
    # The handle's views of info (matrix, this rank's received rows, per-expert rows), made
    # with the receive block's tensors by a one-call dispatch; None: views of `info`.
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


# A launch-ahead call that must run again with exact sizes (see KernelsBackend.dispatch).
_RUN_AGAIN: Any = object()


def _kernel_args(args: DispatchArgs) -> DispatchArgs:
    """``args`` as the kernels read them: x contiguous, the counts contiguous int32 (``args``
    itself, without a copy or a launch, when they already are)."""
    per_rank, per_expert = args.num_tokens_per_rank, args.num_tokens_per_expert
    if (
        args.x.is_contiguous()
        and per_rank.dtype == torch.int32
        and per_rank.is_contiguous()
        and (per_expert is None or (per_expert.dtype == torch.int32 and per_expert.is_contiguous()))
    ):
        return args
    return dataclasses.replace(
        args,
        x=args.x.contiguous(),
        num_tokens_per_rank=as_int32(per_rank),
        num_tokens_per_expert=None if per_expert is None else as_int32(per_expert),
    )


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
        options: BufferOptions,
    ) -> None:
        super().__init__(group, topology, device, num_nvl_bytes, num_rdma_bytes, options)
        c = load_c()
        self._c = c
        self._status = 0
        self._destroyed = False
        # Peers whose process exited (rank -> why), seen by the liveness watcher's thread.
        self._exited: dict[int, str] = {}
        self._watcher: PeerWatcher | None = None
        # Serialises the watcher thread's post into this rank's own control region with what
        # replaces or frees that region (a regrow, destroy).
        self._region_lock = threading.Lock()
        # A CUDA graph captured a call: its kernels hold the buffer addresses, so no regrow.
        self._captured = False
        # An input error of a sync-free call was raised already (destroy() raises it otherwise).
        self._reported = False
        # Why this rank told its peers to stop (abort_peers, _give_up): this Buffer is unusable.
        self._aborted: str | None = None
        self._device_index = (
            device.index if device.index is not None else torch.cuda.current_device()
        )
        # This rank's last device-checked call: describe_call's arguments, put in words only
        # when an error quotes them (host time).
        self._last_call: tuple[Any, ...] = ("no call", None, 0, 0)
        # Typed launch arguments, built once per layout and shape and reused (host time):
        # _C.DispatchLaunch, _C.DispatchRows bounds, _C.CombineLaunch.
        self._launches: dict[tuple[Any, ...], Any] = {}
        self._bounds: dict[int, Any] = {}
        self._combine_launches: dict[tuple[Any, ...], Any] = {}
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
            allow_grow=bool(options.grow_nvl_buffer),
        )
        with torch.cuda.device(self._device_index):  # its device flag lives on this GPU
            self._status = c.host_status_alloc()
        warm_poison(c, self._status, device)
        self._ctx: Any = None  # see _context
        self._ctx_grows = -1
        self._timeout_ms = self.timeout_ms
        self._use_tma = bool(options.tma)
        # Combine reads an arena-resident x where it lies (per rank, told to peers per call).
        self._combine_in_place = bool(options.combine_in_place)
        self._timeout_ns = self._timeout_ms * 1_000_000
        # Zero-copy receive: dispatch outputs carved from a registered arena (arena.py).
        self.recv_arena = RecvArena(
            c,
            group,
            topology.rank,
            self._device_index,
            int(options.arena_bytes),
            topology.num_ranks,
        )
        # Launch-ahead of exact dispatches (see dispatch): every rank must take the same path
        # in every call, so it is on only where it is on for every rank. Each rank's process
        # identity rides along (the liveness watcher's).
        flags: list[Any] = [None] * topology.num_ranks
        dist.all_gather_object(flags, (bool(options.launch_ahead), process_identity()), group=group)
        self._launch_ahead = all(f[0] for f in flags)
        self._ahead_rows = 0  # the next call's bound (_note_counts): identical on every rank
        self.ahead_calls = 0  # exact dispatches served by launch-ahead
        self.ahead_reruns = 0  # launch-ahead calls that ran again with exact sizes
        # Launch-ahead calls whose counts, outputs and handle came from one binding call
        # (intranode_ahead_finish); the others were judged from its words.
        self.ahead_finishes = 0
        self.combine_in_place_calls = 0  # combines whose x peers read in this rank's arena
        # Combines whose x (or weights) the caller made elsewhere, copied into the arena first
        # (_copy_in); they count as in place too. Off: such combines push their rows back.
        self._combine_copy_in = self._combine_in_place and bool(options.combine_copy_in)
        self.combine_copied_in_calls = 0
        # At 2 ranks a combine of an exact dispatch's rows whose x is not read in place sends
        # them back with the copy engine on this side stream while its SMs only sum
        # (csrc/kernels/combine.cu); per rank, told to the peer per call. combine_copy_engine
        # turns it off and on.
        self._ce_stream = None
        if options.combine_copy_engine and topology.num_ranks == 2:
            self._ce_stream = torch.cuda.Stream(device=self._device_index)
        self._copy_engine = self._ce_stream is not None
        self.combine_copy_engine_calls = 0
        # Dispatches launched by one binding call (intranode_dispatch_begin; see dispatch).
        self.one_call_dispatches = 0
        self.lane: Any = None  # _C.IntranodeLane of the Buffer's direct lane (make_lane)
        self._watch([f[1] for f in flags])

    def _watch(self, identities: list[Any]) -> None:
        """Watch the peers' processes (``liveness.py``): a peer that exits never signals, so
        this rank's kernels would wait for it until the timeout. The watcher's callback holds
        this backend weakly, and is stopped by destroy() or when the backend is collected."""
        ref = weakref.ref(self)

        def exited(peer: int, pid: int) -> None:
            backend = ref()
            if backend is not None:
                backend._peer_exited(peer, pid)

        rank = self.topology.rank
        self._watcher = watch_peers(rank, identities, exited, f"uccl_ep-liveness-r{rank}")
        if self._watcher is not None:
            weakref.finalize(self, self._watcher.close)

    def _peer_exited(self, peer: int, pid: int) -> None:
        """Rank ``peer``'s process exited (the watcher's thread): post an abort record in its
        name into this rank's own control region, so this rank's kernels waiting for it stop
        within microseconds and raise naming it. A record it posted itself before it died
        says more (why it gave up) and is kept."""
        with self._region_lock:
            if self._destroyed:
                return
            why = peer_exited_reason(peer, pid)
            self._exited[peer] = why
            own = self._buffers[self.topology.rank]
            c = self._c
            try:
                with torch.cuda.device(self._device_index):
                    if c.read_abort(own, peer)[0] == 0:
                        c.post_abort_as(own, peer, abort_word(ABORT_PEER_EXITED), why)
            except Exception as exc:  # noqa: BLE001 - the host still raises at its next call
                log.warning(
                    "rank %d: %s, but its kernels could not be told (%s): a call under way "
                    "ends at UCCL_EP_TIMEOUT_MS",
                    self.topology.rank,
                    why,
                    exc,
                )

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
        with self._region_lock:  # the watcher posts into this rank's region: not meanwhile
            self._ipc.grow([need] * self.topology.num_ranks, what)

    def _context(self) -> Any:
        """The per-Buffer part of every launch (``_C.IntranodeContext``), built once and again
        after a regrow (its buffer list and size change then)."""
        grows = self._ipc.grows
        if self._ctx is None or self._ctx_grows != grows:
            self._ctx = self._c.IntranodeContext(
                buffers=self._buffers,
                buffer_bytes=self._buffer_bytes,
                rank=self.topology.rank,
                num_ranks=self.topology.num_ranks,
                status=self._status,
                timeout_ns=self._timeout_ns,
                use_tma=self._use_tma,
                arenas=self.recv_arena.ptrs,
                arena_sizes=self.recv_arena.sizes,
                combine_in_place=self._combine_in_place,
                copy_engine_stream=0 if self._ce_stream is None else self._ce_stream.cuda_stream,
            )
            self._ctx.copy_engine = self._copy_engine
            self._ctx_grows = grows
        return self._ctx

    @property
    def combine_copy_engine(self) -> bool:
        """Whether a 2-rank combine of an exact dispatch's rows whose x is not read in place
        sends them back with the copy engine (``UCCL_EP_COMBINE_COPY_ENGINE``); settable, per
        rank."""
        return self._copy_engine

    @combine_copy_engine.setter
    def combine_copy_engine(self, on: bool) -> None:
        self._copy_engine = bool(on) and self._ce_stream is not None
        if self._ctx is not None:
            self._ctx.copy_engine = self._copy_engine

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
        rank = self.topology.rank
        self._post_abort(
            f"rank {rank} rejected {call} and told its peers to stop",
            abort_word(ABORT_REJECTED, error_code(error)),
            f"{call}: {type(error).__name__}: {error}",
            error,
        )

    def _give_up(self, call: str, error: BaseException) -> None:
        """This rank's host leaves ``call`` without the kernels having failed (interrupted,
        an error of its own after a launch, a stuck stream): its peers' kernels would wait for
        it until the timeout, or pass a barrier it signalled and move rows it never takes.
        Its abort record stops them at once, naming this rank. Nothing is posted when the
        status word is set: a kernel that timed out told the peers itself, and an input error
        found on the GPU was found by every rank."""
        if self._destroyed or self._c.host_status_read(self._status)[0]:
            return
        reason = gave_up_reason(self.topology.rank, call, error)
        self._post_abort(reason, abort_word(ABORT_HOST_GAVE_UP), reason, error)

    def _post_abort(self, why: str, word: int, reason: str, error: BaseException) -> None:
        """Post this rank's abort record ``(word, reason)`` into every peer's control region,
        once; ``why`` is what this rank's later calls raise."""
        if self._destroyed or self._aborted is not None:
            return
        self._aborted = why
        try:
            with torch.cuda.device(self._device_index):
                self._c.post_abort(self._buffers, self.topology.rank, word, reason)
        except Exception as exc:  # noqa: BLE001 - the original error is what the caller sees
            error.add_note(f"uccl_ep: could not tell the peers ({exc}); they will time out")

    def _check_status(self) -> None:
        if self._exited and not self._destroyed:
            # A wait of this call stopped on a dead peer's record: name the call too.
            words = self._c.host_status_read(self._status)
            if words[0] == self._c.STATUS_PEER_ABORT and words[1] in self._exited:
                raise self._status_error(*words)
        self._check_usable()
        words = self._c.host_status_read(self._status)
        if words[0]:
            raise self._status_error(*words)

    def _check_usable(self) -> None:
        """Raise when this backend was destroyed, a peer's process exited (the cause of any
        failure after it) or this rank aborted a call (host flags)."""
        if self._destroyed:
            raise UcclEpError("the kernels backend was destroyed; create a new Buffer")
        if self._exited:
            reasons = "; ".join(self._exited[r] for r in sorted(self._exited))
            raise peer_exited_error(self.topology.rank, "every call of this Buffer", reasons)
        if self._aborted is not None:
            raise UcclEpError(
                f"{self._aborted}; the group's calls no longer match, so this Buffer is "
                "unusable: create a new one"
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
    # Five paths, one function each: the one-call dispatch (``_one_call``: sync-free,
    # launch-ahead or cached, rows known before notify, outputs in the receive arena), the
    # step-by-step ones (``_staged``: the same with staged outputs, or ``_exact``: rows known
    # only after the counts are read back), and the launch-ahead call that runs again with
    # exact sizes (``_run_again``).
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        # The status word is read by intranode_dispatch_begin, or by _staged.
        self._check_usable()
        kind = "cached dispatch" if args.cached is not None else "dispatch"
        try:
            args = _kernel_args(args)
            launch = self._dispatch_launch(args)
            x = args.x
            num_scales = 0 if args.x_scales is None else args.x_scales.shape[1]
            self._last_call = (kind, x.dtype, x.shape[1], num_scales)
            rows = self._rows_before_notify(args, launch)
            result = None
            if rows is not None and rows.num_recv > 0 and self.recv_arena.core is not None:
                result = self._one_call(args, launch, rows)
            if result is None:
                result = self._staged(args, launch, rows)
            if result is _RUN_AGAIN:
                # Some rank receives more rows than the launch-ahead bound: every data kernel
                # skipped the call, and every rank runs it again with exact sizes. The bound's
                # block went back with the frame that held it, before the exact call takes its
                # own.
                return self._run_again(args, launch)
            return result
        except UcclEpError:
            raise  # every rank raises it alike, or the kernels told the peers
        except BaseException as exc:
            self._give_up(kind, exc)
            raise

    def _dispatch_launch(self, args: DispatchArgs) -> Any:
        """The ``_C.DispatchLaunch`` of this call's layout and shapes (built once, reused)."""
        x, scales, idx = args.x, args.x_scales, args.topk_idx
        key = (
            x.dtype,
            x.shape[1],
            0 if scales is None else scales.shape[1],
            0 if idx is None else idx.shape[1],
            args.num_experts,
            args.config.num_sms,
            args.expert_alignment,
            args.num_worst_tokens,
            args.cached is not None,
        )
        launch = self._launches.get(key)
        if launch is None:
            experts_per_rank = args.num_experts // self.topology.num_ranks
            if experts_per_rank > self._c.KERNELS_MAX_LOCAL_EXPERTS:
                raise UnsupportedError(
                    f"{experts_per_rank} experts per rank exceed the kernels' limit of "
                    f"{self._c.KERNELS_MAX_LOCAL_EXPERTS}; use the reference backend"
                )
            if len(self._launches) >= 64:  # shapes a caller used and dropped
                self._launches.clear()
            # The call header every rank must agree on: read back with the counts (exact
            # mode), judged by notify (sync-free) or compared with its barrier (cached).
            launch = self._launches[key] = self._c.DispatchLaunch(
                num_sms=args.config.num_sms,
                experts_per_rank=experts_per_rank,
                num_experts=args.num_experts,
                header=pack_dispatch_header(*key[:5]),
                expert_alignment=args.expert_alignment,
                num_worst_tokens=args.num_worst_tokens,
                cached=args.cached is not None,
            )
        return launch

    def _rows_before_notify(self, args: DispatchArgs, launch: Any) -> Any:
        """The ``_C.DispatchRows`` of a call whose output rows are known before notify:
        num_worst_tokens (sync-free), the launch-ahead bound (an exact call after an earlier
        one), a cached call's received rows (from its handle); None for an exact call without
        a bound."""
        worst = args.num_worst_tokens  # launch.num_worst_tokens, without a property read
        cached = args.cached
        if worst > 0:
            return self._bound(worst)
        if cached is not None:
            if self.recv_arena.core is None:
                return None  # only the one-call path takes them from here
            return self._c.intranode_exact_rows(
                cached.state.prefix_host, self.topology.rank, self.topology.num_ranks
            )
        return self._bound(self._ahead_rows) if self._ahead_rows > 0 else None

    def _bound(self, rows: int) -> Any:
        """``_C.DispatchRows.of_bound(rows)``, made once per distinct bound (host time)."""
        bound = self._bounds.get(rows)
        if bound is None:
            if len(self._bounds) >= 64:
                self._bounds.clear()
            bound = self._bounds[rows] = self._c.DispatchRows.of_bound(rows)
        return bound

    def _one_call(self, args: DispatchArgs, launch: Any, rows: Any) -> Any:
        """Rows known before notify (sync-free, launch-ahead, cached): one binding call looks at
        the status word, the capture state and the staging size, reserves the block (outputs,
        send_pos, info) and launches notify and the dispatch kernel. None: take the
        step-by-step path (it raises a set status word, handles a capture, grows the staging or
        goes staged), which decides exactly as this call would have. ``_RUN_AGAIN``: see
        ``dispatch``."""
        cached = args.cached
        stream = self._stream()
        ctx = self._context()
        reserved = self._c.intranode_dispatch_begin(
            ctx,
            launch,
            rows,
            stream,
            self.caller_stream or stream,
            self.recv_arena.core,
            args,
            None if cached is None else cached.state.send_pos,
        )
        if reserved is None:
            return None
        self.one_call_dispatches += 1
        x = args.x if args.x_scales is None else (args.x, args.x_scales)
        if cached is not None and self.lane is not None:  # its binding serves this signature now
            self.lane.learn_cached(
                x,
                args.expert_alignment,
                args.num_worst_tokens,
                args.config,
                launch,
                self._last_call,
            )
        elif self.lane is not None:
            self.lane.learn(
                x,
                args.num_tokens_per_rank,
                args.num_tokens_per_rdma_rank,
                args.is_token_in_rank,
                args.num_tokens_per_expert,
                args.topk_idx,
                args.topk_weights,
                args.expert_alignment,
                args.num_worst_tokens,
                args.config,
                launch,
                self._last_call,
            )
        outs = RecvOutputs(None, True, [], reserved, args.x.dtype)
        if cached is not None:
            outs.made()  # its info stays in the block, which the rows keep alive
            return self._cached_result(cached, outs, rows.num_recv)
        if args.num_worst_tokens == 0:  # launch-ahead: the handle's tensors come with the counts
            call = _Call(ctx, launch, stream, args, None, None)
            return self._ahead_result(call, outs, rows.num_recv, reserved)
        send_pos, *views = reserved.aux(self.topology.rank)
        call = _Call(ctx, launch, stream, args, None, send_pos, tuple(views))
        return self._dispatch_result(call, outs.made(), [], None, rows, True)

    def _staged(self, args: DispatchArgs, launch: Any, rows: Any) -> Any:
        """The step-by-step path: notify, then the data kernel, each its own binding call, into
        outputs made before notify when their rows are known (sync-free, launch-ahead: staged,
        or in the arena while capturing is off) or after the counts are read (``_exact``)."""
        self._check_status()
        capturing = self._capturing()
        worst = launch.num_worst_tokens
        if capturing and worst == 0:
            raise UnsupportedError(
                "dispatch without num_worst_tokens reads the received counts back to the host, "
                "which a CUDA graph cannot capture: pass num_worst_tokens > 0 (sync-free mode)"
            )
        c = self._c
        x, topk_idx = args.x, args.topk_idx
        num_scales = 0 if args.x_scales is None else args.x_scales.shape[1]
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        row_bytes = x.shape[1] * x.element_size()
        if worst > 0:
            # Sync-free: staging for the worst case, sized from host-known values before
            # anything is launched (every rank passes the same num_worst_tokens).
            idx_size = topk_idx.element_size() if topk_idx is not None else 8
            need = c.dispatch_staging_bytes(worst, row_bytes, num_scales, num_topk, idx_size)
            self._fit(need, f"dispatch of up to {worst} rows of {row_bytes} bytes", capturing)
        elif args.cached is not None:
            rows = None  # an exact cached call: _exact takes its sizes from the handle
        elif rows is not None:
            # Launch-ahead: outputs and staging for the bound every rank holds alike, without
            # growing the buffer (a regrow is collective and synchronizes). Every rank must
            # decide alike, so from what the call header makes equal: ids sized as int64.
            need = c.dispatch_staging_bytes(rows.num_recv, row_bytes, num_scales, num_topk, 8)
            rows = rows if need <= self._buffer_bytes else None
        stream = self._stream()
        if rows is None:
            call = self._new_call(args, launch, stream)
            self._notify(call, [])
            return self._exact(call)
        # Outputs before notify, which hands their place (the receive entry) to every peer with
        # the counts. The block's tensors are made after the launches (host time then overlaps
        # the kernels instead of delaying them); a cached dispatch's at once (it reuses the
        # handle's source indices).
        cached = args.cached
        cached_src = None if cached is None else cached.recv_src_idx
        outs = self._outputs(
            rows.num_recv, x, num_scales, topk_idx, cached_src, capturing, stream, later=True
        )
        call = self._new_call(args, launch, stream)
        self._notify(call, outs.entry)
        # A launch-ahead data kernel goes right behind notify; it judges every rank's checks
        # and counts itself and skips the call on every rank alike when they fail or a rank
        # receives more than the bound. The host reads the counts while it runs.
        self._dispatch_kernel(call, rows, outs)
        if worst == 0:
            return self._ahead_result(call, outs, rows.num_recv)
        if cached is not None:
            return self._cached_result(cached, outs, worst)
        return self._dispatch_result(call, outs.made(), [], None, rows, outs.zero_copy)

    def _run_again(self, args: DispatchArgs, launch: Any) -> DispatchResult:
        """A launch-ahead call whose counts exceeded its bound, run again with exact sizes:
        notify writes send_pos and info afresh, into tensors of its own."""
        call = self._new_call(args, launch, self._stream())
        self._notify(call, [])
        return self._exact(call)

    def make_lane(self, uid: int) -> Any:
        """``_C.IntranodeLane`` (``bindings/intranode_lane.cc``): the direct lane of a one-call
        dispatch (cached or not) and of a combine without bias in one binding call; None
        without a receive arena (no one-call path)."""
        if self.recv_arena.core is None:
            return None
        self.lane = self._c.IntranodeLane(
            device=self._device_index,
            rank=self.topology.rank,
            uid=uid,
            tensor_type=torch.Tensor,
            handle_type=DispatchHandle,
            state_type=_State,
            event_type=EventOverlap,
            error_type=UcclEpError,
            note_wait=note_host_wait,
            current_stream=torch._C._cuda_getCurrentRawStream,
            empty=torch.empty,
        )
        return self.lane

    def ahead_rest(self, args: DispatchArgs, rest: list[Any]) -> Any:
        """The rest of a launch-ahead call that the direct lane's binding launched and whose
        readback is not a good call's, ``rest`` = [(reservation, (state, words), bound rows,
        seq)] (emptied here): judged as ``_ahead_result`` judges it (it raises what failed, or
        runs the call again with exact sizes)."""
        reserved, read, bound, _ = rest.pop()
        try:
            launch = self._dispatch_launch(args)
            call = _Call(self._context(), launch, self._stream(), args, None, None)
            outs = RecvOutputs(None, True, [], reserved, args.x.dtype)
            result = self._ahead_result(call, outs, bound.num_recv, reserved, read)
            if result is _RUN_AGAIN:
                del call, outs, reserved  # the bound's block goes back before the exact call's
                return self._run_again(args, launch)
            return result
        except UcclEpError:
            raise
        except BaseException as exc:
            self._give_up("dispatch", exc)
            raise

    def _new_call(self, args: DispatchArgs, launch: Any, stream: int) -> _Call:
        """A step-by-step call, with its send_pos (the handle's when cached) and its info
        ``[rank_prefix_matrix (R*R) | aligned received rows per local expert]``: the handle's
        rank_prefix_matrix, recv_count and recv_tokens_per_expert are views of it."""
        R = self.topology.num_ranks
        dev = args.x.device
        cached = args.cached
        if cached is None:
            send_pos = torch.empty(args.x.shape[0], R, dtype=torch.int32, device=dev)
        else:
            send_pos = cached.state.send_pos
        info = torch.empty(R * R + launch.experts_per_rank, dtype=torch.int32, device=dev)
        return _Call(self._context(), launch, stream, args, info, send_pos)

    def _ahead_result(
        self, call: _Call, outs: Any, bound: int, reserved: Any = None, read: Any = None
    ) -> Any:
        """A launch-ahead call's result once the host has read its counts, or ``_RUN_AGAIN``
        when some rank receives more than ``bound`` rows: every rank holds the same matrix, so
        every data kernel skipped the call and every rank runs it again. ``reserved``: the
        call's block from ``intranode_dispatch_begin``, whose outputs and handle tensors (not
        made yet: ``call.send_pos`` is None) a good call takes in the same binding call as its
        counts; any other outcome is judged here from the words that call read (``read``: the
        ``(state, words)`` the direct lane's binding read already)."""
        c = self._c
        rank, num_ranks = self.topology.rank, self.topology.num_ranks
        if reserved is not None and read is None:
            read = c.intranode_ahead_finish(call.ctx, call.launch, reserved, bound)
            if len(read) > 2:  # good: see intranode_ahead_finish
                note_host_wait()
                self._check_usable()
                _, prefix_host, expert_counts, rows, most, outputs, aux = read
                self._note_most(most)
                self.ahead_calls += 1
                self.ahead_finishes += 1
                call.send_pos, *views = aux
                call.views = tuple(views)
                return self._dispatch_result(
                    call, outs.adopt(outputs), expert_counts, prefix_host, rows, True
                )
        prefix_host, expert_counts = self._read_counts(call, num_ranks * num_ranks, read)
        rows = c.intranode_exact_rows(prefix_host, rank, num_ranks)
        if self._note_counts(prefix_host) > bound:
            self.ahead_reruns += 1
            return _RUN_AGAIN
        self.ahead_calls += 1
        num_recv = rows.num_recv
        if call.send_pos is None:
            call.send_pos, *views = reserved.aux(rank)
            call.views = tuple(views)
        if outs.tensors is None:  # reserved: tensors of exactly the received rows
            tensors = outs.made(num_recv)
        else:  # staged (the arena was full): views of them
            tensors = tuple(None if t is None else t[:num_recv] for t in outs.tensors)
        return self._dispatch_result(
            call, tensors, expert_counts, prefix_host, rows, outs.zero_copy
        )

    def _exact(self, call: _Call) -> DispatchResult:
        """An exact-size dispatch after its notify: the counts read back (the one host sync;
        a cached dispatch has them in its handle), then outputs of exactly the received rows
        and the data kernel."""
        c = self._c
        rank, num_ranks = self.topology.rank, self.topology.num_ranks
        args = call.args
        cached = args.cached
        x, topk_idx = args.x, args.topk_idx
        num_scales = 0 if args.x_scales is None else args.x_scales.shape[1]
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        row_bytes = x.shape[1] * x.element_size()
        idx_size = topk_idx.element_size() if topk_idx is not None else 8
        expert_counts: list[int] = []
        if cached is not None:
            prefix_host = cached.state.prefix_host
        else:
            # The one host sync (output sizes depend on it); every rank's checks ride along.
            prefix_host, expert_counts = self._read_counts(call, num_ranks * num_ranks)
            self._note_counts(prefix_host)
        rows = c.intranode_exact_rows(prefix_host, rank, num_ranks)
        staging_rows = rows.staging_rows
        need = c.dispatch_staging_bytes(staging_rows, row_bytes, num_scales, num_topk, idx_size)
        # Every rank holds the same prefix matrix, so all decide the same here.
        self._fit(
            need, f"dispatch of up to {staging_rows} received rows of {row_bytes} bytes", False
        )
        call.ctx = self._context()  # a regrow replaced the buffers
        cached_src = None if cached is None else cached.recv_src_idx
        outs = self._outputs(rows.num_recv, x, num_scales, topk_idx, cached_src, False, call.stream)
        self._dispatch_kernel(call, rows, outs)
        if cached is not None:
            return self._cached_result(cached, outs, rows.num_recv)
        return self._dispatch_result(
            call, outs.made(), expert_counts, prefix_host, rows, outs.zero_copy
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

    def _notify(self, call: _Call, entry: list[int]) -> None:
        """Notify: the count exchange and entry barrier. Exact calls read the counts and
        every rank's checks back through mapped host memory (see check_all_ranks); sync-free
        notify judges them itself and records a failure in the status word. Notify scans the
        id range itself (no extra launches); ids are checked whenever given, so
        ``args.check_ids`` (the range is still unchecked) is always honoured. ``entry``: the
        receive entry of outputs made before notify ([] when there are none yet)."""
        self._c.intranode_notify_call(
            call.ctx, call.launch, call.stream, call.args, call.info, call.send_pos, entry
        )

    def _read_counts(
        self, call: _Call, nrr: int, read: tuple[int, list[int]] | None = None
    ) -> tuple[tuple[int, ...], list[int]]:
        """The readback of an exact call's notify: (host prefix matrix, aligned received rows
        per local expert), after raising any rank's bad input on every rank. ``read``: the
        ``(state, words)`` a binding call read already (``intranode_ahead_finish``)."""
        c = self._c
        rank = self.topology.rank
        experts_per_rank = call.launch.experts_per_rank
        if read is None:
            read = c.intranode_read_counts(call.ctx, nrr + experts_per_rank)
        state, info_host = read
        note_host_wait()
        self._check_status()
        if state == -1:  # the status words were clear: cannot happen, but never hang
            raise UcclEpError(f"rank {rank}: the dispatch's notify barrier failed")
        if state == 0:
            stuck = CommTimeoutError(
                f"rank {rank}: the dispatch's notify kernel did not finish within "
                f"{2 * self._timeout_ms} ms (twice UCCL_EP_TIMEOUT_MS): earlier work on "
                "the stream is stuck; the GPU may need a process restart"
            )
            self._give_up(self._last_call[0], stuck)
            raise stuck
        check_all_ranks(
            info_host[-CHECK_WORDS * self.topology.num_ranks :], call.launch.num_experts
        )
        return tuple(info_host[:nrr]), info_host[nrr : nrr + experts_per_rank]

    def _note_counts(self, prefix_host: tuple[int, ...]) -> int:
        """The most rows any rank receives in this call (the prefix matrix's last row), and
        the launch-ahead bound of the next call from it: that plus 1/16 and 64 rows, rounded
        up to 64 (every rank holds the same matrix, so the same bound)."""
        R = self.topology.num_ranks
        return self._note_most(max(prefix_host[R * (R - 1) :]))

    def _note_most(self, most: int) -> int:
        """``_note_counts`` of a call whose most rows any rank receives are ``most``."""
        if self._launch_ahead:
            self._ahead_rows = (most + most // 16 + 127) // 64 * 64
        return most

    def _dispatch_kernel(self, call: _Call, rows: Any, outs: Any) -> None:
        """The dispatch kernel, then (same binding call) the poison fold: a failure inside this
        call is raised at the next one; until then the outputs say so. A reservation's tensors
        are made after this launch."""
        outputs = outs.tensors if outs.tensors is not None else outs.reservation
        self._c.intranode_dispatch_call(
            call.ctx, call.launch, rows, call.stream, call.args, call.info, call.send_pos, outputs
        )

    def _dispatch_result(
        self,
        call: _Call,
        outputs: tuple[Any, ...],
        expert_counts: list[int],
        prefix_host: tuple[int, ...] | None,
        rows: Any,
        zero_copy: bool,
    ) -> DispatchResult:
        """A non-cached dispatch's result; the handle's matrix and counts are views of
        notify's ``info``. ``rows``: the call's ``_C.DispatchRows`` (its combine's too);
        ``zero_copy``: the outputs lie in the receive arena."""
        recv_x, recv_scales, recv_idx, recv_w, recv_src = outputs
        views = call.views
        if views is None:
            R, rank = self.topology.num_ranks, self.topology.rank
            nrr = R * R
            # One as_strided per view (slicing then viewing is two torch calls: host time).
            view = call.info.as_strided
            views = (
                view((R, R), (R, 1), 0),
                view((1,), (1,), nrr - R + rank),  # this rank's received rows: the last row's
                view((call.launch.experts_per_rank,), (1,), nrr),
            )
        prefix, count, per_expert = views
        return DispatchResult(
            recv_x,
            recv_scales,
            recv_idx,
            recv_w,
            expert_counts,
            prefix,
            recv_src,
            rows.num_recv,
            _State(prefix_host, call.send_pos, rows),
            count,
            per_expert,
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

    def _copy_in(self, t: CombineTensors, rows: Any) -> None:
        """Copy a combine's x (and weights) that the caller made outside the receive arena into
        arena blocks, on the call's stream, so that the peers read them in place: one local
        copy of each row at HBM speed and one read over the link, where pushing reads each row,
        writes it into the source's staging and reads it there again, all by the combine's SMs
        (docs/performance.md, "A copied-in combine"). The blocks die with ``t`` after the
        launch (their reuse waits for the combine on this stream, whose end waits for the peers'
        reads). Nothing is copied when the arena is off or full, under graph capture, or when
        rows are not 16-byte multiples (such combines push), nor when the rows go back by the
        copy engine (``rows``: the dispatch's ``_C.DispatchRows``), which reads x where it is."""
        x, w = t.x, t.weights
        arena = self.recv_arena
        if (
            not self._combine_copy_in
            or (self._copy_engine and self._context().by_copy_engine(rows))
            or not arena.enabled
            or x.shape[0] == 0
            or (x.shape[1] * x.element_size()) % 16 != 0
            or self._capturing()
        ):
            return
        copy_x = not arena.holds(x)
        copy_w = w is not None and w.numel() > 0 and not arena.holds(w)
        if not copy_x and not copy_w:
            return
        stream = self._stream()
        blocks = [
            arena.combine_input(a.shape[0], a.shape[1], a.dtype, stream, stream) if copy else a
            for a, copy in ((x, copy_x), (w, copy_w))
        ]
        if any(b is None for b, copy in zip(blocks, (copy_x, copy_w), strict=True) if copy):
            return  # no room: this combine pushes (a block taken dies here unused)
        if copy_x:
            t.x = blocks[0].copy_(x)
        if copy_w:
            t.weights = blocks[1].copy_(w)
        self.combine_copied_in_calls += 1

    def _combine_launch(
        self, dtype: torch.dtype, hidden: int, num_topk: int, num_bias: int, num_sms: int
    ) -> Any:
        """The ``_C.CombineLaunch`` of a combine's shapes (built once, reused)."""
        key = (dtype, hidden, num_topk, num_bias, num_sms)
        launch = self._combine_launches.get(key)
        if launch is None:
            if len(self._combine_launches) >= 64:
                self._combine_launches.clear()
            # pack_combine_header's word: weights' columns as top-k, biases as experts.
            header = pack_dispatch_header(dtype, hidden, 0, num_topk, num_bias)
            launch = self._combine_launches[key] = self._c.CombineLaunch(
                num_sms=num_sms, header=header
            )
        return launch

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
        given_x, given_w = t.x, t.weights
        try:
            state: _State = handle.state
            self._copy_in(t, state.rows)
            x, hidden = t.x, t.x.shape[1]
            num_topk = 0 if topk_weights is None else topk_weights.shape[1]
            staging_rows = state.rows.combine_rows
            row_bytes = hidden * x.element_size()
            need = c.combine_staging_bytes(staging_rows, row_bytes, num_topk)
            if need > self._buffer_bytes:
                self._check_status()
                self._fit(
                    need,
                    f"combine of up to {staging_rows} returned rows of {row_bytes} bytes",
                    self._capturing(),
                )
            num_bias = len(t.biases)
            extra = f"topk_weights columns={num_topk}, biases={num_bias}"
            self._last_call = ("combine", x.dtype, hidden, 0, extra)
            # Rows of x to return: the received count, or its bound in sync-free mode (the kernels
            # read the real count from the device matrix): the dispatch's rows.
            launch = self._combine_launch(x.dtype, hidden, num_topk, num_bias, config.num_sms)
            done = c.intranode_combine_call(
                self._context(),
                launch,
                state.rows,
                self._stream(),
                t,
                handle.rank_prefix_matrix,
                state.send_pos,
            )
            if done == c.COMBINE_STATUS_SET:  # nothing was launched
                self._check_status()
                raise UcclEpError(
                    f"rank {self.topology.rank}: the status word was set, then cleared"
                )
            if done & c.COMBINE_CAPTURED:
                self._captured = True  # its kernels hold the buffer addresses: no regrow from now
            elif (
                self.lane is not None
                and num_bias == 0
                and (topk_weights is None or given_w is topk_weights)
            ):  # the lane's binding serves this signature now (copying into the arena as here)
                self.lane.learn_combine(
                    given_x,
                    topk_weights,
                    handle.num_worst_tokens or handle.num_recv_tokens,
                    num_tokens,
                    config,
                    launch,
                    self._last_call,
                )
            self.combine_in_place_calls += done & c.COMBINED_IN_PLACE
            self.combine_copy_engine_calls += bool(done & c.COMBINED_BY_COPY_ENGINE)
            return t.out, t.out_weights
        except UcclEpError:
            raise  # every rank raises it alike, or the kernels told the peers
        except BaseException as exc:
            self._give_up("combine", exc)
            raise

    # ---- teardown -----------------------------------------------------------------------
    def destroy(self, collective: bool = True) -> None:
        if self._destroyed:
            return
        with self._region_lock:  # no watcher post from here on
            self._destroyed = True
        if self._watcher is not None:
            self._watcher.close()
        # A peer whose process exited takes no part in a collective release: this rank
        # releases its own part alone (the group is gone anyway).
        collective = collective and not self._exited
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

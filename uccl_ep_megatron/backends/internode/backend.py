"""``InternodeBackend``: the host side of one internode dispatch / combine (see the package
docstring for the design). It checks sizes, builds the index tables on the GPU
(``tables.py``) and launches each step with one ``_C.internode`` call that takes the tensors
themselves (``csrc/bindings/internode_calls.cc`` checks their shapes and dtypes and reads the
sizes off them) and a per-Buffer ``Context``; errors the kernels recorded are read from the
status words (``diagnostics.py``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.agreement import COUNTS_COLUMN
from uccl_ep_megatron.backends.base import (
    Backend,
    DispatchArgs,
    DispatchHandle,
    DispatchResult,
    Layout,
    Topology,
)
from uccl_ep_megatron.backends.internode.diagnostics import recorded_error
from uccl_ep_megatron.backends.internode.header import CallHeaderExchange, ExpertCounts
from uccl_ep_megatron.backends.internode.launch import (
    CombineTablesTensors,
    DispatchTablesTensors,
    InternodeCombineTensors,
    InternodeDispatchTensors,
    RingShape,
    RoutingCheckTensors,
)
from uccl_ep_megatron.backends.internode.sizing import check_rings, dispatch_outputs, fit_staging
from uccl_ep_megatron.backends.internode.tables import (
    DispatchState,
    expert_counts,
    received_expert_counts,
    state_sizes,
)
from uccl_ep_megatron.backends.intranode.arena import RecvArena
from uccl_ep_megatron.backends.intranode.backend import KernelsBackend
from uccl_ep_megatron.backends.intranode.launch import (
    as_int32,
    launch_layout,
    prepare_combine,
    warm_poison,
)
from uccl_ep_megatron.backends.ipc_buffer import IpcBuffers
from uccl_ep_megatron.core._c import load as load_c
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import (
    InvalidInputError,
    UcclEpError,
    UnsupportedError,
)
from uccl_ep_megatron.core.options import BufferOptions

# NVLink buffer: barrier flags first (kernels/common.cuh uses its first 64 bytes), staging after.
_NVL_STAGE_OFFSET = 4096
# FIFO channels per GPU: ring channel c uses FIFO channel c % this; proxy threads <= this.
NUM_FIFO_CHANNELS = 8


def _c() -> Any:
    return load_c()


class InternodeBackend(CallHeaderExchange, Backend):
    """GPU-initiated, proxy-executed, node-deduplicated HT dispatch/combine."""

    name = "kernels_internode"
    requested_as = "'kernels' (internode)"
    defers_id_check = True
    agrees_per_call = True
    agrees_on_device = True
    # Synchronous calls run on the caller's stream (api/streams.py): every launch, the header
    # all-gather and the outputs' allocation take the current stream, and the receive arena is
    # told the caller's (caller_stream) and the comm stream's first use (note_stream).
    runs_on_caller_stream = True
    x_dtypes = KernelsBackend.x_dtypes  # the same row formats as the intranode kernels

    @classmethod
    def unsupported_reason(cls, topology: Topology, device: torch.device) -> str | None:
        """Why these kernels cannot serve the group, or ``None`` when they can."""
        c = _c()
        if not c.internode.built():
            return "the _C extension was built without the GPU kernels"
        if device.type != "cuda":
            return f"tensors live on {device.type}"
        if topology.num_nodes < 2:
            return "the group is one node; the intranode kernels serve it"
        if topology.num_nodes > c.internode.MAX_NODES:
            return f"{topology.num_nodes} nodes exceed the {c.internode.MAX_NODES} supported"
        if topology.ranks_per_node > c.internode.MAX_LOCAL:
            return (
                f"{topology.ranks_per_node} ranks per node exceed the "
                f"{c.internode.MAX_LOCAL} NVLink peers supported"
            )
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
        if num_rdma_bytes <= 0:
            raise InvalidInputError(
                f"num_rdma_bytes={num_rdma_bytes}: a group of {topology.num_nodes} nodes needs an "
                "RDMA buffer; pass num_rdma_bytes >= "
                "Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)"
            )
        c = _c()
        self._c = c
        self._in = c.internode
        self._destroyed = False
        topo = topology
        self._timeout_ms = self.timeout_ms
        self._init_header_exchange()
        dev_index = device.index if device.index is not None else torch.cuda.current_device()
        self._dev_index = dev_index
        # NVLink buffer (barrier flags + staging); one node rank alone needs only the flags.
        nvl_bytes = _NVL_STAGE_OFFSET
        if topo.ranks_per_node > 1:
            nvl_bytes = max(int(num_nvl_bytes), _NVL_STAGE_OFFSET)
        with torch.cuda.device(dev_index):
            # Load our kernels now, not lazily at a first launch while another of them waits
            # for the proxies (that load would block the proxies' CUDA calls: a deadlock).
            c.internode.preload_kernels()
            self._region = c.device_alloc_zeroed(int(num_rdma_bytes))
        node0 = topo.node * topo.ranks_per_node
        self._ipc = IpcBuffers(
            c,
            group,
            topo.rank,
            dev_index,
            nvl_bytes,
            list(range(node0, node0 + topo.ranks_per_node)),
            keep_bytes=_NVL_STAGE_OFFSET,
            extra=int(num_rdma_bytes),
            allow_grow=bool(options.grow_nvl_buffer),
        )
        # Rings are placed by this rank's formula at every peer: the smallest region bounds all.
        self._region_bytes = min(int(b) for b in self._ipc.extras)
        # A receive arena shared by the node's ranks (more than one per node): dispatch outputs
        # are carved from it, so node peers write their rows straight into them, and a combine
        # input there is read in place by the peers; neither goes through the NVLink staging.
        self.recv_arena: RecvArena | None = None
        if topo.ranks_per_node > 1:
            self.recv_arena = RecvArena(
                c,
                group,
                topo.rank,
                dev_index,
                int(options.arena_bytes),
                topo.num_ranks,
                peers=list(range(node0, node0 + topo.ranks_per_node)),
            )
        self.placed_dispatches = 0  # dispatches whose node peers wrote into the arena outputs
        self.placed_combines = 0  # combines whose node peers read the input in the arena
        self._ep = self._proxy_endpoint(group, dev_index, int(num_rdma_bytes), options)
        self._ep.connect()
        # ipc NIC model, store delivery: the senders store ring slots straight into the region of
        # the rank with this local index on each node (the model only times the writes).
        self._remote: list[int] = []
        if self._ep.bytes_in_place:
            local = topo.rank % topo.ranks_per_node
            self._remote = self._ep.peer_regions(
                [n * topo.ranks_per_node + local for n in range(topo.num_nodes)]
            )
        handles = self._ep.device_handles()
        self._fifo_handles = torch.frombuffer(bytearray(handles), dtype=torch.uint8).to(device)
        self._state = torch.zeros(int(c.internode.STATE_WORDS), dtype=torch.int64, device=device)
        with torch.cuda.device(device):  # its device flag lives on this GPU
            self._status = c.internode.status_alloc()
        warm_poison(c, self._status, device)
        # Loads the kernels of the sync-free per-expert count, which runs right after the
        # dispatch kernels (see dispatch_outputs on lazy loading).
        for dtype in (torch.int64, torch.int32):
            received_expert_counts(torch.full((1, 1), -1, dtype=dtype, device=device), 1, 1)
        torch.cuda.synchronize(device)
        self._ctx: Any = None
        self._ctx_grows = -1
        self._trace: torch.Tensor | None = None
        self._check_scratch: torch.Tensor | None = None
        self._slot_bytes: dict[tuple[int, ...], tuple[int, int]] = {}

    def set_trace(self, on: bool) -> None:
        """Per-block time accounting of every later launch, read with ``read_trace``
        (``bench internode --trace``). Off by default: the kernels then read no clock for it."""
        words = 2 * int(self._in.MAX_CHANNELS) * int(self._in.TRACE_WORDS)
        self._trace = (
            torch.zeros(words, dtype=torch.int64, device=self._state.device) if on else None
        )
        if self._ctx is not None:
            self._ctx.set_trace(self._trace)

    def read_trace(self, channels: int) -> list[list[int]]:
        """The last launch's words per block (``2 * channels`` blocks; even blocks send, odd
        blocks receive, as the kernels assign roles): entry and exit ns, go rounds, wait rounds,
        then ns waiting, planning, moving rows and pushing commands."""
        if self._trace is None:
            raise RuntimeError("read_trace needs set_trace(True) before the launch")
        w = int(self._in.TRACE_WORDS)
        flat = self._trace[: 2 * channels * w].tolist()
        return [flat[b * w : (b + 1) * w] for b in range(2 * channels)]

    # ---- helpers -----------------------------------------------------------------------
    def _proxy_endpoint(
        self, group: dist.ProcessGroup, dev_index: int, region_bytes: int, options: BufferOptions
    ) -> Any:
        """This rank's FIFO channels, counters, proxy and transport (``options`` pick the
        transport, its threads and ordering, and the ipc NIC model's wire and faults)."""
        from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint

        config = ProxyConfig(
            num_channels=NUM_FIFO_CHANNELS,
            num_counters=int(self._in.NUM_COUNTERS),
            ranks_per_node=self.topology.ranks_per_node,
            num_threads=options.num_proxy_threads,
            timeout_ms=self.timeout_ms,
            ordering=options.proxy_ordering,
            transport=options.transport,
            ipc_reorder=options.ipc_reorder,
            ipc_link_gbps=options.ipc_link_gbps,
            ipc_latency_us=options.ipc_latency_us,
            ipc_fault=options.ipc_fault,
            ipc_copy_streams=options.ipc_copy_streams,
        )
        return ProxyEndpoint(
            self._region,
            region_bytes,
            device=dev_index,
            group=group,
            config=config,
            bytes_in_place=options.ipc_delivery == "store",
        )

    @property
    def proxy(self) -> Any:
        """This rank's ``ProxyEndpoint`` (stats, counters, transport kind)."""
        return self._ep

    def _stream(self) -> int:
        # The raw handle, without building a torch.cuda.Stream object (~10 us of host time
        # under MPS; two to three per call: the routing check, the tables and the launch).
        return torch._C._cuda_getCurrentRawStream(self._dev_index)

    def check(self) -> None:
        """Raise the first failure of a kernel wait, a FIFO push, a proxy thread, or the GPU
        check of a sync-free call's headers. Never waits for the GPU (the status words are
        mapped host memory); only the message of a timed-out wait reads device state back."""
        if self._destroyed:
            raise UcclEpError("the internode backend was destroyed; create a new Buffer")
        if self._broken:
            raise UcclEpError(
                f"this Buffer is unusable: {self._broken} (the collective may still be pending "
                "on the group); create a new Buffer"
            )
        self._ep.check()
        error = recorded_error(
            self._in, self._status, self._ep, self._state, self.topology, self._timeout_ms
        )
        if error is not None:
            raise error

    check_errors = check

    def _context(self) -> Any:
        """The per-Buffer part of every launch (``_C.internode.Context``), built once and again
        after the NVLink buffers grew (their addresses change; the barrier count carries on)."""
        grows = self._ipc.grows
        if self._ctx is None or self._ctx_grows != grows:
            topo = self.topology
            self._ctx = self._in.Context(
                topo.rank,
                topo.num_ranks,
                topo.ranks_per_node,
                self._fifo_handles,
                NUM_FIFO_CHANNELS,
                self._ep.counters.dev_ptr,
                self._state,
                self._region,
                self._region_bytes,
                list(self._ipc.ptrs),
                _NVL_STAGE_OFFSET,
                self._status,
                self._timeout_ms * 1_000_000,
                0 if self._ctx is None else self._ctx.barrier_seq,
                self._remote,
                self.recv_arena.ptrs if self.recv_arena is not None else [],
                self.recv_arena.nbytes
                if self.recv_arena is not None and self.recv_arena.enabled
                else 0,
            )
            self._ctx_grows = grows
            if self._trace is not None:
                self._ctx.set_trace(self._trace)
        return self._ctx

    def _rings(self, config: Config) -> RingShape:
        """The ring shape of a call's launches: (channels, slots per ring, tokens per write)."""
        if config.num_channels > self._in.MAX_CHANNELS:
            raise UnsupportedError(
                f"Config.num_sms={config.num_sms} gives {config.num_channels} channels; the "
                f"internode kernels support up to {self._in.MAX_CHANNELS} (num_sms <= "
                f"{2 * self._in.MAX_CHANNELS})"
            )
        return RingShape(
            channels=config.num_channels,
            slots=config.num_max_rdma_chunked_recv_tokens,
            chunk=config.num_max_rdma_chunked_send_tokens,
        )

    def _slots(
        self,
        combine: bool,
        config: Config,
        row_bytes: int,
        num_scales: int,
        num_topk: int,
        idx_bytes: int,
    ) -> tuple[int, int]:
        """(ring slot, NVLink staging slot) bytes of a call's row shape, its rings checked
        against the RDMA region (``check_rings`` raises when they do not fit). Pure functions
        of the shape, the config and this Buffer's fixed region: computed once per shape, not
        in three binding calls that build dicts on every call. A combine stages its ring
        slots."""
        key = (
            combine,
            row_bytes,
            num_scales,
            num_topk,
            idx_bytes,
            config.num_channels,
            config.num_max_rdma_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens,
        )
        slots = self._slot_bytes.get(key)
        if slots is None:
            L = self.topology.ranks_per_node
            if combine:
                slot = stage = self._in.combine_slot(row_bytes, num_topk)["bytes"]
            else:
                slot = self._in.dispatch_slot(row_bytes, num_scales, num_topk, L)["bytes"]
                stage = self._in.stage_slot(row_bytes, num_scales, num_topk, idx_bytes)["bytes"]
            check_rings(self._c, self._region_bytes, self.topology.num_nodes, combine, config, slot)
            if len(self._slot_bytes) >= 64:  # shapes a caller used and dropped
                self._slot_bytes.clear()
            slots = self._slot_bytes[key] = (slot, stage)
        return slots

    def note_stream(self, stream: int) -> None:
        if self.recv_arena is not None:
            self.recv_arena.note_stream(stream)

    def combine_input(
        self, rows: int, hidden: int, dtype: torch.dtype, comm_stream: int
    ) -> torch.Tensor | None:
        # A block of the node's receive arena (ranks per node > 1): the node peers read the
        # combine that takes it in place, with no staging copy (see intranode's).
        arena = self.recv_arena
        if arena is None or torch.cuda.is_current_stream_capturing():
            return None
        stream = self._stream()
        return arena.combine_input(rows, hidden, dtype, stream, comm_stream or stream)

    def _outputs(
        self,
        rows: int,
        x: torch.Tensor,
        num_scales: int,
        topk_idx: torch.Tensor | None,
        cached_src: torch.Tensor | None,
    ) -> tuple[tuple[torch.Tensor | None, ...], torch.Tensor | None]:
        """A dispatch's ``(recv_x, scales, ids, weights)`` and its source indices (a cached
        dispatch's: the handle's; ``None`` when the index tables carve them): carved from the
        receive arena where there is one and they fit, else allocated."""
        arena = self.recv_arena
        if arena is None or not arena.enabled:
            idx_dtype = None if topk_idx is None else topk_idx.dtype
            num_topk = 0 if topk_idx is None else topk_idx.shape[1]
            return dispatch_outputs(rows, x, num_scales, idx_dtype, num_topk), cached_src
        stream = self._stream()
        outs = arena.outputs(
            rows,
            x.shape[1],
            x.dtype,
            num_scales,
            topk_idx,
            cached_src,
            x.device,
            torch.cuda.is_current_stream_capturing(),
            stream,
            self.caller_stream or stream,
        )
        recv_x, scales, ids, weights, src = outs.made()
        return (recv_x, scales, ids, weights), src

    def _fit_staging(self, rows_of_rank: tuple[int, ...], slot_bytes: int, op: str) -> None:
        if self.topology.ranks_per_node > 1:  # else no NVLink staging: only barrier flags
            fit_staging(self._ipc, _NVL_STAGE_OFFSET, rows_of_rank, slot_bytes, op)

    # ---- layout -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        self.check()
        topo = self.topology
        per_rank, per_expert, in_rank = launch_layout(
            self._c, topk_idx, num_experts, topo.num_ranks, self._stream()
        )
        num_tokens = in_rank.shape[0]
        per_node = in_rank.view(num_tokens, topo.num_nodes, topo.ranks_per_node).any(2)
        per_rdma = per_node.sum(0, dtype=torch.int32)
        return Layout(per_rank, per_rdma, per_expert, in_rank)

    def routing_check(
        self, given: Layout, topk_idx: torch.Tensor | None, num_experts: int
    ) -> torch.Tensor:
        """The routing check in one launch (``_C.internode.routing_check``); the torch form
        (``Backend.routing_check``) without ``topk_idx`` or past the kernel's 32 ranks."""
        topo = self.topology
        if topk_idx is None or topo.num_ranks > 32 or given.is_token_in_rank.dtype != torch.bool:
            return super().routing_check(given, topk_idx, num_experts)
        dev = topk_idx.device
        R, N = topo.num_ranks, topo.num_nodes
        words = 4 + R + N + num_experts
        if self._check_scratch is None or self._check_scratch.numel() < words:
            # The kernel's state between launches (each launch restores it): zeros, word 0 all
            # ones. Set here once, not by two memsets per call.
            scratch = torch.zeros(words, dtype=torch.int64, device=dev)
            scratch[0] = -1
            self._check_scratch = scratch
        out = torch.empty(3, dtype=torch.int64, device=dev)
        rdma = given.num_tokens_per_rdma_rank
        t = RoutingCheckTensors(
            topk_idx.contiguous(),
            as_int32(given.num_tokens_per_rank),
            None if rdma is None else as_int32(rdma),
            as_int32(given.num_tokens_per_expert),
            given.is_token_in_rank.contiguous(),
            self._check_scratch,
            out,
        )
        self._in.routing_check(self._stream(), topo.ranks_per_node, t)
        return out

    # ---- dispatch -----------------------------------------------------------------------
    def _expert_counts(
        self, args: DispatchArgs, read: ExpertCounts | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Exact mode: rows per local expert (aligned), as the host list and on the device. The
        header exchange read them with the rows (``read``) when the rows carried every rank's
        per-expert counts; a dispatch with more experts than a row holds (``EXPERT_SLOTS``)
        gathers them here, with a second exchange and read. Sync-free mode has no collective
        after the header exchange (a rank whose own checks failed raised there and takes part
        in nothing more): the device counts come from the verdict's launch on the rows
        (``exchange_header_async``) or, past the rows' per-expert block, from the outputs after
        the kernels (``received_expert_counts``)."""
        if args.num_worst_tokens > 0:
            return [], None
        if read is not None:
            return read.host, read.device
        topo = self.topology
        epr = args.num_experts // topo.num_ranks
        gathered = self._gather_rows(args.num_tokens_per_expert)
        per_expert = expert_counts(gathered, topo.rank, epr, args.expert_alignment)
        return self._read(per_expert, "the all-gather of per-expert counts", self._call), per_expert

    def _dispatch_shape(self, args: DispatchArgs, x: torch.Tensor) -> tuple[int, int, int]:
        """Row bytes, top-k and scale columns of a dispatch, checked against the kernels'."""
        row_bytes = x.shape[1] * x.element_size()
        if row_bytes % 16:
            raise UnsupportedError(
                f"hidden={x.shape[1]} x {x.element_size()}-byte elements = {row_bytes} bytes per "
                "row; the internode kernels move rows in 16-byte vectors: use a hidden size that "
                "makes rows a multiple of 16 bytes"
            )
        topk_idx = None if args.cached is not None else args.topk_idx
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        if num_topk > self._in.MAX_TOPK:
            raise UnsupportedError(f"num_topk={num_topk} exceeds {self._in.MAX_TOPK}")
        num_scales = 0 if args.x_scales is None else args.x_scales.shape[1]
        return row_bytes, num_topk, num_scales

    def _int32(self, device: torch.device, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
        """Fresh int32 tensors of these shapes, carved from one allocation (1-D ones are the
        split's own views: one torch op fewer each)."""
        sizes = [math.prod(s) for s in shapes]
        parts = torch.empty(sum(sizes), dtype=torch.int32, device=device).split(sizes)
        return [t if len(s) == 1 else t.view(s) for t, s in zip(parts, shapes, strict=True)]

    def _new_state(
        self,
        rows: torch.Tensor,
        in_rank: torch.Tensor,
        args: DispatchArgs,
        sizes: tuple[int, int, tuple[int, ...]],
        outputs: tuple[torch.Tensor | None, ...],
        src: torch.Tensor | None,
    ) -> tuple[DispatchState, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A non-cached dispatch's state, its streams (lists, list_count) and its
        ``recv_src_idx`` (``src``, or carved with the tables), built on the GPU by one kernel
        from the gathered call headers ``rows``. ``sizes``: its ``state_sizes``; ``outputs``:
        its ``(recv_x, scales, ids, weights)``; a sync-free call's ids, weights and source
        indices are padded by the same launch."""
        topo = self.topology
        R, L, N, T = topo.num_ranks, topo.ranks_per_node, topo.num_nodes, in_rank.shape[0]
        C = args.config.num_channels
        out_rows, plan_tokens, stage_rows = sizes
        shapes = (
            (out_rows,),  # first: the poison fold needs an output 8-byte aligned
            (T, R),
            (N, T),
            (C, N),
            (R, R),
            (L,),
            (R + 1,),
            (1,),
            (N,),
            (N, plan_tokens, L),
        )
        carved, dst, lists, count, prefix, recv_rows, recv_prefix, recv_count, src_tokens, plan = (
            self._int32(in_rank.device, *shapes)
        )
        recv_src = carved if src is None else src
        pad = args.num_worst_tokens > 0
        t = DispatchTablesTensors(
            rows,
            in_rank,
            dst,
            lists,
            count,
            prefix,
            recv_rows,
            recv_prefix,
            recv_count,
            src_tokens,
            plan,
            pad_ids=outputs[2] if pad else None,
            pad_weights=outputs[3] if pad else None,
            pad_src=recv_src if pad else None,
        )
        self._in.dispatch_tables(self._context(), self._stream(), C, COUNTS_COLUMN, t)
        state = DispatchState(
            rank_prefix_matrix=prefix,
            dst_row=dst,
            plan=plan,
            plan_tokens=plan_tokens,
            src_tokens=src_tokens,
            recv_rows=recv_rows,
            recv_prefix=recv_prefix,
            recv_count=recv_count,
            out_rows=out_rows,
            stage_rows=stage_rows,
        )
        return state, lists, count, recv_src

    def _cached_streams(
        self, in_rank: torch.Tensor, config: Config
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A cached dispatch's streams (lists, list_count) for its config's channels."""
        N, T, C = self.topology.num_nodes, in_rank.shape[0], config.num_channels
        lists, count = self._int32(in_rank.device, (N, T), (C, N))
        t = DispatchTablesTensors(
            None, in_rank, None, lists, count, None, None, None, None, None, None
        )
        self._in.dispatch_tables(self._context(), self._stream(), C, COUNTS_COLUMN, t)
        return lists, count

    def _dispatch_tensors(
        self,
        args: DispatchArgs,
        x: torch.Tensor,
        state: DispatchState,
        streams: tuple[torch.Tensor, torch.Tensor],
        outputs: tuple[torch.Tensor | None, ...],
        recv_src: torch.Tensor | None,
    ) -> InternodeDispatchTensors:
        """The launch's inputs, index tables and outputs. ``Buffer`` handed the arguments
        over checked and contiguous (``api/validation.py``): ids int64/int32, weights float32."""
        cached = args.cached
        topk_idx = None if cached is not None else args.topk_idx
        lists, list_count = streams
        recv_x, recv_scales, recv_idx, recv_w = outputs
        return InternodeDispatchTensors(
            x=x,
            x_scales=args.x_scales,
            topk_idx=topk_idx,
            topk_weights=None if topk_idx is None else args.topk_weights,
            dst_row=state.dst_row,
            lists=lists,
            list_count=list_count,
            plan=state.plan,
            recv_rows=state.recv_rows,
            recv_prefix=state.recv_prefix,
            recv_x=recv_x,
            recv_x_scales=recv_scales,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            recv_src_idx=recv_src,  # None for a cached dispatch: the handle has the sources
        )

    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        # The status words and the proxy were checked by this call's header exchange, just
        # before (``exchange_header``): no second read here.
        rows, verdict, read = self._take_rows()
        topo, cfg, cached = self.topology, args.config, args.cached
        x = args.x
        row_bytes, num_topk, num_scales = self._dispatch_shape(args, x)
        in_rank = args.is_token_in_rank
        topk_idx = None if cached is not None else args.topk_idx
        recv_src = None
        if cached is not None:
            state: DispatchState = cached.state
            outputs, _ = self._outputs(state.out_rows, x, num_scales, None, cached.recv_src_idx)
            streams = self._cached_streams(in_rank, cfg)
        else:
            sizes = state_sizes(topo, args.num_worst_tokens, args.agreed)
            outputs, src = self._outputs(sizes[0], x, num_scales, topk_idx, None)
            state, *streams, recv_src = self._new_state(rows, in_rank, args, sizes, outputs, src)
        expert_list: list[int] = []
        per_expert = None
        if cached is None:
            expert_list, per_expert = self._expert_counts(args, read)
        idx_bytes = args.topk_idx.element_size() if num_topk else 8
        _, stage = self._slots(False, cfg, row_bytes, num_scales, num_topk, idx_bytes)
        self._fit_staging(state.stage_rows, stage, "dispatch")
        t = self._dispatch_tensors(args, x, state, tuple(streams), outputs, recv_src)
        # The kernels, then (ranks per node > 1) the node barrier and, for outputs outside the
        # receive arena, the rows node peers staged here; then the poison fold of the outputs;
        # sizes are read off the tensors in _C. The index tables die with
        # this call, after the launch: the caching allocator is stream-ordered.
        epr = args.num_experts // topo.num_ranks
        if self._in.dispatch_call(
            self._context(), self._stream(), verdict, self._rings(cfg), t, cached is not None, epr
        ):
            self.placed_dispatches += 1
        if cached is None and per_expert is None and t.recv_topk_idx is not None:
            # Sync-free: summed from the rows by the verdict's launch when they carry the
            # per-expert counts, else counted from the outputs.
            if read is not None:
                per_expert = read.device
            else:
                per_expert = received_expert_counts(t.recv_topk_idx, epr, args.expert_alignment)
        return DispatchResult(
            recv_x=t.recv_x,
            recv_x_scales=t.recv_x_scales,
            recv_topk_idx=t.recv_topk_idx,
            recv_topk_weights=t.recv_topk_weights,
            num_recv_tokens_per_expert=expert_list,
            rank_prefix_matrix=state.rank_prefix_matrix,
            recv_src_idx=cached.recv_src_idx if cached is not None else t.recv_src_idx,
            num_recv_tokens=state.out_rows,
            state=state,
            recv_count=state.recv_count,
            recv_tokens_per_expert=per_expert,
        )

    # ---- combine ------------------------------------------------------------------------
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Checked by this call's header exchange (see dispatch).
        verdict = self._take_rows().verdict
        topo = self.topology
        num_nodes = topo.num_nodes
        num_tokens = handle.is_token_in_rank.shape[0]
        t = prepare_combine(x, topk_weights, bias, num_tokens, "the internode kernels backend")
        x, hidden = t.x, t.x.shape[1]
        state: DispatchState = handle.state
        row_bytes = hidden * x.element_size()
        if row_bytes % 16:
            raise UnsupportedError(
                f"combine: rows of {row_bytes} bytes; the internode kernels need a multiple of 16"
            )
        num_topk = 0 if topk_weights is None else topk_weights.shape[1]
        slot, _ = self._slots(True, config, row_bytes, 0, num_topk, 0)
        self._fit_staging(state.stage_rows, slot, "combine")

        cch = config.num_channels
        # The stream positions of this rank's tokens, and the streams it forwards back: tokens
        # of source (m, my local) it received (its own node's rows never cross the network:
        # the plan has none for it). One launch.
        cum, lists, counts = self._int32(
            x.device, (num_tokens, num_nodes), (num_nodes, state.plan_tokens), (cch, num_nodes)
        )
        self._in.combine_tables(
            self._context(),
            self._stream(),
            cch,
            CombineTablesTensors(
                handle.is_token_in_rank.contiguous(),
                state.plan,
                state.src_tokens,
                cum,
                lists,
                counts,
            ),
        )

        biases = t.biases
        # Ranks per node > 1: x staged unless it lies in the receive arena (the kernel tells the
        # node peers where to read it); the kernel, a closing node barrier (peers read x until
        # then), then the poison fold of the outputs.
        tensors = InternodeCombineTensors(
            x=x,
            topk_weights=t.weights,
            bias0=biases[0] if len(biases) > 0 else None,
            bias1=biases[1] if len(biases) > 1 else None,
            out=t.out,
            out_weights=t.out_weights,
            recv_count=state.recv_count,
            plan=state.plan,
            lists=lists,
            list_count=counts,
            src_tokens=state.src_tokens,
            dst_row=state.dst_row,
            stream_cum=cum,
        )
        if self._in.combine_call(
            self._context(), self._stream(), verdict, self._rings(config), tensors, state.out_rows
        ):
            self.placed_combines += 1
        return t.out, t.out_weights

    # ---- teardown -----------------------------------------------------------------------
    def destroy(self, collective: bool = True) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        c = self._c
        torch.cuda.synchronize(self.device)
        # What the kernels recorded last (a rejected sync-free call) is raised after the
        # release, so the Buffer's memory is freed either way.
        pending = recorded_error(
            self._in, self._status, self._ep, self._state, self.topology, self._timeout_ms
        )
        self._ep.close()
        with torch.cuda.device(self._dev_index):
            self._ipc.close(collective, self._timeout_ms)
            if self.recv_arena is not None:
                # Freed now, or when the last dispatch output carved from it dies.
                self.recv_arena.close(collective, self._timeout_ms)
            # Every write into the region was consumed by this rank's kernels (synchronized
            # above), so no peer still targets it; peers' mappings keep their own reference.
            c.device_free(self._region)
        self._in.status_free(self._status)
        if collective and isinstance(pending, InvalidInputError):
            raise pending


__all__ = ["InternodeBackend", "NUM_FIFO_CHANNELS"]

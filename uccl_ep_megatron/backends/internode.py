"""The ``kernels_internode`` backend: HT dispatch/combine across (virtual) nodes.

Token bytes cross nodes the UCCL-EP way: GPU warps pack each token **once per destination
node** into a send ring of this rank's registered RDMA region and push 16-byte ``TransferCmd``
descriptors (Write + software-atomic tail update) into GPU->CPU FIFO channels; the CPU proxy
(``uccl_ep_megatron.proxy``) posts them through the transport (``verbs`` on RDMA NICs, ``ipc``
on one host) to the rank with the same local index on the destination node (the rail); the
receiving proxy applies the tail update only after the write landed (receiver-side ordering,
so out-of-order NICs such as EFA and the ``ipc`` reorder injector are safe); forwarder warps
there copy the token over NVLink to every local rank hosting one of its experts. Combine runs
backwards and hierarchically: each node sums its rows of a token into one partial, one partial
per (token, node) crosses the network, and the source adds them up (``csrc/kernels/internode.h``).

Per call, a few small collectives on the group (NCCL) stay on the host side. Every call starts
with the all-gather of the call header (``agreement.py``), which carries the per-rank counts
and the expert-id / layout checks, so ranks that disagree or reject their arguments all raise
the same error before any kernel runs; the host reads it once (for a dispatch that read sizes
the outputs, as DeepEP's notify does). Being stream-ordered, it also makes sure every rank
finished its previous kernels (every ring is drained before a call with another layout). A
dispatch that returns per-expert counts then all-gathers those. The bulk index tables (final
rows, per-channel stream lists) are torch ops on the GPU.

Virtual nodes: ``UCCL_EP_RANKS_PER_NODE`` splits one host's GPUs into nodes and the path is the
same. The proxies' transport is chosen as on a cluster (``UCCL_EP_TRANSPORT``; ``auto`` is
``verbs`` when an RDMA port is active, else ``ipc``, a copy into the peer's IPC-mapped region);
only ``ipc`` has run, on hosts without a NIC, so set ``UCCL_EP_TRANSPORT=ipc`` for virtual nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.agreement import timeout_error, wait_stream
from uccl_ep_megatron.backends.base import (
    Backend,
    DispatchArgs,
    DispatchHandle,
    DispatchResult,
    Layout,
    Topology,
)
from uccl_ep_megatron.backends.ipc_buffer import IpcBuffers
from uccl_ep_megatron.backends.kernels import (
    KernelsBackend,
    launch_layout,
    poison_dispatch,
    poison_on_timeout,
    prepare_combine,
    warm_poison,
)
from uccl_ep_megatron.config import Config
from uccl_ep_megatron.errors import (
    BufferTooSmallError,
    CommTimeoutError,
    InvalidInputError,
    UcclEpError,
    UnsupportedError,
)

# NVLink buffer: barrier flags first (kernels/common.cuh uses its first 64 bytes), staging after.
_NVL_STAGE_OFFSET = 4096
# FIFO channels per GPU: ring channel c uses FIFO channel c % this; proxy threads <= this.
NUM_FIFO_CHANNELS = 8


def _c() -> Any:
    from uccl_ep_megatron import _C

    return _C


def stream_tables(
    mask: torch.Tensor, num_channels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel token streams of a ``[T, N]`` token->node mask, without a host sync.

    Tokens are split into ``num_channels`` contiguous ranges (``_C.internode.channel_range``);
    the stream (channel c, node n) is the tokens of range c with ``mask[t, n]``, ascending.

    Returns:
        lists: ``[N, T]`` int32; stream (c, n) is ``lists[n, begin(c) : begin(c) + count[c, n]]``.
        count: ``[C, N]`` int32 tokens per stream.
        cum: ``[T, N]`` int32, inclusive count of masked tokens of t's range up to t (the ring
            position of t's entry in its stream is ``cum - 1``).
    """
    num_tokens, num_nodes = mask.shape
    dev = mask.device
    if num_tokens == 0:
        return (
            torch.zeros(num_nodes, 0, dtype=torch.int32, device=dev),
            torch.zeros(num_channels, num_nodes, dtype=torch.int32, device=dev),
            torch.zeros(0, num_nodes, dtype=torch.int32, device=dev),
        )
    per = -(-num_tokens // num_channels)
    t = torch.arange(num_tokens, device=dev)
    begin = (t // per) * per
    cs = mask.to(torch.int64).cumsum(0)
    cs_pad = torch.cat([torch.zeros(1, num_nodes, dtype=torch.int64, device=dev), cs])
    cum = cs - cs_pad[begin]
    index = torch.where(mask, begin[:, None] + cum - 1, torch.full_like(cum, num_tokens))
    lists = torch.full((num_nodes, num_tokens + 1), -1, dtype=torch.int32, device=dev)
    lists.scatter_(1, index.t().contiguous(), t.to(torch.int32).expand(num_nodes, -1).contiguous())
    c = torch.arange(num_channels, device=dev)
    begins = torch.clamp(c * per, max=num_tokens)
    ends = torch.clamp(c * per + per, max=num_tokens)
    last = torch.clamp(ends - 1, min=0)
    count = torch.where((ends > begins)[:, None], cum[last], torch.zeros_like(cum[last]))
    return lists[:, :num_tokens].contiguous(), count.to(torch.int32), cum.to(torch.int32)


def dst_rows(is_token_in_rank: torch.Tensor, first_row: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` int32 final row of token t at rank r (``first_row[r]`` + its position), -1 if
    t does not go to r: the receiver's order is source rank major, token order within."""
    pos = is_token_in_rank.to(torch.int32).cumsum(0, dtype=torch.int32) - 1
    return torch.where(is_token_in_rank, first_row.to(torch.int32)[None, :] + pos, -1).to(
        torch.int32
    )


@dataclass(frozen=True)
class _State:
    """What combine and cached dispatch need from a dispatch (kept in the handle)."""

    prefix_host: tuple[int, ...]  # rank_prefix_matrix, row-major
    src_tokens: tuple[int, ...]  # tokens of every rank in this dispatch
    dst_row: torch.Tensor  # [T, R] int32
    plan: torch.Tensor  # [N, plan_T, L] int32: rows of tokens this rank forwarded
    plan_tokens: int


class InternodeBackend(Backend):
    """GPU-initiated, proxy-executed, node-deduplicated HT dispatch/combine."""

    name = "kernels_internode"
    defers_id_check = True
    agrees_per_call = True
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
    ) -> None:
        super().__init__(group, topology, device, num_nvl_bytes, num_rdma_bytes)
        reason = self.unsupported_reason(topology, device)
        if reason is not None:
            raise UnsupportedError(f"backend='kernels' (internode) is unavailable: {reason}")
        if num_rdma_bytes <= 0:
            raise InvalidInputError(
                f"num_rdma_bytes={num_rdma_bytes}: a group of {topology.num_nodes} nodes needs an "
                "RDMA buffer; pass num_rdma_bytes >= "
                "Config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)"
            )
        from uccl_ep_megatron.config import effective_env
        from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint

        c = _c()
        self._c = c
        self._in = c.internode
        self._destroyed = False
        topo = topology
        self._timeout_ms = int(effective_env()["UCCL_EP_TIMEOUT_MS"])
        self._call = ""
        self._broken = ""
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
        )
        # Rings are placed by this rank's formula at every peer: the smallest region bounds all.
        self._region_bytes = min(int(b) for b in self._ipc.extras)
        self._ep = ProxyEndpoint(
            self._region,
            int(num_rdma_bytes),
            device=dev_index,
            group=group,
            config=ProxyConfig(
                num_channels=NUM_FIFO_CHANNELS,
                num_counters=int(c.internode.NUM_COUNTERS),
                ranks_per_node=topo.ranks_per_node,
            ),
        )
        self._ep.connect()
        handles = self._ep.device_handles()
        self._fifo_handles = torch.frombuffer(bytearray(handles), dtype=torch.uint8).to(device)
        self._state = torch.zeros(int(c.internode.STATE_WORDS), dtype=torch.int64, device=device)
        self._status = c.internode.status_alloc()
        warm_poison(c, self._status, device)
        self._barrier_seq = 0

    # ---- helpers -----------------------------------------------------------------------
    @property
    def proxy(self) -> Any:
        """This rank's ``ProxyEndpoint`` (stats, counters, transport kind)."""
        return self._ep

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _next_barrier(self) -> int:
        self._barrier_seq += 1
        return self._barrier_seq

    def check(self) -> None:
        """Raise the first failure of a kernel wait, a FIFO push or a proxy thread."""
        if self._destroyed:
            raise UcclEpError("the internode backend was destroyed; create a new Buffer")
        if self._broken:
            raise UcclEpError(
                f"this Buffer is unusable: {self._broken} (the collective may still be pending "
                "on the group); create a new Buffer"
            )
        self._ep.check()
        st = self._in.status_read(self._status)
        if st[0]:
            peer, want, site, channel, got = st[1], st[2], st[3], st[4], st[5]
            what = self._in.SITES.get(site, f"site {site}")
            topo = self.topology
            if site == 17:  # NVLink barrier: word 1 is the peer's local index
                peer = topo.node * topo.ranks_per_node + peer
                detail = f"barrier #{want}"
            else:
                streams = self._stream_state(channel, peer)
                detail = f"channel {channel}, waited for {want}, saw {got}; {streams}"
            raise CommTimeoutError(
                f"rank {topo.rank} (node {topo.node}): internode {what} failed waiting for rank "
                f"{peer} (node {peer // topo.ranks_per_node}), {detail}, within "
                f"UCCL_EP_TIMEOUT_MS={self._timeout_ms}. Rank {peer} crashed, stopped calling "
                "dispatch/combine in step with this rank, or its proxy stopped; raise "
                "UCCL_EP_TIMEOUT_MS if it is only slow. This Buffer is unusable now. "
                f"Proxy of this rank: {self._ep.stats()}"
            )

    def _stream_state(self, channel: int, peer: int) -> str:
        """Counters and kernel positions of one channel toward a peer's node (diagnostics)."""
        if not 0 <= channel < self._in.MAX_CHANNELS or not 0 <= peer < self.topology.num_ranks:
            return "no stream state"
        node = peer // self.topology.ranks_per_node
        vals = self._ep.counter_values()
        counters = {
            k: vals[self._in.counter_index(v, channel, node)]
            for k, v in self._in.COUNTER_KINDS.items()
        }
        words = self._state.tolist()
        per_kind = self._in.MAX_CHANNELS * self._in.MAX_NODES
        at = channel * self._in.MAX_NODES + node
        names = ("dispatch_sent", "dispatch_consumed", "combine_sent", "combine_consumed", "calls")
        state = {n: words[i * per_kind + at] for i, n in enumerate(names)}
        return f"counters for node {node}: {counters}, kernel positions: {state}"

    def _common(self, config: Config) -> Any:
        topo = self.topology
        cm = self._in.Common()
        cm.rank, cm.num_ranks = topo.rank, topo.num_ranks
        cm.ranks_per_node = topo.ranks_per_node
        cm.num_channels = config.num_channels
        if config.num_channels > self._in.MAX_CHANNELS:
            raise UnsupportedError(
                f"Config.num_sms={config.num_sms} gives {config.num_channels} channels; the "
                f"internode kernels support up to {self._in.MAX_CHANNELS} (num_sms <= "
                f"{2 * self._in.MAX_CHANNELS})"
            )
        cm.fifo_handles = self._fifo_handles.data_ptr()
        cm.num_fifos = NUM_FIFO_CHANNELS
        cm.counters = self._ep.counters.dev_ptr
        cm.state = self._state.data_ptr()
        cm.region = self._region
        cm.region_bytes = self._region_bytes
        cm.nvl = list(self._ipc.ptrs)
        cm.cap = config.num_max_rdma_chunked_recv_tokens
        cm.chunk = config.num_max_rdma_chunked_send_tokens
        cm.status = self._status
        cm.timeout_ns = self._timeout_ms * 1_000_000
        return cm

    def _check_rings(self, combine: bool, config: Config, slot_bytes: int) -> None:
        topo = self.topology
        lay = self._in.ring_layout(
            combine,
            self._region_bytes,
            config.num_channels,
            topo.num_nodes,
            config.num_max_rdma_chunked_recv_tokens,
            slot_bytes,
        )
        if lay["bytes"] > lay["half_bytes"]:
            op = "combine" if combine else "dispatch"
            raise BufferTooSmallError(
                f"{op}: {config.num_channels} channels x {topo.num_nodes} nodes x "
                f"{config.num_max_rdma_chunked_recv_tokens} ring slots of {slot_bytes} bytes "
                f"(send + receive) need {lay['bytes']} bytes, but half the RDMA buffer is "
                f"{lay['half_bytes']} (num_rdma_bytes={self._region_bytes}); create the Buffer "
                f"with num_rdma_bytes >= {2 * lay['bytes'] + 32} or lower "
                "num_max_rdma_chunked_recv_tokens / num_sms"
            )
        max_len = self._c.cmd_limits["max_length"]
        if config.num_max_rdma_chunked_send_tokens * slot_bytes > max_len:
            raise InvalidInputError(
                f"Config.num_max_rdma_chunked_send_tokens={config.num_max_rdma_chunked_send_tokens}"
                f" x {slot_bytes}-byte slots exceeds one RDMA write ({max_len} bytes); lower it"
            )

    def _fit_staging(self, rows_of_rank: list[int], slot_bytes: int, op: str) -> None:
        """Grow the NVLink buffers (collectively) when a rank stages more rows than they hold.

        ``rows_of_rank`` comes from the all-gathered count matrix, identical on every rank.
        """
        if self.topology.ranks_per_node == 1:
            return  # no NVLink staging: the buffer holds only barrier flags
        needs = [_NVL_STAGE_OFFSET + rows * slot_bytes for rows in rows_of_rank]
        self._ipc.grow(needs, f"{op} staging {max(rows_of_rank)} rows of {slot_bytes} bytes")

    # ---- the call header (agreement.py) --------------------------------------------------
    def _gather(self, row: torch.Tensor, what: str, call: str) -> list[list[int]]:
        """All-gather of one int64 row per rank, read on the host within UCCL_EP_TIMEOUT_MS."""
        num_ranks = self.topology.num_ranks
        out = torch.empty(num_ranks * row.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(out, row.to(torch.int64).contiguous(), group=self.group)

        def expired() -> CommTimeoutError:
            self._broken = f"{what} of {call} timed out"
            return timeout_error(self.topology.rank, what, call, self._timeout_ms)

        wait_stream(self._timeout_ms, expired)
        return out.view(num_ranks, -1).tolist()

    def exchange_header(self, row: torch.Tensor, call: str) -> list[list[int]]:
        self.check()
        self._call = call
        # Stream-ordered: every rank's previous kernels finished (all rings drained) before our
        # next kernel starts.
        return self._gather(row, "the call-header exchange", call)

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

    # ---- dispatch -----------------------------------------------------------------------
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        self.check()
        topo = self.topology
        rank, num_ranks = topo.rank, topo.num_ranks
        num_nodes, local_n = topo.num_nodes, topo.ranks_per_node
        cfg = args.config
        x = args.x.contiguous()
        num_tokens, hidden = x.shape
        dev = x.device
        row_bytes = hidden * x.element_size()
        if row_bytes % 16:
            raise UnsupportedError(
                f"hidden={hidden} x {x.element_size()}-byte elements = {row_bytes} bytes per row; "
                "the internode kernels move rows in 16-byte vectors: use a hidden size that makes "
                "rows a multiple of 16 bytes"
            )
        cached = args.cached
        topk_idx = None if cached is not None else args.topk_idx
        num_topk = 0 if topk_idx is None else topk_idx.shape[1]
        if num_topk > self._in.MAX_TOPK:
            raise UnsupportedError(f"num_topk={num_topk} exceeds {self._in.MAX_TOPK}")
        scales = args.x_scales
        num_scales = 0 if scales is None else scales.shape[1]
        in_rank = args.is_token_in_rank.contiguous()

        if cached is None:
            # The counts came with the call header (the notify; its read sized the outputs).
            agreed = args.agreed
            num_experts = args.num_experts
            epr = num_experts // num_ranks
            prefix: list[int] = []
            run = [0] * num_ranks
            for s in range(num_ranks):
                run = [run[r] + agreed.counts[s][r] for r in range(num_ranks)]
                prefix.extend(run)
            prefix_host = tuple(prefix)
            src_tokens = tuple(agreed.num_tokens)
            expert_counts = []
            if args.num_worst_tokens == 0:
                per_expert = self._gather(
                    args.num_tokens_per_expert,
                    "the all-gather of per-expert counts",
                    self._call,
                )
                align = args.expert_alignment
                for e in range(epr):
                    n = sum(per_expert[s][rank * epr + e] for s in range(num_ranks))
                    expert_counts.append((n + align - 1) // align * align)
        else:
            state: _State = cached.state
            prefix_host = state.prefix_host
            src_tokens = state.src_tokens
            epr = 0
            expert_counts = []

        def pm(i: int, r: int) -> int:
            return prefix_host[i * num_ranks + r] if i >= 0 else 0

        num_recv = pm(num_ranks - 1, rank)
        node0 = topo.node * local_n
        if cached is None:
            first_row = torch.tensor(
                [pm(rank - 1, r) for r in range(num_ranks)], dtype=torch.int32, device=dev
            )
            dst_row = dst_rows(in_rank, first_row)
            plan_tokens = max(1, max(src_tokens))
            plan = torch.full((num_nodes, plan_tokens, local_n), -1, dtype=torch.int32, device=dev)
        else:
            dst_row, plan, plan_tokens = state.dst_row, state.plan, state.plan_tokens

        rows_out = num_recv
        if args.num_worst_tokens > 0:
            # Every rank's value was checked against its rows with the call header.
            rows_out = args.num_worst_tokens
            expert_counts = []

        idx_bytes = topk_idx.element_size() if topk_idx is not None else 8
        slot = self._in.dispatch_slot(row_bytes, num_scales, num_topk, local_n)["bytes"]
        self._check_rings(False, cfg, slot)
        stage = self._in.stage_slot(row_bytes, num_scales, num_topk, idx_bytes)["bytes"]
        self._fit_staging([pm(num_ranks - 1, r) for r in range(num_ranks)], stage, "dispatch")

        node_mask = in_rank.view(num_tokens, num_nodes, local_n).any(2)
        lists, list_count, _ = stream_tables(node_mask, cfg.num_channels)

        recv_x = torch.empty(rows_out, hidden, dtype=x.dtype, device=dev)
        recv_scales = None
        if scales is not None:
            recv_scales = torch.empty(rows_out, num_scales, dtype=torch.float32, device=dev)
            scales = scales.contiguous()
        recv_idx = recv_w = None
        topk_w = None
        if topk_idx is not None:
            topk_idx = topk_idx.contiguous()
            topk_w = args.topk_weights.to(torch.float32).contiguous()
            recv_idx = torch.empty(rows_out, num_topk, dtype=topk_idx.dtype, device=dev)
            recv_w = torch.empty(rows_out, num_topk, dtype=torch.float32, device=dev)
        recv_src = (
            torch.empty(num_recv, dtype=torch.int32, device=dev)
            if cached is None
            else cached.recv_src_idx
        )

        a = self._in.DispatchArgs()
        a.common = self._common(cfg)
        a.num_tokens, a.experts_per_rank = num_tokens, epr
        a.num_topk, a.num_scales, a.row_bytes = num_topk, num_scales, row_bytes
        a.x = x.data_ptr()
        a.x_scales = 0 if scales is None else scales.data_ptr()
        if topk_idx is not None:
            a.topk_idx = topk_idx.data_ptr()
            a.idx_is_64 = topk_idx.dtype == torch.int64
            a.topk_weights = topk_w.data_ptr()
            a.recv_topk_idx = recv_idx.data_ptr()
            a.recv_topk_weights = recv_w.data_ptr()
        a.dst_row = dst_row.data_ptr()
        a.lists = lists.data_ptr()
        a.list_count = list_count.data_ptr()
        a.recv_x = recv_x.data_ptr()
        a.recv_scales = 0 if recv_scales is None else recv_scales.data_ptr()
        a.recv_src_idx = 0 if cached is not None else recv_src.data_ptr()
        a.plan = 0 if cached is not None else plan.data_ptr()
        a.plan_tokens = plan_tokens
        a.stage_offset = _NVL_STAGE_OFFSET
        a.recv_rows = [pm(num_ranks - 1, node0 + j) for j in range(local_n)]
        stream = self._stream()
        if rows_out > num_recv:
            # Padding rows are disjoint from the kernel's rows; fill them BEFORE the launch.
            # Under CUDA lazy loading (PyTorch's default) the first launch of a kernel (e.g. the
            # bf16 fill) loads it holding the context lock until the GPU drains; launched while
            # the dispatch kernel waits for the proxies, it blocks their cudaMemcpyAsync (ipc
            # transport) and deadlocks both until UCCL_EP_TIMEOUT_MS (bench/DEVICE_RUNS.md).
            recv_x[num_recv:].zero_()
            if recv_scales is not None:
                recv_scales[num_recv:].zero_()
            if recv_idx is not None:
                recv_idx[num_recv:].fill_(-1)
                recv_w[num_recv:].zero_()
        self._in.dispatch(a, stream)
        if local_n > 1:
            recv_prefix = [pm(s - 1, rank) for s in range(num_ranks)] + [num_recv]
            self._in.dispatch_finish(a, recv_prefix, self._next_barrier(), stream)
        outs = (recv_x, recv_scales, recv_idx, recv_w, recv_src if cached is None else None)
        poison_dispatch(self._c, self._status, stream, *outs)

        if cached is None:
            prefix_t = torch.tensor(prefix_host, dtype=torch.int32, device=dev).view(
                num_ranks, num_ranks
            )
            new_state = _State(prefix_host, src_tokens, dst_row, plan, plan_tokens)
        else:
            prefix_t, new_state = cached.rank_prefix_matrix, cached.state
        return DispatchResult(
            recv_x=recv_x,
            recv_x_scales=recv_scales,
            recv_topk_idx=recv_idx,
            recv_topk_weights=recv_w,
            num_recv_tokens_per_expert=expert_counts,
            rank_prefix_matrix=prefix_t,
            recv_src_idx=recv_src,
            num_recv_tokens=num_recv,
            state=new_state,
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
        self.check()
        topo = self.topology
        num_ranks = topo.num_ranks
        num_nodes, local_n = topo.num_nodes, topo.ranks_per_node
        num_tokens = handle.is_token_in_rank.shape[0]
        t = prepare_combine(x, topk_weights, bias, num_tokens, "the internode kernels backend")
        x, hidden = t.x, t.x.shape[1]
        state: _State = handle.state
        row_bytes = hidden * x.element_size()
        if row_bytes % 16:
            raise UnsupportedError(
                f"combine: rows of {row_bytes} bytes; the internode kernels need a multiple of 16"
            )
        num_topk = 0 if topk_weights is None else topk_weights.shape[1]
        dev = x.device
        num_recv = handle.num_recv_tokens
        prefix_host = state.prefix_host
        slot = self._in.combine_slot(row_bytes, num_topk)["bytes"]
        self._check_rings(True, config, slot)
        recv_of = [prefix_host[(num_ranks - 1) * num_ranks + r] for r in range(num_ranks)]
        self._fit_staging(recv_of, slot, "combine")

        cch = config.num_channels
        node_mask = handle.is_token_in_rank.view(num_tokens, num_nodes, local_n).any(2)
        _, _, cum = stream_tables(node_mask, cch)
        # The streams this rank forwards back: tokens of source (m, my local) it received.
        plan_tokens = state.plan_tokens
        lists = torch.full((num_nodes, plan_tokens), -1, dtype=torch.int32, device=dev)
        counts = torch.zeros(cch, num_nodes, dtype=torch.int32, device=dev)
        src_tokens = []
        for m in range(num_nodes):
            tm = state.src_tokens[m * local_n + topo.local_rank]
            src_tokens.append(tm)
            if m == topo.node or tm == 0:
                continue
            mask_m = (state.plan[m, :tm] >= 0).any(-1)
            lm, cm_, _ = stream_tables(mask_m[:, None], cch)
            lists[m, :tm] = lm[0]
            counts[:, m] = cm_[:, 0]

        a = self._in.CombineArgs()
        a.common = self._common(config)
        a.dtype = t.dtype_code
        a.num_topk, a.num_tokens, a.num_recv = num_topk, num_tokens, num_recv
        a.row_bytes = row_bytes
        a.x = x.data_ptr()
        a.topk_weights = 0 if t.weights is None else t.weights.data_ptr()
        a.plan = state.plan.data_ptr()
        a.plan_tokens = plan_tokens
        a.lists = lists.data_ptr()
        a.list_count = counts.data_ptr()
        a.src_tokens = src_tokens
        a.dst_row = state.dst_row.data_ptr()
        a.stream_cum = cum.data_ptr()
        a.bias0 = t.biases[0].data_ptr() if len(t.biases) > 0 else 0
        a.bias1 = t.biases[1].data_ptr() if len(t.biases) > 1 else 0
        a.out = t.out.data_ptr()
        a.out_weights = 0 if t.out_weights is None else t.out_weights.data_ptr()
        a.stage_offset = _NVL_STAGE_OFFSET
        stream = self._stream()
        if local_n > 1:
            self._in.combine_prepare(a, self._next_barrier(), stream)
        self._in.combine(a, stream)
        if local_n > 1:
            # Peers read this rank's staging until here; the next call may overwrite it.
            self._in.node_barrier(a.common, self._next_barrier(), stream)
        poison_on_timeout(self._c, self._status, stream, (t.out, "nan"), (t.out_weights, "nan"))
        # Keep the index tables alive until the kernels ran (the caching allocator is
        # stream-ordered, so freeing them after the launch on this stream is safe).
        del lists, counts, cum
        return t.out, t.out_weights

    # ---- teardown -----------------------------------------------------------------------
    def destroy(self, collective: bool = True) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        c = self._c
        torch.cuda.synchronize(self.device)
        self._ep.close()
        with torch.cuda.device(self._dev_index):
            self._ipc.close(collective, self._timeout_ms)
            # Every write into the region was consumed by this rank's kernels (synchronized
            # above), so no peer still targets it; peers' mappings keep their own reference.
            c.device_free(self._region)
        self._in.status_free(self._status)


__all__ = ["InternodeBackend", "dst_rows", "stream_tables", "NUM_FIFO_CHANNELS"]

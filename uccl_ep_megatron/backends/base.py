"""The seam between ``Buffer`` and the code that moves bytes.

``Buffer`` validates every argument, manages streams/events and handle ownership, and then
calls exactly one backend method on the communication stream. A backend only implements the
data movement with the semantics documented here; it never re-validates user input.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.agreement import (
    Agreement,
    CallHeader,
    DispatchExperts,
    encode_row,
)
from uccl_ep_megatron.backends.agreement.group import BufferGroup
from uccl_ep_megatron.core.config import Config
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.core.options import BufferOptions


@dataclass(frozen=True)
class Topology:
    """Where this rank sits. Nodes are runs of ``ranks_per_node`` consecutive ranks."""

    rank: int
    num_ranks: int
    ranks_per_node: int

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node


class Layout(NamedTuple):
    """Output of ``get_dispatch_layout`` (all on the device of ``topk_idx``)."""

    num_tokens_per_rank: torch.Tensor  # [R] int32: tokens sent to each rank (deduplicated)
    num_tokens_per_rdma_rank: torch.Tensor | None  # [nodes] int32, None on one node
    num_tokens_per_expert: torch.Tensor  # [E] int32: tokens choosing each expert
    is_token_in_rank: torch.Tensor  # [T, R] bool


@dataclass
class DispatchArgs:
    """A validated dispatch request. ``cached`` is set for ``dispatch(x, handle=...)``."""

    x: torch.Tensor  # [T, H]
    x_scales: torch.Tensor | None  # [T, H/128] float32 for FP8 input, else None
    topk_idx: torch.Tensor | None  # [T, K] int64/int32 global expert ids, -1 = none
    topk_weights: torch.Tensor | None  # [T, K] float32
    is_token_in_rank: torch.Tensor  # [T, R] bool
    num_tokens_per_rank: torch.Tensor  # [R] int32
    num_tokens_per_rdma_rank: torch.Tensor | None
    num_tokens_per_expert: torch.Tensor | None  # [E] int32 (None when cached)
    num_experts: int
    expert_alignment: int
    num_worst_tokens: int
    config: Config
    cached: DispatchHandle | None
    # The id range of topk_idx is still to be checked: by a backend that does it at its one
    # host sync instead of syncing for it up front (``Backend.defers_id_check``).
    check_ids: bool = False
    # Every rank's call header, checks and counts (``agreement.py``), when the backend
    # exchanges them (``Backend.agrees_per_call``); the counts are the ones it needs.
    agreed: Agreement | None = None


class DispatchResult(NamedTuple):
    recv_x: torch.Tensor  # [N_recv or num_worst_tokens, H]
    recv_x_scales: torch.Tensor | None
    recv_topk_idx: torch.Tensor | None  # local expert ids, -1 elsewhere / on padding
    recv_topk_weights: torch.Tensor | None  # 0.0 where the id is -1
    num_recv_tokens_per_expert: list[int]  # aligned; [] when num_worst_tokens > 0
    rank_prefix_matrix: torch.Tensor  # [R, R] int32, [i][r] = rows r gets from ranks 0..i
    # [N_recv] int32: source token index of each received row; [W] with -1 on padding rows
    # when num_worst_tokens = W > 0
    recv_src_idx: torch.Tensor
    num_recv_tokens: int  # rows received; num_worst_tokens when that is > 0 (output rows)
    state: Any  # backend-private data combine / cached dispatch need
    # GPU int32 [1]: rows received (before padding); None for cached dispatch.
    recv_count: torch.Tensor | None = None
    # GPU int32 [num_local_experts]: received rows per local expert, rounded up to
    # expert_alignment (the numbers of the exact-mode list); None for cached dispatch.
    recv_tokens_per_expert: torch.Tensor | None = None
    # The received rows, scales, ids, weights and source indices live in memory the backend
    # orders across streams itself (the receive arena), not in the caching allocator's: the
    # Buffer then records only the other outputs on the caller's stream.
    arena: bool = False


class DispatchHandle(NamedTuple):
    """What ``dispatch`` returns as ``handle``; ``combine`` and cached dispatch take it back.

    A tuple like DeepEP's: ``handle[0]`` is the rank prefix matrix. Treat it as opaque.
    """

    rank_prefix_matrix: torch.Tensor
    is_token_in_rank: torch.Tensor  # [T, R] bool, sender side
    num_tokens_per_rank: torch.Tensor  # [R] int32, sender side
    recv_src_idx: torch.Tensor  # [N_recv] int32 ([W], -1 on padding rows, when W > 0)
    num_recv_tokens: int  # rows received; num_worst_tokens (the output rows) when that is > 0
    num_worst_tokens: int
    num_topk: int  # K of the forward dispatch (0 without top-k)
    state: Any
    owner: int  # Buffer.uid of the Buffer that made it
    seq: int = 0  # the Buffer's number of the dispatch call that made it
    # GPU int32 [1] on the output device: rows this rank received (before padding). Set in
    # both modes, so sync-free callers (num_worst_tokens > 0) read it without a host sync.
    recv_count: torch.Tensor | None = None
    # GPU int32 [num_local_experts]: received rows per local expert, rounded up to
    # expert_alignment (the numbers of the exact-mode num_recv_tokens_per_expert_list).
    recv_tokens_per_expert: torch.Tensor | None = None

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors a combine or cached dispatch with this handle reads on the device (an
        asynchronous call records them on its stream): the handle's own and those its
        backend's ``state`` names in ``tensors``."""
        own = (
            self.rank_prefix_matrix,
            self.is_token_in_rank,
            self.num_tokens_per_rank,
            self.recv_src_idx,
            self.recv_count,
            self.recv_tokens_per_expert,
        )
        held = [t for t in own if isinstance(t, torch.Tensor)]
        return held + list(getattr(self.state, "tensors", ()))


class Backend(abc.ABC):
    """Moves the bytes for one ``Buffer``; runs on the stream current at call time."""

    name: str
    # True: ``Buffer`` leaves the id range of topk_idx to the backend, which reads its
    # (min, max) with the host sync it makes anyway and raises ``check_expert_ids``; its
    # kernels must ignore ids outside [0, E) until then.
    defers_id_check: bool = False
    # True: ``exchange_header`` all-gathers the per-call rows of ``agreement.py`` before every
    # dispatch/combine, so ranks that disagree (or one rank whose checks failed) all raise the
    # same error; a deferred id check then travels in that row too.
    agrees_per_call: bool = False
    # True (with ``agrees_per_call``): a call that needs no host sizes (``num_worst_tokens > 0``,
    # a cached dispatch, a combine) hands its row to ``exchange_header_async`` instead, which
    # checks the rows on the GPU; a failed check is raised at the next host-visible point.
    agrees_on_device: bool = False

    # How a user asks for this backend (``Buffer(backend=...)``), for the unavailability error.
    requested_as: str = "'auto'"
    # The caller's stream handle of the call in progress (set by ``Buffer`` before each call;
    # 0 = the call's own stream): where its outputs are used.
    caller_stream: int = 0
    # True: ``Buffer`` runs this backend's synchronous calls on the caller's stream, not on its
    # communication stream (``api/streams.py``); the backend then hears of the comm stream's
    # first use through ``note_stream``.
    runs_on_caller_stream: bool = False
    # The Buffer's channel for its collectives and bounded waits (``agreement.group``), set by
    # ``Buffer`` right after construction.
    comm: BufferGroup | None = None

    @classmethod
    def unsupported_reason(cls, topology: Topology, device: torch.device) -> str | None:
        """Why this backend cannot serve the group, or ``None`` when it can (checked by the
        constructor, which raises ``UnsupportedError`` with it)."""
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
        reason = self.unsupported_reason(topology, device)
        if reason is not None:
            raise UnsupportedError(f"backend={self.requested_as} is unavailable: {reason}")
        self.group = group
        self.topology = topology
        self.device = device
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        # The Buffer's knobs, every field resolved (BufferOptions.resolved()).
        self.options = options
        # Bound of every wait of this backend.
        self.timeout_ms = int(options.timeout_ms)

    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        """Counts per rank / node / expert and the token->rank mask, local computation only."""

    def routing_check(
        self, given: Layout, topk_idx: torch.Tensor | None, num_experts: int
    ) -> torch.Tensor:
        """``routing_check``'s words for a dispatch's layout ``given`` (no host sync): against
        the layout ``topk_idx`` implies (``get_dispatch_layout``), or without it against
        ``is_token_in_rank`` alone. Backends may compute the same words faster."""
        true = None if topk_idx is None else self.get_dispatch_layout(topk_idx, num_experts)
        return routing_check(given, true, topk_idx, self.topology)

    @abc.abstractmethod
    def dispatch(self, args: DispatchArgs) -> DispatchResult:
        """Send each token once to every rank hosting one of its experts (see ``Buffer``)."""

    @abc.abstractmethod
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None,
        bias: tuple[torch.Tensor, ...],
        config: Config,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sum each received row back into its source token (and top-k weights likewise)."""

    def make_lane(self, uid: int) -> Any:
        """A binding that serves ``Buffer(uid).dispatch``'s direct lane in one call
        (``api/direct.py``), or ``None``: the lane stays in Python."""
        return None

    def combine_input(
        self, rows: int, hidden: int, dtype: torch.dtype, comm_stream: int
    ) -> torch.Tensor | None:
        """A ``[rows, hidden]`` tensor that this backend's combine reads in place, or ``None``
        (the caller allocates an ordinary one). ``comm_stream``: the raw handle combine runs on."""
        return None

    def note_stream(self, stream: int) -> None:  # noqa: B027 - optional hook
        """The communication stream (raw handle) now runs calls too: memory this backend
        handed out earlier may be read there (``runs_on_caller_stream`` backends)."""

    def check_errors(self) -> None:  # noqa: B027 - optional hook
        """Raise an error that earlier GPU work recorded and no call has raised yet (sync-free
        calls report through the status word); never synchronizes the device. The default
        backend reports every error at the call that makes it, so it has none pending."""

    def exchange_header(
        self, row: torch.Tensor, call: str, experts: DispatchExperts | None = None
    ) -> list[list[int]] | None:
        """Every rank's ``row`` (rank order) on the host, bounded by ``UCCL_EP_TIMEOUT_MS``;
        ``None`` when this backend has no host-side exchange to carry it. ``experts``: a
        non-cached dispatch's per-expert counts, which the rows carry; a backend may read its
        local experts' received counts back with the rows (the rows may then omit the block)."""
        return None

    def encode_row(
        self,
        header: CallHeader,
        checks: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        num_tokens: int = 0,
        experts: DispatchExperts | None = None,
    ) -> torch.Tensor:
        """This rank's row of the call header (``agreement.encode_row``, which defines it), on
        this backend's device."""
        return encode_row(
            header, self.topology.num_ranks, self.device, checks, counts, num_tokens, experts
        )

    def exchange_header_async(
        self, row: torch.Tensor, call: str, experts: DispatchExperts | None = None
    ) -> None:
        """``exchange_header`` without reading the rows back (``agrees_on_device``);
        ``experts`` as there (a backend may sum its local experts' counts on the device)."""
        raise UnsupportedError(
            f"{call}: the {self.name} backend checks call headers on the host "
            "(agrees_on_device is False); use exchange_header"
        )

    def gather_objects(self, obj: Any, call: str) -> list[Any]:
        """Every rank's picklable ``obj`` (the error path of the header exchange)."""
        if self.comm is not None:
            return self.comm.all_gather_object(obj, call)
        out: list[Any] = [None] * self.topology.num_ranks
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def abort_peers(self, call: str, error: BaseException) -> None:  # noqa: B027 - optional hook
        """This rank's own checks rejected ``call`` before it launched anything: tell the peers
        that wait for it in that call, so they raise ``error``'s class naming this rank at once
        instead of timing out. Backends that agree on every call's header (their peers learn
        of the error from the exchange) need nothing here."""

    def destroy(self, collective: bool = True) -> None:  # noqa: B027 - optional hook
        """Release backend resources; the default holds none. ``collective``: every rank calls
        it together (``Buffer.destroy()``); ``False`` from ``__del__``, where peers may not."""


def check_expert_ids(lo: int, hi: int, num_experts: int) -> None:
    """Raise ``InvalidInputError`` unless every id lies in [-1, num_experts)."""
    if lo < -1 or hi >= num_experts:
        bad = lo if lo < -1 else hi
        raise InvalidInputError(
            f"topk_idx contains expert id {bad}; ids must be in [0, {num_experts}) or -1 for an "
            "unused slot"
        )


def routing_check(
    given: Layout,
    true: Layout | None,
    topk_idx: torch.Tensor | None,
    topology: Topology,
) -> torch.Tensor:
    """``[id min, id max, layout bits]`` (int64, on the tensors' device, no host sync).

    ``given`` is the caller's layout, ``true`` the one ``get_dispatch_layout(topk_idx, E)``
    computes for the same ids (``None`` without ``topk_idx``: then only what
    ``is_token_in_rank`` fixes is compared, and per-expert counts only for sign and against
    the rank counts). Bits as in ``agreement.LAYOUT_BITS``; (0, -1) bounds when there are no
    ids. Valid ids are assumed for the comparison: callers check the bounds first.
    """
    dev = given.is_token_in_rank.device

    def differ(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        if a is None or b is None:
            return torch.zeros((), dtype=torch.bool, device=dev)
        return (a.to(torch.int64) != b.to(torch.int64)).any()

    if topk_idx is not None and topk_idx.numel():
        lo, hi = torch.aminmax(topk_idx.to(torch.int64))
    else:
        lo = torch.zeros((), dtype=torch.int64, device=dev)
        hi = torch.full((), -1, dtype=torch.int64, device=dev)
    in_rank = given.is_token_in_rank
    if true is not None:
        mismatch = [
            differ(given.num_tokens_per_rank, true.num_tokens_per_rank),
            differ(given.num_tokens_per_rdma_rank, true.num_tokens_per_rdma_rank),
            differ(given.num_tokens_per_expert, true.num_tokens_per_expert),
            differ(given.is_token_in_rank, true.is_token_in_rank),
        ]
        dup = torch.zeros((), dtype=torch.bool, device=dev)
        if topk_idx is not None and topk_idx.shape[1] > 1 and topk_idx.numel():
            s = topk_idx.sort(dim=1).values
            dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()
        mismatch.append(dup)
    else:
        per_rank = in_rank.sum(0, dtype=torch.int64)
        rdma = None
        if topology.num_nodes > 1:
            per_node = in_rank.view(-1, topology.num_nodes, topology.ranks_per_node).any(2)
            rdma = per_node.sum(0, dtype=torch.int64)
        per_expert = given.num_tokens_per_expert.to(torch.int64)
        groups = per_expert.view(topology.num_ranks, -1).sum(1)
        mismatch = [
            differ(given.num_tokens_per_rank, per_rank),
            differ(given.num_tokens_per_rdma_rank, rdma),
            (per_expert < 0).any() | (groups < per_rank).any(),
            torch.zeros((), dtype=torch.bool, device=dev),
            torch.zeros((), dtype=torch.bool, device=dev),
        ]
    # Bit i of the word is mismatch[i] (built on the device: a host tensor would sync).
    weights = torch.pow(2, torch.arange(len(mismatch), dtype=torch.int64, device=dev))
    bits = (torch.stack(mismatch).to(torch.int64) * weights).sum()
    return torch.stack([lo.to(torch.int64), hi.to(torch.int64), bits])

"""The call header of an internode call (``agreement.py``): all-gathered over NCCL on the
device, read back on the host (exact mode) or checked on the GPU (sync-free mode).

An exact dispatch's rows carry every rank's per-expert counts too: the host reads the rows
without that block plus this rank's local experts' received counts, summed on the device (never
the ``[R, E]`` counts themselves), so the dispatch has one exchange and one read. One launch
writes what the host reads into pinned host memory (``_read_header``), so the read is a wait for
the stream, with no copy.

``CallHeaderExchange`` is a mixin of ``InternodeBackend``: it uses the backend's ``topology``,
``group``, ``device``, ``_timeout_ms`` and ``check()``, and keeps the rows of the current call
(and the local expert counts read with them) until its dispatch or combine takes them
(``_take_rows``)."""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from uccl_ep_megatron.backends.agreement import (
    COUNTS_COLUMN,
    EXPERT_SLOTS,
    EXPERTS_COLUMN,
    KIND_DISPATCH,
    VERDICTS,
    CallHeader,
    DispatchExperts,
    header_words,
    host_part,
    local_expert_counts,
    row_width,
    timeout_error,
    verdict_columns,
    verdict_message,
    wait_stream,
    wait_work,
)
from uccl_ep_megatron.core.errors import InvalidInputError, UcclEpError

_W_FIELD = list(CallHeader.__dataclass_fields__).index("num_worst_tokens")
_KIND_FIELD = list(CallHeader.__dataclass_fields__).index("kind")
_CHECK_WORDS = EXPERTS_COLUMN - len(CallHeader.__dataclass_fields__)


def _carried_experts_per_rank(experts: DispatchExperts | None, num_ranks: int) -> int:
    """Experts per rank of a dispatch whose rows carry its per-expert counts (the local
    counts are then summed from the rows), else 0."""
    if experts is None or not experts.carried or experts.num_experts % num_ranks:
        return 0
    return experts.num_experts // num_ranks


class ExpertCounts(NamedTuple):
    """Rows this rank receives per local expert, rounded up to the dispatch's alignment."""

    host: list[int]
    device: torch.Tensor  # int32 [experts per rank]


class TakenRows(NamedTuple):
    """What the exchange of the current call left for its dispatch or combine."""

    rows: torch.Tensor  # int64 [R, width] on the device
    verdict: torch.Tensor | None  # the GPU verdict of a sync-free call
    experts: ExpertCounts | None  # read with the rows (an exact dispatch whose rows carry them)


class CallHeaderExchange:
    """The header exchange of a backend that checks call headers on the device."""

    def _init_header_exchange(self) -> None:
        self._call = ""
        # Set when a bounded wait expired: the collective may still be pending, so the
        # backend refuses further calls (``check``).
        self._broken = ""
        # The all-gathered call-header rows of the current call (device) and, for a sync-free
        # call, the GPU verdict on them that its kernels read.
        self._rows: torch.Tensor | None = None
        self._verdict: torch.Tensor | None = None
        self._experts: ExpertCounts | None = None
        # Pinned host words the exact calls' header reads land in (``_read_header``).
        self._read_host: torch.Tensor | None = None
        # The process group's own all-gather into one tensor, found at the first exchange.
        self._all_gather: Any = None
        self._gather_blocks = False  # set with _all_gather: the group's wait blocks the host
        self._gather_opts = AllgatherOptions()
        if hasattr(self._gather_opts, "asyncOp"):  # as the wrapper sets it (torch 2.6+)
            self._gather_opts.asyncOp = False

    def encode_row(
        self,
        header: CallHeader,
        checks: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
        num_tokens: int = 0,
        experts: DispatchExperts | None = None,
    ) -> torch.Tensor:
        """``agreement.encode_row`` in one launch (``_C.internode.encode_row``): the host words
        travel as kernel parameters, with no staging copy and no small torch ops."""
        row = torch.empty(row_width(self.topology.num_ranks), dtype=torch.int64, device=self.device)
        per_expert = experts.counts if experts is not None and experts.carried else None
        self._in.encode_row(
            self._stream(),
            header_words(header) + [num_tokens],
            _CHECK_WORDS,
            EXPERT_SLOTS,
            row,
            self._on_device(checks, (torch.int64,)),
            self._on_device(counts),
            self._on_device(per_expert),
        )
        return row

    def _on_device(
        self, t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64)
    ) -> torch.Tensor | None:
        """``t`` as the row kernel reads it: contiguous, on this GPU, of one of ``dtypes``."""
        if t is None:
            return None
        if not (t.is_cuda and t.get_device() == self._dev_index and t.is_contiguous()):
            t = t.to(device=self.device).contiguous()
        return t if t.dtype in dtypes else t.to(torch.int64)

    def _gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """All-gather of one int64 row per rank into ``[R, width]`` on the device: no host
        wait with NCCL (the stream waits); a gloo group (ranks sharing a GPU) waits on the
        host, at most UCCL_EP_TIMEOUT_MS."""
        num_ranks = self.topology.num_ranks
        out = torch.empty(num_ranks * row.numel(), dtype=torch.int64, device=self.device)
        if self._all_gather is None:
            # ``all_gather_single`` (``_allgather_base`` before torch 2.12): what the
            # torch.distributed wrapper calls after argument checks that cost about as much
            # host time as the collective's launch, twice per dispatch/combine pair.
            group = self.group if self.group is not None else dist.group.WORLD
            self._all_gather = getattr(group, "all_gather_single", None) or group._allgather_base
            # "gloo", or "cpu:gloo,cuda:nccl" for a group made without a backend: CUDA rows
            # go through NCCL there.
            self._gather_blocks = "nccl" not in str(dist.get_backend(group))
        if row.dtype != torch.int64 or not row.is_contiguous():  # not encode_row's rows
            row = row.to(torch.int64).contiguous()
        work = self._all_gather(out, row, self._gather_opts)
        if work is not None:
            if self._gather_blocks:
                # gloo stages the rows through the host and its wait blocks until every rank
                # joined (gloo's own limit is minutes): bounded as the exact-mode read is.
                what = "the call-header all-gather"
                wait_work(work, self._timeout_ms, lambda: self._expired(what, self._call))
            else:
                work.wait()
        return out.view(num_ranks, -1)

    def _expired(self, what: str, call: str) -> UcclEpError:
        """The error of a bounded wait of ``call`` that expired; the Buffer is unusable from
        now on (the collective may still be pending on the group)."""
        cause = self._own_failure()
        self._broken = f"{what} of {call} timed out"
        if cause is not None:
            # This rank's own proxy or kernels failed (e.g. a NIC completion error): that,
            # not "another rank", is why the exchange could not complete.
            return type(cause)(f"{cause} ({what} of {call} could not complete after it)")
        return timeout_error(self.topology.rank, what, call, self._timeout_ms)

    def _read(self, t: torch.Tensor, what: str, call: str) -> list[Any]:
        """``t`` on the host, waiting for the stream at most UCCL_EP_TIMEOUT_MS."""
        wait_stream(self._timeout_ms, lambda: self._expired(what, call))
        return t.tolist()

    def _own_failure(self) -> UcclEpError | None:
        """The failure this rank's proxy or kernels recorded, if any, waiting a short grace for
        a kernel wait that expires about now (it started before the exchange did)."""
        deadline = time.monotonic() + min(1.0, self._timeout_ms / 4000)
        while True:
            try:
                self.check()
            except UcclEpError as exc:
                return exc
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def exchange_header(
        self, row: torch.Tensor, call: str, experts: DispatchExperts | None = None
    ) -> list[list[int]]:
        """Every rank's row without its per-expert block, read in one copy together with this
        rank's local expert counts when ``experts`` are carried (kept for ``_take_rows``)."""
        self.check()
        self._call = call
        # Stream-ordered: every rank's previous kernels finished (all rings drained) before our
        # next kernel starts.
        self._rows = rows = self._gather_rows(row)
        self._verdict = None
        values, local = self._read_header(rows, experts, call)
        num_ranks = rows.shape[0]
        n = len(values) - (0 if local is None else local.numel())
        width = n // num_ranks
        self._experts = None if local is None else ExpertCounts(values[n:], local)
        rows_host = [values[r * width : (r + 1) * width] for r in range(num_ranks)]
        worst = {r[_W_FIELD] for r in rows_host if r[_KIND_FIELD] == KIND_DISPATCH}
        if len(worst) > 1:
            # A rank that passed num_worst_tokens > 0 checks on the GPU and skips the call.
            first = rows_host[0][_W_FIELD]
            rank = next(i for i, r in enumerate(rows_host) if r[_W_FIELD] != first)
            value = rows_host[rank][_W_FIELD]
            raise InvalidInputError(
                f"{call}: " + verdict_message(VERDICTS.index("worst_differs") + 1, rank, value)
            )
        return rows_host

    def _read_header(
        self, rows: torch.Tensor, experts: DispatchExperts | None, call: str
    ) -> tuple[list[int], torch.Tensor | None]:
        """``_host_part_and_counts`` of ``rows`` on the host, and the local expert counts on the
        device: on a GPU one launch (``_C.internode.header_read``) writes them into pinned host
        memory, so the read is a wait for the stream and no copy (about ten torch ops and a
        device-to-host copy fewer per exact call); rows on the CPU (tests) take the torch form."""
        if not rows.is_cuda:
            read, local = self._host_part_and_counts(rows, experts)
            return self._read(read, "the call-header exchange", call), local
        num_ranks = rows.shape[0]
        epr = _carried_experts_per_rank(experts, num_ranks)
        words = (rows.shape[1] - (COUNTS_COLUMN - EXPERTS_COLUMN)) * num_ranks + epr
        if self._read_host is None or self._read_host.numel() < words:
            self._read_host = torch.empty(max(words, 1024), dtype=torch.int64, pin_memory=True)
        local = torch.empty(epr, dtype=torch.int32, device=rows.device) if epr else None
        self._in.header_read(
            self._stream(),
            rows,
            self._read_host,
            local,
            EXPERTS_COLUMN,
            COUNTS_COLUMN,
            self.topology.rank,
            experts.alignment if epr else 1,
        )
        wait_stream(self._timeout_ms, lambda: self._expired("the call-header exchange", call))
        return self._read_host[:words].tolist(), local

    def _host_part_and_counts(
        self, rows: torch.Tensor, experts: DispatchExperts | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the host reads of ``rows`` (flat, on the device): the rows without their
        per-expert block, then, when the rows carry ``experts``, this rank's local expert
        counts; and those counts as the int32 device tensor of the dispatch's outputs (the
        definition of ``_C.internode.header_read``)."""
        num_ranks = rows.shape[0]
        epr = _carried_experts_per_rank(experts, num_ranks)
        if not epr:
            return host_part(rows).view(-1), None
        host = (rows.shape[1] - (COUNTS_COLUMN - EXPERTS_COLUMN)) * num_ranks
        read = torch.empty(host + epr, dtype=torch.int64, device=rows.device)
        host_part(rows, out=read[:host].view(num_ranks, -1))
        rank = self.topology.rank
        local = local_expert_counts(rows, rank, epr, experts.alignment, out=read[host:])
        return read, local.to(torch.int32)

    def exchange_header_async(
        self, row: torch.Tensor, call: str, experts: DispatchExperts | None = None
    ) -> None:
        """The call header of a sync-free call: all-gathered and checked on the GPU; the
        verdict travels to this call's kernels, which record a rejection in the status words
        (raised by ``check`` at the next host-visible point) and move nothing. When the rows
        carry a dispatch's per-expert counts (``experts``), the same launch sums this rank's
        local experts' received counts (``local_expert_counts``), kept for ``_take_rows``.

        No host wait is needed between calls: the all-gather is stream-ordered like exact
        mode's, so a rank's kernels of this call start only after every rank's kernels of the
        previous call finished (each rank's contribution leaves after its own previous work).
        What can still be in flight are the proxies' last head increments of that call (its
        tails and end markers were awaited by the call itself); counters are cumulative and a
        sender only waits for room, so late increments only delay the next call's senders
        (tests/test_internode_protocol.py holds them back into the next call)."""
        self.check()
        self._call = call
        self._rows = self._gather_rows(row)
        epr = _carried_experts_per_rank(experts, self.topology.num_ranks)
        # device_verdict's checks in one launch (its torch form is the definition), and the
        # local expert counts in the words after the verdict's three.
        words = torch.empty(3 + (epr + 1) // 2, dtype=torch.int64, device=self.device)
        self._verdict = words[:3]
        local = words[3:].view(torch.int32)[:epr] if epr else None
        self._in.call_verdict(
            self._stream(),
            self._rows,
            self._verdict,
            verdict_columns(),
            local,
            self.topology.rank,
            experts.alignment if epr else 1,
        )
        self._experts = None if local is None else ExpertCounts([], local)

    def _take_rows(self) -> TakenRows:
        if self._rows is None:
            raise UcclEpError(
                f"internode {self._call or 'call'}: no call header was exchanged for it; call "
                "through Buffer, which exchanges one before every dispatch and combine"
            )
        taken = TakenRows(self._rows, self._verdict, self._experts)
        self._rows = self._verdict = self._experts = None
        return taken

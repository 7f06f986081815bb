"""The call header of an internode call (``agreement.py``): all-gathered over NCCL on the
device, read back on the host (exact mode) or checked on the GPU (sync-free mode).

``CallHeaderExchange`` is a mixin of ``InternodeBackend``: it uses the backend's ``topology``,
``group``, ``device``, ``_timeout_ms`` and ``check()``, and keeps the rows of the current call
until its dispatch or combine takes them (``_take_rows``)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.agreement import (
    KIND_DISPATCH,
    VERDICTS,
    CallHeader,
    timeout_error,
    verdict_columns,
    verdict_message,
    wait_stream,
)
from uccl_ep_megatron.core.errors import InvalidInputError, UcclEpError

_W_FIELD = list(CallHeader.__dataclass_fields__).index("num_worst_tokens")
_KIND_FIELD = list(CallHeader.__dataclass_fields__).index("kind")


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

    def _gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """All-gather of one int64 row per rank into ``[R, width]`` on the device (no sync)."""
        num_ranks = self.topology.num_ranks
        out = torch.empty(num_ranks * row.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(out, row.to(torch.int64).contiguous(), group=self.group)
        return out.view(num_ranks, -1)

    def _read(self, t: torch.Tensor, what: str, call: str) -> list[Any]:
        """``t`` on the host, waiting for the stream at most UCCL_EP_TIMEOUT_MS."""

        def expired() -> UcclEpError:
            cause = self._own_failure()
            self._broken = f"{what} of {call} timed out"
            if cause is not None:
                # This rank's own proxy or kernels failed (e.g. a NIC completion error): that,
                # not "another rank", is why the exchange could not complete.
                return type(cause)(f"{cause} ({what} of {call} could not complete after it)")
            return timeout_error(self.topology.rank, what, call, self._timeout_ms)

        wait_stream(self._timeout_ms, expired)
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

    def exchange_header(self, row: torch.Tensor, call: str) -> list[list[int]]:
        self.check()
        self._call = call
        # Stream-ordered: every rank's previous kernels finished (all rings drained) before our
        # next kernel starts.
        self._rows = self._gather_rows(row)
        self._verdict = None
        rows = self._read(self._rows, "the call-header exchange", call)
        worst = {r[_W_FIELD] for r in rows if r[_KIND_FIELD] == KIND_DISPATCH}
        if len(worst) > 1:
            # A rank that passed num_worst_tokens > 0 checks on the GPU and skips the call.
            rank = next(i for i, r in enumerate(rows) if r[_W_FIELD] != rows[0][_W_FIELD])
            raise InvalidInputError(
                f"{call}: "
                + verdict_message(VERDICTS.index("worst_differs") + 1, rank, rows[rank][_W_FIELD])
            )
        return rows

    def exchange_header_async(self, row: torch.Tensor, call: str) -> None:
        """The call header of a sync-free call: all-gathered and checked on the GPU; the
        verdict travels to this call's kernels, which record a rejection in the status words
        (raised by ``check`` at the next host-visible point) and move nothing.

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
        # device_verdict's checks in one launch (its torch form is the definition).
        self._verdict = torch.empty(3, dtype=torch.int64, device=self.device)
        self._in.call_verdict(self._stream(), self._rows, self._verdict, verdict_columns())

    def _take_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._rows is None:
            raise UcclEpError(
                f"internode {self._call or 'call'}: no call header was exchanged for it; call "
                "through Buffer, which exchanges one before every dispatch and combine"
            )
        rows, verdict = self._rows, self._verdict
        self._rows = self._verdict = None
        return rows, verdict

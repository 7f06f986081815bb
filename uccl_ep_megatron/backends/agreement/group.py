"""The channel a ``Buffer``'s per-call exchanges run over, and bounded waits on it.

A wait that gives up must not leave a collective posted where someone else will post the next
one: gloo matches operations by their order on a group, so the first collective a rank posts
after abandoning one meets the peer's copy of the abandoned one, and gloo aborts the process
("Received data size doesn't match expected size"). So a ``Buffer`` over a gloo group runs
its collectives on a group of its own (``ProcessGroupGloo`` over the default store, created by
the construction exchange): a timed-out wait then breaks only that Buffer, never the caller's
process group. NCCL cannot cancel a queued collective either, and a second NCCL communicator
per Buffer costs GPU memory, so over NCCL the Buffer uses the caller's group and a timed-out
wait marks that group unusable: every later ``Buffer`` on it raises at once, saying to create
a new process group.

Waits are sliced: the first slice covers a call whose peers are already there at no cost;
past it the rank posts where it waits in the store and checks, every slice, whether a peer
gave up on this Buffer, whether a peer on this host has died, and whether a peer waits in a
call of another Buffer. Each of these raises at once, naming the rank; only a peer that is
alive but elsewhere costs the whole ``UCCL_EP_TIMEOUT_MS``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError, UcclEpError

_SLICE_S = 0.2  # a call whose peers are all there completes in the first slice
# Groups (by name) whose NCCL communicator holds a collective this package gave up waiting for.
_POISONED: dict[str, str] = {}
# Private groups of broken Buffers: destroying one joins its worker threads, which wait for
# the abandoned collective until gloo's own timeout; kept here so no destructor blocks.
_ABANDONED: list[Any] = []


@dataclasses.dataclass(frozen=True)
class Peer:
    """What a rank tells the others at construction."""

    host: str
    gpu: str | None  # the GPU's UUID (None on CPU)
    pid: int
    # The environment that must agree: it shapes the layout every rank assumes.
    ranks_per_node: str | None  # ranks per node as set (option or variable; None: unset or 0)

    @staticmethod
    def here(gpu: str | None, ranks_per_node: int | None = None) -> Peer:
        """This rank; ``ranks_per_node``: the Buffer's resolved option (0 or None: unset;
        None also falls back to the variable as set)."""
        if ranks_per_node is None:
            raw = os.environ.get("UCCL_EP_RANKS_PER_NODE", "").strip()
        else:
            raw = str(ranks_per_node)
        return Peer(socket.gethostname(), gpu, os.getpid(), raw if raw not in ("", "0") else None)


def poisoned_reason(group: dist.ProcessGroup) -> str | None:
    """Why ``group`` is unusable (a collective this package abandoned is queued on it)."""
    return _POISONED.get(_group_name(group))


def _group_name(group: dist.ProcessGroup) -> str:
    return str(getattr(group, "group_name", "") or id(group))


def pid_gone(pid: int) -> bool:
    """The process ``pid`` of this host has exited (or is a zombie waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


class BufferGroup:
    """A Buffer's own channel: its collectives, the store its ranks meet in, and its peers.

    Args:
        group: the caller's process group.
        store: the default store; ``prefix`` is this Buffer's namespace in it.
        buffer_id: the number every rank of the group gave this construction (agreed).
        peers: every rank's ``Peer``.
        timeout_ms: ``UCCL_EP_TIMEOUT_MS``.
        private: run collectives on a gloo group of this Buffer's own (gloo groups).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        store: Any,
        prefix: str,
        buffer_id: int,
        peers: list[Peer],
        timeout_ms: int,
        private: bool,
    ) -> None:
        self.group = group
        self.store = store
        self.prefix = prefix
        self.buffer_id = buffer_id
        self.peers = peers
        self.timeout_ms = timeout_ms
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._waiting_prefix = prefix.rsplit("/", 1)[0] + "/waiting"
        self.broken = ""
        self._own = private and self.size > 1
        self._cuda = not self._own and _object_device(group).type == "cuda"
        self._pg = None
        if self._own:
            self._pg = _private_group(store, prefix, self.rank, self.size, timeout_ms)

    @property
    def private(self) -> bool:
        """Collectives run on a group of this Buffer's own (the caller's group over NCCL)."""
        return self._own

    # ---- collectives (start them; ``wait`` bounds them) ------------------------------------
    def all_gather(self, t: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        self.check_usable()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        if self._pg is not None:
            return self._pg.allgather([parts], [t.contiguous()]), parts
        return dist.all_gather(parts, t.contiguous(), group=self.group, async_op=True), parts

    def all_to_all_single(
        self, recv: torch.Tensor, send: torch.Tensor, recv_counts: list[int], send_counts: list[int]
    ) -> Any:
        self.check_usable()
        if self._pg is not None:
            opts = dist.AllToAllOptions()
            return self._pg.alltoall_base(recv, send.contiguous(), recv_counts, send_counts, opts)
        return dist.all_to_all_single(
            recv,
            send.contiguous(),
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=self.group,
            async_op=True,
        )

    def all_gather_object(self, obj: Any, call: str) -> list[Any]:
        """Every rank's picklable ``obj``, each step bounded like any other wait."""
        device = torch.device("cpu") if self._own else _object_device(self.group)
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        work, sizes = self.all_gather(torch.tensor([data.numel()], device=device))
        self.wait(work, "the exchange of error texts", call)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        work, parts = self.all_gather(padded)
        self.wait(work, "the exchange of error texts", call)
        return [
            pickle.loads(p[: int(s.item())].cpu().numpy().tobytes())
            for p, s in zip(parts, sizes, strict=True)
        ]

    # ---- bounded waits -----------------------------------------------------------------------
    def check_usable(self) -> None:
        if self.broken:
            raise UcclEpError(f"this Buffer is unusable: {self.broken}; {self._advice()}")

    def wait(self, work: Any, what: str, call: str) -> None:
        """Wait for ``work`` (a collective of this channel), bounded by ``UCCL_EP_TIMEOUT_MS``;
        raise at once when a peer is known dead, gave up, or waits in another Buffer."""
        self.check_usable()
        deadline = time.monotonic() + self.timeout_ms / 1e3
        posted = False
        try:
            if self._cuda:
                # NCCL orders the current stream after the collective; the host polls an event.
                work.wait()
                work = torch.cuda.Event()
                work.record()
            while not self._wait_slice(work, min(_SLICE_S, self.timeout_ms / 1e3), what, call):
                if not posted:
                    self._post_waiting(call)
                    posted = True
                problem = self._diagnose(what, call)
                if problem is None and time.monotonic() > deadline:
                    problem = self._timed_out(what, call)
                if problem is not None:
                    raise problem
        except BaseException as exc:
            if not self.broken:
                cls = "PeerLost" if getattr(exc, "peer_lost", False) else "UcclEpError"
                self._give_up(_reason(self.rank, what, call, exc, self.timeout_ms), cls)
            self._abandon()
            raise
        finally:
            if posted:
                self._clear_waiting()

    def _wait_slice(self, work: Any, seconds: float, what: str, call: str) -> bool:
        """One slice of the wait: ``True`` once the collective (or, over NCCL, the event
        recorded after it) completed."""
        if self._cuda:
            end = time.monotonic() + seconds
            while not work.query():
                if time.monotonic() > end:
                    return False
                time.sleep(50e-6)
            return True
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
            return True
        except RuntimeError as exc:
            if not work.is_completed():
                return False
            error = exc
        # The slice ran out just before the collective completed ("Operation timed out!", then
        # completed), or it failed: a second wait returns at once, or raises its own error.
        try:
            work.wait()
            return True
        except RuntimeError as exc:
            error = exc
        raise self._failed(what, call, error) from error

    def _failed(self, what: str, call: str, error: BaseException) -> UcclEpError:
        """The collective failed: a peer's connection closed. Say which rank and why."""
        # A peer's sockets close while its process is torn down, a moment before the process
        # is gone from the process table: give a same-host peer that moment.
        # A peer that destroyed its Buffer says so in the store first (not a lost peer's guess).
        bounded(1000, lambda: bool(self.dead_ranks()) or self._told(), sleep_s=0.01)
        known = self._diagnose(what, call)
        if known is not None:
            return known
        lost = UcclEpError(
            f"rank {self.rank}: {what} of {call} failed: a peer closed its connection (its "
            f"process exited on another host, or the host is unreachable): {error}. This Buffer "
            f"is unusable; {self._advice()}"
        )
        lost.peer_lost = True  # what this rank tells the others is a guess: see _told
        return lost

    def _told(self) -> bool:
        """A peer marked this Buffer broken for a reason it knows (not a lost connection)."""
        key = self.prefix + "/broken"
        return self.store.check([key]) and not self.store.get(key).startswith(b"PeerLost|")

    def dead_ranks(self) -> list[int]:
        """Ranks on this host whose process has exited."""
        host = socket.gethostname()
        return [
            r
            for r, p in enumerate(self.peers)
            if r != self.rank and p.host == host and pid_gone(p.pid)
        ]

    # ---- what the store tells ------------------------------------------------------------
    def _post_waiting(self, call: str) -> None:
        self.store.set(f"{self._waiting_prefix}/{self.rank}", f"{self.buffer_id}|{call}")

    def _clear_waiting(self) -> None:
        try:
            self.store.set(f"{self._waiting_prefix}/{self.rank}", "")
        except Exception:  # noqa: BLE001 - a store that went away has nothing left to clear
            pass

    def _waiting(self) -> dict[int, tuple[int, str]]:
        """Where each peer waits (Buffer id, call), for those that posted it."""
        keys = [f"{self._waiting_prefix}/{r}" for r in range(self.size)]
        out = {}
        for r, key in enumerate(keys):
            if r == self.rank or not self.store.check([key]):
                continue
            text = self.store.get(key).decode()
            if text:
                buffer_id, call = text.split("|", 1)
                out[r] = (int(buffer_id), call)
        return out

    def _diagnose(self, what: str, call: str) -> UcclEpError | None:
        dead = self.dead_ranks()  # the root cause when there is one
        if dead:
            return UcclEpError(
                f"rank {self.rank}: {what} of {call} cannot complete: rank(s) {dead} exited "
                f"(their processes are gone). This Buffer is unusable; {self._advice()}"
            )
        key = self.prefix + "/broken"
        if self.store.check([key]):
            cls_name, reason = self.store.get(key).decode().split("|", 1)
            self.broken = reason
            cls = InvalidInputError if cls_name == "InvalidInputError" else UcclEpError
            return cls(
                f"rank {self.rank}: {what} of {call} cannot complete: {reason}. This Buffer is "
                f"unusable; {self._advice()}"
            )
        elsewhere = {r: w for r, w in self._waiting().items() if w[0] != self.buffer_id}
        if not elsewhere:
            return None
        where = "; ".join(
            f"rank {r} waits in {c} of Buffer #{b}" for r, (b, c) in elsewhere.items()
        )
        reason = (
            f"rank {self.rank} waits in {call} of Buffer #{self.buffer_id} while {where}: the "
            "ranks call their Buffers in different orders. Every rank must call the Buffers of "
            "a group in the same order"
        )
        # The peers may stop waiting before they look: tell them through their Buffers too.
        for b in {b for b, _ in elsewhere.values()}:
            self._mark_broken(
                f"{self.prefix.rsplit('/', 1)[0]}/buffer{b}", reason, "InvalidInputError"
            )
        self._give_up(reason, "InvalidInputError")
        return InvalidInputError(f"{reason}. This Buffer is unusable; {self._advice()}")

    def _timed_out(self, what: str, call: str) -> CommTimeoutError:
        here = self._waiting()
        missing = [
            r for r in range(self.size) if r != self.rank and here.get(r, (0, ""))[1] != call
        ]
        nowhere = "not in any call of this group"
        detail = ", ".join(
            f"rank {r} ({'waits in ' + here[r][1] if r in here else nowhere})" for r in missing
        )
        return CommTimeoutError(
            f"rank {self.rank}: {what} of {call} (Buffer #{self.buffer_id}) did not complete "
            f"within UCCL_EP_TIMEOUT_MS={self.timeout_ms} ms: {detail or 'no rank'} did not "
            "reach it (a rank that raised before the call, skipped it, destroyed its Buffer or "
            "is stuck elsewhere; raise UCCL_EP_TIMEOUT_MS if it is only slow). This Buffer is "
            f"unusable; {self._advice()}"
        )

    def _give_up(self, reason: str, cls_name: str = "UcclEpError") -> None:
        """Mark this Buffer broken for every rank; a gloo group of its own is never used again."""
        self.broken = reason
        self._mark_broken(self.prefix, reason, cls_name)
        self._abandon()

    def _abandon(self) -> None:
        """This rank leaves a collective posted: never touch its group again."""
        if self._own:
            if self._pg is not None:
                _ABANDONED.append(self._pg)
            self._pg = None
        elif self.broken:
            _POISONED.setdefault(_group_name(self.group), self.broken)

    def _mark_broken(self, prefix: str, reason: str, cls_name: str) -> None:
        try:
            self.store.compare_set(prefix + "/broken", "", f"{cls_name}|{reason}")
        except Exception:  # noqa: BLE001 - peers then find out by their own timeout
            pass

    def _advice(self) -> str:
        if self._own:
            return (
                "the process group is not affected (this Buffer's collectives run on a group of "
                "its own): create a new Buffer on every rank"
            )
        return (
            "its process group is unusable too (NCCL cannot cancel the collective still queued "
            "on it): destroy it and create a new process group (torch.distributed.new_group, or "
            "destroy_process_group + init_process_group), or restart the job"
        )

    def close(self) -> None:
        """Release the private group (nothing is pending on it unless the Buffer broke). Peers
        still in a call of this Buffer then fail at once, and read why here."""
        if not self.broken and not sys.is_finalizing():
            self.broken = f"rank {self.rank} destroyed its Buffer #{self.buffer_id}"
            self._mark_broken(self.prefix, self.broken, "UcclEpError")
        self._pg = None


def _private_group(store: Any, prefix: str, rank: int, size: int, timeout_ms: int) -> Any:
    """A gloo group of the Buffer's ranks, connected on all of them before any returns.

    gloo's constructor returns once this rank's pairs are up; a rank that then dropped the
    group at once (a Buffer made and destroyed) closed connections a slower peer was still
    handshaking on, and that peer's connect failed. So each rank reports in the store and
    waits for all; should a connect fail anyway, every rank drops its group and all try again
    on fresh keys."""
    timeout = datetime.timedelta(milliseconds=2 * timeout_ms)
    error = ""
    for attempt in range(3):
        base = f"{prefix}/pg{attempt}"
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(base + "/", store), rank, size, timeout)
            store.set(f"{base}/ok/{rank}", "1")
        except RuntimeError as exc:
            pg, error = None, str(exc)
            store.set(f"{base}/failed", f"rank {rank}: {exc}")
        oks = [f"{base}/ok/{r}" for r in range(size)]
        failed = [f"{base}/failed"]
        # Each rank writes one of the two keys, so "all ok" means nobody failed.
        if not bounded(timeout_ms, lambda o=oks, f=failed: store.check(o) or store.check(f)):
            raise CommTimeoutError(
                f"rank {rank}: Buffer construction: the ranks did not all connect the Buffer's "
                f"gloo group within UCCL_EP_TIMEOUT_MS={timeout_ms} ms (a rank exited?)"
            )
        if store.check(oks):
            return pg
        error = error or store.get(failed[0]).decode()
    raise UcclEpError(f"Buffer construction: the Buffer's gloo group did not connect: {error}")


def _reason(rank: int, what: str, call: str, exc: BaseException, timeout_ms: int) -> str:
    """What a rank that gives up on a wait tells its peers."""
    if isinstance(exc, CommTimeoutError):
        return f"rank {rank} gave up on {what} of {call} after UCCL_EP_TIMEOUT_MS={timeout_ms} ms"
    if isinstance(exc, UcclEpError):
        return f"rank {rank} abandoned {what} of {call}: {str(exc).split('. ', 1)[0]}"
    return f"rank {rank} was interrupted ({type(exc).__name__}) in {what} of {call}"


def _object_device(group: dist.ProcessGroup) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def bounded(timeout_ms: int, fn: Callable[[], bool], sleep_s: float = 0.002) -> bool:
    """Poll ``fn`` until it returns ``True`` or ``timeout_ms`` pass; whether it did."""
    deadline = time.monotonic() + timeout_ms / 1e3
    while not fn():
        if time.monotonic() > deadline:
            return False
        time.sleep(sleep_s)
        sleep_s = min(2 * sleep_s, 0.05)
    return True

"""Peer liveness: learn at once that a peer rank's process has exited.

Kernels that wait for a dead peer would otherwise spin until ``UCCL_EP_TIMEOUT_MS``: a process
that is gone never signals and never posts an abort record. Ranks that share this host and
pid namespace can watch each other's processes through pidfds (Linux 5.3+): one daemon thread
per watcher blocks in ``poll`` on them (no CPU while every peer lives) and on a wake pipe for
shutdown, and calls back once per peer whose process exits.

Peers elsewhere (another host, another pid namespace: a container of its own) cannot be
watched this way; their death is still found by the timeout.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProcessIdentity:
    """What a peer needs to know to watch this process: its pid and where that pid means
    this process (the kernel's boot id: one host; the pid namespace's inode: one namespace)."""

    pid: int
    boot_id: str
    pid_ns: int


def process_identity() -> ProcessIdentity:
    """This process's identity (boot id and pid namespace empty/0 where /proc lacks them)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return ProcessIdentity(os.getpid(), boot_id, pid_ns)


def unwatchable_reason(own: ProcessIdentity, peer: ProcessIdentity) -> str | None:
    """Why ``peer``'s pid cannot be watched from ``own``'s process, or None when it can."""
    if not hasattr(os, "pidfd_open"):
        return "os.pidfd_open is unavailable (Linux 5.3+ and Python 3.9+ have it)"
    if not own.boot_id or not own.pid_ns or not peer.boot_id or not peer.pid_ns:
        return "/proc does not give the boot id or pid namespace"
    if peer.boot_id != own.boot_id:
        return "it runs on another host"
    if peer.pid_ns != own.pid_ns:
        return "it runs in another pid namespace"
    return None


class PeerWatcher:
    """Calls ``on_exit(rank, pid)`` once for each watched peer whose process exits, from a
    daemon thread; never for a live one. :meth:`close` stops the thread (joined) and closes
    the descriptors; no callback starts after it returns.

    Args:
        peers: rank -> pid of the processes to watch (on this host, in this pid namespace).
        on_exit: the callback; an exception it raises is logged, not propagated.
        name: the thread's name.
    """

    def __init__(
        self, peers: dict[int, int], on_exit: Callable[[int, int], None], name: str
    ) -> None:
        self._on_exit = on_exit
        self._fds: dict[int, tuple[int, int]] = {}  # fd -> (rank, pid)
        self._live = dict(peers)  # rank -> pid, until its exit is reported
        self._closed = False
        self._lock = threading.Lock()  # a callback and close() do not overlap
        self._owner = os.getpid()  # a forked child inherits the object, not the thread
        gone: list[tuple[int, int]] = []
        try:
            for rank, pid in peers.items():
                try:
                    self._fds[os.pidfd_open(pid)] = (rank, pid)
                except ProcessLookupError:
                    gone.append((rank, pid))  # exited already: report it from the thread
            self._wake_r, self._wake_w = os.pipe()
        except BaseException:
            for fd in self._fds:
                os.close(fd)
            raise
        self._thread = threading.Thread(target=self._run, args=(gone,), name=name, daemon=True)
        self._thread.start()

    @property
    def watched(self) -> list[int]:
        """The ranks still watched (those whose exit has not been reported)."""
        return sorted(self._live)

    def _run(self, gone: list[tuple[int, int]]) -> None:
        for rank, pid in gone:
            self._report(rank, pid)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for fd in list(self._fds):
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    return
                poller.unregister(fd)
                rank, pid = self._fds[fd]
                self._report(rank, pid)

    def _report(self, rank: int, pid: int) -> None:
        with self._lock:
            if self._closed:
                return
            self._live.pop(rank, None)
            try:
                self._on_exit(rank, pid)
            except Exception:  # noqa: BLE001 - a watcher thread has nobody to raise to
                log.exception("reporting the exit of rank %d (pid %d) failed", rank, pid)

    def close(self) -> None:
        """Stop watching: wake and join the thread (a callback under way finishes first),
        then close every descriptor. Idempotent. In a forked child (a data loader worker)
        it does nothing: the pipe is shared with the parent, whose thread must go on."""
        if os.getpid() != self._owner:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join()
        for fd in (*self._fds, self._wake_r, self._wake_w):
            os.close(fd)
        self._fds.clear()


def watch_peers(
    rank: int,
    identities: Sequence[ProcessIdentity],
    on_exit: Callable[[int, int], None],
    name: str,
) -> PeerWatcher | None:
    """A ``PeerWatcher`` over every peer of ``identities`` (indexed by rank) that this process
    can watch, or None when there is none. Each peer it cannot watch is named in a debug log
    line: its death is found by the timeout instead."""
    own = identities[rank]
    peers: dict[int, int] = {}
    for r, peer in enumerate(identities):
        if r == rank:
            continue
        why = unwatchable_reason(own, peer)
        if why is None:
            peers[r] = peer.pid
        else:
            log.debug(
                "rank %d: rank %d (pid %d) is not watched (%s); its exit is found by "
                "UCCL_EP_TIMEOUT_MS",
                rank,
                r,
                peer.pid,
                why,
            )
    if not peers:
        return None
    try:
        return PeerWatcher(peers, on_exit, name)
    except OSError as exc:  # pidfd_open refused (seccomp, an old kernel)
        log.debug(
            "rank %d: peers are not watched (%s); their exit is found by UCCL_EP_TIMEOUT_MS",
            rank,
            exc,
        )
        return None

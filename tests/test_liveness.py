"""The peer liveness watcher (``backends/liveness.py``) on real processes: a peer that is killed
or exits is reported once, with its rank and pid, within a bound far below any timeout; a live
peer never is; ``close`` joins the thread and closes its descriptors, and nothing is reported
after it. Which peers can be watched at all (host, pid namespace) is decided from the identity
each rank sends at construction."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from uccl_ep_megatron.backends.liveness import (
    PeerWatcher,
    ProcessIdentity,
    process_identity,
    unwatchable_reason,
    watch_peers,
)

pytestmark = pytest.mark.skipif(
    not hasattr(os, "pidfd_open") or not sys.platform.startswith("linux"),
    reason="pidfds are Linux 5.3+",
)

REPORT_S = 2.0  # the bound on a report (the machine may be loaded; the timeout is seconds)


def _child() -> subprocess.Popen:
    """A peer process: it lives until it is killed or reads a line."""
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE
    )


class _Reports:
    """The watcher's callback: what it was told, and when."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []
        self.cond = threading.Condition()

    def __call__(self, rank: int, pid: int) -> None:
        with self.cond:
            self.calls.append((rank, pid, time.monotonic()))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout_s: float) -> None:
        with self.cond:
            self.cond.wait_for(lambda: len(self.calls) >= n, timeout=timeout_s)


@pytest.fixture
def children():
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_killed_peer_and_an_exiting_peer_are_reported_once_and_live_ones_never(children):
    children.extend(_child() for _ in range(3))
    reports = _Reports()
    watcher = PeerWatcher(
        {1: children[0].pid, 2: children[1].pid, 3: children[2].pid}, reports, "t"
    )
    try:
        time.sleep(0.2)
        assert reports.calls == [], "a live peer was reported"
        t0 = time.monotonic()
        children[1].send_signal(signal.SIGKILL)
        reports.wait_for(1, REPORT_S)
        assert [(r, p) for r, p, _ in reports.calls] == [(2, children[1].pid)], reports.calls
        assert reports.calls[0][2] - t0 < REPORT_S
        assert watcher.watched == [1, 3]
        # An ordinary exit, reaped by its parent before or after the report: reported too.
        children[0].communicate(b"\n", timeout=10)
        reports.wait_for(2, REPORT_S)
        assert [(r, p) for r, p, _ in reports.calls] == [
            (2, children[1].pid),
            (1, children[0].pid),
        ], reports.calls
        time.sleep(0.2)
        assert len(reports.calls) == 2, "a peer was reported twice, or a live one at all"
        assert children[2].poll() is None
    finally:
        watcher.close()


def test_a_peer_that_exited_before_the_watch_began_is_reported(children):
    children.append(_child())
    children[0].kill()
    os.waitid(os.P_PID, children[0].pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
    reports = _Reports()
    watcher = PeerWatcher({5: children[0].pid}, reports, "t")
    try:
        reports.wait_for(1, REPORT_S)
        assert [(r, p) for r, p, _ in reports.calls] == [(5, children[0].pid)]
    finally:
        watcher.close()


def test_close_joins_the_thread_closes_the_fds_and_reports_nothing_after(children):
    children.extend(_child() for _ in range(2))
    reports = _Reports()
    watcher = PeerWatcher({0: children[0].pid, 2: children[1].pid}, reports, "liveness-test")
    thread = watcher._thread
    fds = [*watcher._fds, watcher._wake_r, watcher._wake_w]
    assert thread.is_alive() and thread.daemon
    t0 = time.monotonic()
    watcher.close()
    assert not thread.is_alive() and time.monotonic() - t0 < REPORT_S
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    watcher.close()  # idempotent
    children[0].kill()
    children[0].wait()
    time.sleep(0.2)
    assert reports.calls == []


def test_a_callback_that_raises_is_logged_and_the_watch_goes_on(children, caplog):
    children.extend(_child() for _ in range(2))
    reports = _Reports()

    def on_exit(rank: int, pid: int) -> None:
        reports(rank, pid)
        if rank == 0:
            raise RuntimeError("the device is gone")

    watcher = PeerWatcher({0: children[0].pid, 1: children[1].pid}, on_exit, "t")
    try:
        with caplog.at_level(logging.ERROR, logger="uccl_ep_megatron.backends.liveness"):
            children[0].kill()
            reports.wait_for(1, REPORT_S)
            children[1].kill()
            reports.wait_for(2, REPORT_S)
        assert sorted(r for r, _, _ in reports.calls) == [0, 1]
        assert "rank 0 (pid" in caplog.text and "the device is gone" in caplog.text
    finally:
        watcher.close()


def test_the_identity_is_this_process_on_this_host_in_this_pid_namespace():
    me = process_identity()
    assert me.pid == os.getpid()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert me.boot_id == f.read().strip() and len(me.boot_id) == 36
    assert os.readlink("/proc/self/ns/pid") == f"pid:[{me.pid_ns}]"


def test_only_peers_of_this_host_and_pid_namespace_are_watched(children, caplog):
    me = process_identity()
    children.extend(_child() for _ in range(3))
    same = ProcessIdentity(children[0].pid, me.boot_id, me.pid_ns)
    other_host = ProcessIdentity(children[1].pid, "0" * 36, me.pid_ns)
    other_ns = ProcessIdentity(children[2].pid, me.boot_id, me.pid_ns + 1)
    assert unwatchable_reason(me, same) is None
    assert unwatchable_reason(me, other_host) == "it runs on another host"
    assert unwatchable_reason(me, other_ns) == "it runs in another pid namespace"
    assert "boot id" in unwatchable_reason(me, ProcessIdentity(1, "", 0))

    reports = _Reports()
    with caplog.at_level(logging.DEBUG, logger="uccl_ep_megatron.backends.liveness"):
        watcher = watch_peers(1, [same, me, other_host, other_ns], reports, "t")
    try:
        assert watcher is not None and watcher.watched == [0]
        # The fallback is said, naming each rank left to the timeout and why.
        assert f"rank 2 (pid {children[1].pid}) is not watched (it runs on another host)" in (
            caplog.text
        )
        assert "rank 3" in caplog.text and "another pid namespace" in caplog.text
        assert "UCCL_EP_TIMEOUT_MS" in caplog.text
        children[1].kill()  # not watched: not reported
        children[0].kill()
        reports.wait_for(1, REPORT_S)
        time.sleep(0.2)
        assert [(r, p) for r, p, _ in reports.calls] == [(0, children[0].pid)]
    finally:
        watcher.close()
    with caplog.at_level(logging.DEBUG, logger="uccl_ep_megatron.backends.liveness"):
        assert watch_peers(0, [me, other_host], reports, "t") is None


def test_a_forked_child_closing_its_copy_leaves_the_parents_watch_running(children):
    children.append(_child())
    reports = _Reports()
    watcher = PeerWatcher({4: children[0].pid}, reports, "t")
    try:
        pid = os.fork()
        if pid == 0:  # the child: close its inherited copy, then leave without cleanup
            watcher.close()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert watcher._thread.is_alive()
        children[0].kill()
        reports.wait_for(1, REPORT_S)
        assert [(r, p) for r, p, _ in reports.calls] == [(4, children[0].pid)]
    finally:
        watcher.close()

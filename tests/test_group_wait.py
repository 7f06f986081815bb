"""The bounded wait of a Buffer's gloo channel (``BufferGroup._wait_slice``) against the
semantics of torch's ``c10d::Work``: ``wait(timeout)`` raises "Operation timed out!" while the
collective is not complete, and a completed collective's ``wait`` returns at once or raises the
error it completed with."""

from __future__ import annotations

import types

import pytest

from uccl_ep_megatron.backends.agreement.group import BufferGroup
from uccl_ep_megatron.core.errors import UcclEpError


class Work:
    """A collective that completes (``error`` None: successfully) after ``polls`` waits."""

    def __init__(self, polls: int, error: str | None = None, completes_during_timeout=False):
        self.polls, self.error, self.late = polls, error, completes_during_timeout
        self.completed = False

    def wait(self, timeout=None):
        self.polls -= 1
        if self.polls <= 0:
            if self.late and not self.completed:
                self.completed = True  # completes just after the timed wait gave up
                raise RuntimeError("Operation timed out!")
            self.completed = True
        if not self.completed:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def is_completed(self):
        return self.completed


def _slice(work):
    channel = types.SimpleNamespace(
        _cuda=False, _failed=lambda what, call, exc: UcclEpError(f"{what} of {call}: {exc}")
    )
    return BufferGroup._wait_slice(channel, work, 0.01, "the all-to-all", "dispatch #1")


def test_a_collective_that_completes_as_the_slice_runs_out_is_complete():
    assert _slice(Work(1, completes_during_timeout=True)) is True


def test_a_pending_collective_asks_for_another_slice():
    assert _slice(Work(3)) is False


def test_a_completed_collective_returns_at_once():
    assert _slice(Work(1)) is True


@pytest.mark.parametrize("late", [False, True])
def test_a_failed_collective_raises_its_own_error(late):
    work = Work(1, error="Connection closed by peer", completes_during_timeout=late)
    expected = "the all-to-all of dispatch #1: Connection closed by peer"
    with pytest.raises(UcclEpError, match=expected):
        _slice(work)

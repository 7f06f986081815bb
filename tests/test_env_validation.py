"""The environment registry's rules: the library rejects exactly what ``doctor`` flags.

The rules live in one place (``csrc/common/env.cc``, ``Env::load``): ``Buffer()`` reads the
registry strictly and raises on the first bad value, ``doctor`` reads it leniently and lists
every bad value. These tests hold the two readings against each other."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

HERE = os.path.abspath(__file__)

# (variable, value, accepted): values of the right type, some of which the library cannot use.
CASES = [
    ("UCCL_EP_TIMEOUT_MS", "0", False),
    ("UCCL_EP_TIMEOUT_MS", "-1", False),
    ("UCCL_EP_TIMEOUT_MS", "1", True),
    ("UCCL_EP_TIMEOUT_MS", "abc", False),
    ("UCCL_EP_NUM_PROXY_THREADS", "0", False),
    ("UCCL_EP_NUM_PROXY_THREADS", "1", True),
    ("UCCL_EP_PROXY_IDLE_US", "-1", False),
    ("UCCL_EP_PROXY_IDLE_US", "0", True),
    ("UCCL_EP_RECV_ARENA_BYTES", "-1", False),
    ("UCCL_EP_RECV_ARENA_BYTES", "0", True),
    ("UCCL_EP_FIFO_CAPACITY", "1000", False),
    ("UCCL_EP_FIFO_CAPACITY", "1024", True),
    ("UCCL_EP_RANKS_PER_NODE", "-1", False),
    ("UCCL_EP_RANKS_PER_NODE", "0", True),
    ("UCCL_EP_LOG_LEVEL", "foo", False),
    ("UCCL_EP_LOG_LEVEL", "WARNING", True),
    ("UCCL_EP_LOG_LEVEL", "debug", True),
    ("UCCL_EP_BACKEND", "foo", False),
    ("UCCL_EP_BACKEND", "reference", True),
    ("UCCL_EP_TRANSPORT", "foo", False),
    ("UCCL_EP_TRANSPORT", "ipc", True),
    ("UCCL_EP_PROXY_ORDERING", "foo", False),
    ("UCCL_EP_PROXY_ORDERING", "sender", True),
]


@pytest.mark.parametrize("name, value, accepted", CASES)
def test_the_library_rejects_exactly_what_doctor_flags(monkeypatch, name, value, accepted):
    from uccl_ep_megatron.core import _c
    from uccl_ep_megatron.core.config import effective_env
    from uccl_ep_megatron.core.errors import InvalidInputError

    monkeypatch.setenv(name, value)
    flagged = dict(_c.load().env_problems())
    try:
        effective_env()
        rejected = None
    except InvalidInputError as exc:
        rejected = str(exc)
    assert (rejected is None) == accepted, rejected
    assert (name in flagged) == (not accepted), flagged
    if not accepted:
        assert f"{name}='{value}'" in rejected and f"{name}='{value}'" in flagged[name]
        assert set(flagged) == {name}


def w_buffer_with_env(rank, world):
    from uccl_ep_megatron import Buffer
    from uccl_ep_megatron.core.errors import InvalidInputError

    t0 = time.monotonic()
    try:
        Buffer(None, 0, 0, backend="reference")
    except InvalidInputError as exc:
        return str(exc), time.monotonic() - t0
    raise AssertionError("Buffer() accepted the environment")


@pytest.mark.parametrize(
    "name, value",
    [(n, v) for n, v, ok in CASES if not ok and n != "UCCL_EP_BACKEND"]
    + [("UCCL_EP_BACKEND", "foo")],
)
def test_buffer_rejects_the_value_before_any_exchange(pool2, name, value):
    for msg, dt in pool2.run(HERE, "w_buffer_with_env", env={name: value}):
        assert name in msg and value in msg, msg  # the variable and the value it holds
        assert dt < 5, dt

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from dist_utils import DistPool  # noqa: E402

_pools: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    """A gloo pool of ``world_size`` ranks shared by every test of the session."""
    pool = _pools.get(world_size)
    if pool is None or not pool.alive():
        pool = _pools[world_size] = DistPool(world_size)
    return pool


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"ranks{n}")
def pool(request) -> DistPool:
    return get_pool(request.param)


@pytest.fixture
def pool2() -> DistPool:
    return get_pool(2)


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()
    _pools.clear()

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


@pytest.fixture
def plugin():
    """The Megatron plugin installed for one test, uninstalled (and its options reset) after."""
    from uccl_ep_megatron.token_dispatcher import reset_options

    from uccl_ep_megatron import megatron_plugin

    megatron_plugin.install()
    yield megatron_plugin
    megatron_plugin.uninstall()
    reset_options()


def pytest_sessionfinish(session, exitstatus):
    for p in _pools.values():
        p.close()
    _pools.clear()

"""Eager CUDA module loading for the ipc transport's copy delivery: which ranks ask for it, and
the check that refuses lazy loading with the fix in its message (``proxy/loading.py`` says why
it matters; the default store delivery makes no CUDA call and needs neither)."""

from __future__ import annotations

import pytest

from uccl_ep_megatron.core.errors import UnsupportedError
from uccl_ep_megatron.proxy.loading import (
    ENV,
    check_ipc_module_loading,
    eager_loading_env,
    may_use_ipc,
)


@pytest.mark.parametrize(
    ("environ", "local_ranks", "transport", "expected"),
    [
        ({}, 4, None, False),  # one node of 4: intranode kernels, no proxy
        ({"UCCL_EP_RANKS_PER_NODE": "2"}, 4, None, True),  # 2 virtual nodes of 2
        ({"UCCL_EP_RANKS_PER_NODE": "1"}, 2, None, True),
        ({"UCCL_EP_RANKS_PER_NODE": "4"}, 4, None, False),  # one node after all
        ({"UCCL_EP_RANKS_PER_NODE": "0"}, 4, None, False),  # 0 means unset
        ({"UCCL_EP_RANKS_PER_NODE": "two"}, 4, None, False),  # the registry reports it
        ({"UCCL_EP_TRANSPORT": "ipc"}, 1, None, True),
        ({"UCCL_EP_TRANSPORT": " IPC "}, 1, None, True),
        ({"UCCL_EP_TRANSPORT": "verbs", "UCCL_EP_RANKS_PER_NODE": "2"}, 4, None, False),
        ({"UCCL_EP_RANKS_PER_NODE": "2"}, 4, "verbs", False),  # a recipe's transport wins
        ({}, 4, "ipc", True),
    ],
)
def test_which_ranks_may_use_ipc(environ, local_ranks, transport, expected):
    assert may_use_ipc(environ, local_ranks, transport) is expected
    # Store delivery (the default, or named) needs no eager loading; copy delivery does.
    for delivery in ({}, {"UCCL_EP_IPC_DELIVERY": "store"}):
        assert eager_loading_env({**environ, **delivery}, local_ranks, transport) == {}
    env = eager_loading_env({**environ, "UCCL_EP_IPC_DELIVERY": " Copy "}, local_ranks, transport)
    assert env == ({ENV: "EAGER"} if expected else {})


def test_a_loading_mode_the_user_chose_is_kept():
    environ = {"UCCL_EP_RANKS_PER_NODE": "2", "UCCL_EP_IPC_DELIVERY": "copy", ENV: "LAZY"}
    assert may_use_ipc(environ, 4)
    assert eager_loading_env(environ, 4) == {}


def test_lazy_loading_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv(ENV, "LAZY")
    with pytest.raises(UnsupportedError) as info:
        check_ipc_module_loading(3, mode="LAZY")
    text = str(info.value)
    assert text.startswith(
        "rank 3: the ipc transport's copy delivery needs CUDA_MODULE_LOADING=EAGER"
    )
    assert "CUDA_MODULE_LOADING='LAZY'" in text
    assert "UCCL_EP_IPC_DELIVERY=store" in text
    assert "UCCL_EP_TRANSPORT=verbs" in text


@pytest.mark.parametrize("mode", ["EAGER", None])
def test_eager_or_unknown_loading_passes(mode):
    check_ipc_module_loading(0, mode=mode)  # None: no CUDA driver answered (CPU, ROCm)


def test_train_asks_for_eager_loading_only_for_uccl_ep(monkeypatch):
    from uccl_ep_megatron.training.job import _rank_env
    from uccl_ep_megatron.training.recipes import load_recipe

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("UCCL_EP_RANKS_PER_NODE", "2")
    recipe = load_recipe()
    monkeypatch.delenv("UCCL_EP_IPC_DELIVERY", raising=False)
    assert _rank_env(recipe, "uccl_ep", 4) == {}  # store delivery: no CUDA call in the model
    monkeypatch.setenv("UCCL_EP_IPC_DELIVERY", "copy")
    assert _rank_env(recipe, "uccl_ep", 4) == {ENV: "EAGER"}
    assert _rank_env(recipe, "alltoall", 4) == {}
    assert _rank_env(recipe, "uccl_ep", 2) == {}  # 2 ranks per node of 2: one node
    ipc = load_recipe(overrides={"dispatcher": {"transport": "ipc"}})
    monkeypatch.delenv("UCCL_EP_RANKS_PER_NODE")
    assert _rank_env(ipc, "uccl_ep", 4) == {ENV: "EAGER"}

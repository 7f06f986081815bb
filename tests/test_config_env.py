"""Config validation, buffer-size hints and the env registry (its table: tests/test_docs.py)."""

from __future__ import annotations

import os
import re

import pytest

from uccl_ep_megatron import Buffer, Config, InvalidInputError
from uccl_ep_megatron.core.config import effective_env, env_registry, ranks_per_node


def test_config_rejects_bad_values():
    with pytest.raises(InvalidInputError, match="num_sms=3"):
        Config(3)
    with pytest.raises(InvalidInputError, match="num_max_nvl_chunked_recv_tokens"):
        Config(24, 6, 0)
    with pytest.raises(InvalidInputError, match="exceeds the NVL ring"):
        Config(24, 300, 256)


def test_size_hints_grow_with_hidden_and_ranks():
    cfg = Config(24, 6, 256, 6, 128)
    small = cfg.get_nvl_buffer_size_hint(2048 * 2, 2)
    big = cfg.get_nvl_buffer_size_hint(7168 * 2, 2)
    assert 0 < small < big
    assert big % 128 == 0
    # A ring holds num_max_nvl_chunked_recv_tokens full rows per (channel, peer).
    assert big >= cfg.num_channels * 2 * 256 * 7168 * 2
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 8) == 0  # one node
    assert cfg.get_rdma_buffer_size_hint(7168 * 2, 16) > 0  # two nodes of 8
    with pytest.raises(InvalidInputError, match="hidden_bytes"):
        cfg.get_nvl_buffer_size_hint(0, 2)


def test_ranks_per_node_from_env(monkeypatch):
    monkeypatch.delenv("UCCL_EP_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert ranks_per_node(4) == 4
    assert ranks_per_node(32) == 8
    with pytest.raises(InvalidInputError, match="UCCL_EP_RANKS_PER_NODE"):
        ranks_per_node(12)
    monkeypatch.setenv("UCCL_EP_RANKS_PER_NODE", "2")
    assert ranks_per_node(4) == 2
    monkeypatch.setenv("UCCL_EP_RANKS_PER_NODE", "3")
    with pytest.raises(InvalidInputError, match="does not divide"):
        ranks_per_node(4)


def test_default_configs_and_set_num_sms():
    saved = Buffer.num_sms
    try:
        Buffer.set_num_sms(20)
        assert Buffer.get_dispatch_config(8).num_sms == 20
        assert Buffer.get_combine_config(16).num_sms == 20
        with pytest.raises(InvalidInputError):
            Buffer.set_num_sms(7)
    finally:
        Buffer.set_num_sms(saved)


def test_env_registry_parses_current_environment(monkeypatch):
    names = [p["name"] for p in env_registry()]
    assert len(names) == len(set(names))
    monkeypatch.setenv("UCCL_EP_NUM_PROXY_THREADS", "6")
    assert effective_env()["UCCL_EP_NUM_PROXY_THREADS"] == 6
    monkeypatch.setenv("UCCL_EP_NUM_PROXY_THREADS", "six")
    with pytest.raises(InvalidInputError, match="UCCL_EP_NUM_PROXY_THREADS"):
        effective_env()


def test_every_registered_variable_is_read_somewhere():
    # A variable in the registry (and so in doctor and the docs) that no code reads promises
    # a knob that does nothing (UCCL_SOCKET_IFNAME once did). "Read" means: its Env field is
    # used by the C++ core, or its name appears in Python code other than the places that only
    # print or export it.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    defs = open(os.path.join(root, "csrc", "common", "env_params.def")).read()
    fields = dict(re.findall(r'^UCCL_EP_ENV_\w+\((\w+), "(\w+)"', defs, re.M))
    assert len(fields) == len(env_registry())
    cpp, py = [], []
    for sub, exts, out in (
        ("csrc", (".cc", ".cu", ".cuh", ".h"), cpp),
        ("uccl_ep_megatron", (".py",), py),
    ):
        for dirpath, _, files in os.walk(os.path.join(root, sub)):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(exts) and not path.endswith(
                    ("env.h", "env.cc", os.path.join("cli", "doctor.py"), "launch.py")
                ):
                    out.append(open(path).read())
    cpp_text, py_text = "\n".join(cpp), "\n".join(py)
    unread = [
        name
        for field, name in fields.items()
        if not re.search(rf"[.>]{field}\b", cpp_text) and f'"{name}"' not in py_text
    ]
    assert not unread, f"registered but never read: {unread}"

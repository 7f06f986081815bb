"""``BufferOptions``: every field left ``None`` takes the environment registry's value (the
variable, else the registry default), an explicit field wins, bad values raise naming the
field (or the variable) and the fix; a ``Buffer`` resolves them once, at construction."""

from __future__ import annotations

import dataclasses
import os

import pytest

from uccl_ep_megatron import BufferOptions, InvalidInputError
from uccl_ep_megatron.core.config import env_registry

HERE = os.path.abspath(__file__)
FIELDS = {f.name: f.metadata["env"] for f in dataclasses.fields(BufferOptions)}
REGISTRY = {p["name"]: p for p in env_registry()}

# A valid value of each field that differs from its registry default, and its text in the
# environment.
OTHER = {
    "backend": ("reference", "reference"),
    "timeout_ms": (4321, "4321"),
    "tma": (True, "1"),
    "launch_ahead": (False, "0"),
    "combine_in_place": (False, "0"),
    "combine_copy_in": (False, "0"),
    "combine_copy_engine": (False, "0"),
    "arena_bytes": (1 << 20, str(1 << 20)),
    "grow_nvl_buffer": (False, "0"),
    "ranks_per_node": (2, "2"),
    "transport": ("ipc", "ipc"),
    "num_proxy_threads": (3, "3"),
    "proxy_ordering": ("sender", "sender"),
    "ipc_reorder": (True, "1"),
    "ipc_link_gbps": (50.0, "50"),
    "ipc_latency_us": (2.5, "2.5"),
    "ipc_fault": ("dead_peer:rank=1,after=5", "dead_peer:rank=1,after=5"),
    "ipc_delivery": ("copy", "copy"),
    "ipc_copy_streams": (2, "2"),
}
# Variables the registry keeps as text that the options hold as numbers.
NUMERIC = {f.metadata["env"] for f in dataclasses.fields(BufferOptions) if f.metadata["convert"]}


def _parse(entry: dict[str, str]):
    """The registry's default as its declared type (an oracle apart from the C++ parser)."""
    raw = entry["default"]
    if entry.get("name") in NUMERIC:
        return float(raw)
    if entry["type"] == "int":
        return int(raw)
    if entry["type"] == "bool":
        return raw in ("1", "true")
    return raw


@pytest.fixture
def clean_env(monkeypatch):
    for var in FIELDS.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_every_field_is_a_registry_variable():
    assert set(OTHER) == set(FIELDS), "a field without a test value"
    for name, var in FIELDS.items():
        assert var in REGISTRY, f"BufferOptions.{name} names {var}, which the registry lacks"


def test_defaults_come_from_the_registry(clean_env):
    got = BufferOptions().resolved()
    for name, var in FIELDS.items():
        assert getattr(got, name) == _parse(REGISTRY[var]), name
        assert getattr(got, name) != OTHER[name][0], name  # so the cases below show a change


def test_environment_supplies_fields_left_none(clean_env):
    for name, (_, text) in OTHER.items():
        clean_env.setenv(FIELDS[name], text)
    got = BufferOptions().resolved()
    assert {name: getattr(got, name) for name in FIELDS} == {k: v for k, (v, _) in OTHER.items()}
    # Resolved once: the environment changing later changes nothing.
    clean_env.setenv("UCCL_EP_TIMEOUT_MS", "99")
    assert got.timeout_ms == OTHER["timeout_ms"][0]


def test_an_explicit_field_wins(clean_env):
    for name, (value, _) in OTHER.items():
        default = _parse(REGISTRY[FIELDS[name]])
        # The variable says the other value; the argument says the default: the argument wins.
        clean_env.setenv(FIELDS[name], OTHER[name][1])
        got = BufferOptions(**{name: default}).resolved()
        assert getattr(got, name) == default, name
        assert BufferOptions(**{name: value}).resolved() == BufferOptions().resolved(), name


def test_blank_variables_take_the_registry_default(clean_env):
    clean_env.setenv("UCCL_EP_BACKEND", "  ")
    clean_env.setenv("UCCL_EP_TRANSPORT", "")
    got = BufferOptions().resolved()
    assert (got.backend, got.transport) == ("auto", "auto")


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("backend", "kernel", "must be one of 'auto', 'kernels', 'reference'"),
        ("timeout_ms", 0, r"must be an int >= 1 \(milliseconds\)"),
        ("timeout_ms", 1.5, "must be an int >= 1"),
        ("tma", 1, "must be True or False"),
        ("launch_ahead", "yes", "must be True or False"),
        ("arena_bytes", -1, r"must be an int >= 0 \(bytes\)"),
        ("ranks_per_node", True, "must be an int >= 0"),
        ("transport", "rdma", "must be one of 'auto', 'verbs', 'ipc'"),
        ("num_proxy_threads", 65, r"must be an int in \[1, 64\]"),
        ("proxy_ordering", "fifo", "must be one of 'receiver', 'sender', 'none'"),
        ("ipc_link_gbps", -1, "must be a finite number >= 0"),
        ("ipc_latency_us", "3", "must be a finite number >= 0"),
        ("ipc_fault", 5, "must be a string"),
        ("ipc_delivery", "dma", "must be one of 'store', 'copy'"),
        ("ipc_copy_streams", 0, r"must be an int in \[1, 64\]"),
    ],
)
def test_bad_values_name_the_field_and_the_fix(field, value, needle):
    with pytest.raises(InvalidInputError, match=needle) as err:
        BufferOptions(**{field: value})
    text = str(err.value)
    assert text.startswith(f"BufferOptions({field}={value!r})"), text
    assert f"None for the default (the value of {FIELDS[field]})" in text, text


@pytest.mark.parametrize(
    "var, raw, needle",
    [
        ("UCCL_EP_TRANSPORT", "rdma", "use auto, verbs or ipc"),
        ("UCCL_EP_PROXY_ORDERING", "fifo", "use receiver, sender or none"),
        ("UCCL_EP_NUM_PROXY_THREADS", "0", "must be at least 1"),
        ("UCCL_EP_TIMEOUT_MS", "0", "must be a positive number of milliseconds"),
        ("UCCL_EP_BACKEND", "gpu", "use auto, kernels or reference"),
    ],
)
def test_bad_variables_name_the_variable_and_the_fix(clean_env, var, raw, needle):
    """The registry's rules (the ones doctor applies) reject a bad variable when the options
    are resolved, naming it, its value and what it must be: an explicit field does not make a
    broken environment acceptable."""
    clean_env.setenv(var, raw)
    with pytest.raises(InvalidInputError, match=needle) as err:
        BufferOptions().resolved()
    assert str(err.value).startswith(f"{var}='{raw}'"), str(err.value)


def test_a_bad_number_variable_names_the_field(clean_env):
    """A variable the registry keeps as text but the options read as a number."""
    clean_env.setenv("UCCL_EP_IPC_LINK_GBPS", "fast")
    with pytest.raises(InvalidInputError, match="must be a finite number") as err:
        BufferOptions().resolved()
    text = str(err.value)
    assert text.startswith("UCCL_EP_IPC_LINK_GBPS='fast'"), text
    assert "BufferOptions(ipc_link_gbps=...)" in text, text
    BufferOptions(ipc_link_gbps=50).resolved()  # an explicit field never reads it


def test_options_are_frozen():
    opts = BufferOptions(tma=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.tma = False


# ---- through Buffer (a gloo pair of ranks, reference backend) ----------------------------
def w_buffer_takes_options(rank, world):
    from uccl_ep_megatron import Buffer, Config
    from uccl_ep_megatron.core.config import default_dispatch_config

    # The variables the pool set for this call: the environment's values.
    assert os.environ["UCCL_EP_TIMEOUT_MS"] == "777"
    env_buf = Buffer(None, 1 << 20, backend="reference")
    assert env_buf.options.timeout_ms == 777 == env_buf._backend.timeout_ms
    assert env_buf.num_rdma_ranks == 1  # UCCL_EP_RANKS_PER_NODE=2: one node of two ranks
    env_buf.destroy()

    opts = BufferOptions(backend="reference", timeout_ms=4321, ranks_per_node=1)
    buf = Buffer(None, 1 << 20, options=opts)
    assert buf.backend == "reference" and buf.options.backend == "reference"
    assert buf.options.timeout_ms == 4321 == buf._backend.timeout_ms
    # Explicit ranks_per_node=1 beats UCCL_EP_RANKS_PER_NODE=2: two virtual nodes.
    assert (buf.num_rdma_ranks, buf.num_nvl_ranks) == (2, 1)
    # The default config follows the Buffer's nodes, not the environment's.
    got = buf._check_config(None, "dispatch")
    assert got == default_dispatch_config(world, Buffer.num_sms, 1)
    assert got != default_dispatch_config(world, Buffer.num_sms, world)
    assert isinstance(got, Config)
    buf.destroy()

    # The DeepEP constructor stays as it was; options is an extra keyword.
    Buffer(None, 1 << 20, 0, False, 24, backend="reference", options=BufferOptions()).destroy()
    for kwargs, needle in (
        (dict(backend="kernels", options=BufferOptions(backend="reference")), "disagree"),
        (dict(backend="gpu"), "backend='gpu' is unknown"),
        (dict(options={"tma": True}), "pass a uccl_ep_megatron.BufferOptions"),
    ):
        try:
            Buffer(None, 1 << 20, **kwargs)
        except InvalidInputError as e:
            assert needle in str(e), str(e)
        else:
            raise AssertionError(f"{kwargs} was accepted")


def test_buffer_takes_options(pool2):
    pool2.run(
        HERE,
        "w_buffer_takes_options",
        env={"UCCL_EP_TIMEOUT_MS": "777", "UCCL_EP_RANKS_PER_NODE": "2"},
    )

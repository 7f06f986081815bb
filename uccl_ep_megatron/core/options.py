"""``BufferOptions``: the behaviour knobs of one ``Buffer``, as arguments.

Every field left ``None`` takes its value from the environment registry
(``csrc/common/env_params.def``, read through ``core.config.effective_env``: the variable when
set, else the registry's default); a field given explicitly wins over the environment. Values
are checked when the options are made (explicit ones) and when they are resolved (the ones from
the environment), with errors that name the field, the variable and the fix.

Adding a knob: one field line below (``_knob(variable, check)``), one line in the docstring,
and the line of the backend that reads ``options.<field>``. A knob with no variable in the
registry gives its default instead: ``_knob(None, check, default=...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from uccl_ep_megatron.core.config import effective_env, env_registry
from uccl_ep_megatron.core.errors import InvalidInputError

# A check returns what the value must be (for the error), or None when it is fine.
Check = Callable[[Any], "str | None"]


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be True or False"


def _int_in(lo: int, hi: int | None = None, unit: str = "") -> Check:
    what = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
    what += f" ({unit})" if unit else ""

    def check(value: Any) -> str | None:
        ok = type(value) is int and value >= lo and (hi is None or value <= hi)
        return None if ok else f"must be {what}"

    return check


def _one_of(*choices: str) -> Check:
    def check(value: Any) -> str | None:
        return None if value in choices else f"must be one of {', '.join(map(repr, choices))}"

    return check


def _number(value: Any) -> str | None:
    ok = type(value) in (int, float) and 0 <= value < float("inf")
    return None if ok else "must be a finite number >= 0 (0 = off)"


def _as_number(value: Any) -> Any:
    """A registry string such as "50" or "2.5" as a number (anything else is left for the
    check to name)."""
    try:
        return float(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _text(value: Any) -> str | None:
    return None if isinstance(value, str) else "must be a string"


def _knob(
    env: str | None, check: Check, default: Any = None, convert: Callable[[Any], Any] | None = None
) -> Any:
    """A field: ``None`` by default (the environment's value, or ``default`` when the knob has
    no variable), checked by ``check``; ``convert`` turns the variable's text into the field's
    type first."""
    meta = {"env": env, "check": check, "default": default, "convert": convert}
    return field(default=None, metadata=meta)


@dataclass(frozen=True)
class BufferOptions:
    """Behaviour knobs of a ``Buffer``; ``None`` = the environment registry's value.

    Args:
        backend: ``"auto"``, ``"kernels"`` or ``"reference"`` (``UCCL_EP_BACKEND``).
        timeout_ms: bound of every kernel, proxy and teardown wait (``UCCL_EP_TIMEOUT_MS``).
        tma: intranode rows moved with Hopper bulk copies (``UCCL_EP_INTRANODE_TMA``).
        launch_ahead: intranode exact dispatches launch their data kernel before their counts
            are read, into outputs sized from the previous call (``UCCL_EP_LAUNCH_AHEAD``); on
            for the group only where every rank has it on.
        combine_in_place: intranode combines read an arena-resident x where it lies
            (``UCCL_EP_COMBINE_IN_PLACE``).
        combine_copy_in: with ``combine_in_place``, an x (or weights) made outside the arena
            is copied into an arena block and read there (``UCCL_EP_COMBINE_COPY_IN``).
        combine_copy_engine: at 2 ranks, a combine of an exact dispatch's rows whose x is not
            read in place sends them back with the copy engine while its SMs only sum
            (``UCCL_EP_COMBINE_COPY_ENGINE``).
        arena_bytes: bytes of each rank's receive arena for zero-copy dispatch; 0 on any rank
            turns it off for the group (``UCCL_EP_RECV_ARENA_BYTES``).
        grow_nvl_buffer: a call that stages more rows than ``num_nvl_bytes`` holds grows every
            rank's buffer; False raises ``BufferTooSmallError`` (``UCCL_EP_GROW_NVL_BUFFER``).
        ranks_per_node: ranks per (virtual) node; 0 = from ``LOCAL_WORLD_SIZE`` or the host
            names (``UCCL_EP_RANKS_PER_NODE``). Set it to split one host into virtual nodes.
        transport: the internode proxy's ``"auto"``, ``"verbs"`` or ``"ipc"``
            (``UCCL_EP_TRANSPORT``).
        num_proxy_threads: CPU proxy threads per GPU (``UCCL_EP_NUM_PROXY_THREADS``).
        proxy_ordering: where the proxies enforce per-channel order: ``"receiver"``,
            ``"sender"`` or ``"none"`` (``UCCL_EP_PROXY_ORDERING``).
        ipc_reorder: the ipc transport delivers out of order after random delays, as EFA SRD
            may (``UCCL_EP_IPC_REORDER``).
        ipc_link_gbps: line rate of each rank's virtual NIC in GB/s, 0 = unthrottled
            (``UCCL_EP_IPC_LINK_GBPS``).
        ipc_latency_us: one-way latency of the virtual wire (``UCCL_EP_IPC_LATENCY_US``).
        ipc_fault: faults the NIC model injects, e.g. ``"dead_peer:rank=1,after=200"``
            (``UCCL_EP_IPC_FAULT``; the same on every rank).
        ipc_delivery: how the NIC model gets write bytes to GPU regions: ``"store"`` (the
            sending kernels store them in the receiver's ring; the model times delivery) or
            ``"copy"`` (the model copies them with the copy engines) (``UCCL_EP_IPC_DELIVERY``;
            the same on every rank).
        ipc_copy_streams: copy streams of the virtual NIC in copy delivery
            (``UCCL_EP_IPC_COPY_STREAMS``).
    """

    backend: str | None = _knob("UCCL_EP_BACKEND", _one_of("auto", "kernels", "reference"))
    timeout_ms: int | None = _knob("UCCL_EP_TIMEOUT_MS", _int_in(1, unit="milliseconds"))
    tma: bool | None = _knob("UCCL_EP_INTRANODE_TMA", _flag)
    launch_ahead: bool | None = _knob("UCCL_EP_LAUNCH_AHEAD", _flag)
    combine_in_place: bool | None = _knob("UCCL_EP_COMBINE_IN_PLACE", _flag)
    combine_copy_in: bool | None = _knob("UCCL_EP_COMBINE_COPY_IN", _flag)
    combine_copy_engine: bool | None = _knob("UCCL_EP_COMBINE_COPY_ENGINE", _flag)
    arena_bytes: int | None = _knob("UCCL_EP_RECV_ARENA_BYTES", _int_in(0, unit="bytes"))
    grow_nvl_buffer: bool | None = _knob("UCCL_EP_GROW_NVL_BUFFER", _flag)
    ranks_per_node: int | None = _knob("UCCL_EP_RANKS_PER_NODE", _int_in(0))
    transport: str | None = _knob("UCCL_EP_TRANSPORT", _one_of("auto", "verbs", "ipc"))
    num_proxy_threads: int | None = _knob("UCCL_EP_NUM_PROXY_THREADS", _int_in(1, 64))
    proxy_ordering: str | None = _knob(
        "UCCL_EP_PROXY_ORDERING", _one_of("receiver", "sender", "none")
    )
    ipc_reorder: bool | None = _knob("UCCL_EP_IPC_REORDER", _flag)
    ipc_link_gbps: float | None = _knob("UCCL_EP_IPC_LINK_GBPS", _number, convert=_as_number)
    ipc_latency_us: float | None = _knob("UCCL_EP_IPC_LATENCY_US", _number, convert=_as_number)
    ipc_fault: str | None = _knob("UCCL_EP_IPC_FAULT", _text)
    ipc_delivery: str | None = _knob("UCCL_EP_IPC_DELIVERY", _one_of("store", "copy"))
    ipc_copy_streams: int | None = _knob("UCCL_EP_IPC_COPY_STREAMS", _int_in(1, 64))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            problem = f.metadata["check"](value)
            if problem is not None:
                env = f.metadata["env"]
                default = f" (the value of {env})" if env else ""
                raise InvalidInputError(
                    f"BufferOptions({f.name}={value!r}): {problem}; pass a valid value, or "
                    f"None for the default{default}"
                )

    def resolved(self) -> BufferOptions:
        """A copy with every ``None`` replaced by the environment registry's value, checked."""
        env = effective_env()
        registry = {p["name"]: p for p in env_registry()}
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            name = f.metadata["env"]
            if value is None and name is None:
                value = f.metadata["default"]
            elif value is None:
                value = env[name]
                if isinstance(value, str):
                    # Blank is unset (as the shell's `VAR=` usually means).
                    value = value.strip() or registry[name]["default"]
                if f.metadata["convert"] is not None:
                    value = f.metadata["convert"](value)
                problem = f.metadata["check"](value)
                if problem is not None:
                    raise InvalidInputError(
                        f"{name}={value!r} (the default of BufferOptions.{f.name}): {problem}; "
                        f"fix or unset the variable, or pass BufferOptions({f.name}=...)"
                    )
            values[f.name] = value
        return BufferOptions(**values)


__all__ = ["BufferOptions"]

"""GPU->CPU FIFO channels, CPU proxies and their transports, from Python.

The C++ core (``csrc/fifo``, ``csrc/proxy``, ``csrc/transport``) does the work; this module wires
one rank's pieces together and runs the out-of-band bootstrap over a ``torch.distributed`` group
(any backend, gloo included): every rank publishes its transport's connection blob (QP numbers,
GIDs, region addresses and keys, IPC handles) with ``all_gather_object`` and then connects.

Typical use on each rank::

    ep = ProxyEndpoint(region_ptr, region_bytes, device=torch.cuda.current_device(), group=group)
    handles = ep.device_handles()   # FifoDeviceHandle array for kernels
    ...                             # kernels push TransferCmds; ep.check() between steps
    ep.close()
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from uccl_ep_megatron.core import _c
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError, UnsupportedError
from uccl_ep_megatron.proxy.loading import check_ipc_module_loading

_ORDERINGS = ("receiver", "sender", "none")
_TRANSPORTS = ("auto", "verbs", "ipc")
# Pieces of endpoints whose proxy could not stop (a thread stuck in a transport call): that
# thread may still use them when the call returns, so they are never freed.
_STUCK: list[tuple[Any, ...]] = []


def _env() -> dict[str, Any]:
    return _c.load().env_effective()


@dataclass
class ProxyConfig:
    """Knobs of one rank's proxy; ``None`` fields take the registry's environment value.

    Attributes:
        num_channels: FIFO channels per GPU (the kernel maps each ordered sequence to one).
        num_threads: proxy threads (``UCCL_EP_NUM_PROXY_THREADS``); channel c -> thread c % n.
        fifo_capacity: slots per channel (``UCCL_EP_FIFO_CAPACITY``), a power of two.
        timeout_ms: bound of every proxy/producer wait (``UCCL_EP_TIMEOUT_MS``).
        ordering: ``receiver``, ``sender`` or ``none`` (``UCCL_EP_PROXY_ORDERING``).
        transport: ``auto``, ``verbs`` or ``ipc`` (``UCCL_EP_TRANSPORT``).
        ranks_per_node: for same-rail barriers (``UCCL_EP_RANKS_PER_NODE``; 0: whole group).
        num_counters: software-atomic counters per rank (<= 4096).
        ipc_reorder: ipc injector on (``UCCL_EP_IPC_REORDER``).
        ipc_seed: injector seed (``UCCL_EP_IPC_REORDER_SEED``), combined with rank and thread.
        ipc_max_delay_us: injector's longest hold (``UCCL_EP_IPC_MAX_DELAY_US``).
        ipc_link_gbps: NIC model line rate, GB/s per rank (``UCCL_EP_IPC_LINK_GBPS``; 0: none).
        ipc_latency_us: NIC model one-way latency (``UCCL_EP_IPC_LATENCY_US``).
        ipc_fault: injected NIC faults (``UCCL_EP_IPC_FAULT``; "" = none).
        ipc_copy_streams: copy streams of the NIC model (``UCCL_EP_IPC_COPY_STREAMS``).
        pin_cpus: CPUs for the proxy threads; ``None``: the GPU's NUMA node.
    """

    num_channels: int = 8
    num_threads: int | None = None
    fifo_capacity: int | None = None
    timeout_ms: int | None = None
    ordering: str | None = None
    transport: str | None = None
    ranks_per_node: int | None = None
    num_counters: int = 1024
    ipc_reorder: bool | None = None
    ipc_seed: int | None = None
    ipc_max_delay_us: int | None = None
    ipc_link_gbps: float | None = None
    ipc_latency_us: float | None = None
    ipc_fault: str | None = None
    ipc_copy_streams: int | None = None
    pin_cpus: list[int] | None = field(default=None)

    def resolved(self) -> ProxyConfig:
        """A copy with every ``None`` replaced by its environment value, validated."""
        e = _env()
        r = ProxyConfig(**self.__dict__)
        r.num_threads = int(
            e["UCCL_EP_NUM_PROXY_THREADS"] if r.num_threads is None else r.num_threads
        )
        r.fifo_capacity = int(
            e["UCCL_EP_FIFO_CAPACITY"] if r.fifo_capacity is None else r.fifo_capacity
        )
        r.timeout_ms = int(e["UCCL_EP_TIMEOUT_MS"] if r.timeout_ms is None else r.timeout_ms)
        r.ordering = str(e["UCCL_EP_PROXY_ORDERING"] if r.ordering is None else r.ordering)
        r.transport = str(e["UCCL_EP_TRANSPORT"] if r.transport is None else r.transport)
        r.ranks_per_node = int(
            e["UCCL_EP_RANKS_PER_NODE"] if r.ranks_per_node is None else r.ranks_per_node
        )
        r.ipc_reorder = bool(e["UCCL_EP_IPC_REORDER"] if r.ipc_reorder is None else r.ipc_reorder)
        r.ipc_seed = int(e["UCCL_EP_IPC_REORDER_SEED"] if r.ipc_seed is None else r.ipc_seed)
        r.ipc_max_delay_us = int(
            e["UCCL_EP_IPC_MAX_DELAY_US"] if r.ipc_max_delay_us is None else r.ipc_max_delay_us
        )
        r.ipc_link_gbps = _number(e, "UCCL_EP_IPC_LINK_GBPS", r.ipc_link_gbps)
        r.ipc_latency_us = _number(e, "UCCL_EP_IPC_LATENCY_US", r.ipc_latency_us)
        r.ipc_fault = str(e["UCCL_EP_IPC_FAULT"] if r.ipc_fault is None else r.ipc_fault)
        r.ipc_copy_streams = int(
            e["UCCL_EP_IPC_COPY_STREAMS"] if r.ipc_copy_streams is None else r.ipc_copy_streams
        )
        if not 1 <= r.ipc_copy_streams <= 64:
            raise InvalidInputError(
                f"ipc_copy_streams={r.ipc_copy_streams} must be in [1, 64] "
                "(UCCL_EP_IPC_COPY_STREAMS)"
            )
        try:
            _c.load().parse_ipc_faults(r.ipc_fault)
        except Exception as exc:  # the C++ parser names the bad part
            raise InvalidInputError(str(exc)) from None
        if r.num_channels < 1:
            raise InvalidInputError(f"num_channels={r.num_channels} must be >= 1")
        if not 1 <= r.num_threads <= min(64, r.num_channels):
            raise InvalidInputError(
                f"num_threads={r.num_threads} must be in [1, min(64, "
                f"num_channels={r.num_channels})] (UCCL_EP_NUM_PROXY_THREADS)"
            )
        if r.fifo_capacity < 2 or r.fifo_capacity & (r.fifo_capacity - 1):
            raise InvalidInputError(
                f"fifo_capacity={r.fifo_capacity} must be a power of two >= 2 "
                "(UCCL_EP_FIFO_CAPACITY)"
            )
        if r.timeout_ms <= 0:
            raise InvalidInputError(
                f"timeout_ms={r.timeout_ms} must be positive (UCCL_EP_TIMEOUT_MS)"
            )
        if r.ordering not in _ORDERINGS:
            raise InvalidInputError(
                f"ordering={r.ordering!r} must be one of {_ORDERINGS} (UCCL_EP_PROXY_ORDERING)"
            )
        if r.transport not in _TRANSPORTS:
            raise InvalidInputError(
                f"transport={r.transport!r} must be one of {_TRANSPORTS} (UCCL_EP_TRANSPORT)"
            )
        limit = _c.load().cmd_limits["num_atomic_counters"]
        if not 1 <= r.num_counters <= limit:
            raise InvalidInputError(f"num_counters={r.num_counters} must be in [1, {limit}]")
        return r


def _number(env: dict[str, Any], name: str, value: float | None) -> float:
    """A non-negative number: ``value``, or the registry's string for ``name`` when None."""
    raw = env[name] if value is None else value
    try:
        out = float(raw)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{name}={raw!r} is not a number; give e.g. 50 or 2.5") from None
    if not out >= 0 or out == float("inf"):
        raise InvalidInputError(f"{name}={raw!r} must be a finite number >= 0 (0 = off)")
    return out


def exchange(blob: bytes, group: Any = None) -> list[bytes]:
    """All-gather one ``bytes`` blob per rank over a torch.distributed group (rank order)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InvalidInputError(
            "the proxy bootstrap needs torch.distributed initialized "
            "(init_process_group, any backend)"
        )
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, blob, group=group)
    return [bytes(b) for b in out]


def rdma_usable() -> bool:
    """True when libibverbs loads and some RDMA port is ACTIVE."""
    c = _c.load()
    if not c.verbs_status()["loaded"]:
        return False
    try:
        devices = c.list_rdma_devices()
    except Exception:  # noqa: BLE001 - a broken verbs stack means "not usable", doctor explains
        return False
    return any(p["state"] == "ACTIVE" for d in devices for p in d["ports"])


def choose_transport(requested: str) -> str:
    """Resolve ``auto`` to ``verbs`` (an active RDMA port exists) or ``ipc``."""
    if requested == "auto":
        return "verbs" if rdma_usable() else "ipc"
    verbs = _c.load().verbs_status()
    if requested == "verbs" and not verbs["loaded"]:
        raise UnsupportedError(
            "UCCL_EP_TRANSPORT=verbs but libibverbs is unavailable: " + verbs["error"]
        )
    return requested


class ProxyEndpoint:
    """One rank's FIFO channels, counters, transport and proxy, connected to the group.

    Args:
        region_ptr: address of the symmetric region commands' offsets refer to (GPU or host).
        region_bytes: its size; peers bounds-check every command against it.
        device: CUDA device of the region and of the pushing kernels; ``None`` for host memory
            and CPU producers (tests, CPU-only runs).
        group: torch.distributed group of the EP ranks (default: the world).
        config: knobs (defaults from the environment).
        shm_name: for host regions shared across processes (``_C.HostRegion(shared=True)``).
        rank, world_size, infos: bypass torch.distributed (in-process tests): this rank's
            identity; call :meth:`connect` with every rank's :attr:`local_info` afterwards.
        bytes_in_place: the producers store every write's bytes at its destination themselves
            (the internode kernels with ``UCCL_EP_IPC_DELIVERY=store``), so the ipc NIC model
            times the writes and moves no GPU bytes; ignored by the verbs transport.
    """

    def __init__(
        self,
        region_ptr: int,
        region_bytes: int,
        *,
        device: int | None = None,
        group: Any = None,
        config: ProxyConfig | None = None,
        shm_name: str = "",
        rank: int | None = None,
        world_size: int | None = None,
        bytes_in_place: bool = False,
    ) -> None:
        c = _c.load()
        self.config = (config or ProxyConfig()).resolved()
        cfg = self.config
        if region_ptr <= 0 or region_bytes <= 0:
            raise InvalidInputError(
                f"region_ptr={region_ptr} region_bytes={region_bytes}: pass a registered region"
            )
        self.device = device
        self.group = group
        if rank is None or world_size is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise InvalidInputError(
                    "ProxyEndpoint needs torch.distributed initialized, or explicit rank/world_size"
                )
            rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        self.rank, self.world_size = int(rank), int(world_size)
        if self.world_size > c.cmd_limits["max_ranks"]:
            raise InvalidInputError(
                f"world_size={self.world_size} exceeds {c.cmd_limits['max_ranks']} ranks"
            )
        self.transport_kind = choose_transport(cfg.transport)
        gpu = -1 if device is None else int(device)
        self.bytes_in_place = self.transport_kind == "ipc" and bool(bytes_in_place)
        if self.transport_kind == "ipc" and gpu >= 0 and not self.bytes_in_place:
            check_ipc_module_loading(self.rank)
        # Producers wait longer than the proxy: when a peer dies, the proxy times out first and
        # records which rank and channel stalled, then aborts the producers' waits.
        fifo_timeout = 2 * cfg.timeout_ms + 1000
        if gpu >= 0:
            self.channels = [
                c.FifoChannel.gpu(i, cfg.fifo_capacity, fifo_timeout, gpu)
                for i in range(cfg.num_channels)
            ]
        else:
            self.channels = [
                c.FifoChannel.host(i, cfg.fifo_capacity, fifo_timeout)
                for i in range(cfg.num_channels)
            ]
        self.counters = c.Counters(cfg.num_counters, gpu >= 0)
        # What both transports take first: ranks, threads, channels, the region, its GPU.
        setup = (
            self.rank,
            self.world_size,
            cfg.num_threads,
            cfg.num_channels,
            region_ptr,
            region_bytes,
            gpu,
        )
        if self.transport_kind == "verbs":
            local = int(os.environ.get("LOCAL_RANK", gpu if gpu >= 0 else 0))
            self.transport = c.VerbsTransport(*setup, local)
        else:
            self.transport = c.IpcTransport(
                *setup,
                cfg.ipc_reorder,
                cfg.ipc_seed,
                cfg.ipc_max_delay_us,
                4096,
                shm_name,
                # A GPU copy that never runs is reported by the transport, naming it, before the
                # proxy's generic timeout fires.
                max(1, cfg.timeout_ms // 2),
                cfg.ipc_link_gbps,
                cfg.ipc_latency_us,
                cfg.ipc_fault,
                cfg.ipc_copy_streams,
                self.bytes_in_place,
            )
        self.proxy: Any = None
        self._host = socket.gethostname()

    @property
    def local_info(self) -> bytes:
        """This rank's connection blob, tagged with its host name."""
        return self._host.encode() + b"\0" + bytes(self.transport.local_info())

    def connect(self, infos: list[bytes] | None = None, start_proxy: bool = True) -> None:
        """Exchange connection blobs (over ``group`` unless given) and start the proxy
        (``start_proxy=False``: connect the transport only, e.g. for ``ipc_copy_test``)."""
        if infos is None:
            infos = exchange(self.local_info, self.group)
        if len(infos) != self.world_size:
            raise InvalidInputError(
                f"got {len(infos)} connection blobs for {self.world_size} ranks"
            )
        hosts = [b.split(b"\0", 1)[0].decode() for b in infos]
        if self.transport_kind == "ipc" and len(set(hosts)) > 1:
            raise UnsupportedError(
                f"the ipc transport needs all ranks on one host, got {sorted(set(hosts))}; "
                "set UCCL_EP_TRANSPORT=verbs on RDMA clusters"
            )
        self.transport.connect([b.split(b"\0", 1)[1] for b in infos])
        if not start_proxy:
            return
        cfg = self.config
        e = _env()
        cap = int(e["UCCL_IB_MAX_INFLIGHT_NORMAL"]) or self._c.cmd_limits["seq_window"]
        cap = min(cap, self._c.cmd_limits["seq_window"])
        cpus = cfg.pin_cpus
        if cpus is None and self.device is not None:
            cpus = self._c.numa_cpus_of_pci(self._c.gpu_pci_bus_id(self.device))
        self.proxy = self._c.Proxy(
            self.rank,
            self.world_size,
            cfg.ranks_per_node,
            cfg.num_threads,
            cfg.timeout_ms,
            cfg.ordering,
            self.channels,
            self.transport,
            self.counters,
            cap,
            int(e["UCCL_IB_MAX_INFLIGHT_BYTES"]),
            list(cpus or []),
            int(e["UCCL_EP_PROXY_IDLE_US"]),
        )
        self.proxy.start()

    @property
    def _c(self) -> Any:
        return _c.load()

    def device_handles(self) -> bytes:
        """The channels' FifoDeviceHandle structs back to back (copy to device memory)."""
        return b"".join(ch.device_handle_bytes() for ch in self.channels)

    def push(self, channel: int, cmd: tuple[int, int]) -> int:
        """Push a command from the CPU (host channels only); returns its FIFO index."""
        return self.channels[channel].push(*cmd)

    def wait(self, channel: int, index: int) -> None:
        """Block until ``index`` of ``channel`` was popped; re-raises a proxy failure first."""
        try:
            self.channels[channel].wait_completion(index)
        finally:
            self.check()

    def check(self) -> None:
        """Raise the first failure of a proxy thread or a kernel producer (typed, with context)."""
        if self.proxy is not None:
            self.proxy.check()
        for ch in self.channels:
            ch.check_error()

    def stats(self) -> dict[str, int]:
        """Proxy counters: commands, writes/bytes/atomics posted, received, held out of order."""
        return dict(self.proxy.stats()) if self.proxy is not None else {}

    def nic_stats(self) -> dict[str, float]:
        """What the ipc NIC model did (messages, bytes, copies, batches, CPU seconds of its
        thread); empty for other transports."""
        fn = getattr(self.transport, "nic_stats", None)
        return dict(fn()) if fn is not None else {}

    def peer_regions(self, ranks: list[int]) -> list[int]:
        """Where each of ``ranks``' regions is mapped in this process, for producers that store
        in place (``bytes_in_place``); needs :meth:`connect`."""
        if not self.bytes_in_place:
            raise InvalidInputError(
                "peer_regions is for an ipc endpoint made with bytes_in_place=True "
                f"(this one: transport {self.transport_kind}, bytes_in_place False)"
            )
        return [int(self.transport.peer_region(r)) for r in ranks]

    def counter_values(self) -> list[int]:
        """Current software-atomic counters of this rank."""
        return list(self.counters.values())

    def close(self, timeout_ms: int = 0) -> None:
        """Stop the proxy threads (idempotent); the transport is released with this object.

        Waits at most ``timeout_ms`` (0: 5 s) for each thread. A thread stuck inside a transport
        call raises ``CommTimeoutError`` naming it; the proxy, transport, channels and counters
        are then kept alive for the rest of the process (the thread may still use them), and
        ``close()`` may be called again.
        """
        if self.proxy is None:
            return
        try:
            self.proxy.stop(timeout_ms)
        except CommTimeoutError:
            _STUCK.append((self.proxy, self.transport, self.channels, self.counters))
            raise

    def __enter__(self) -> ProxyEndpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = [
    "ProxyConfig",
    "ProxyEndpoint",
    "choose_transport",
    "exchange",
    "rdma_usable",
]

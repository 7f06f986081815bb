"""Where a ``Buffer``'s ranks run: its device, the (virtual) nodes, and ranks sharing a GPU."""

from __future__ import annotations

import itertools
import pickle

import torch
import torch.distributed as dist

from uccl_ep_megatron.backends.agreement.group import BufferGroup, Peer, bounded, poisoned_reason
from uccl_ep_megatron.core.config import env_ranks_per_node
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError, UnsupportedError


def group_device(
    group: dist.ProcessGroup, backend_name: str, device: torch.device | str | int | None
) -> torch.device:
    """The device of the Buffer's tensors: the caller's ``device``, else the current CUDA
    device for NCCL groups and for gloo groups that ask for the GPU kernels (ranks sharing a
    GPU), else the CPU."""
    if device is not None:
        try:
            dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidInputError(f"device={device!r} is not a device ({exc})") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise InvalidInputError(f"device={device!r} but no GPU is visible; pass 'cpu'")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        return dev
    group_backend = dist.get_backend(group)
    if group_backend == "gloo" and backend_name != "kernels":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if group_backend == "gloo":
            raise UnsupportedError(
                "backend='kernels' is unavailable: no GPU is visible; use backend='reference' "
                "on CPU"
            )
        raise InvalidInputError(
            f"the group uses the {group_backend!r} backend but no GPU is visible; use a gloo "
            "group on CPU"
        )
    return torch.device("cuda", torch.cuda.current_device())


def meet(
    group: dist.ProcessGroup,
    device: torch.device,
    timeout_ms: int,
    ranks_per_node: int | None = None,
) -> BufferGroup:
    """The construction exchange: every rank's ``Peer``, bounded by ``timeout_ms``.

    It runs in the default store, not as a collective, so a rank that gives up leaves nothing
    posted on the process group. Ranks pair by their count of constructions on the group; the
    first rank to decide writes the outcome ("ok" once every rank arrived, else who gave up
    waiting for whom), so a rank that arrives after the others gave up raises at once instead
    of waiting for them.
    """
    reason = poisoned_reason(group)
    if reason is not None:
        raise CommTimeoutError(
            f"the process group is unusable: {reason}, and NCCL cannot cancel that collective. "
            "Create a new process group (torch.distributed.new_group, or destroy_process_group "
            "+ init_process_group) and build the Buffer on it, or restart the job"
        )
    store = dist.distributed_c10d._get_default_store()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    base = f"uccl_ep/{getattr(group, 'group_name', '') or 'group'}"
    number = store.add(f"{base}/constructions/{rank}", 1)
    prefix = f"{base}/buffer{number}"
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    store.set(f"{prefix}/peer/{rank}", pickle.dumps(Peer.here(gpu, ranks_per_node)))
    keys = [f"{prefix}/peer/{r}" for r in range(size)]
    arrived = bounded(timeout_ms, lambda: store.check(keys))
    missing = [] if arrived else [r for r, k in enumerate(keys) if not store.check([k])]
    verdict = (
        "ok"
        if arrived
        else (
            f"rank {rank} gave up after UCCL_EP_TIMEOUT_MS={timeout_ms} ms waiting for rank(s) "
            f"{missing} to construct Buffer #{number} of the group"
        )
    )
    outcome = store.compare_set(f"{prefix}/outcome", "", verdict).decode()
    if outcome != "ok":
        late = "" if not arrived else " (this rank arrived after that)"
        raise CommTimeoutError(
            f"rank {rank}: Buffer construction: {outcome}{late}. Every rank of the group must "
            "construct the Buffer; nothing is pending on the process group, which stays "
            "usable: construct a new Buffer on every rank (raise UCCL_EP_TIMEOUT_MS if a rank "
            "is only slow)"
        )
    peers = [pickle.loads(store.get(k)) for k in keys]
    private = dist.get_backend(group) == "gloo" and device.type == "cpu"
    return BufferGroup(group, store, prefix, number, peers, timeout_ms, private)


def detect_placement(
    peers: list[Peer], rank: int, device: torch.device, requested: int | None = None
) -> tuple[int, int]:
    """Ranks per (virtual) node, checked against where the ranks really run, and how many
    ranks of the group share this rank's GPU (1 unless ranks share GPUs under MPS).

    Ranks per node: ``requested`` (``BufferOptions.ranks_per_node``; None:
    ``UCCL_EP_RANKS_PER_NODE``) for virtual nodes, or ``LOCAL_WORLD_SIZE`` when set, else the
    count of ranks sharing rank 0's host. Nodes must be runs of consecutive ranks.
    """
    size = len(peers)
    settings = [p.ranks_per_node for p in peers]
    if len(set(settings)) > 1:
        by_rank = ", ".join(
            f"{'unset' if v is None else repr(v)} on rank {r}" for r, v in enumerate(settings)
        )
        raise InvalidInputError(
            f"UCCL_EP_RANKS_PER_NODE (or BufferOptions.ranks_per_node) differs between the "
            f"ranks of the group ({by_rank}); set it to the same value on every rank (or unset "
            "it everywhere)"
        )
    places = [(p.host, p.gpu) for p in peers]
    hosts = [p[0] for p in places]
    me = places[rank]
    sharers = sum(1 for p in places if p == me) if device.type == "cuda" else 1
    host_nodes = contiguous_runs(hosts)
    if host_nodes is None:
        raise UnsupportedError(
            f"ranks of one host are not consecutive in the group ({hosts}); launch with ranks "
            "grouped by node (torchrun does this)"
        )
    from_env = env_ranks_per_node(size, requested)
    if from_env is not None:
        if host_nodes % from_env:
            raise InvalidInputError(
                f"ranks_per_node={from_env} (BufferOptions.ranks_per_node, UCCL_EP_RANKS_PER_NODE "
                f"or LOCAL_WORLD_SIZE) makes a node span two hosts "
                f"(each host has {host_nodes} consecutive ranks); use a divisor of that"
            )
        return from_env, sharers
    return host_nodes, sharers


def sm_budget(device: torch.device, sharers: int) -> int | None:
    """The largest even SM count each of ``sharers`` ranks on one GPU may use; ``None`` when
    the GPU is not shared (no limit beyond the device's own)."""
    if device.type != "cuda" or sharers <= 1:
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(2, sms // sharers // 2 * 2)


def contiguous_runs(hosts: list[str | None]) -> int | None:
    """Ranks per host when every host holds one run of equal length, else ``None``."""
    runs = [len(list(g)) for _, g in itertools.groupby(hosts)]
    if len(runs) != len(set(hosts)) or len(set(runs)) != 1:
        return None
    return runs[0]

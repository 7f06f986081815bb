"""Where a ``Buffer``'s ranks run: its device, the (virtual) nodes, and ranks sharing a GPU."""

from __future__ import annotations

import itertools
import socket

import torch
import torch.distributed as dist

from uccl_ep_megatron.core.config import env_ranks_per_node
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError


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


def detect_placement(
    group: dist.ProcessGroup, device: torch.device, requested: int | None = None
) -> tuple[int, int]:
    """Ranks per (virtual) node, checked against where the ranks really run, and how many
    ranks of the group share this rank's GPU (1 unless ranks share GPUs under MPS).

    Ranks per node: ``requested`` (``BufferOptions.ranks_per_node``; None:
    ``UCCL_EP_RANKS_PER_NODE``) for virtual nodes, or ``LOCAL_WORLD_SIZE`` when set, else the
    count of ranks sharing rank 0's host. Nodes must be runs of consecutive ranks.
    """
    size = dist.get_world_size(group)
    gpu = None
    if device.type == "cuda":
        gpu = str(torch.cuda.get_device_properties(device).uuid)
    places: list[tuple[str, str | None] | None] = [None] * size
    dist.all_gather_object(places, (socket.gethostname(), gpu), group=group)
    hosts = [p[0] for p in places]
    me = places[dist.get_rank(group)]
    sharers = sum(1 for p in places if p == me) if gpu is not None else 1
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

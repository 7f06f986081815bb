"""What the internode kernels recorded, turned into the exception every rank raises.

The kernels write their first failure into the Buffer's mapped host status words: a timed-out
wait (which rank, channel, counter value), a corrupted slot, or, for a sync-free call, the GPU
verdict on the call headers (``agreement.device_verdict``). Reading the words never waits for
the GPU: they are host memory the kernels of earlier calls wrote.
"""

from __future__ import annotations

from typing import Any

import torch

from uccl_ep_megatron.backends.agreement import verdict_message
from uccl_ep_megatron.backends.base import Topology
from uccl_ep_megatron.core.errors import CommTimeoutError, InvalidInputError, UcclEpError

# Site of the NVLink barrier (word 1 is then the peer's local index) and of the node's
# placement exchange (word 1 the peer's rank, word 2 the sequence); kernels/internode.h.
_SITE_NVL_BARRIER = 17
_SITE_PLACE = 20
_STATE_NAMES = ("dispatch_sent", "dispatch_consumed", "combine_sent", "combine_consumed", "calls")


def stream_state(
    c_in: Any, endpoint: Any, state: torch.Tensor, topology: Topology, channel: int, peer: int
) -> str:
    """Counters and kernel positions of one channel toward a peer's node (after a timeout;
    it reads the device state words back, which waits for the GPU)."""
    if not 0 <= channel < c_in.MAX_CHANNELS or not 0 <= peer < topology.num_ranks:
        return "no stream state"
    node = peer // topology.ranks_per_node
    vals = endpoint.counter_values()
    counters = {
        k: vals[c_in.counter_index(v, channel, node)] for k, v in c_in.COUNTER_KINDS.items()
    }
    words = state.tolist()
    per_kind = c_in.MAX_CHANNELS * c_in.MAX_NODES
    at = channel * c_in.MAX_NODES + node
    positions = {n: words[i * per_kind + at] for i, n in enumerate(_STATE_NAMES)}
    return f"counters for node {node}: {counters}, kernel positions: {positions}"


def recorded_error(
    c_in: Any,
    status: int,
    endpoint: Any,
    state: torch.Tensor,
    topology: Topology,
    timeout_ms: int,
) -> UcclEpError | None:
    """The error the status words hold, or ``None``. The words stay set: the kernels of every
    later call give up at once, and each host-visible point raises the error again."""
    st = c_in.status_read(status)
    if not st[0]:
        return None
    peer, want, site, channel, got = st[1], st[2], st[3], st[4], st[5]
    if site == c_in.SITE_AGREEMENT:
        return InvalidInputError(
            f"rank {topology.rank}: a sync-free call (num_worst_tokens > 0) was rejected on every "
            f"rank by the GPU check of the call headers: "
            f"{verdict_message(int(want), int(peer), int(got))}. No kernel moved data; its outputs "
            "hold NaN rows, -1 ids, 0 weights and -1 source indices. This Buffer is unusable now; "
            "create a new one"
        )
    what = c_in.SITES.get(site, f"site {site}")
    if site == _SITE_NVL_BARRIER:
        peer = topology.node * topology.ranks_per_node + peer
        detail = f"barrier #{want}"
    elif site == _SITE_PLACE:
        detail = f"placement #{want} (saw #{got})"
    else:
        streams = stream_state(c_in, endpoint, state, topology, channel, peer)
        detail = f"channel {channel}, waited for {want}, saw {got}; {streams}"
    return CommTimeoutError(
        f"rank {topology.rank} (node {topology.node}): internode {what} failed waiting for rank "
        f"{peer} (node {peer // topology.ranks_per_node}), {detail}, within "
        f"UCCL_EP_TIMEOUT_MS={timeout_ms}. Rank {peer} crashed, stopped calling "
        "dispatch/combine in step with this rank, or its proxy stopped; raise "
        "UCCL_EP_TIMEOUT_MS if it is only slow. This Buffer is unusable now. "
        f"Proxy of this rank: {endpoint.stats()}"
    )


__all__ = ["recorded_error", "stream_state"]

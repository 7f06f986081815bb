"""The ``kernels_internode`` backend: HT dispatch/combine across (virtual) nodes.

Token bytes cross nodes the UCCL-EP way: GPU warps pack each token **once per destination
node** into a send ring of this rank's registered RDMA region and push 16-byte ``TransferCmd``
descriptors (Write + software-atomic tail update) into GPU->CPU FIFO channels; the CPU proxy
(``uccl_ep_megatron.proxy``) posts them through the transport (``verbs`` on RDMA NICs, ``ipc``
on one host) to the rank with the same local index on the destination node (the rail); the
receiving proxy applies the tail update only after the write landed (receiver-side ordering,
so out-of-order NICs such as EFA and the ``ipc`` reorder injector are safe); forwarder warps
there copy the token over NVLink to every local rank hosting one of its experts. Combine runs
backwards and hierarchically: each node sums its rows of a token into one partial, one partial
per (token, node) crosses the network, and the source adds them up (``csrc/kernels/internode.h``).

Every call starts with the all-gather (NCCL) of the call header (``agreement``; exchanged by
``header.py``), which carries the per-rank and per-expert counts and the expert-id / layout
checks. Being stream-ordered, it also makes sure every rank finished its previous kernels (every
ring is drained before a call with another layout). The index tables (final rows, per-rank
prefixes, per-channel stream lists) are built from the gathered rows on the GPU by one kernel
(``tables.py`` has their torch form); no count is copied from the host to the device.

- Exact mode (``num_worst_tokens=0``): a dispatch reads the gathered headers on the host once,
  with its local experts' received counts summed on the device, so ranks that disagree or
  reject their arguments all raise the same error before any kernel runs and the outputs are
  sized. A cached dispatch and a combine read back the headers alone.
- Sync-free mode (``num_worst_tokens=W > 0``, and the cached dispatch / combine of its handle):
  nothing is read back. Outputs have W rows; the headers are checked on the GPU
  (``agreement.device_verdict``) and a rejection (bad expert id, layout tensors that disagree
  with ``topk_idx``, more than W rows or tokens at a rank, W not the same on every rank, ranks
  in different calls) makes every rank's kernels record it in the status words and move
  nothing; the outputs are poisoned, and the next host-visible point raises it on every rank
  (``diagnostics.py``).

Virtual nodes: ``UCCL_EP_RANKS_PER_NODE`` splits one host's GPUs into nodes and the path is the
same. The proxies' transport is chosen as on a cluster (``UCCL_EP_TRANSPORT``; ``auto`` is
``verbs`` when an RDMA port is active, else ``ipc``, a copy into the peer's IPC-mapped region);
only ``ipc`` has run, on hosts without a NIC, so set ``UCCL_EP_TRANSPORT=ipc`` for virtual nodes.
"""

from uccl_ep_megatron.backends.internode.backend import NUM_FIFO_CHANNELS, InternodeBackend
from uccl_ep_megatron.backends.internode.diagnostics import recorded_error, stream_state
from uccl_ep_megatron.backends.internode.tables import (
    CallTables,
    DispatchState,
    call_tables,
    dst_rows,
    expert_counts,
    received_expert_counts,
    stream_tables,
    streams,
)

__all__ = [
    "NUM_FIFO_CHANNELS",
    "CallTables",
    "DispatchState",
    "InternodeBackend",
    "call_tables",
    "dst_rows",
    "expert_counts",
    "received_expert_counts",
    "recorded_error",
    "stream_state",
    "stream_tables",
    "streams",
]

"""The ``kernels`` backend: our CUDA/HIP intranode kernels (``_C``) over NVLink / xGMI.

Every rank allocates one registered buffer of ``num_nvl_bytes`` (cudaMalloc in ``_C``), and the
ranks all-gather its IPC handle once, at ``Buffer`` creation, so each kernel can write into
every peer's buffer directly. A dispatch is two launches on the communication stream:

1. ``notify``: each rank writes its per-rank and per-expert counts into every peer's control
   region and waits for theirs (the entry barrier). Outputs: ``rank_prefix_matrix`` and the
   aligned per-local-expert counts; in exact mode the host reads them once (one sync, as
   DeepEP does) to size the outputs. With ``num_worst_tokens`` (sync-free mode) the outputs
   have that many rows, the kernels read every offset from the device matrix, and notify
   itself records bad input or an overflow in the status word, raised at the next call.
2. ``dispatch``: every token row is read once and written to each destination rank at its final
   row index: straight into this rank's output tensors for rows it keeps, into the peer's
   staging region otherwise. Top-k ids become local ids (-1 elsewhere), weights 0.0 there.
   Each chunk of tokens is published to the receiver with one release store (its row range).
3. In the same kernel, receiver blocks copy each peer chunk from staging into the freshly
   allocated outputs as soon as it lands (local HBM copy hidden under the NVLink transfer),
   and fill ``num_worst_tokens`` padding.

Zero-copy receive (``arena.py``, ``UCCL_EP_RECV_ARENA_BYTES``): when a rank's outputs fit in
its receive arena (a second registered region every peer maps once), they are views of one
arena block, and the dispatch kernel hands the block's offsets to every peer at its start;
senders write that rank's rows straight into its outputs (no staging, no copy-out, every block
sends), signal "done" after their last row, and its kernel ends once every peer's arrived.
Each rank decides per call; a rank whose outputs do not fit is staged as above.

Combine mirrors it: ``push`` sends each received row back to its source rank's staging and
``reduce`` sums each token's rows in rank order in fp32 (rows kept locally read in place).
Every wait has a deadline (``UCCL_EP_TIMEOUT_MS``); a timeout is recorded in mapped host
memory and raised here as ``CommTimeoutError`` naming the stalled rank and barrier. The wait
that times out also writes an abort record into every peer's control region (as the host does
when it rejects a call or leaves one: an interrupt, an error of its own), and every wait and
entry barrier of a peer checks it: a rank that reaches the call late would otherwise pass the
barrier its peer signalled before giving up. It raises at once instead, naming the rank that
gave up and where (exact dispatches in the call; combine and sync-free calls at the next host
read of the status word, their outputs poisoned until then). A peer whose process exits posts
nothing: a thread of each rank watches its peers' processes (``backends/liveness.py``; same
host and pid namespace) and posts an abort record in the dead rank's name into this rank's own
control region, so its waits stop at once and raise naming that rank and pid. Barrier
sequence numbers come from a counter in the control region, not from launch arguments, so a
CUDA graph of these calls replays with fresh ones.
"""

from uccl_ep_megatron.backends.intranode.backend import KernelsBackend
from uccl_ep_megatron.backends.intranode.launch import (
    CombineTensors,
    launch_layout,
    poison_on_timeout,
    prepare_combine,
    warm_poison,
)

__all__ = [
    "CombineTensors",
    "KernelsBackend",
    "launch_layout",
    "poison_on_timeout",
    "prepare_combine",
    "warm_poison",
]

"""Agreement before action: the per-call header every rank exchanges with its counts.

Before a dispatch, cached dispatch or combine moves any byte, each rank contributes one
fixed-size row to an all-gather over the group: a header describing the call as this rank sees
it (which call of the ``Buffer``, dtype, hidden size, top-k, experts, FP8 scales, handle,
config, and an error flag when its own argument checks failed), the routing checks that need
the GPU (expert-id bounds, layout-vs-``topk_idx`` mismatches), and the counts the call needs
anyway (tokens sent to each rank, tokens of this rank). Every rank then holds every rank's row
and runs the same checks on the same data, so when ranks disagree, or one rank rejected its
arguments, every rank raises the same error naming the rank, the call and the reason, instead
of one rank failing alone while the others wait in a collective (or, worse, move bytes laid out
differently: a bf16 1.0 read as fp16 arrives as 1.875).

The row has the same length on every rank whatever the call (header, 3 check words, a fixed
block of per-expert counts that a dispatch fills, one count per rank, the token count), so even
ranks in different calls complete the exchange and report it. A rank whose checks failed still
takes part, with the error flag set; the text of its error then follows in a second exchange
that only the error path makes.

The header names the Buffer too (its number, agreed at construction), so calls of two Buffers
of one group never match each other.

The package: ``row`` (the header, the row's encoding, ``Agreement``), ``verdict`` (the same
checks on the GPU), ``packed`` (the intranode kernels' one-word header), ``group`` (the
Buffer's own channel for its exchanges, and their bounded waits that name the rank at fault),
``waits`` (bounded waits for the kernels backends' exchanges).
"""

from uccl_ep_megatron.backends.agreement.group import BufferGroup, Peer
from uccl_ep_megatron.backends.agreement.packed import (
    check_packed_headers,
    describe_packed_header,
    pack_combine_header,
    pack_dispatch_header,
)
from uccl_ep_megatron.backends.agreement.row import (
    COUNTS_COLUMN,
    DTYPE_CODES,
    EXPERT_SLOTS,
    EXPERTS_COLUMN,
    KIND_CACHED,
    KIND_COMBINE,
    KIND_DISPATCH,
    KIND_NAMES,
    LAYOUT_BITS,
    Agreement,
    CallHeader,
    DispatchExperts,
    describe_error,
    describe_layout_bits,
    encode_row,
    error_class,
    error_code,
    header_words,
    host_part,
    local_expert_counts,
    peer_error,
    row_counts,
    row_num_tokens,
    row_width,
)
from uccl_ep_megatron.backends.agreement.verdict import (
    VERDICTS,
    VerdictColumns,
    device_verdict,
    verdict_columns,
    verdict_message,
)
from uccl_ep_megatron.backends.agreement.waits import timeout_error, wait_stream, wait_work

__all__ = [
    "Agreement",
    "BufferGroup",
    "Peer",
    "CallHeader",
    "COUNTS_COLUMN",
    "DTYPE_CODES",
    "DispatchExperts",
    "EXPERT_SLOTS",
    "EXPERTS_COLUMN",
    "KIND_CACHED",
    "KIND_COMBINE",
    "KIND_DISPATCH",
    "KIND_NAMES",
    "LAYOUT_BITS",
    "VERDICTS",
    "VerdictColumns",
    "check_packed_headers",
    "describe_packed_header",
    "describe_error",
    "device_verdict",
    "describe_layout_bits",
    "encode_row",
    "error_class",
    "error_code",
    "header_words",
    "host_part",
    "local_expert_counts",
    "pack_combine_header",
    "pack_dispatch_header",
    "peer_error",
    "row_counts",
    "row_num_tokens",
    "row_width",
    "timeout_error",
    "verdict_columns",
    "verdict_message",
    "wait_stream",
    "wait_work",
]

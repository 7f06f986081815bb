"""Local permutation between the dispatch receive layout and per-expert order.

Three implementations with the same results, one module each, all importable from here: the
fused GPU kernels (``permute_fused.py``: ``permute_fused`` / ``unpermute_fused``), used on
CUDA/HIP tensors when ``_C`` has them; the torch path (``permute_torch.py``: ``make_plan`` /
``permute`` / ``unpermute``), used on the CPU and as the independent reference of the kernels'
tests; and megatron-core's own permutation (``permute_megatron.py``), for
``--moe-permute-fusion``.

``Buffer.dispatch`` returns each received token once, with the ids of the local experts it
chose (``-1`` elsewhere). Megatron's experts want one contiguous segment per local expert
(a token appears once per chosen local expert), segments in expert order, tokens inside a
segment in receive order, with one routing probability per row. With padding for quantized
GEMMs each segment is rounded up to a multiple of the alignment with zero rows (probability
0) that ``unpermute`` drops again.

Capacity mode (``capacity=C > 0``): every segment has exactly ``C`` rows; pairs past the first
``C`` of an expert get no row and are counted in ``dropped``. Every path is differentiable.
"""

from uccl_ep_megatron.token_dispatcher.permute_fused import (
    FusedPlan,
    fused_available,
    permute_fused,
    unpermute_fused,
)
from uccl_ep_megatron.token_dispatcher.permute_megatron import (
    MegatronPlan,
    megatron_fused_permute_available,
    permute_megatron,
    unpermute_megatron,
)
from uccl_ep_megatron.token_dispatcher.permute_torch import (
    PermutePlan,
    check_capacity,
    make_plan,
    permute,
    unpermute,
)

__all__ = [
    "FusedPlan",
    "MegatronPlan",
    "PermutePlan",
    "check_capacity",
    "fused_available",
    "make_plan",
    "megatron_fused_permute_available",
    "permute",
    "permute_fused",
    "permute_megatron",
    "unpermute",
    "unpermute_fused",
    "unpermute_megatron",
]

"""``UcclEpTokenDispatcher``: Megatron-Core's token dispatcher contract on ``uccl_ep`` Buffers.

Like Megatron's flex dispatcher it communicates once over the TP×EP group: the routing map is
expanded so that every expert-TP rank of an expert's EP slot receives the token (rank
``ep_rank * tp_size + tp_rank`` of the group, Megatron's ordering), the partial outputs of the
TP shards are summed by combine. Routing probabilities travel as float32 next to the tokens.

Flow (one MoE layer forward; backward runs the opposite collectives through
``uccl_ep_megatron.ops``):

``dispatch_preprocess``  routing map [T, E] -> top-k ids [T, tp*k] over the TP×EP group
``token_dispatch``        ``ops.dispatch`` (layout + dispatch, async on the comm stream)
``dispatch_postprocess``  received rows -> one segment per local expert (+ quantization pad)
experts
``combine_preprocess``    per-expert rows -> one row per received token (sum)
``token_combine``         ``ops.combine`` back to the source tokens
``combine_postprocess``   original shape
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from uccl_ep_megatron.token_dispatcher.buffer_cache import buffers, hidden_bytes_of
from uccl_ep_megatron.token_dispatcher.options import UcclEpOptions, get_options
from uccl_ep_megatron.token_dispatcher.permute import PermutePlan, make_plan, permute, unpermute

from uccl_ep_megatron import dispatch_metrics, ops
from uccl_ep_megatron.buffer import Buffer
from uccl_ep_megatron.config import MAX_TOPK
from uccl_ep_megatron.errors import InvalidInputError, UnsupportedError

# megatron-core 0.14 names the process-group argument ``model_comm_pgs``, 0.15+ ``pg_collection``.
_PG_KWARG = (
    "pg_collection"
    if "pg_collection" in inspect.signature(MoETokenDispatcher.__init__).parameters
    else "model_comm_pgs"
)
_layer_ids = itertools.count()


def quantization_alignment(config: Any) -> int:
    """Rows per expert are padded to this multiple (1 = no padding) for FP8/FP4 GEMMs."""
    enabled = getattr(config, "moe_router_padding_for_quantization", False) or getattr(
        config, "moe_router_padding_for_fp8", False
    )
    if not enabled:
        return 1
    try:
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    except ImportError:  # megatron-core < 0.16: FP8 only
        from megatron.core.fp8_utils import get_fp8_align_size

        return int(get_fp8_align_size(config.fp8_recipe))
    # 0.19 answers 0 (no padding) when neither FP8 nor FP4 is on.
    return max(1, int(get_align_size_for_quantization(config)))


class UcclEpTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher over the TP×EP group on ``uccl_ep_megatron.Buffer``.

    Args:
        num_local_experts: experts hosted on this rank.
        local_expert_indices: their global ids (contiguous, as ``MoELayer`` passes them).
        config: the layer's ``TransformerConfig``.
        pg_collection: process groups (``ep``, ``expt_tp``, ``tp_ep``); megatron-core 0.14
            callers may pass it as ``model_comm_pgs``.
        options: dispatcher knobs; ``None`` = ``token_dispatcher.options.get_options()``.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
        options: UcclEpOptions | None = None,
    ) -> None:
        pgs = pg_collection if pg_collection is not None else model_comm_pgs
        if pgs is None:
            raise InvalidInputError(
                "UcclEpTokenDispatcher needs the process groups (ep, expt_tp, tp_ep): pass "
                "pg_collection= (MoELayer does), e.g. "
                "ProcessGroupCollection.use_mpu_process_groups()"
            )
        super().__init__(config=config, **{_PG_KWARG: pgs})
        self.options = options if options is not None else get_options()
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.layer_number = next(_layer_ids)
        self._check_config()
        self.num_ranks = self.tp_size * self.ep_size
        # Experts as the TP×EP group sees them: each EP slot's experts repeated per TP rank.
        self.num_comm_experts = self.num_ranks * num_local_experts
        self.comm_topk = self.tp_size * config.moe_router_topk
        self.align = quantization_alignment(config)
        self.router_dtype = getattr(config, "moe_router_dtype", None)
        Buffer.set_num_sms(self.options.num_sms)
        if self.options.metrics:
            dispatch_metrics.enable(True)
        # Per-forward state (set by dispatch, consumed by combine).
        self.hidden_shape: torch.Size | None = None
        self.token_indices: torch.Tensor | None = None
        self.token_probs: torch.Tensor | None = None
        self.buffer: Buffer | None = None
        self.handle = None
        self.recv_topk_idx: torch.Tensor | None = None
        self.recv_counts: list[int] = []
        self.plan: PermutePlan | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def _check_config(self) -> None:
        cfg = self.config
        if cfg.num_moe_experts is None or cfg.num_moe_experts % self.ep_size:
            raise InvalidInputError(
                f"num_moe_experts={cfg.num_moe_experts} is not divisible by the expert-parallel "
                f"size {self.ep_size}; use a multiple of --expert-model-parallel-size"
            )
        if self.num_local_experts * self.ep_size != cfg.num_moe_experts:
            raise InvalidInputError(
                f"num_local_experts={self.num_local_experts} x EP {self.ep_size} != "
                f"num_moe_experts={cfg.num_moe_experts}"
            )
        if self.tp_size * cfg.moe_router_topk > MAX_TOPK:
            raise UnsupportedError(
                f"moe_router_topk={cfg.moe_router_topk} x expert TP {self.tp_size} = "
                f"{self.tp_size * cfg.moe_router_topk} routed copies per token exceeds "
                f"{MAX_TOPK}; lower --expert-tensor-parallel-size or the top-k"
            )
        if getattr(cfg, "moe_pad_expert_input_to_capacity", False):
            raise UnsupportedError(
                "moe_pad_expert_input_to_capacity is not supported by the uccl_ep dispatcher "
                "(it is dropless; token dropping with --moe-expert-capacity-factor works); "
                "drop --moe-pad-expert-input-to-capacity or use "
                "--moe-token-dispatcher-type alltoall"
            )

    def set_shared_experts(self, shared_experts: Any) -> None:
        """Shared-expert overlap is not offered; MoELayer then runs the shared expert itself."""
        raise UnsupportedError(
            "moe_shared_expert_overlap is not supported with the uccl_ep dispatcher; the shared "
            "expert still runs (MoELayer computes it outside the dispatcher) when "
            "--moe-shared-expert-overlap is left off"
        )

    # ---- dispatch ---------------------------------------------------------------------------
    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Flatten tokens; turn the [T, E] routing map into top-k ids over the TP×EP group.

        Returns:
            ``(hidden_states [T, H], token_probs [T, tp*k] float32)``; slots without an expert
            (tokens dropped by capacity) have id -1 and probability 0.
        """
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        num_tokens = hidden_states.shape[0]
        num_experts = self.config.num_moe_experts
        routing_map = routing_map.reshape(num_tokens, num_experts)
        probs = probs.reshape(num_tokens, num_experts)
        if self.tp_size > 1:
            # Replicate each EP slot's columns for its TP ranks: comm expert
            # (ep * tp + tp_rank) * L + l, so rank ep * tp + tp_rank receives the token.
            shape = (num_tokens, self.ep_size, 1, self.num_local_experts)
            full = (num_tokens, self.num_comm_experts)
            routing_map = routing_map.reshape(shape).expand(-1, -1, self.tp_size, -1).reshape(full)
            probs = probs.reshape(shape).expand(-1, -1, self.tp_size, -1).reshape(full)
        # Top-k of the 0/1 map, not of the probabilities: a chosen expert with probability 0
        # must still be dispatched (its gradient is not 0).
        k = min(self.comm_topk, self.num_comm_experts)
        chosen, indices = torch.topk(routing_map.to(torch.float32), k, dim=-1)
        selected = chosen > 0
        self.token_indices = torch.where(selected, indices, -1)
        token_probs = probs.gather(1, indices).float()
        self.token_probs = torch.where(selected, token_probs, 0.0)
        return hidden_states, self.token_probs

    def token_dispatch(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor | None = None,
        async_finish: bool = True,
        allocate_on_comm_stream: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each token once to every rank hosting one of its experts.

        Args:
            hidden_states: ``[T, H]`` from ``dispatch_preprocess``.
            probs: ``[T, tp*k]`` float32 from ``dispatch_preprocess`` (its own if ``None``).
            async_finish, allocate_on_comm_stream: as in ``Buffer.dispatch`` (Megatron's
                flex path passes ``True``; the result is joined to the current stream).

        Returns:
            ``(recv_x [N, H], recv_probs [N, tp*k] float32)``.
        """
        if self.token_indices is None:
            raise InvalidInputError("token_dispatch called before dispatch_preprocess")
        probs = self.token_probs if probs is None else probs
        if probs.dtype != torch.float32:
            probs = probs.float()
        self.buffer = buffers.get(
            self.tp_ep_group, hidden_bytes_of(hidden_states), self.options.backend
        )
        timer = dispatch_metrics.recorder.start(hidden_states.device)
        recv_x, recv_idx, recv_probs, counts, handle = ops.dispatch(
            self.buffer,
            hidden_states,
            self.token_indices,
            probs,
            self.num_comm_experts,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        dispatch_metrics.recorder.record(
            timer, self.layer_number, "dispatch", recv_x.numel() * recv_x.element_size()
        )
        self.handle = handle
        self.recv_topk_idx = recv_idx
        self.recv_counts = list(counts)  # exact per local expert (alignment 1)
        return recv_x, recv_probs

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Received rows -> per-local-expert segments.

        Returns:
            ``(rows [sum(tokens_per_expert), H], tokens_per_expert [L] int64 on the CPU,
            permuted_probs [rows] float32, float64 with --moe-router-dtype fp64)``.
        """
        if self.recv_topk_idx is None:
            raise InvalidInputError("dispatch_postprocess called before token_dispatch")
        self.plan = make_plan(
            self.recv_topk_idx, self.num_local_experts, self.align, counts=self.recv_counts
        )
        if dispatch_metrics.is_enabled():
            dispatch_metrics.recorder.note_tokens(self.layer_number, self.recv_counts)
        rows, permuted_probs = permute(self.plan, hidden_states, probs)
        if self.router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        self.tokens_per_expert = torch.tensor(self.plan.tokens_per_expert, dtype=torch.int64)
        return rows, self.tokens_per_expert, permuted_probs

    # ---- combine ----------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Per-expert rows (already weighted by the experts) -> one row per received token."""
        if self.plan is None:
            raise InvalidInputError("combine_preprocess called before dispatch_postprocess")
        return unpermute(self.plan, hidden_states)

    def token_combine(
        self,
        hidden_states: torch.Tensor,
        async_finish: bool = True,
        allocate_on_comm_stream: bool = True,
    ) -> torch.Tensor:
        """Sum the rows back into their source tokens (the inverse of ``token_dispatch``)."""
        if self.handle is None or self.buffer is None:
            raise InvalidInputError("token_combine called without a preceding token_dispatch")
        timer = dispatch_metrics.recorder.start(hidden_states.device)
        out = ops.combine(
            self.buffer,
            hidden_states.contiguous(),
            self.handle,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        dispatch_metrics.recorder.record(
            timer,
            self.layer_number,
            "combine",
            hidden_states.numel() * hidden_states.element_size(),
        )
        # The autograd graph keeps what backward needs; drop the forward's references.
        self.handle = None
        self.plan = None
        self.recv_topk_idx = None
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Restore the input's shape."""
        return hidden_states.view(self.hidden_shape)

"""``UcclEpTokenDispatcher``: Megatron-Core's token dispatcher contract on ``uccl_ep`` Buffers.

Like Megatron's flex dispatcher it communicates once over the TP×EP group: the routing map is
expanded so that every expert-TP rank of an expert's EP slot receives the token (rank
``ep_rank * tp_size + tp_rank`` of the group, Megatron's ordering), the partial outputs of the
TP shards are summed by combine. Routing probabilities travel as float32 next to the tokens.

Flow (one MoE layer forward; backward runs the opposite collectives through
``uccl_ep_megatron.api.ops``):

``dispatch_preprocess``  routing map [T, E] -> top-k ids [T, tp*k] over the TP×EP group
``token_dispatch``        ``ops.dispatch`` (layout + dispatch, async on the comm stream); with
                          ``fp8_dispatch`` the rows travel as E4M3 + per-128 scales
                          (``fp8.dispatch_fp8``) and arrive dequantized
``dispatch_postprocess``  received rows -> one segment per local expert (+ quantization pad)
experts
``combine_preprocess``    per-expert rows -> one row per received token (sum)
``token_combine``         ``ops.combine`` back to the source tokens
``combine_postprocess``   original shape

Two modes (``mode`` attribute, chosen from the config when the dispatcher is built), and two
sizings of sync-free mode (``dropless``; ``mode_name`` says which):

- **exact** (dropless, the default): dispatch reads the received counts back to the host, the
  layer's one host sync; ``tokens_per_expert`` comes from that read (the dispatch's
  ``num_recv_tokens_per_expert_list``, rounded to the quantization alignment). Nothing else
  reads back. Experts that take their counts on the GPU (``device_counts``, below) get the
  fused plan's equal GPU sizes instead, so the host sends nothing up after its read.
- **sync-free, with a capacity**: a per-rank capacity fixes every size on the host, so
  dispatch -> experts -> combine never waits for the GPU. Dispatch returns ``num_worst_tokens``
  rows (padding rows have no expert), every local expert gets exactly ``C`` rows and
  ``tokens_per_expert`` is the constant ``[C] * L``. Where the experts take their counts on the
  GPU (``TorchGroupedMLP``: ``device_counts``, set by the plugin's ``MoELayer``), the fused
  permutation packs the segments instead: expert ``e`` gets its kept pairs (at most ``C``) back
  to back, the rows past the last segment are padding (not written), and ``tokens_per_expert``
  is the int32 GPU tensor of segment sizes, so the grouped GEMMs skip the padding; still no
  host sync. ``C`` comes from Megatron's ``moe_expert_capacity_factor`` with
  ``moe_pad_expert_input_to_capacity`` (the router already dropped tokens past the capacity, so
  nothing is dropped here), else from ``UcclEpOptions.capacity_factor``
  (``--moe-uccl-ep-capacity-factor``; pairs past ``C`` are dropped, counted on the GPU and
  logged every ``drop_log_interval`` forward passes from an asynchronous copy).
- **sync-free, dropless** (``UcclEpOptions.sync_free``, ``--moe-uccl-ep-sync-free``, with no
  capacity): sync-free with no capacity at all. The experts get ``B`` rows, a bound of every
  pair the ``num_worst_tokens`` received rows can hold (``num_worst_tokens x min(k, L)`` plus
  the alignment padding, ``sizing.bounded_rows``), with every pair's row packed by expert as in
  exact mode; ``tokens_per_expert`` is the GPU tensor of segment sizes. Nothing is dropped, so
  the layer computes what exact mode does, without its host sync. The rows past the last
  segment are neither written nor read (the grouped GEMMs and the fused SwiGLU stop at the
  last offset); what the bound costs is memory, not bandwidth. Needs experts that take their
  counts on the GPU (``device_counts``): ``set_experts`` refuses any other.

Under Megatron's EP overlap schedule (``--overlap-moe-expert-parallel-comm``: dispatch and
combine are separate schedule nodes on Megatron's communication stream, overlapped with the
other micro-batch's compute) the dispatcher works as the ``flex`` dispatcher's DeepEP path does:
``token_dispatch`` and ``token_combine`` (and their backward) run asynchronously on the Buffer's
communication stream, ordered by events with the stream that called (``ops``). Two things
change for the schedule's memory handling, which frees a node's input right after the node's
forward (``untyped_storage().resize_(0)``, the dispatch node's and the expert node's): the
dispatch input is a copy of the tokens (the tokens themselves are the pre-MLP layernorm's
output, which the router's and shared experts' backward read), and the Buffer has no receive
arena (its rows are not the caching allocator's: they could not be resized, and a stream
other than the caller's that reads them is not ordered before their reuse).

With ``--moe-shared-expert-overlap``, where megatron-core's ``flex`` dispatcher overlaps the
shared expert (0.19+), the dispatcher calls the shared expert's split forward exactly where
``flex`` does: its first GEMM after the dispatch, its second after the combine, on its stream.

On a GPU the permutation runs on the fused kernels (``permute.permute_fused``); on the CPU, and
where ``_C`` lacks them, on the torch path (``permute.make_plan``). ``--moe-permute-fusion``
selects megatron-core's fused (Transformer Engine) permutation instead where it fits (exact mode,
no alignment padding, Transformer Engine present); the choice is logged once.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
from typing import Any

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache, configs, hidden_bytes_of
from uccl_ep_megatron.token_dispatcher.fp8 import BLOCK as FP8_BLOCK
from uccl_ep_megatron.token_dispatcher.fp8 import dispatch_fp8
from uccl_ep_megatron.token_dispatcher.options import UcclEpOptions, get_options
from uccl_ep_megatron.token_dispatcher.permute import (
    FusedPlan,
    MegatronPlan,
    PermutePlan,
    fused_available,
    make_plan,
    megatron_fused_permute_available,
    permute,
    permute_fused,
    permute_megatron,
    unpermute,
    unpermute_fused,
    unpermute_megatron,
)
from uccl_ep_megatron.token_dispatcher.sizing import (
    DropLog,
    bounded_rows,
    quantization_alignment,
    sync_free_sizes,
)

from uccl_ep_megatron.api import ops
from uccl_ep_megatron.api.buffer import Buffer
from uccl_ep_megatron.core.config import MAX_TOPK
from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError
from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics

log = logging.getLogger(__name__)
EXACT, SYNC_FREE = "exact", "sync-free"

# megatron-core 0.14 names the process-group argument ``model_comm_pgs``, 0.15+ ``pg_collection``.
_PG_KWARG = (
    "pg_collection"
    if "pg_collection" in inspect.signature(MoETokenDispatcher.__init__).parameters
    else "model_comm_pgs"
)
_layer_ids = itertools.count()
_logged: set[str] = set()


def flex_overlaps_shared_experts() -> bool:
    """Whether this megatron-core's ``flex`` dispatcher overlaps the shared expert
    (``--moe-shared-expert-overlap``; 0.19+): releases that refuse it override the base
    dispatcher's ``set_shared_experts`` with one that raises."""
    from megatron.core.transformer.moe import token_dispatcher as mcore

    flex = getattr(mcore, "MoEFlexTokenDispatcher", None)
    return flex is not None and "set_shared_experts" not in vars(flex)


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


class UcclEpTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher over the TP×EP group on ``uccl_ep_megatron.Buffer``.

    Args:
        num_local_experts: experts hosted on this rank.
        local_expert_indices: their global ids (contiguous, as ``MoELayer`` passes them).
        config: the layer's ``TransformerConfig``.
        pg_collection: process groups (``ep``, ``expt_tp``, ``tp_ep``); megatron-core 0.14
            callers may pass it as ``model_comm_pgs``.
        options: dispatcher knobs; ``None`` = ``token_dispatcher.options.get_options()``.
        buffers: the ``BufferCache`` the layers of one model share (the plugin passes one);
            ``None``: this dispatcher owns a private cache.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config: Any,
        pg_collection: Any = None,
        model_comm_pgs: Any = None,
        options: UcclEpOptions | None = None,
        buffers: BufferCache | None = None,
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
        self.buffers = buffers if buffers is not None else BufferCache()
        self.dispatch_config, self.combine_config = configs(self.num_ranks, self.options.num_sms)
        if self.options.metrics:
            dispatch_metrics.enable(True)
        self.mode = self._select_mode()
        # Sync-free mode with no capacity: the dropless bounded layout.
        self.dropless = self.mode == SYNC_FREE and not self._capacity_configured()
        self.te_permute = self._use_te_permute()
        # Megatron's EP overlap schedule (see the module docstring).
        self.overlap = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
        self.buffer_options = self.options.buffer_options()
        if self.overlap:
            self.buffer_options = dataclasses.replace(self.buffer_options, arena_bytes=0)
        # Sync-free mode: sizes per number of input tokens (fixed in training), drop counter.
        self._sizes: dict[int, tuple[int, int]] = {}
        self._bounds: dict[int, int] = {}  # dropless: bounded rows per number of input tokens
        self.dropped: torch.Tensor | None = None  # int64 [1] on the device, accumulated
        self._drop_log = DropLog(self.options.drop_log_interval, self.layer_number, log)
        # Per-forward state (set by dispatch, consumed by combine).
        self.hidden_shape: torch.Size | None = None
        self.token_indices: torch.Tensor | None = None
        self.token_probs: torch.Tensor | None = None
        self.buffer: Buffer | None = None
        self.handle = None
        self.recv_topk_idx: torch.Tensor | None = None
        self.recv_counts: list[int] = []
        self.num_tokens = 0
        self.fused = False  # this forward's permutation runs on the fused kernels
        self.plan: PermutePlan | FusedPlan | MegatronPlan | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        # The experts take tokens_per_expert on the GPU: sync-free mode packs its segments.
        self.device_counts = False

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
        if self.options.fp8_dispatch and cfg.hidden_size % FP8_BLOCK:
            raise InvalidInputError(
                f"FP8 dispatch (--moe-uccl-ep-fp8-dispatch) scales every {FP8_BLOCK} channels: "
                f"hidden_size {cfg.hidden_size} is not a multiple of {FP8_BLOCK}; turn it off"
            )
        if getattr(cfg, "moe_pad_expert_input_to_capacity", False) and (
            getattr(cfg, "moe_expert_capacity_factor", None) is None
        ):
            raise InvalidInputError(
                "moe_pad_expert_input_to_capacity needs --moe-expert-capacity-factor (the "
                "capacity it pads to)"
            )

    def _capacity_configured(self) -> bool:
        pad = getattr(self.config, "moe_pad_expert_input_to_capacity", False)
        return bool(pad) or self.options.capacity_factor is not None

    def _select_mode(self) -> str:
        if self.options.sync_free or self._capacity_configured():
            return SYNC_FREE
        return EXACT

    @property
    def mode_name(self) -> str:
        """The mode with its sizing: ``exact``, ``sync-free dropless`` or ``sync-free with a
        capacity``."""
        if self.mode == EXACT:
            return EXACT
        return f"{SYNC_FREE} {'dropless' if self.dropless else 'with a capacity'}"

    def _use_te_permute(self) -> bool:
        """``--moe-permute-fusion`` selects megatron-core's fused (Transformer Engine)
        permutation where it fits: Transformer Engine present, exact mode, no alignment padding.
        Otherwise uccl_ep's kernels run. Which one is logged once, never silently chosen."""
        ours = "uccl_ep's fused permute kernels on GPU (the torch path on CPU)"
        if not getattr(self.config, "moe_permute_fusion", False):
            _log_once(f"uccl_ep dispatcher: {self.mode} mode; permute/unpermute on {ours}")
            return False
        if not megatron_fused_permute_available():
            why = "Transformer Engine's fused permutation is not importable"
        elif self.mode != EXACT:
            why = "sync-free mode's capacity layout is not Transformer Engine's"
        elif self.align > 1:
            why = f"Transformer Engine's permutation does not pad segments to {self.align}"
        else:
            _log_once(
                f"uccl_ep dispatcher: {self.mode} mode; --moe-permute-fusion: permute/unpermute "
                "on megatron-core's fused permutation (Transformer Engine) on GPU"
            )
            return True
        _log_once(
            f"uccl_ep dispatcher: {self.mode} mode; --moe-permute-fusion: {why}, so "
            f"permute/unpermute run on {ours}"
        )
        return False

    def set_experts(self, experts: Any) -> None:
        """The expert module that takes this dispatcher's rows. Experts that take their counts
        on the GPU (``TorchGroupedMLP``) get packed sync-free segments (``device_counts``);
        any other keeps the padded ``[C] * L`` layout and host counts.

        Raises:
            UnsupportedError: dropless sync-free mode with experts that read their counts on
                the host (only a capacity gives those a layout without a host sync).
        """
        from uccl_ep_megatron.token_dispatcher.grouped_experts import TorchGroupedMLP

        self.device_counts = isinstance(experts, TorchGroupedMLP)
        if self.dropless and not self.device_counts:
            raise self._dropless_needs_device_counts(type(experts).__name__)

    def _dropless_needs_device_counts(self, experts: str) -> UnsupportedError:
        return UnsupportedError(
            f"uccl_ep sync-free mode without a capacity (--moe-uccl-ep-sync-free) packs the "
            f"experts' rows on the GPU, and {experts} reads its per-expert counts on the host: "
            "run the grouped experts (--moe-uccl-ep-grouped-experts, TorchGroupedMLP), or give "
            "a capacity (--moe-uccl-ep-capacity-factor F, pairs past it dropped), or leave "
            "--moe-uccl-ep-sync-free off (exact mode)"
        )

    def capacity(self, num_tokens: int) -> int:
        """Rows per local expert in sync-free mode for ``num_tokens`` input tokens per rank.

        With Megatron's capacity options: Megatron's per-source capacity
        ``ceil(tokens x topk / experts x factor)`` times the group size (each source rank sends
        at most that many rows per expert, as with the ``alltoall`` dispatcher). Otherwise the
        same formula with ``UcclEpOptions.capacity_factor``. Rounded up to the alignment. 0 in
        dropless sync-free mode (no capacity; ``bounded_rows`` gives its rows).
        """
        return self._sync_free_sizes(num_tokens)[0]

    def bounded_rows(self, num_tokens: int) -> int:
        """Dropless sync-free mode: the experts' rows for ``num_tokens`` input tokens per rank
        (``sizing.bounded_rows``); 0 in the other modes."""
        if not self.dropless:
            return 0
        rows = self._bounds.get(num_tokens)
        if rows is None:
            worst = self._sync_free_sizes(num_tokens)[1]
            rows = bounded_rows(worst, self.comm_topk, self.num_local_experts, self.align)
            self._bounds[num_tokens] = rows
            hidden = self.config.hidden_size
            _log_once(
                f"uccl_ep dispatcher: sync-free mode without a capacity gives the experts "
                f"{rows} rows per layer for {num_tokens} tokens per rank over "
                f"{self.num_ranks} ranks ({rows * hidden * 2 / 2**30:.2f} GiB per bf16 "
                f"tensor of width {hidden}); it grows with the group size: give a capacity "
                "(--moe-uccl-ep-capacity-factor) where that does not fit"
            )
        return rows

    def _sync_free_sizes(self, num_tokens: int) -> tuple[int, int]:
        """(capacity per local expert, num_worst_tokens) for ``num_tokens`` tokens per rank."""
        sizes = self._sizes.get(num_tokens)
        if sizes is None:
            sizes = self._sizes[num_tokens] = sync_free_sizes(
                self.config,
                self.options.capacity_factor,
                num_tokens,
                self.num_ranks,
                self.num_local_experts,
                self.align,
            )
        return sizes

    def set_shared_experts(self, shared_experts: Any) -> None:
        """``--moe-shared-expert-overlap``: the shared expert runs on its own stream beside
        dispatch and combine, as in megatron-core's ``flex`` dispatcher, where that release's
        ``flex`` offers it (``flex_overlaps_shared_experts``); elsewhere ``MoELayer`` runs the
        shared expert itself when the flag is left off."""
        if not flex_overlaps_shared_experts():
            raise UnsupportedError(
                "moe_shared_expert_overlap: this megatron-core's flex dispatcher does not overlap "
                "the shared expert, and neither does uccl_ep here (megatron-core 0.19+ does); "
                "leave --moe-shared-expert-overlap off (MoELayer then runs the shared expert)"
            )
        super().set_shared_experts(shared_experts)

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
        if self.overlap:
            # The overlap schedule frees the dispatch node's input after its forward.
            hidden_states = hidden_states.clone()
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
        # must still be dispatched (its gradient is not 0). With Megatron's padding to capacity
        # the map also holds padding picks (probability 0, beyond the token's top-k): rank the
        # routed picks (probability > 0) first; padding picks that do not fit add nothing here
        # (their probability is 0 and its gradient does not reach the router), and the
        # capacity permutation pads every expert with zero rows instead.
        k = min(self.comm_topk, self.num_comm_experts)
        key = routing_map.to(torch.float32)
        if getattr(self.config, "moe_pad_expert_input_to_capacity", False):
            key = key + (probs != 0).to(torch.float32)
        chosen, indices = torch.topk(key, k, dim=-1)
        selected = chosen > 0
        self.token_indices = torch.where(selected, indices, -1)
        token_probs = probs.gather(1, indices).float()
        self.token_probs = torch.where(selected, token_probs, 0.0)
        self.num_tokens = num_tokens
        return hidden_states, self.token_probs

    def token_dispatch(
        self,
        hidden_states: torch.Tensor,
        probs: torch.Tensor | None = None,
        async_finish: bool | None = None,
        allocate_on_comm_stream: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send each token once to every rank hosting one of its experts.

        Args:
            hidden_states: ``[T, H]`` from ``dispatch_preprocess``.
            probs: ``[T, tp*k]`` float32 from ``dispatch_preprocess`` (its own if ``None``).
            async_finish: run on the Buffer's communication stream, ordered by events (``ops``);
                ``None``: under Megatron's EP overlap schedule only (outside it synchronous
                calls cost less host time). The result is joined to the current stream.
            allocate_on_comm_stream: as in ``Buffer.dispatch``.

        Returns:
            ``(recv_x [N, H], recv_probs [N, tp*k] float32)``; in sync-free mode ``N`` is the
            fixed ``num_worst_tokens`` (padding rows have no expert).
        """
        if self.token_indices is None:
            raise InvalidInputError("token_dispatch called before dispatch_preprocess")
        probs = self.token_probs if probs is None else probs
        if probs.dtype != torch.float32:
            probs = probs.float()
        self.buffer = self.buffers.get(
            self.tp_ep_group,
            hidden_bytes_of(hidden_states),
            self.options.backend,
            self.options.num_sms,
            self.buffer_options,
        )
        shared = self.shared_experts
        if shared is not None:
            shared.wait_current_stream()  # its input (the tokens) is ready on its stream
        async_finish = self.overlap if async_finish is None else async_finish
        recv_x, recv_probs = self._send(hidden_states, probs, async_finish, allocate_on_comm_stream)
        if shared is not None:
            # As megatron-core's flex dispatcher: its first GEMM beside the dispatch.
            shared.pre_forward_comm(hidden_states, wait_current_stream=False)
            shared.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_probs

    def _send(
        self, hidden_states: torch.Tensor, probs: torch.Tensor, async_finish: bool, allocate: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_dispatch``'s dispatch call (bf16 or FP8), its metrics and per-forward state."""
        self.fused = fused_available(hidden_states.device)
        worst = self._sync_free_sizes(self.num_tokens)[1] if self.mode == SYNC_FREE else 0
        timer = dispatch_metrics.recorder.start(hidden_states.device)
        if self.options.fp8_dispatch:
            recv_x, recv_idx, recv_probs, counts, handle = dispatch_fp8(
                self.buffer,
                hidden_states,
                self.token_indices,
                probs,
                self.num_comm_experts,
                num_worst_tokens=worst,
                config=self.dispatch_config,
            )
            # What moved: one byte a channel plus a float32 scale per 128 channels.
            moved = recv_x.shape[0] * (recv_x.shape[1] + recv_x.shape[1] // 128 * 4)
        else:
            recv_x, recv_idx, recv_probs, counts, handle = ops.dispatch(
                self.buffer,
                hidden_states,
                self.token_indices,
                probs,
                self.num_comm_experts,
                # True counts (the metrics report them); the aligned sizes come from the host.
                expert_alignment=1,
                num_worst_tokens=worst,
                config=self.dispatch_config,
                async_finish=async_finish,
                allocate_on_comm_stream=allocate,
            )
            moved = recv_x.numel() * recv_x.element_size()
        dispatch_metrics.recorder.record(timer, self.layer_number, "dispatch", moved)
        self.handle = handle
        self.recv_topk_idx = recv_idx
        self.recv_counts = list(counts)  # exact mode: per local expert; sync-free: []
        return recv_x, recv_probs

    def dispatch_postprocess(
        self, hidden_states: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Received rows -> per-local-expert segments.

        Returns:
            ``(rows [sum(tokens_per_expert), H], tokens_per_expert [L] int64 on the CPU,
            permuted_probs [rows] float32, float64 with --moe-router-dtype fp64)``; with
            ``device_counts`` (experts that take GPU counts) and the fused kernels,
            ``tokens_per_expert [L]`` is int32 on the GPU, and sync-free mode's rows are
            ``[L * C, H]`` with packed segments.
        """
        if self.recv_topk_idx is None:
            raise InvalidInputError("dispatch_postprocess called before token_dispatch")
        capacity = self.capacity(self.num_tokens) if self.mode == SYNC_FREE else 0
        bound = self.bounded_rows(self.num_tokens)
        if self.dropless and hidden_states.is_cuda and not (self.fused and self.device_counts):
            raise (
                self._dropless_needs_device_counts("an expert module that was not set")
                if self.fused
                else UnsupportedError(
                    "uccl_ep sync-free mode without a capacity needs the fused permute kernels "
                    "of uccl_ep_megatron._C on GPUs, and this build lacks them: rebuild the "
                    "package, or leave --moe-uccl-ep-sync-free off"
                )
            )
        if self.dropped is None and (self.mode == SYNC_FREE or self.fused):
            # Exact mode's fused plan counts pairs its host sizes leave out (none, unless the
            # sizes and ids disagree) into the same counter: one allocation, not one a call.
            self.dropped = torch.zeros(1, dtype=torch.int64, device=hidden_states.device)
        if self.te_permute and hidden_states.is_cuda:
            rows, permuted_probs, self.plan = permute_megatron(
                hidden_states,
                probs,
                self.recv_topk_idx,
                self.num_local_experts,
                self.recv_counts,
                fused=True,
            )
        elif self.fused:
            rows, permuted_probs, self.plan = permute_fused(
                hidden_states,
                probs,
                self.recv_topk_idx,
                self.num_local_experts,
                align=self.align,
                tokens_per_expert=None if capacity or bound else self._aligned(self.recv_counts),
                capacity=capacity,
                recv_count=getattr(self.handle, "recv_count", None),
                dropped=self.dropped,
                packed=bool(capacity or bound) and self.device_counts,
                max_rows=bound,
            )
        else:
            # Dropless sync-free mode on the CPU: the counts are counted here (host data).
            self.plan = make_plan(
                self.recv_topk_idx,
                self.num_local_experts,
                self.align,
                counts=None if capacity or bound else self.recv_counts,
                capacity=capacity,
            )
            rows, permuted_probs = permute(self.plan, hidden_states, probs)
            if capacity:
                self.dropped += self.plan.dropped
        if dispatch_metrics.is_enabled() and self.mode == EXACT:
            dispatch_metrics.recorder.note_tokens(self.layer_number, self.recv_counts)
        if self.router_dtype == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        if isinstance(self.plan, FusedPlan) and (
            self.plan.tokens_per_expert is None or self.device_counts
        ):
            # Packed segments, or experts that take their counts on the GPU: the plan's sizes
            # there (in exact mode equal to the host's), so nothing goes up from the host.
            self.tokens_per_expert = self.plan.segment_rows
        else:
            self.tokens_per_expert = torch.tensor(self.plan.tokens_per_expert, dtype=torch.int64)
        if self.mode == SYNC_FREE:
            self._drop_log.note(self.dropped)
        return rows, self.tokens_per_expert, permuted_probs

    def _aligned(self, counts: list[int]) -> list[int]:
        return [(c + self.align - 1) // self.align * self.align for c in counts]

    def dropped_pairs(self) -> int:
        """Pairs dropped by the capacity so far on this rank (reads the GPU counter: a sync)."""
        return 0 if self.dropped is None else int(self.dropped.sum())

    # ---- combine ----------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Per-expert rows (already weighted by the experts) -> one row per received token."""
        if self.plan is None:
            raise InvalidInputError("combine_preprocess called before dispatch_postprocess")
        if isinstance(self.plan, FusedPlan):
            # Into the receive arena where the backend has one: combine then reads it in place.
            buffer = self.buffer
            alloc = None if buffer is None else buffer.get_combine_input
            return unpermute_fused(self.plan, hidden_states, alloc)
        if isinstance(self.plan, MegatronPlan):
            return unpermute_megatron(self.plan, hidden_states)
        return unpermute(self.plan, hidden_states)

    def token_combine(
        self,
        hidden_states: torch.Tensor,
        async_finish: bool | None = None,
        allocate_on_comm_stream: bool = True,
    ) -> torch.Tensor:
        """Sum the rows back into their source tokens (the inverse of ``token_dispatch``;
        ``async_finish`` and ``allocate_on_comm_stream`` as there)."""
        if self.handle is None or self.buffer is None:
            raise InvalidInputError("token_combine called without a preceding token_dispatch")
        if self.shared_experts is not None:
            # As flex: the shared expert's second GEMM does not run beside the routed ones.
            self.shared_experts.wait_current_stream()
        timer = dispatch_metrics.recorder.start(hidden_states.device)
        out = ops.combine(
            self.buffer,
            hidden_states.contiguous(),
            self.handle,
            config=self.combine_config,
            async_finish=self.overlap if async_finish is None else async_finish,
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
        """Restore the input's shape; with shared-expert overlap, add the shared expert's
        output (its second GEMM beside the combine's tail, as in flex)."""
        shared = self.shared_experts
        if shared is not None:
            shared.linear_fc2_forward(hidden_states)
            shared.post_forward_comm()
            hidden_states = hidden_states + shared.get_output()
        return hidden_states.view(self.hidden_shape)

"""Sizes a ``UcclEpTokenDispatcher`` fixes on the host: the quantization alignment of the
expert segments, and in sync-free mode the capacity per local expert (or, without one, the bound
of the packed rows) and ``num_worst_tokens`` (see ``dispatcher.py``), plus the log of the
(token, expert) pairs that a capacity dropped."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch


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


def sync_free_sizes(
    config: Any,
    capacity_factor: float | None,
    num_tokens: int,
    num_ranks: int,
    num_local_experts: int,
    align: int,
) -> tuple[int, int]:
    """(capacity per local expert, num_worst_tokens) of sync-free mode for ``num_tokens`` input
    tokens per rank over ``num_ranks`` ranks (``UcclEpTokenDispatcher.capacity`` says how).
    ``capacity_factor`` is ``UcclEpOptions.capacity_factor``, used unless Megatron's own
    capacity options (``moe_pad_expert_input_to_capacity``) are on; with neither, the capacity
    is 0 (no capacity: the dropless bounded layout, ``bounded_rows``)."""
    megatron = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
    factor = config.moe_expert_capacity_factor if megatron else capacity_factor
    if factor is None:
        return 0, max(num_ranks * num_tokens, 1)
    per_source = math.ceil(num_tokens * config.moe_router_topk / config.num_moe_experts * factor)
    capacity = per_source * num_ranks
    capacity = -(-capacity // align) * align
    if megatron:
        # The router capped every expert at `per_source` tokens of this rank, so a source
        # sends a rank at most min(tokens, L x per_source) rows.
        worst = num_ranks * min(num_tokens, num_local_experts * per_source)
    else:
        worst = num_ranks * num_tokens
    return max(capacity, align), max(worst, 1)


def bounded_rows(num_worst_tokens: int, topk: int, num_local_experts: int, align: int) -> int:
    """Rows of sync-free mode's dropless packed layout: every pair the received rows can hold
    (a row carries at most ``min(topk, local experts)`` of this rank's experts), plus each
    segment's alignment padding. No routing can need more, so nothing is ever dropped."""
    pairs = num_worst_tokens * min(topk, num_local_experts)
    return max(pairs + num_local_experts * (align - 1), 1)


class DropLog:
    """The warning about pairs sync-free mode's capacity dropped: every ``interval`` forwards
    (0 = never) of layer ``layer``, from an asynchronous copy of the device counter that is
    never waited for, on the dispatcher's ``logger``."""

    def __init__(self, interval: int, layer: int, logger: logging.Logger) -> None:
        self.interval = interval
        self.layer = layer
        self.logger = logger
        self._forwards = 0
        self._read: tuple[torch.Tensor, Any] | None = None  # (pinned copy, event)
        self._logged = 0

    def note(self, dropped: torch.Tensor) -> None:
        """One forward: every ``interval`` of them, log the count copied at the previous
        interval (if that copy has finished), then start the next copy of ``dropped``."""
        self._forwards += 1
        if not self.interval or self._forwards % self.interval:
            return
        if dropped.device.type != "cuda":
            self._log(int(dropped[0]))
            return
        if self._read is not None and self._read[1].query():
            self._log(int(self._read[0][0]))
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        host.copy_(dropped, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._read = (host, event)

    def _log(self, total: int) -> None:
        if total > self._logged:
            self.logger.warning(
                "uccl_ep layer %s: %d (token, expert) pairs dropped by the sync-free capacity "
                "so far (%d since the last report); raise --moe-uccl-ep-capacity-factor to drop "
                "fewer",
                self.layer,
                total,
                total - self._logged,
            )
            self._logged = total


__all__ = ["DropLog", "bounded_rows", "quantization_alignment", "sync_free_sizes"]

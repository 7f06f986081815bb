"""Per-layer dispatch/combine metrics of the ``uccl_ep`` token dispatcher.

When enabled (``enable()``, ``--moe-uccl-ep-metrics`` or ``UcclEpOptions(metrics=True)``),
every ``UcclEpTokenDispatcher`` records, per MoE layer and forward pass:

* dispatch and combine time (CUDA events on the caller's stream, resolved lazily at
  ``collect()`` so recording never synchronizes; wall-clock on CPU),
* tokens received per local expert (before quantization padding),
* bytes moved: bytes of the received token rows, DeepEP's bandwidth convention, used for both
  dispatch and combine.

Only forward passes are timed; the backward runs the same two collectives in reverse.
``collect()`` returns a ``StepDispatchMetrics`` and resets; ``StepDispatchMetrics.summary()``
gives the metric names of ``uccl_ep_megatron.metrics`` (``dispatch_time_ms``,
``combine_time_ms``, ``dispatch_gbps``, ``combine_gbps``) plus
``local_expert_load_imbalance``: the worst MoE layer's max / mean over this rank's local
experts, which is not ``expert_load_imbalance`` (global experts, averaged over layers).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from uccl_ep_megatron.errors import InvalidInputError


class _Timer:
    """A start/stop pair on the current stream (CUDA events) or the host clock."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.stop = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
            self.t1 = self.t0

    def finish(self) -> None:
        if self.cuda:
            self.stop.record()
        else:
            self.t1 = time.perf_counter()

    def elapsed_ms(self) -> float:
        if self.cuda:
            self.stop.synchronize()
            return float(self.start.elapsed_time(self.stop))
        return (self.t1 - self.t0) * 1e3


@dataclass
class LayerDispatchMetrics:
    """One layer's totals over the forward passes since the last ``collect()``."""

    layer: int
    calls: int = 0
    dispatch_ms: float = 0.0
    combine_ms: float = 0.0
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    tokens_per_local_expert: list[int] = field(default_factory=list)

    @property
    def dispatch_gbps(self) -> float:
        return self.dispatch_bytes / self.dispatch_ms / 1e6 if self.dispatch_ms > 0 else 0.0

    @property
    def combine_gbps(self) -> float:
        return self.combine_bytes / self.combine_ms / 1e6 if self.combine_ms > 0 else 0.0


@dataclass
class StepDispatchMetrics:
    """Everything recorded since the previous ``collect()``, per layer."""

    layers: dict[int, LayerDispatchMetrics]

    def summary(self) -> dict[str, float]:
        """Totals over layers under the names ``uccl_ep_megatron.metrics`` logs; {} if empty."""
        if not self.layers:
            return {}
        d_ms = sum(m.dispatch_ms for m in self.layers.values())
        c_ms = sum(m.combine_ms for m in self.layers.values())
        d_bytes = sum(m.dispatch_bytes for m in self.layers.values())
        c_bytes = sum(m.combine_bytes for m in self.layers.values())
        out = {
            "dispatch_time_ms": d_ms,
            "combine_time_ms": c_ms,
            "dispatch_gbps": d_bytes / d_ms / 1e6 if d_ms > 0 else 0.0,
            "combine_gbps": c_bytes / c_ms / 1e6 if c_ms > 0 else 0.0,
            "dispatch_bytes": float(d_bytes),
        }
        imbalances = [
            _imbalance(m.tokens_per_local_expert)
            for m in self.layers.values()
            if m.tokens_per_local_expert
        ]
        if imbalances:
            # The worst layer: one overloaded expert stalls its whole layer. Only this rank's
            # experts: a different quantity from the global expert_load_imbalance, so another name.
            out["local_expert_load_imbalance"] = max(imbalances)
        return out

    def per_layer(self) -> dict[str, float]:
        """Flat ``layer{N}/<metric>`` values, for per-layer charts."""
        out: dict[str, float] = {}
        for n, m in sorted(self.layers.items()):
            out[f"layer{n}/dispatch_time_ms"] = m.dispatch_ms
            out[f"layer{n}/combine_time_ms"] = m.combine_ms
            out[f"layer{n}/dispatch_gbps"] = m.dispatch_gbps
            out[f"layer{n}/combine_gbps"] = m.combine_gbps
            if m.tokens_per_local_expert:
                out[f"layer{n}/local_expert_load_imbalance"] = _imbalance(m.tokens_per_local_expert)
        return out


def _imbalance(counts: list[int]) -> float:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else 0.0


@dataclass
class _Pending:
    layer: int
    kind: str  # "dispatch" or "combine"
    timer: _Timer
    num_bytes: int
    tokens_per_local_expert: list[int] | None


class DispatchMetricsRecorder:
    """Collects records from dispatchers; thread-safe, cheap when disabled."""

    def __init__(self) -> None:
        self.enabled = False
        self._pending: list[_Pending] = []
        self._lock = threading.Lock()
        self._listeners: list[Callable[[StepDispatchMetrics], Any]] = []

    def start(self, device: torch.device) -> _Timer | None:
        """Start timing an operation; ``None`` when disabled."""
        return _Timer(device) if self.enabled else None

    def record(
        self,
        timer: _Timer | None,
        layer: int,
        kind: str,
        num_bytes: int,
        tokens_per_local_expert: list[int] | None = None,
    ) -> None:
        """Stop ``timer`` and keep the record until ``collect()``."""
        if timer is None:
            return
        if kind not in ("dispatch", "combine"):
            raise InvalidInputError(f"kind={kind!r}: must be 'dispatch' or 'combine'")
        timer.finish()
        with self._lock:
            self._pending.append(
                _Pending(layer, kind, timer, int(num_bytes), tokens_per_local_expert)
            )

    def note_tokens(self, layer: int, tokens_per_local_expert: list[int]) -> None:
        """Attach tokens-per-local-expert counts to the layer's latest dispatch record."""
        if not self.enabled:
            return
        with self._lock:
            for p in reversed(self._pending):
                if p.layer == layer and p.kind == "dispatch":
                    p.tokens_per_local_expert = list(tokens_per_local_expert)
                    return

    def collect(self) -> StepDispatchMetrics:
        """Resolve every pending record (waits for their events), reset, notify listeners."""
        with self._lock:
            pending, self._pending = self._pending, []
        layers: dict[int, LayerDispatchMetrics] = {}
        for p in pending:
            m = layers.setdefault(p.layer, LayerDispatchMetrics(p.layer))
            ms = p.timer.elapsed_ms()
            if p.kind == "dispatch":
                m.calls += 1
                m.dispatch_ms += ms
                m.dispatch_bytes += p.num_bytes
                if p.tokens_per_local_expert is not None:
                    if not m.tokens_per_local_expert:
                        m.tokens_per_local_expert = [0] * len(p.tokens_per_local_expert)
                    for i, c in enumerate(p.tokens_per_local_expert):
                        m.tokens_per_local_expert[i] += c
            else:
                m.combine_ms += ms
                m.combine_bytes += p.num_bytes
        step = StepDispatchMetrics(layers)
        for fn in list(self._listeners):
            fn(step)
        return step

    def add_listener(self, fn: Callable[[StepDispatchMetrics], Any]) -> None:
        """Call ``fn(step_metrics)`` on every ``collect()`` (e.g. a wandb writer)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[StepDispatchMetrics], Any]) -> None:
        """Undo ``add_listener``."""
        self._listeners.remove(fn)


recorder = DispatchMetricsRecorder()


def enable(enabled: bool = True) -> None:
    """Turn recording on (or off); pending records are kept until ``collect()``."""
    recorder.enabled = bool(enabled)


def is_enabled() -> bool:
    """Whether dispatchers record metrics now."""
    return recorder.enabled


def collect() -> StepDispatchMetrics:
    """Records since the last call, per layer (see ``DispatchMetricsRecorder.collect``)."""
    return recorder.collect()

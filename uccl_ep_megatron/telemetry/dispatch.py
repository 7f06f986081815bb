"""The one recorder of token dispatch/combine metrics, per MoE layer, for every dispatcher.

Two producers feed it, and one call is measured once:

* the ``uccl_ep`` dispatcher records its own ``token_dispatch`` / ``token_combine`` when enabled
  (``enable()``, ``--moe-uccl-ep-metrics`` or ``UcclEpOptions(metrics=True)``);
* :func:`instrument` wraps any Megatron dispatcher's ``token_dispatch`` / ``token_combine``
  (``uccl_ep``, ``alltoall``, ...), which is how ``uccl-ep-megatron train`` times every
  dispatcher the same way. A timing opened by :func:`instrument` owns the call: the
  dispatcher's own recording inside it is skipped, so nothing is counted twice.

What each number is, per call (forward passes; the backward's are below):

* **device time** (``dispatch_time_ms`` / ``combine_time_ms``): CUDA events recorded on the
  caller's current stream right before and right after the call. Dispatchers run their
  communication on that stream, or (``uccl_ep``) on a communication stream that first waits for
  it and that it waits for again before the call returns, so the interval is the GPU time from
  "inputs ready" to "outputs ready". Events are resolved at ``collect()``, so recording never
  synchronizes.
* **host time** (``dispatch_host_ms`` / ``combine_host_ms``): CPU wall time spent inside the
  call (``time.perf_counter``): argument checks, launches, and any wait of the host on the GPU.

A host synchronization inside a call (e.g. reading counts back) shows up in **both**: the host
waits for the device (host time), and the device idles until the host launches the rest
(device time). A large host time with a device time close to it means the call is host-bound.
On the CPU (gloo) there is no device clock: both columns hold the same wall time.

* **backward device time** (``dispatch_backward_time_ms`` / ``combine_backward_time_ms``, calls
  timed by :func:`instrument` whose hidden states require a gradient): the backward of a
  dispatch moves the gradient rows back, a combine's backward moves them out again. A tensor
  hook on the call's row output records the start event when that output's gradient has been
  computed, and one on its row input records the stop event when the input's gradient has (on
  the stream the backward runs on; the hooks change neither the graph nor the gradients): the
  GPU time from "output gradient ready" to "input gradient ready", whatever ran on that stream
  in between (if the input feeds other layers too, until their gradients are in as well). With
  forward and backward a step's exchange time is all four columns; ``collect()`` must then come
  after the backward.
* **permutation device time** (``permute_time_ms`` / ``permute_backward_time_ms``, calls timed
  by :func:`instrument`): the dispatcher's other methods around the exchange, where it has them
  (megatron-core's ``dispatch_preprocess``, ``dispatch_postprocess``, ``combine_preprocess``,
  ``combine_postprocess``): sorting rows by expert and back, the counts, and any host sync
  they hold (``alltoall`` reads its split sizes back there). Forward and backward, the same
  events and hooks as above. With them the six columns are everything the dispatcher costs a
  step, the share a dispatcher that cost nothing would save.

Also recorded: tokens received per local expert (before quantization padding) and bytes
moved (bytes of the received token rows, DeepEP's bandwidth convention, used for both
dispatch and combine). ``collect()`` returns a ``StepDispatchMetrics`` and resets;
``StepDispatchMetrics.summary()`` gives the metric names of ``uccl_ep_megatron.telemetry.metrics``
plus ``local_expert_load_imbalance``: the worst MoE layer's max / mean over this rank's local
experts, which is not ``expert_load_imbalance`` (global experts, averaged over layers).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from uccl_ep_megatron.core.errors import InvalidInputError


class _Timer:
    """Device time (CUDA events on the current stream) and host time of one call."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.stop = torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()
        self.t1 = self.t0

    def finish(self) -> None:
        self.t1 = time.perf_counter()
        if self.cuda:
            self.stop.record()

    def host_ms(self) -> float:
        return (self.t1 - self.t0) * 1e3

    def device_ms(self) -> float:
        """The events' interval (waits for the stop event); host time without a device."""
        if self.cuda:
            self.stop.synchronize()
            return float(self.start.elapsed_time(self.stop))
        return self.host_ms()


@dataclass
class LayerDispatchMetrics:
    """One layer's totals over the forward passes since the last ``collect()``."""

    layer: int
    calls: int = 0
    dispatch_ms: float = 0.0
    combine_ms: float = 0.0
    dispatch_host_ms: float = 0.0
    combine_host_ms: float = 0.0
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    tokens_per_local_expert: list[int] = field(default_factory=list)
    dispatch_backward_ms: float = 0.0
    combine_backward_ms: float = 0.0
    backward_calls: int = 0  # backward records, dispatch and combine
    permute_ms: float = 0.0  # the dispatcher's methods around the exchange (module doc)
    permute_backward_ms: float = 0.0
    permute_calls: int = 0  # permutation records, forward and backward

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
        """Totals over layers under the names ``telemetry.metrics`` logs; {} if empty."""
        if not self.layers:
            return {}
        d_ms = sum(m.dispatch_ms for m in self.layers.values())
        c_ms = sum(m.combine_ms for m in self.layers.values())
        d_bytes = sum(m.dispatch_bytes for m in self.layers.values())
        c_bytes = sum(m.combine_bytes for m in self.layers.values())
        out = {
            "dispatch_time_ms": d_ms,
            "combine_time_ms": c_ms,
            "dispatch_host_ms": sum(m.dispatch_host_ms for m in self.layers.values()),
            "combine_host_ms": sum(m.combine_host_ms for m in self.layers.values()),
            "dispatch_gbps": d_bytes / d_ms / 1e6 if d_ms > 0 else 0.0,
            "combine_gbps": c_bytes / c_ms / 1e6 if c_ms > 0 else 0.0,
            "dispatch_bytes": float(d_bytes),
        }
        if any(m.backward_calls for m in self.layers.values()):
            out["dispatch_backward_time_ms"] = sum(
                m.dispatch_backward_ms for m in self.layers.values()
            )
            out["combine_backward_time_ms"] = sum(
                m.combine_backward_ms for m in self.layers.values()
            )
        if any(m.permute_calls for m in self.layers.values()):
            out["permute_time_ms"] = sum(m.permute_ms for m in self.layers.values())
            out["permute_backward_time_ms"] = sum(
                m.permute_backward_ms for m in self.layers.values()
            )
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
            out[f"layer{n}/dispatch_host_ms"] = m.dispatch_host_ms
            out[f"layer{n}/combine_host_ms"] = m.combine_host_ms
            out[f"layer{n}/dispatch_gbps"] = m.dispatch_gbps
            out[f"layer{n}/combine_gbps"] = m.combine_gbps
            if m.backward_calls:
                out[f"layer{n}/dispatch_backward_time_ms"] = m.dispatch_backward_ms
                out[f"layer{n}/combine_backward_time_ms"] = m.combine_backward_ms
            if m.permute_calls:
                out[f"layer{n}/permute_time_ms"] = m.permute_ms
                out[f"layer{n}/permute_backward_time_ms"] = m.permute_backward_ms
            if m.tokens_per_local_expert:
                out[f"layer{n}/local_expert_load_imbalance"] = _imbalance(m.tokens_per_local_expert)
        return out


def _imbalance(counts: list[int]) -> float:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean > 0 else 0.0


_KINDS = ("dispatch", "combine", "permute")
_BACKWARD_KINDS = ("dispatch_backward", "combine_backward", "permute_backward")
# The dispatcher methods `instrument` times as "permute", where the dispatcher has them.
_PERMUTE_METHODS = (
    "dispatch_preprocess",
    "dispatch_postprocess",
    "combine_preprocess",
    "combine_postprocess",
)


@dataclass
class _Pending:
    layer: int
    kind: str  # one of _KINDS or _BACKWARD_KINDS
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
        self._owned = threading.local()  # set while `timed` owns a call on this thread

    def start(self, device: torch.device) -> _Timer | None:
        """Start timing an operation; ``None`` when disabled or inside a ``timed`` call."""
        if not self.enabled or getattr(self._owned, "active", False):
            return None
        return _Timer(device)

    @contextlib.contextmanager
    def timed(self, device: torch.device, layer: int, kind: str) -> Iterator[list[int]]:
        """Time the body as one ``kind`` call of ``layer``; records nested inside it are skipped.

        Yields a one-element list: set ``[0]`` to the bytes moved before leaving the body.
        Nothing is recorded when the recorder is disabled or the body raises.
        """
        if kind not in _KINDS:
            raise InvalidInputError(f"kind={kind!r}: must be one of {', '.join(_KINDS)}")
        if not self.enabled or getattr(self._owned, "active", False):
            yield [0]
            return
        timer = _Timer(device)
        nbytes = [0]
        self._owned.active = True
        try:
            yield nbytes
        finally:
            self._owned.active = False
        self.record(timer, layer, kind, nbytes[0])

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
        if kind not in _KINDS + _BACKWARD_KINDS:
            raise InvalidInputError(
                f"kind={kind!r}: must be one of {', '.join(_KINDS)} (or their '_backward')"
            )
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
            ms, host_ms = p.timer.device_ms(), p.timer.host_ms()
            if p.kind in ("permute", "permute_backward"):
                m.permute_calls += 1
                if p.kind == "permute":
                    m.permute_ms += ms
                else:
                    m.permute_backward_ms += ms
            elif p.kind in _BACKWARD_KINDS:
                m.backward_calls += 1
                if p.kind == "dispatch_backward":
                    m.dispatch_backward_ms += ms
                else:
                    m.combine_backward_ms += ms
            elif p.kind == "dispatch":
                m.calls += 1
                m.dispatch_ms += ms
                m.dispatch_host_ms += host_ms
                m.dispatch_bytes += p.num_bytes
                if p.tokens_per_local_expert is not None:
                    if not m.tokens_per_local_expert:
                        m.tokens_per_local_expert = [0] * len(p.tokens_per_local_expert)
                    for i, c in enumerate(p.tokens_per_local_expert):
                        m.tokens_per_local_expert[i] += c
            else:
                m.combine_ms += ms
                m.combine_host_ms += host_ms
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


def _row_bytes(value: Any) -> int:
    """Bytes of the token rows in ``value`` (a tensor, or the first element of a tuple)."""
    t = value[0] if isinstance(value, (tuple, list)) and value else value
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _first(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states: the first argument, by position or by name."""
    return args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values())))


class _BackwardClock:
    """Times one call's backward: ``begin`` when its output's gradient arrives, ``end`` when the
    gradient has gone through to its input (module doc)."""

    def __init__(self, device: torch.device, layer: int, kind: str) -> None:
        self.device, self.layer, self.kind = device, layer, kind
        self.timer: _Timer | None = None

    def begin(self) -> None:
        if self.timer is None:
            self.timer = _Timer(self.device)

    def end(self) -> None:
        if self.timer is not None:
            recorder.record(self.timer, self.layer, self.kind, 0)
            self.timer = None


def _backward_clock(t: Any, layer: int, kind: str) -> _BackwardClock | None:
    """A clock for the backward of a call on rows ``t`` (the recorder on, a gradient to come)."""
    if (
        recorder.enabled
        and isinstance(t, torch.Tensor)
        and t.requires_grad
        and torch.is_grad_enabled()
    ):
        return _BackwardClock(t.device, layer, kind)
    return None


def _on_gradient(t: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` when the gradient of ``t`` (a tensor, or the rows first in a tuple or list)
    has been computed: a tensor hook, which leaves the graph and the gradient as they are."""
    rows = t[0] if isinstance(t, (tuple, list)) and t else t
    if isinstance(rows, torch.Tensor) and rows.requires_grad:
        rows.register_hook(lambda _grad: fn())


def _on_node_done(t: Any, fn: Callable[[], None]) -> None:
    """Call ``fn`` once the autograd node that made ``t`` (or the rows first in a tuple or list)
    has run its backward: a post-hook on that node, which leaves the gradients as they are."""
    rows = t[0] if isinstance(t, (tuple, list)) and t else t
    if isinstance(rows, torch.Tensor) and rows.grad_fn is not None:
        rows.grad_fn.register_hook(lambda _grad_inputs, _grad_outputs: fn())


def instrument(dispatcher: Any, layer: int | Callable[[], int]) -> None:
    """Time ``dispatcher.token_dispatch`` / ``token_combine`` through ``recorder`` (any type),
    and its methods around them (``_PERMUTE_METHODS``, where it has them) as ``permute``;
    forward and, where the rows require a gradient, backward (module doc).

    ``layer``: the records' layer number, or a function giving it at each call (a layer's number
    may be set after its dispatcher is built). Bytes: the received rows (``token_dispatch``'s
    first output) and the rows sent back (``token_combine``'s first argument). The hooks record
    only while the recorder is enabled. A dispatcher is wrapped once: a second call does nothing.
    """
    if getattr(dispatcher, "_dispatch_metrics_instrumented", False):
        return
    dispatch, combine = dispatcher.token_dispatch, dispatcher.token_combine
    number = layer if callable(layer) else (lambda: layer)

    def call(
        fn: Callable[..., Any], kind: str, args: tuple, kwargs: dict, shared: bool = False
    ) -> Any:
        hidden_states = _first(args, kwargs)
        if not isinstance(hidden_states, torch.Tensor):
            return fn(*args, **kwargs)  # not a call on rows: nothing to time
        n = int(number())
        clock = _backward_clock(hidden_states, n, f"{kind}_backward")
        with recorder.timed(hidden_states.device, n, kind) as nbytes:
            out = fn(*args, **kwargs)
            if kind != "permute":
                nbytes[0] = _row_bytes(out if kind == "dispatch" else hidden_states)
        if clock is not None:
            _on_gradient(out, clock.begin)
            # An input shared with other modules (the layer's input, which the router and the
            # shared experts read too) has its gradient only after theirs: the backward ends
            # with the node that made the output instead (the row permutation).
            if shared:
                _on_node_done(out, clock.end)
            else:
                _on_gradient(hidden_states, clock.end)
        return out

    @functools.wraps(dispatch)
    def token_dispatch(*args: Any, **kwargs: Any) -> Any:
        return call(dispatch, "dispatch", args, kwargs)

    @functools.wraps(combine)
    def token_combine(*args: Any, **kwargs: Any) -> Any:
        return call(combine, "combine", args, kwargs)

    def permuting(fn: Callable[..., Any], shared: bool) -> Callable[..., Any]:
        @functools.wraps(fn)
        def method(*args: Any, **kwargs: Any) -> Any:
            return call(fn, "permute", args, kwargs, shared)

        return method

    dispatcher.token_dispatch = token_dispatch
    dispatcher.token_combine = token_combine
    for name in _PERMUTE_METHODS:
        fn = getattr(dispatcher, name, None)
        if callable(fn):
            setattr(dispatcher, name, permuting(fn, shared=name == "dispatch_preprocess"))
    dispatcher._dispatch_metrics_instrumented = True

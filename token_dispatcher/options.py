"""Options of the ``uccl_ep`` dispatcher that are not part of Megatron's ``TransformerConfig``.

Megatron builds its ``TransformerConfig`` from the dataclass fields only, so dispatcher knobs
(``--moe-uccl-ep-num-sms`` ...) cannot travel inside it. They are kept here instead: the
plugin's command-line flags and ``megatron_plugin.install(...)`` write them, each
``UcclEpTokenDispatcher`` reads them when it is built. One process trains one model, so one
set of options per process is enough.

Nothing here touches the environment: ``num_sms`` reaches the kernels through the ``Config``
each dispatcher passes to ``Buffer.dispatch``/``combine``; the proxy's knobs
(``BUFFER_OPTIONS``) reach the ``Buffer`` the dispatcher makes as ``BufferOptions``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from uccl_ep_megatron.core.errors import InvalidInputError
from uccl_ep_megatron.core.options import BufferOptions

BACKENDS = ("auto", "kernels", "reference")
TRANSPORTS = ("auto", "verbs", "ipc")
# Options that are BufferOptions fields too: they reach the Buffer the dispatcher makes.
BUFFER_OPTIONS = ("num_proxy_threads", "transport")


@dataclass(frozen=True)
class UcclEpOptions:
    """Knobs of the ``uccl_ep`` token dispatcher.

    Args:
        num_sms: SM (CU) budget of the dispatch/combine kernels; even. Maps onto
            the ``Config`` the dispatcher passes to each dispatch/combine.
        num_proxy_threads: CPU proxy threads per GPU; ``None`` keeps
            ``UCCL_EP_NUM_PROXY_THREADS`` (default 4). The plugin exports it to that variable.
        transport: proxy transport ``auto``/``verbs``/``ipc``; ``None`` keeps
            ``UCCL_EP_TRANSPORT``. The plugin exports it to that variable.
        backend: ``Buffer`` backend ``auto``/``kernels``/``reference``; ``None`` keeps
            ``UCCL_EP_BACKEND`` (default ``auto``).
        metrics: record per-layer dispatch/combine time, tokens per local expert and bytes
            (``uccl_ep_megatron.telemetry.dispatch``).
        capacity_factor: sync-free mode without Megatron's capacity options: every local
            expert gets ``ceil(factor x tokens x topk / experts) x group size`` rows (rounded
            up to the quantization alignment); pairs past that are dropped and counted.
            ``None`` (default): exact mode, unless ``sync_free`` or Megatron's
            ``moe_expert_capacity_factor`` with ``moe_pad_expert_input_to_capacity`` selects
            sync-free mode.
        sync_free: sync-free mode. Without a capacity (``capacity_factor`` or Megatron's) it
            drops nothing: the experts' rows are bounded by what a rank can receive (every
            received token's pairs, ``group size x tokens x min(topk, local experts)``) and
            the segments are packed on the GPU; it needs experts that take their counts on
            the GPU (``TorchGroupedMLP``, ``grouped_experts``).
        drop_log_interval: in sync-free mode, the dropped-pair counter (on the GPU) is copied
            to the host asynchronously every this many forward passes of a layer and logged
            when it grew (read at the next interval, without waiting); 0 = never.
        grouped_experts: MoE layers built from local (non-Transformer-Engine) specs get
            ``TorchGroupedMLP`` experts (PyTorch's grouped_mm) instead of ``SequentialMLP`` or
            the legacy ``GroupedMLP``, whatever their dispatcher; TE's ``TEGroupedMLP`` is
            left alone.
        fp8_dispatch: dispatch the tokens in FP8 (E4M3, one float32 scale per 128 channels,
            as DeepSeek-V3), dequantized on arrival for the experts; combine and every
            gradient stay in the layer's dtype (``token_dispatcher.fp8``).
    """

    num_sms: int = 24
    num_proxy_threads: int | None = None
    transport: str | None = None
    backend: str | None = None
    metrics: bool = False
    capacity_factor: float | None = None
    sync_free: bool = False
    drop_log_interval: int = 100
    grouped_experts: bool = False
    fp8_dispatch: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.num_sms, bool) or not isinstance(self.num_sms, int):
            raise InvalidInputError(f"num_sms={self.num_sms!r}: must be an int")
        if self.num_sms <= 0 or self.num_sms % 2:
            raise InvalidInputError(
                f"num_sms={self.num_sms}: must be a positive even number "
                "(--moe-uccl-ep-num-sms 24 is the default)"
            )
        if self.num_proxy_threads is not None and (
            isinstance(self.num_proxy_threads, bool)
            or not isinstance(self.num_proxy_threads, int)
            or self.num_proxy_threads <= 0
        ):
            raise InvalidInputError(
                f"num_proxy_threads={self.num_proxy_threads!r}: must be a positive int"
            )
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise InvalidInputError(
                f"transport={self.transport!r}: must be one of {', '.join(TRANSPORTS)}"
            )
        if self.backend is not None and self.backend not in BACKENDS:
            raise InvalidInputError(
                f"backend={self.backend!r}: must be one of {', '.join(BACKENDS)}"
            )
        factor = self.capacity_factor
        if factor is not None and (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not math.isfinite(factor)
            or factor <= 0
        ):
            raise InvalidInputError(
                f"capacity_factor={factor!r}: must be a positive number "
                "(--moe-uccl-ep-capacity-factor 1.5, say), or None for exact mode"
            )
        if (
            isinstance(self.drop_log_interval, bool)
            or not isinstance(self.drop_log_interval, int)
            or self.drop_log_interval < 0
        ):
            raise InvalidInputError(
                f"drop_log_interval={self.drop_log_interval!r}: must be an int >= 0 (0 = never)"
            )

        for name in ("sync_free", "grouped_experts", "fp8_dispatch"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name}={getattr(self, name)!r}: must be True or False")

    def buffer_options(self) -> BufferOptions:
        """The ``Buffer`` knobs these options set (unset ones: the environment's values)."""
        return BufferOptions(
            **{
                option: getattr(self, option)
                for option in BUFFER_OPTIONS
                if getattr(self, option) is not None
            }
        )


_options = UcclEpOptions()


def get_options() -> UcclEpOptions:
    """The options new ``UcclEpTokenDispatcher`` objects use."""
    return _options


def set_options(**changes: object) -> UcclEpOptions:
    """Update some options (validated) and return the result.

    Raises:
        InvalidInputError: an unknown option name or an invalid value.
    """
    global _options
    known = {f.name for f in dataclasses.fields(UcclEpOptions)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise InvalidInputError(
            f"unknown uccl_ep option(s) {unknown}; known: {', '.join(sorted(known))}"
        )
    _options = dataclasses.replace(_options, **changes)
    return _options


def restore_options(options: UcclEpOptions) -> None:
    """Put back options saved earlier with ``get_options()``."""
    global _options
    if not isinstance(options, UcclEpOptions):
        raise InvalidInputError(f"restore_options({options!r}): pass a UcclEpOptions")
    _options = options


def reset_options() -> UcclEpOptions:
    """Back to the defaults (tests)."""
    global _options
    _options = UcclEpOptions()
    return _options

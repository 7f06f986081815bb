"""Options of the ``uccl_ep`` dispatcher that are not part of Megatron's ``TransformerConfig``.

Megatron builds its ``TransformerConfig`` from the dataclass fields only, so dispatcher knobs
(``--moe-uccl-ep-num-sms`` ...) cannot travel inside it. They are kept here instead: the
plugin's command-line flags and ``megatron_plugin.install(...)`` write them, each
``UcclEpTokenDispatcher`` reads them when it is built. One process trains one model, so one
set of options per process is enough.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from uccl_ep_megatron.errors import InvalidInputError

BACKENDS = ("auto", "kernels", "reference")
TRANSPORTS = ("auto", "verbs", "ipc")
# Options the C++ core reads from the environment: option name -> variable.
ENV_OPTIONS = {"num_proxy_threads": "UCCL_EP_NUM_PROXY_THREADS", "transport": "UCCL_EP_TRANSPORT"}


@dataclass(frozen=True)
class UcclEpOptions:
    """Knobs of the ``uccl_ep`` token dispatcher.

    Args:
        num_sms: SM (CU) budget of the dispatch/combine kernels; even. Maps onto
            ``Buffer.set_num_sms``.
        num_proxy_threads: CPU proxy threads per GPU; ``None`` keeps
            ``UCCL_EP_NUM_PROXY_THREADS`` (default 4). Exported to that variable.
        transport: proxy transport ``auto``/``verbs``/``ipc``; ``None`` keeps
            ``UCCL_EP_TRANSPORT``. Exported to that variable.
        backend: ``Buffer`` backend ``auto``/``kernels``/``reference``; ``None`` keeps
            ``UCCL_EP_BACKEND`` (default ``auto``).
        metrics: record per-layer dispatch/combine time, tokens per local expert and bytes
            (``uccl_ep_megatron.dispatch_metrics``).
    """

    num_sms: int = 24
    num_proxy_threads: int | None = None
    transport: str | None = None
    backend: str | None = None
    metrics: bool = False

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

    def export_env(self) -> None:
        """Write the options the C++ core reads from the environment (before any ``Buffer``)."""
        for option, variable in ENV_OPTIONS.items():
            value = getattr(self, option)
            if value is not None:
                os.environ[variable] = str(value)


_options = UcclEpOptions()


def get_options() -> UcclEpOptions:
    """The options new ``UcclEpTokenDispatcher`` objects use."""
    return _options


def set_options(**changes: object) -> UcclEpOptions:
    """Update some options (validated), export the environment-backed ones, return the result.

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
    _options.export_env()
    return _options


def restore_options(options: UcclEpOptions) -> None:
    """Put back options saved earlier with ``get_options()`` (the environment is left alone)."""
    global _options
    if not isinstance(options, UcclEpOptions):
        raise InvalidInputError(f"restore_options({options!r}): pass a UcclEpOptions")
    _options = options


def reset_options() -> UcclEpOptions:
    """Back to the defaults (tests; the environment is left as it is)."""
    global _options
    _options = UcclEpOptions()
    return _options

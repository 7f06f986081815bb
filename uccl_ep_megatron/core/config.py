"""Performance knobs (``Config``) and the environment registry.

``Config`` mirrors DeepEP's normal-mode ``Config``: an SM budget and the chunk / ring-buffer
sizes of the NVLink (intranode) and RDMA (internode) paths, plus the buffer-size hints a
caller uses to size ``Buffer(num_nvl_bytes=..., num_rdma_bytes=...)``.

The environment registry lives in C++ (``csrc/common/env_params.def``); ``env_registry`` and
``effective_env`` read it through ``_C`` so Python and C++ never disagree on a name or default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from uccl_ep_megatron.core import _c
from uccl_ep_megatron.core.errors import InvalidInputError

# Per-token metadata that travels with a row, sized for the largest supported top-k so one
# buffer works for any routing: ids (int64) + weights (float32) + source index (int32).
MAX_TOPK = 32
_TOKEN_META_BYTES = MAX_TOPK * (8 + 4) + 4
# Ranks of one node that NVLink/xGMI connects directly.
MAX_NVL_PEERS = 8
_ALIGN = 128


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def _token_bytes(hidden_bytes: int) -> int:
    # FP8 rows carry one float32 scale per 128 elements; hidden_bytes counts 2 bytes an element.
    scale_bytes = (hidden_bytes // 2 // 128) * 4
    return _align(hidden_bytes + scale_bytes + _TOKEN_META_BYTES, 16)


@dataclass(frozen=True)
class Config:
    """SM budget and chunking of the dispatch/combine kernels.

    What each field does here (DeepEP's meaning differs for the NVLink pair):

    Args:
        num_sms: SMs (CUs on AMD) the dispatch/combine kernels may occupy; even. The knob that
            matters on one node: the intranode dispatch splits these blocks between senders
            and receivers, the combine kernel between pushers and reducers, and the
            internode kernels run ``num_sms / 2`` channels of two blocks.
        num_max_nvl_chunked_send_tokens: validated and used only by
            ``get_nvl_buffer_size_hint``: the NVLink paths here have no ring. They stage a
            whole call in the receiver's buffer (``num_nvl_bytes``, grown on demand, see
            ``UCCL_EP_GROW_NVL_BUFFER``) and publish chunks of ``max(64, tokens / 4096)``
            tokens, so neither NVLink field changes what the kernels do.
        num_max_nvl_chunked_recv_tokens: as above; sizes ``get_nvl_buffer_size_hint`` only.
        num_max_rdma_chunked_send_tokens: tokens per RDMA write of the internode kernels.
        num_max_rdma_chunked_recv_tokens: internode ring capacity in tokens per
            (channel, node).
    """

    num_sms: int
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        if self.num_sms <= 0 or self.num_sms % 2:
            raise InvalidInputError(
                f"Config.num_sms={self.num_sms}: must be a positive even number "
                "(each channel uses a send and a receive SM)"
            )
        for name in (
            "num_max_nvl_chunked_send_tokens",
            "num_max_nvl_chunked_recv_tokens",
            "num_max_rdma_chunked_send_tokens",
            "num_max_rdma_chunked_recv_tokens",
        ):
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"Config.{name}={getattr(self, name)}: must be positive")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise InvalidInputError(
                f"Config: NVL send chunk {self.num_max_nvl_chunked_send_tokens} exceeds the NVL "
                f"ring of {self.num_max_nvl_chunked_recv_tokens} tokens; lower the chunk or "
                "raise the ring"
            )
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens:
            raise InvalidInputError(
                f"Config: RDMA send chunk {self.num_max_rdma_chunked_send_tokens} exceeds the "
                f"RDMA ring of {self.num_max_rdma_chunked_recv_tokens} tokens"
            )

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(
        self, hidden_bytes: int, num_ranks: int, node_size: int | None = None
    ) -> int:
        """Bytes of NVLink buffer a ``Buffer`` needs for rows of ``hidden_bytes``.

        ``hidden_bytes`` is ``hidden * max(element_size, 2)``, as in DeepEP and Megatron.
        ``node_size``: ranks per node of the group, when known (else ``ranks_per_node(num_ranks)``).
        """
        _check_sizes(hidden_bytes, num_ranks)
        nvl_peers = node_size or ranks_per_node(num_ranks)
        num_nodes = num_ranks // nvl_peers
        per_peer = self.num_max_nvl_chunked_recv_tokens * _token_bytes(hidden_bytes) * num_nodes
        control = (2 * num_nodes + 4) * 4 * nvl_peers
        return _align(self.num_channels * nvl_peers * (per_peer + control) + 4 * num_ranks**2 * 4)

    def get_rdma_buffer_size_hint(
        self, hidden_bytes: int, num_ranks: int, node_size: int | None = None
    ) -> int:
        """Bytes of RDMA buffer needed; 0 when every rank fits in one node. ``node_size``
        as in ``get_nvl_buffer_size_hint``."""
        _check_sizes(hidden_bytes, num_ranks)
        num_nodes = num_ranks // (node_size or ranks_per_node(num_ranks))
        if num_nodes <= 1:
            return 0
        per_node = self.num_max_rdma_chunked_recv_tokens * _token_bytes(hidden_bytes)
        # The internode kernels split the region into a dispatch half and a combine half, each
        # holding a send and a receive ring per (channel, node); head/tail counters live in the
        # proxy's host memory. _token_bytes bounds both slot layouts (metadata for top-32).
        return _align(2 * self.num_channels * num_nodes * 2 * per_node + 64)


def _check_sizes(hidden_bytes: int, num_ranks: int) -> None:
    if hidden_bytes <= 0:
        raise InvalidInputError(f"hidden_bytes={hidden_bytes}: must be positive")
    if num_ranks <= 0:
        raise InvalidInputError(f"num_ranks={num_ranks}: must be positive")


def env_ranks_per_node(num_ranks: int, requested: int | None = None) -> int | None:
    """Ranks per node from ``requested`` (``BufferOptions.ranks_per_node``; 0: not set), else
    ``UCCL_EP_RANKS_PER_NODE`` (when ``requested`` is None), else ``LOCAL_WORLD_SIZE``;
    ``None`` if none is set."""
    sources: list[tuple[str, str]] = []
    if requested is not None:
        sources.append(("BufferOptions.ranks_per_node", str(requested)))
    else:
        sources.append(("UCCL_EP_RANKS_PER_NODE", os.environ.get("UCCL_EP_RANKS_PER_NODE", "")))
    sources.append(("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "")))
    for var, raw in sources:
        raw = raw.strip()
        if raw and raw != "0":
            try:
                value = int(raw)
            except ValueError as exc:
                raise InvalidInputError(f"{var}={raw!r} is not an integer") from exc
            if value <= 0 or num_ranks % value:
                raise InvalidInputError(
                    f"{var}={value} does not divide the {num_ranks} ranks of the group; "
                    "set it to the number of GPUs per (virtual) node"
                )
            return value
    return None


def ranks_per_node(num_ranks: int, requested: int | None = None) -> int:
    """Ranks per (virtual) node for ``num_ranks`` ranks.

    ``requested`` (``BufferOptions.ranks_per_node``) or else ``UCCL_EP_RANKS_PER_NODE`` wins
    (virtual nodes on one host), then the launcher's ``LOCAL_WORLD_SIZE``, then one node of up
    to ``MAX_NVL_PEERS`` ranks.
    """
    from_env = env_ranks_per_node(num_ranks, requested)
    if from_env is not None:
        return from_env
    if num_ranks <= MAX_NVL_PEERS:
        return num_ranks
    if num_ranks % MAX_NVL_PEERS:
        raise InvalidInputError(
            f"{num_ranks} ranks do not split into nodes of {MAX_NVL_PEERS}; set "
            "UCCL_EP_RANKS_PER_NODE (or LOCAL_WORLD_SIZE) to the GPUs per node"
        )
    return MAX_NVL_PEERS


def default_dispatch_config(num_ranks: int, num_sms: int, node_size: int | None = None) -> Config:
    """Tuned defaults by rank count (one node vs several). ``node_size``: ranks per node when
    the caller knows them (a ``Buffer``'s topology), else ``ranks_per_node(num_ranks)``."""
    if (node_size or ranks_per_node(num_ranks)) == num_ranks:
        return Config(num_sms, 6, 256, 6, 128)
    return Config(num_sms, 16, 288, 20, 128)


def default_combine_config(num_ranks: int, num_sms: int, node_size: int | None = None) -> Config:
    """Tuned defaults by rank count (one node vs several); ``node_size`` as above."""
    if (node_size or ranks_per_node(num_ranks)) == num_ranks:
        return Config(num_sms, 6, 256, 6, 128)
    return Config(num_sms, 6, 288, 16, 128)


def env_registry() -> list[dict[str, str]]:
    """Every environment variable the package reads: name, type, default, doc."""
    return list(_c.load().env_registry())


def effective_env() -> dict[str, object]:
    """The registry's variables as parsed from the current environment."""
    return dict(_c.load().env_effective())


def env_markdown() -> str:
    """The registry as the Markdown table of docs/configuration.md (``doctor --markdown``)."""
    rows = ["| Variable | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    for p in env_registry():
        default = p["default"] if p["default"] != "" else "(empty)"
        rows.append(f"| `{p['name']}` | {p['type']} | `{default}` | {p['doc']} |")
    return "\n".join(rows)

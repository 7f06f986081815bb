"""GPU->CPU FIFO channels and CPU proxies from Python: the endpoint and the command builders.

``endpoint`` wires one rank's FIFO, proxy and transport and runs the bootstrap; ``commands``
builds the 16-byte transfer commands a host producer pushes. Both are re-exported here, so
``from uccl_ep_megatron.proxy import ProxyEndpoint, cmd_write`` keeps working.
"""

from uccl_ep_megatron.proxy.commands import (
    cmd_atomic,
    cmd_barrier,
    cmd_drain,
    cmd_write,
    cmd_write_atomic,
)
from uccl_ep_megatron.proxy.endpoint import (
    ProxyConfig,
    ProxyEndpoint,
    choose_transport,
    exchange,
    rdma_usable,
)

__all__ = [
    "ProxyConfig",
    "ProxyEndpoint",
    "choose_transport",
    "cmd_atomic",
    "cmd_barrier",
    "cmd_drain",
    "cmd_write",
    "cmd_write_atomic",
    "exchange",
    "rdma_usable",
]

"""What ``install()`` changed, shared by the plugin's modules, and the layers' buffer cache."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

DISPATCHER_TYPE = "uccl_ep"
_DEST = "moe_token_dispatcher_type"

_lock = threading.RLock()
_state: dict[str, Any] = {}  # what install() changed, so uninstall() can restore it


def buffer_cache() -> BufferCache:
    """The ``BufferCache`` shared by the ``uccl_ep`` layers this process builds (made on first
    use; ``uninstall()`` drops it, and its buffers once no layer holds them)."""
    # Imported here: the plugin must import without torch.distributed's Buffer machinery.
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

    with _lock:
        cache = _state.get("buffers")
        if cache is None:
            cache = _state["buffers"] = BufferCache()
        return cache

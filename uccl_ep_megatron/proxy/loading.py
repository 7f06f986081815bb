"""CUDA module loading and the ipc transport's copy delivery.

With ``UCCL_EP_IPC_DELIVERY=copy`` the ipc NIC model moves bytes with CUDA copies issued from its
own thread, while the internode kernels of the same process spin until those copies land. Some
CUDA calls of any other thread of the process wait for every running kernel while holding the
context, so the NIC's next copy call never returns and every rank stalls: the first launch of a
kernel under lazy module loading (the driver's default since CUDA 12.2), a library loading its
kernels (cuBLAS does on a new GEMM shape, ``cuLibraryLoadData``), ``cudaFree``, ``cudaFreeHost``
and ``cudaHostUnregister`` (measured on H200, driver 580). The NIC model reports such a stall
after ``copy_timeout_ms``. The default delivery, ``store``, has the kernels store ring bytes
themselves and the model make no CUDA call, so none of this applies to it; nor to a real NIC.

Eager loading (``CUDA_MODULE_LOADING=EAGER``, read once when CUDA starts) removes the first cause:
the ipc transport refuses copy delivery on a GPU without it (``check_ipc_module_loading``), and
the launchers of this package ask for it in the ranks they start (``eager_loading_env``) when
those ranks may use copy delivery. The other causes it cannot remove.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

from uccl_ep_megatron.core.errors import UnsupportedError

ENV = "CUDA_MODULE_LOADING"
_EAGER, _LAZY = 1, 2  # CUmoduleLoadingMode


def driver_module_loading() -> str | None:
    """``"EAGER"`` or ``"LAZY"`` as this process's CUDA driver loads modules, or None where no
    CUDA driver answers (CPU-only hosts, ROCm, a driver without ``cuModuleGetLoadingMode``)."""
    try:
        query = ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode
    except (OSError, AttributeError):
        return None
    mode = ctypes.c_int(0)
    if query(ctypes.byref(mode)) != 0:  # e.g. CUDA_ERROR_NOT_INITIALIZED
        return None
    return {_EAGER: "EAGER", _LAZY: "LAZY"}.get(mode.value)


def check_ipc_module_loading(rank: int, mode: str | None = None) -> None:
    """Raise when the ipc transport would run on a GPU under lazy module loading."""
    mode = driver_module_loading() if mode is None else mode
    if mode != "LAZY":
        return
    raise UnsupportedError(
        f"rank {rank}: the ipc transport's copy delivery needs CUDA_MODULE_LOADING=EAGER, but "
        f"this process loads CUDA modules lazily ({ENV}={os.environ.get(ENV, 'unset')!r}). The "
        "ipc NIC model copies from its own thread while the internode kernels wait for those "
        "copies, and a kernel loaded lazily during a call blocks both, so every rank would "
        f"stall. Set {ENV}=EAGER in the environment of every rank before CUDA starts "
        "(uccl-ep-megatron's train, bench and `python -m uccl_ep_megatron.run` do it), use "
        "UCCL_EP_IPC_DELIVERY=store (the default), or UCCL_EP_TRANSPORT=verbs on RDMA NICs"
    )


def may_use_ipc(environ: Mapping[str, str], local_ranks: int, transport: str | None = None) -> bool:
    """Whether ranks started with ``environ`` on one host of ``local_ranks`` GPUs may run the
    ipc transport: it is asked for by name, or ``UCCL_EP_RANKS_PER_NODE`` splits the host into
    virtual nodes (what the ipc transport exists for; ``auto`` picks it without an RDMA port)."""
    transport = transport or environ.get("UCCL_EP_TRANSPORT", "auto").strip().lower() or "auto"
    if transport == "verbs":
        return False
    if transport == "ipc":
        return True
    raw = environ.get("UCCL_EP_RANKS_PER_NODE", "").strip()
    try:
        per_node = int(raw)
    except ValueError:
        return False  # unset, or a bad value the registry reports with its own message
    return 0 < per_node < local_ranks


def copies_over_ipc(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` asks the ipc NIC model for copy delivery (``UCCL_EP_IPC_DELIVERY``;
    the default, ``store``, makes no CUDA call)."""
    return environ.get("UCCL_EP_IPC_DELIVERY", "").strip().lower() == "copy"


def eager_loading_env(
    environ: Mapping[str, str], local_ranks: int, transport: str | None = None
) -> dict[str, str]:
    """``{CUDA_MODULE_LOADING: EAGER}`` for ranks that may use the ipc transport's copy
    delivery, unless the caller chose a loading mode (then the transport's check speaks if it
    is lazy)."""
    if ENV in environ or not copies_over_ipc(environ):
        return {}
    if not may_use_ipc(environ, local_ranks, transport):
        return {}
    return {ENV: "EAGER"}

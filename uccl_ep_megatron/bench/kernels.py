"""The benchmark extension ``uccl_ep_megatron.bench._bench_C`` (FIFO test and bench kernels).

Built from ``csrc/bench/`` in GPU builds only and kept out of the production ``_C``; only the
benchmarks and the tests import it.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from uccl_ep_megatron.core.errors import UnsupportedError


@functools.cache
def load() -> ModuleType:
    """The ``_bench_C`` module; ``UnsupportedError`` when this install has no GPU build."""
    try:
        return importlib.import_module("uccl_ep_megatron.bench._bench_C")
    except ImportError as exc:
        raise UnsupportedError(
            f"the benchmark kernels (uccl_ep_megatron.bench._bench_C) are not installed ({exc}): "
            "they are built with the GPU kernels; reinstall with nvcc or hipcc present"
        ) from exc


__all__ = ["load"]

"""The one loader of the compiled extension ``uccl_ep_megatron._C``.

Every Python module that calls into C++ gets the module from :func:`load`, not through the
package root, so importing a low layer never runs ``uccl_ep_megatron/__init__.py``'s imports
of the layers above it. The import is deferred to the first call: the package (and its pure
Python parts) import on a host where ``_C`` was not built, and the failure names the fix.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def load() -> ModuleType:
    """The ``_C`` extension module (imported once)."""
    return importlib.import_module("uccl_ep_megatron._C")


__all__ = ["load"]

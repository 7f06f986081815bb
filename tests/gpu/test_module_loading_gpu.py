"""On a GPU: the ipc transport starts under eager module loading and refuses lazy loading with
the fix in its message, in a fresh process for each mode (the driver reads the mode once)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]

_CHILD = """
import torch
from uccl_ep_megatron.core.errors import UnsupportedError
from uccl_ep_megatron.proxy import ProxyConfig, ProxyEndpoint
from uccl_ep_megatron.proxy.loading import driver_module_loading
region = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
print("mode", driver_module_loading())
try:
    ep = ProxyEndpoint(region.data_ptr(), region.numel(), device=0, rank=0, world_size=1,
                       config=ProxyConfig(transport="ipc", num_channels=1, num_threads=1))
except UnsupportedError as exc:
    print("refused", exc)
else:
    print("started")
    ep.close()
"""


def _run(mode: str) -> str:
    env = {**os.environ, "CUDA_MODULE_LOADING": mode, "CUDA_VISIBLE_DEVICES": "0"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_eager_loading_starts_the_ipc_transport():
    out = _run("EAGER")
    assert "mode EAGER" in out
    assert "started" in out


def test_lazy_loading_is_refused_before_any_kernel_runs():
    out = _run("LAZY")
    assert "mode LAZY" in out
    assert (
        "refused rank 0: the ipc transport's copy delivery needs CUDA_MODULE_LOADING=EAGER" in out
    )

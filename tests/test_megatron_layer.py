"""Megatron's ``MoELayer`` end to end on CPU (2 gloo ranks, EP=2), under the plugin's entry point.

``python -m uccl_ep_megatron.run --deep-ep-compat tests/megatron_scripts/moe_layer_equivalence.py``
builds the layer under the dispatcher its command line selects and compares output and every
gradient (input, router, experts) with the same layer under other dispatchers and with an
autograd oracle that uses no dispatcher at all (details in the script). Megatron's defaults
are what runs: the flex path calls ``fused_a2a`` with ``async_finish=True``,
``allocate_on_comm_stream=True`` and a ``previous_event``, nothing shimmed.

* ``flex`` + ``deepep`` is megatron-core's own ``fused_a2a`` on this package's ``Buffer`` (the
  ``deep_ep`` drop-in), as UCCL-EP users run it; ``uccl_ep`` is the plugin's dispatcher;
  ``allgather`` is megatron-core's dispatcher that runs on CPU (``alltoall`` needs CUDA streams:
  ``tests/gpu/test_megatron_versions_gpu.py`` compares with it on GPUs).
* ``moe_router_dtype`` fp32 and fp64; ``moe_router_padding_for_quantization`` (alignment 16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "megatron_scripts", "moe_layer_equivalence.py"
)


def _layer_run(tmp_path, *script_args: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_EP_")}
    env["RESULT_DIR"] = str(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "uccl_ep_megatron.run",
        "--deep-ep-compat",
        SCRIPT,
        *script_args,
    ]
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: import the installed package
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    failures = [f for r in reports for f in r["failures"]]
    assert proc.returncode == 0 and len(reports) == 2, (failures, proc.stderr[-4000:])
    return reports


def test_deep_ep_drop_in_flex_layer_fp32_with_quantization_padding(tmp_path):
    reports = _layer_run(
        tmp_path,
        "--moe-token-dispatcher-type",
        "flex",
        "--moe-flex-dispatcher-backend",
        "deepep",
        "--moe-router-dtype",
        "fp32",
        "--moe-router-padding-for-quantization",
        "--reference",
        "uccl_ep",
        "--reference",
        "allgather",
    )
    for r in reports:
        assert r["dispatcher"] == "MoEFlexTokenDispatcher"
        assert "uccl_ep_megatron" in r["deep_ep_module"]  # fused_a2a ran on our Buffer
        assert all(t % 16 == 0 for t in r["tokens_per_expert"]) and sum(r["tokens_per_expert"])
        for ref in ("uccl_ep", "allgather", "oracle"):
            assert f"{ref}/output" in r["checks"] and f"{ref}/input_grad" in r["checks"]


def test_uccl_ep_layer_fp64_against_deep_ep_drop_in_and_allgather(tmp_path):
    reports = _layer_run(
        tmp_path,
        "--moe-token-dispatcher-type",
        "uccl_ep",
        "--moe-uccl-ep-backend",
        "reference",
        "--moe-router-dtype",
        "fp64",
        "--reference",
        "flex",
        "--reference",
        "allgather",
    )
    for r in reports:
        assert r["dispatcher"] == "UcclEpTokenDispatcher"
        assert sum(r["tokens_per_expert"]) > 0
        assert "flex/grad/router.weight" in r["checks"] and "oracle/output" in r["checks"]


def test_metrics_flag_times_any_dispatcher_forward_and_backward_without_changing_it(tmp_path):
    """``--moe-uccl-ep-metrics`` times megatron-core's own dispatcher too (and ours), forward and
    backward; outputs and every gradient still equal the references' and the oracle's."""
    reports = _layer_run(
        tmp_path,
        "--moe-token-dispatcher-type",
        "allgather",
        "--moe-uccl-ep-metrics",
        "--moe-uccl-ep-backend",
        "reference",
        "--reference",
        "uccl_ep",
    )
    for r in reports:
        assert r["instrumented"] == {"allgather": True, "uccl_ep": True}
        m = r["metrics"]
        for key in (
            "dispatch_time_ms",
            "combine_time_ms",
            "dispatch_backward_time_ms",
            "combine_backward_time_ms",
            "permute_time_ms",
            "permute_backward_time_ms",
        ):
            assert m[key] > 0, key
        assert "uccl_ep/input_grad" in r["checks"] and "oracle/grad/router.weight" in r["checks"]

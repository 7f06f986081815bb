"""The Megatron-LM-style entry fixture (``tests/megatron_scripts/pretrain_gpt.py``) on CPU.

The GPU test (``tests/gpu/test_pretrain_gpt_gpu.py``) trains with it; here, on every release
that ships ``megatron.training`` (0.17+), Megatron-LM's own parser and ``validate_args`` accept
the GPU test's flags (the local, no-Transformer-Engine ones and ``--moe-token-dispatcher-type
uccl_ep`` with the plugin's flags, through ``python -m uccl_ep_megatron.run``), and the
fixture's model provider builds a GPT whose MoE layers use ``UcclEpTokenDispatcher``, and its
dataset provider yields the windows the training loop reads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.training") is None,
        reason="Megatron-LM's megatron.training is not installed (megatron-core 0.17+ ship it)",
    ),
]

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_scripts")

# Python 3.11 lacks typing.override, which megatron.training 0.18+ imports: lent from
# typing_extensions. megatron-core allocates on torch.cuda.current_device() and forks the CUDA
# RNG tracker while building layers: pointed at the CPU / made a no-op. Nothing else replaced.
_CHECK = r"""
import typing
if not hasattr(typing, "override"):
    import typing_extensions
    typing.override = typing_extensions.override
import contextlib, json, os, sys, tempfile
import torch, torch.distributed as dist
torch.cuda.current_device = lambda: "cpu"
sys.path.insert(0, os.environ["SCRIPTS"])
import pretrain_gpt
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
# The GPU test's flags, as its command line would carry them.
sys.argv[1:] = pretrain_gpt.example_args(1, "uccl_ep", 3) + ["--moe-uccl-ep-num-sms", "16"]
args = parse_args()
validate_args(args, pretrain_gpt.ARGS_DEFAULTS)
global_vars.set_global_variables(args)
args.use_cpu_initialization = True
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.moe.moe_layer import MoELayer
ps.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
model = pretrain_gpt.model_provider()
moe = [m for m in model.modules() if isinstance(m, MoELayer)]
train, valid, test = pretrain_gpt.train_valid_test_datasets_provider([4, 2, 1])
print(json.dumps({
    "dispatchers": sorted({type(m.token_dispatcher).__name__ for m in moe}),
    "moe_layers": len(moe),
    "sizes": [len(train), len(valid), len(test)],
    "sample": list(train[3]["text"].shape),
    "same_sample": bool(torch.equal(train[3]["text"], train[3]["text"])),
    "vocab": args.padded_vocab_size,
    "num_sms": args.moe_uccl_ep_num_sms,
    "impl": args.transformer_impl,
}))
"""


def test_entry_fixture_parses_validates_and_builds_on_cpu(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(_CHECK)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_EP_")}
    env.update(SCRIPTS=SCRIPTS, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    proc = subprocess.run(
        [sys.executable, "-m", "uccl_ep_megatron.run", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["dispatchers"] == ["UcclEpTokenDispatcher"] and seen["moe_layers"] == 4
    assert seen["sizes"] == [4, 2, 1] and seen["sample"] == [1025] and seen["same_sample"]
    assert seen["vocab"] >= 8192 and seen["num_sms"] == 16 and seen["impl"] == "local"

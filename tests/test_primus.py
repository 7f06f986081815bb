"""AMD Primus without AMD hardware: its argument handling and its dispatcher patch, on CPU.

* Primus builds Megatron's namespace from its experiment YAML without running argparse
  actions and drops keys Megatron's parser does not know; with the plugin installed first
  (``python -m uccl_ep_megatron.run``) ``moe_token_dispatcher_type: uccl_ep`` and the
  ``moe_uccl_ep_*`` keys survive and reach the dispatcher; without it they do not.
* Primus' Turbo patch (``megatron.turbo.moe_dispatcher``, phase ``before_train``) replaces
  ``MoEFlexTokenDispatcher`` in ``moe_layer`` and ``token_dispatcher``. Whether it runs before
  or after ``install()``, ``uccl_ep`` layers get ``UcclEpTokenDispatcher`` and ``flex`` layers
  get Primus' class, which stays in place.

Primus-Turbo's own DeepEP calls (its ``DEEP_EP`` backend) on the ``deep_ep`` drop-in are in
``tests/megatron_scripts/deepep_flex.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

from conftest import get_pool  # noqa: E402

HERE = os.path.abspath(__file__)
SCRIPT = os.path.join(os.path.dirname(HERE), "megatron_scripts", "primus_args.py")
needs_megatron_training = pytest.mark.skipif(
    importlib.util.find_spec("megatron.training") is None,
    reason="Megatron-LM's megatron.training is not installed (megatron-core 0.17+ ship it)",
)


def _primus(overrides: dict, plugin: bool = True) -> subprocess.CompletedProcess:
    prefix = ["-m", "uccl_ep_megatron.run"] if plugin else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCCL_EP_")}
    with tempfile.TemporaryDirectory() as cwd:  # not the checkout: import the installed package
        return subprocess.run(
            [sys.executable, *prefix, SCRIPT, json.dumps(overrides)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
            cwd=cwd,
        )


@needs_megatron_training
def test_yaml_overrides_reach_the_uccl_ep_dispatcher():
    proc = _primus(
        {
            "moe_token_dispatcher_type": "uccl_ep",
            "moe_uccl_ep_num_sms": 16,
            "moe_uccl_ep_backend": "reference",
            "moe_uccl_ep_metrics": True,
            "moe_uccl_ep_transport": "ipc",
            "not_a_megatron_arg": 1,
        }
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["dispatcher"] == "UcclEpTokenDispatcher"
    assert seen["dropped"] == ["not_a_megatron_arg"]
    assert seen["uccl_ep_keys_known"] == sorted(
        [
            "moe_uccl_ep_backend",
            "moe_uccl_ep_capacity_factor",
            "moe_uccl_ep_drop_log_interval",
            "moe_uccl_ep_fp8_dispatch",
            "moe_uccl_ep_grouped_experts",
            "moe_uccl_ep_metrics",
            "moe_uccl_ep_num_proxy_threads",
            "moe_uccl_ep_num_sms",
            "moe_uccl_ep_sync_free",
            "moe_uccl_ep_transport",
        ]
    )
    assert (seen["num_sms"], seen["backend"], seen["metrics"]) == (16, "reference", True)
    assert seen["transport"] == seen["buffer_transport"] == "ipc"
    assert seen["env_transport"] is None  # the plugin configures the Buffer, not the process


@needs_megatron_training
def test_yaml_defaults_leave_the_options_alone():
    proc = _primus({"moe_token_dispatcher_type": "uccl_ep"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (seen["num_sms"], seen["backend"], seen["metrics"]) == (24, None, False)


@needs_megatron_training
def test_bad_yaml_value_is_named():
    proc = _primus({"moe_token_dispatcher_type": "uccl_ep", "moe_uccl_ep_num_sms": 7})
    assert proc.returncode != 0
    assert "moe_uccl_ep_num_sms=7" in proc.stderr and "positive even" in proc.stderr


@needs_megatron_training
def test_without_the_plugin_primus_cannot_select_uccl_ep():
    """The patch order that matters: the plugin goes in before Primus builds its arguments."""
    proc = _primus({"moe_token_dispatcher_type": "uccl_ep", "moe_uccl_ep_num_sms": 16}, False)
    assert proc.returncode != 0
    assert "Unsupported token dispatcher type: uccl_ep" in proc.stderr


# ---- Primus-Turbo's MoEFlexTokenDispatcher patch ------------------------------------------------
def w_turbo_patch_order(rank, world, turbo_first):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import moe_layer, token_dispatcher
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from uccl_ep_megatron.token_dispatcher import UcclEpTokenDispatcher, reset_options

    from uccl_ep_megatron import megatron_plugin

    class TurboDeepEPStandIn(token_dispatcher.MoETokenDispatcher):
        """In the place of PrimusTurboDeepEPTokenDispatcher (needs ROCm's primus_turbo)."""

        def __init__(self, num_local_experts, local_expert_indices, config, **pgs):
            super().__init__(config=config, **pgs)
            self.built_with = config.moe_token_dispatcher_type

    def primus_turbo_patch():  # what primus/backends/megatron/patches/turbo/... does
        token_dispatcher.MoEFlexTokenDispatcher = TurboDeepEPStandIn
        moe_layer.MoEFlexTokenDispatcher = TurboDeepEPStandIn

    originals = (token_dispatcher.MoEFlexTokenDispatcher, moe_layer.MoEFlexTokenDispatcher)
    megatron_plugin.uninstall()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    try:
        if turbo_first:
            primus_turbo_patch()
            megatron_plugin.install(backend="reference")
        else:
            megatron_plugin.install(backend="reference")
            primus_turbo_patch()

        def layer(dispatcher, **extra):
            cfg = TransformerConfig(
                num_layers=1,
                hidden_size=16,
                num_attention_heads=1,
                num_moe_experts=2 * world,
                moe_router_topk=2,
                moe_ffn_hidden_size=8,
                add_bias_linear=False,
                use_cpu_initialization=True,
                moe_token_dispatcher_type=dispatcher,
                **extra,
            )
            spec = ModuleSpec(
                module=SequentialMLP,
                submodules=MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                ),
            )
            return MoELayer(cfg, MoESubmodules(experts=spec), layer_number=1)

        ours = layer("uccl_ep")
        # Primus turns moe_enable_deepep on with its patch.
        turbo = layer("flex", moe_enable_deepep=True)
        ours_again = layer("uccl_ep")
        assert type(ours.token_dispatcher) is UcclEpTokenDispatcher
        assert type(ours_again.token_dispatcher) is UcclEpTokenDispatcher
        assert type(turbo.token_dispatcher) is TurboDeepEPStandIn
        assert turbo.token_dispatcher.built_with == "flex"
        assert moe_layer.MoEFlexTokenDispatcher is TurboDeepEPStandIn, "Primus' patch undone"
        assert token_dispatcher.MoEFlexTokenDispatcher is TurboDeepEPStandIn
        assert ours.config.moe_token_dispatcher_type == "uccl_ep"
    finally:
        token_dispatcher.MoEFlexTokenDispatcher, moe_layer.MoEFlexTokenDispatcher = originals
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()
        reset_options()


@pytest.mark.parametrize(
    "turbo_first", [True, False], ids=["turbo-then-plugin", "plugin-then-turbo"]
)
def test_primus_turbo_patch_and_plugin_in_either_order(turbo_first):
    get_pool(2).run(HERE, "w_turbo_patch_order", turbo_first)

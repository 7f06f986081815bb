"""How Primus hands Megatron its arguments, and what the ``uccl_ep`` plugin makes of them.

Primus (AMD-AGI/Primus, ``primus/backends/megatron/argument_builder.py``) never parses a
command line for Megatron: it builds Megatron-LM's parser (``add_megatron_arguments``), takes
``parse_args([])`` as the defaults, keeps those keys of its experiment YAML that the parser
knows (others are dropped without a word), and hands Megatron a ``SimpleNamespace`` that
``parse_args`` then returns (it patches it) and ``set_global_variables`` stores. So no
argparse action of ours runs. This script does the same with the overrides given as JSON in
``argv[1]`` and builds one ``MoELayer`` on a single gloo rank.

Run it through ``python -m uccl_ep_megatron.run`` (the plugin installed first, as the Primus
section of docs/megatron.md says). Needs Megatron-LM's ``megatron.training`` (megatron-core 0.17+
ship it); on Python 3.11 megatron-core 0.18+ import ``typing.override`` (3.12), which is lent
from ``typing_extensions`` here. Prints one JSON object.
"""

import argparse
import datetime
import json
import os
import sys
import tempfile
import types
import typing

if not hasattr(typing, "override"):  # Python 3.11: megatron.training 0.18+ imports it
    import typing_extensions

    typing.override = typing_extensions.override

import torch.distributed as dist
from megatron.training import global_vars
from megatron.training.arguments import add_megatron_arguments
from uccl_ep_megatron.token_dispatcher import get_options

overrides = json.loads(sys.argv[1])
parser = argparse.ArgumentParser(description="Primus Megatron arguments", allow_abbrev=False)
defaults = vars(add_megatron_arguments(parser).parse_args([]))
kept = {k: v for k, v in overrides.items() if k in defaults}
namespace = types.SimpleNamespace(**{**defaults, **kept})
global_vars.set_args(namespace)

with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(tmp, 'pg')}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        add_bias_linear=False,
        use_cpu_initialization=True,
        moe_token_dispatcher_type=namespace.moe_token_dispatcher_type,
    )
    experts = ModuleSpec(
        module=SequentialMLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    layer = MoELayer(config, MoESubmodules(experts=experts), layer_number=1)
    options = get_options()
    print(
        json.dumps(
            {
                "dispatcher": type(layer.token_dispatcher).__name__,
                "dropped": sorted(set(overrides) - set(kept)),
                "uccl_ep_keys_known": sorted(k for k in defaults if k.startswith("moe_uccl_ep")),
                "num_sms": options.num_sms,
                "backend": options.backend,
                "metrics": options.metrics,
                "transport": options.transport,
                # What the dispatcher's Buffer is made with (nothing goes through the env).
                "buffer_transport": options.buffer_options().transport,
                "env_transport": os.environ.get("UCCL_EP_TRANSPORT"),
            }
        )
    )
    ps.destroy_model_parallel()
    dist.destroy_process_group()

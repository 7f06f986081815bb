"""Stand-in for a Megatron-LM 0.16+ entry script: the flag is generated from the config field.

Megatron-LM's ArgumentGroupFactory turns a ``Literal`` field type into ``choices``; this does
the same for the one field, then prints what the script saw as JSON (the plugin's own flags
must be there too).
"""

import argparse
import dataclasses
import json
import typing

from megatron.core.transformer.transformer_config import TransformerConfig
from uccl_ep_megatron.token_dispatcher import get_options

field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["moe_token_dispatcher_type"]
parser = argparse.ArgumentParser(allow_abbrev=False)
group = parser.add_argument_group(title="transformer configuration")
kwargs = {"type": str, "default": field.default}
if typing.get_origin(field.type) is typing.Literal:
    kwargs["choices"] = typing.get_args(field.type)
group.add_argument("--moe-token-dispatcher-type", **kwargs)
args = parser.parse_args()
print(
    json.dumps(
        {
            "dispatcher": args.moe_token_dispatcher_type,
            "choices": kwargs.get("choices"),
            "num_sms": getattr(args, "moe_uccl_ep_num_sms", None),
            "options_num_sms": get_options().num_sms,
            "options_metrics": get_options().metrics,
        }
    )
)

"""Stand-in for a Megatron-LM 0.14/0.15 entry script: arguments.py hard-codes the choices.

Run through ``python -m uccl_ep_megatron.run``; prints what the script saw as JSON.
"""

import json
import sys

from megatron_lm_014 import parser_014
from uccl_ep_megatron.token_dispatcher import get_options

parser, _ = parser_014(description="Megatron-LM Arguments")
args = parser.parse_args()
print(
    json.dumps(
        {
            "name": __name__,
            "argv0": sys.argv[0],
            "dispatcher": args.moe_token_dispatcher_type,
            "num_sms": getattr(args, "moe_uccl_ep_num_sms", None),
            "options_num_sms": get_options().num_sms,
            "options_backend": get_options().backend,
        }
    )
)

"""Old import path, kept: an alias of the module it names below."""

import sys

import uccl_ep_megatron.api.ops as _moved

sys.modules[__name__] = _moved

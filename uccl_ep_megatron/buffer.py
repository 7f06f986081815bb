"""Old import path, kept: an alias of the module it names below."""

import sys

import uccl_ep_megatron.api.buffer as _moved

sys.modules[__name__] = _moved

"""Old import path, kept: the GPU train job's public names, from ``training.gpu``."""

from uccl_ep_megatron.training.gpu import *  # noqa: F403
from uccl_ep_megatron.training.gpu import __all__  # noqa: F401

"""The GPU path of ``uccl-ep-megatron train``: pretraining on megatron-core, one rank per GPU.

``model`` (recipe -> ``TransformerConfig`` / ``GPTModel``), ``data``, ``checkpoint``, ``probe``
(what is measured) and ``loop`` (the job). megatron-core is imported inside the functions, so
these modules import without it.
"""

from uccl_ep_megatron.training.gpu.checkpoint import TRACKER, load_checkpoint, save_checkpoint
from uccl_ep_megatron.training.gpu.data import TokenWindows, batches, forward_step, loss_func
from uccl_ep_megatron.training.gpu.loop import train_megatron
from uccl_ep_megatron.training.gpu.model import (
    EXPERT_PATHS,
    build_model,
    expert_config,
    expert_path,
    transformer_config,
    without_transformer_engine,
)
from uccl_ep_megatron.training.gpu.probe import MoEProbe

__all__ = [
    "EXPERT_PATHS",
    "TRACKER",
    "MoEProbe",
    "TokenWindows",
    "batches",
    "build_model",
    "expert_config",
    "expert_path",
    "forward_step",
    "load_checkpoint",
    "loss_func",
    "save_checkpoint",
    "train_megatron",
    "transformer_config",
    "without_transformer_engine",
]

"""The GPU path of ``uccl-ep-megatron train``: pretraining on megatron-core.

One process per GPU (torchrun). The recipe becomes a megatron-core ``(MLA)TransformerConfig``
and a ``GPTModel`` built from the local (non-Transformer-Engine) layer specs, so it runs where
only PyTorch and megatron-core are installed; ``Float16Module`` + megatron-core DDP + the
Megatron optimizer (fp32 master weights), ``OptimizerParamScheduler`` and
``get_forward_backward_func`` make the step, as in Megatron-LM's ``pretrain_gpt.py``.

Data: synthetic token windows (a seeded generator per data-parallel rank; no download), or
windows of ``seq_length + 1`` tokens cut from a Megatron indexed dataset's token stream.
Checkpoints: ``megatron.core.dist_checkpointing`` (model and optimizer sharded state dicts,
scheduler and iteration as common state) every ``save_interval`` iterations and at the end;
an existing checkpoint resumes the run unless ``--no-resume``.

Metrics per iteration (rank 0 writes): loss, tokens/s (global and per GPU), TFLOP/s per GPU
from ``uccl_ep_megatron.flops`` (the recipe's real architecture), forward dispatch/combine time
summed over MoE layers with CUDA events around the dispatcher's ``token_dispatch`` /
``token_combine`` (the same hooks for ``uccl_ep`` and ``alltoall``), their GB/s (bytes of the
received token rows / time), and expert-load imbalance (max/mean tokens per expert, from the
routers' routing maps, summed over all ranks and averaged over MoE layers).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from uccl_ep_megatron.errors import InvalidInputError, UnsupportedError

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


# ---- experts ------------------------------------------------------------------------------
EXPERT_PATHS = ("TEGroupedMLP", "GroupedMLP", "SequentialMLP")


def expert_path() -> tuple[str, str]:
    """The fastest expert implementation megatron-core offers here, and why.

    ``TEGroupedMLP`` (Transformer Engine's grouped GEMM) when Transformer Engine imports; else
    megatron-core's legacy ``GroupedMLP`` where the release still has it (0.14-0.16, switch
    ``moe_use_legacy_grouped_gemm``) and the ``grouped_gemm`` package is installed; else
    ``SequentialMLP``, one GEMM pair per local expert, the slowest.
    """
    import dataclasses
    import importlib.util

    from megatron.core.transformer.transformer_config import TransformerConfig

    if importlib.util.find_spec("transformer_engine") is not None:
        return "TEGroupedMLP", "Transformer Engine is installed: its grouped GEMM"
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    legacy = "moe_use_legacy_grouped_gemm" in fields
    if legacy and importlib.util.find_spec("grouped_gemm") is not None:
        return "GroupedMLP", "no Transformer Engine; megatron-core's legacy grouped GEMM"
    return (
        "SequentialMLP",
        "no Transformer Engine (and no legacy grouped_gemm): one GEMM pair per local expert, "
        "the slowest path; install transformer-engine for TEGroupedMLP",
    )


def expert_config(path: str) -> dict[str, Any]:
    """``TransformerConfig`` fields that select ``path`` (one of ``EXPERT_PATHS``)."""
    if path not in EXPERT_PATHS:
        raise InvalidInputError(f"expert path {path!r}: use one of {list(EXPERT_PATHS)}")
    if path == "SequentialMLP":
        return {"moe_grouped_gemm": False}
    if path == "GroupedMLP":
        import dataclasses

        from megatron.core.transformer.transformer_config import TransformerConfig

        if "moe_use_legacy_grouped_gemm" not in {
            f.name for f in dataclasses.fields(TransformerConfig)
        }:
            raise UnsupportedError(
                "GroupedMLP (legacy grouped GEMM) is gone from this megatron-core (0.17+): use "
                "TEGroupedMLP (Transformer Engine) or SequentialMLP"
            )
        return {"moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True}
    return {"moe_grouped_gemm": True}


# ---- model --------------------------------------------------------------------------------
def transformer_config(recipe, par: dict[str, int], dispatcher: str, experts: str | None = None):
    """The recipe as a megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for MLA).

    ``experts`` is one of ``EXPERT_PATHS`` (default: ``expert_path()``'s choice).
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    m = recipe.model
    dense = int(m.get("first_k_dense_layers") or 0)
    kwargs: dict[str, Any] = dict(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        kv_channels=m.get("kv_channels"),
        num_query_groups=m.get("num_query_groups"),
        tensor_model_parallel_size=par["tp"],
        pipeline_model_parallel_size=par["pp"],
        expert_model_parallel_size=par["ep"],
        expert_tensor_parallel_size=par["etp"],
        context_parallel_size=par["cp"],
        sequence_parallel=bool(recipe.parallelism.get("sequence_parallel")) and par["tp"] > 1,
        normalization=m.get("normalization") or "RMSNorm",
        layernorm_epsilon=float(m.get("norm_epsilon") or 1e-6),
        gated_linear_unit=bool(m.get("swiglu")),
        activation_func=torch.nn.functional.silu if m.get("swiglu") else torch.nn.functional.gelu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=float(m.get("init_method_std") or 0.02),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        # Fused kernels that need Apex/Transformer Engine stay off: plain PyTorch is enough.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        mtp_num_layers=m.get("mtp_num_layers"),
        mtp_loss_scaling_factor=float(m.get("mtp_loss_scaling_factor") or 0.1),
    )
    if m.get("num_experts"):
        kwargs.update(
            num_moe_experts=m["num_experts"],
            moe_layer_freq=[0] * dense + [1] * (m["num_layers"] - dense),
            moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
            moe_shared_expert_intermediate_size=m.get("moe_shared_expert_intermediate_size"),
            moe_router_topk=m["moe_router_topk"],
            moe_router_num_groups=m.get("moe_router_num_groups"),
            moe_router_group_topk=m.get("moe_router_group_topk"),
            moe_router_score_function=m.get("moe_router_score_function") or "softmax",
            moe_router_enable_expert_bias=bool(m.get("moe_router_enable_expert_bias")),
            moe_router_bias_update_rate=float(m.get("moe_router_bias_update_rate") or 1e-3),
            moe_router_topk_scaling_factor=m.get("moe_router_topk_scaling_factor"),
            moe_router_load_balancing_type=m.get("moe_router_load_balancing_type") or "aux_loss",
            moe_aux_loss_coeff=float(m.get("moe_aux_loss_coeff") or 0.0),
            moe_router_dtype="fp32",
            moe_token_dispatcher_type=dispatcher,
            **expert_config(experts or expert_path()[0]),
        )
    if m.get("multi_latent_attention"):
        return MLATransformerConfig(
            **kwargs,
            multi_latent_attention=True,
            # For MLA this is DeepSeek-V3's RMSNorm on the q and kv latents (q_a/kv_a_layernorm).
            qk_layernorm=True,
            q_lora_rank=m.get("q_lora_rank"),
            kv_lora_rank=m["kv_lora_rank"],
            qk_head_dim=m["qk_head_dim"],
            qk_pos_emb_head_dim=m["qk_pos_emb_head_dim"],
            v_head_dim=m["v_head_dim"],
            rope_type="rope",
            rotary_base=float(m.get("rotary_base") or 10000),
        )
    return TransformerConfig(**kwargs)


def _local_mla_core_attention():
    """megatron-core's unfused ``DotProductAttention`` made to accept MLA's head dims.

    Without Transformer Engine the local MLA spec pairs ``MLASelfAttention`` with
    ``DotProductAttention``, which (megatron-core 0.16) rejects the ``k_channels`` /
    ``v_channels`` MLA passes and sizes its output by ``kv_channels``. Its math already handles
    q/k of ``qk_head_dim + qk_pos_emb_head_dim`` and v of ``v_head_dim``; this subclass takes the
    two arguments, sizes the output by ``v_channels`` and makes the (split) inputs contiguous
    for its ``view`` calls. The softmax scale comes from MLA (``softmax_scale``).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        def __init__(self, *args: Any, k_channels=None, v_channels=None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

        def forward(self, query, key, value, *args: Any, **kwargs: Any):
            return super().forward(
                query.contiguous(), key.contiguous(), value.contiguous(), *args, **kwargs
            )

    return DotProductAttention, LocalMLACoreAttention


def without_transformer_engine() -> bool:
    """Make megatron-core 0.16's MoE and MLA code run where Transformer Engine is missing.

    Two spots assume TE: ``moe_utils.router_gating_linear`` reads the module global
    ``te_general_gemm``, which is only defined when TE imports (a ``NameError`` in every
    router's forward otherwise); ``multi_latent_attention`` sets ``HAVE_TE`` when its TE
    extension module imports (it does without TE, leaving ``TELinear`` None) and then calls
    ``isinstance(x, None)``. Without TE both have a plain-PyTorch path; this selects it.

    Returns:
        ``True`` when TE is missing (and the two module globals were set), else ``False``.
    """
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        return False
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False
    return True


def _patch_mla_core_attention(layer_specs) -> None:
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    plain, local_mla = _local_mla_core_attention()
    for spec in layer_specs:
        attn = getattr(getattr(spec, "submodules", None), "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if attn is not None and attn.module is MLASelfAttention and sub.core_attention is plain:
            sub.core_attention = local_mla


def build_model(recipe, config):
    """``GPTModel`` (and MTP when the recipe has it): Transformer Engine's layer specs when it
    is installed, the local ones otherwise."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )

    m = recipe.model
    # With Transformer Engine the whole block uses its layers (TEGroupedMLP needs them); the
    # local specs otherwise.
    use_te = not without_transformer_engine()
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te)
    if m.get("multi_latent_attention") and not use_te:
        _patch_mla_core_attention(block.layer_specs)
    mtp = None
    if m.get("mtp_num_layers"):
        mtp = get_gpt_mtp_block_spec(config, block, use_transformer_engine=use_te)
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=m["vocab_size"],
        max_sequence_length=int(m.get("max_position_embeddings") or m["seq_length"]),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=not m.get("untie_embeddings_and_output_weights"),
        position_embedding_type=m.get("position_embedding_type") or "rope",
        rotary_base=int(m.get("rotary_base") or 10000),
        mtp_block_spec=mtp,
    )


# ---- data ---------------------------------------------------------------------------------
class TokenWindows:
    """Windows of ``seq_length + 1`` consecutive tokens of an indexed dataset's token stream.

    Documents are concatenated in order (as Megatron's GPT dataset does before sampling), so
    every window is full; window ``i`` starts at token ``i * (seq_length + 1)``.
    """

    def __init__(self, prefix: str, seq_length: int) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dataset = IndexedDataset(prefix)
        self.lengths = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)])
        self.window = seq_length + 1
        self.num_windows = int(self.starts[-1] // self.window)
        if self.num_windows == 0:
            raise InvalidInputError(
                f"--data-path {prefix!r} holds {int(self.starts[-1])} tokens, fewer than one "
                f"sequence of {self.window}; use a larger dataset or a shorter seq_length"
            )

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> np.ndarray:
        pos = (i % self.num_windows) * self.window
        out, need = [], self.window
        doc = int(np.searchsorted(self.starts, pos, side="right") - 1)
        offset = pos - int(self.starts[doc])
        while need:
            take = min(need, int(self.lengths[doc]) - offset)
            if take > 0:
                out.append(np.asarray(self.dataset.get(doc, offset=offset, length=take)))
                need -= take
            doc, offset = doc + 1, 0
        return np.concatenate(out).astype(np.int64)


def batches(
    recipe, par: dict[str, int], dp_rank: int, start_iter: int, data_path: str | None, device
) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches of this data-parallel rank from iteration ``start_iter`` on (resumable)."""
    seq = int(recipe.model["seq_length"])
    mb = int(recipe.training["micro_batch_size"])
    nmb = par["num_microbatches"]
    gb = int(recipe.training["global_batch_size"])
    vocab = int(recipe.model["vocab_size"])
    windows = TokenWindows(data_path, seq) if data_path else None
    seed = int(recipe.training.get("seed") or 1234)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(mb, -1)
    it = start_iter
    while True:
        for k in range(nmb):
            first = it * gb + dp_rank * mb * nmb + k * mb  # this micro-batch's global samples
            if windows is not None:
                rows = np.stack([windows[first + j] for j in range(mb)])
                tokens = torch.from_numpy(rows).to(device, non_blocking=True)
            else:
                g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + first)
                tokens = torch.randint(0, vocab, (mb, seq + 1), generator=g, device=device)
            yield {
                "tokens": tokens[:, :-1].contiguous(),
                "labels": tokens[:, 1:].contiguous(),
                "loss_mask": torch.ones(mb, seq, dtype=torch.float32, device=device),
                "position_ids": position_ids,
                "attention_mask": mask,
            }
        it += 1


def _forward_step(data_iterator, model):
    b = next(data_iterator)
    output = model(
        b["tokens"],
        b["position_ids"],
        b["attention_mask"],
        labels=b["labels"],
        loss_mask=b["loss_mask"],
    )
    return output, functools.partial(_loss, b["loss_mask"])


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    losses = output.float().view(-1)
    mask = loss_mask.view(-1)
    total = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return total, tokens, {"lm loss": torch.stack([total.detach(), tokens.float()])}


# ---- instrumentation ----------------------------------------------------------------------
class MoEProbe:
    """CUDA-event timing of token dispatch/combine and routing-map load per MoE layer."""

    def __init__(self, model: torch.nn.Module) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event, int]] = []
        self.loads: list[torch.Tensor] = []
        layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        for layer in layers:
            disp = layer.token_dispatcher
            disp.token_dispatch = self._timed("dispatch", disp.token_dispatch, out_bytes=True)
            disp.token_combine = self._timed("combine", disp.token_combine, out_bytes=False)
            load = torch.zeros(layer.config.num_moe_experts, device="cuda", dtype=torch.float64)
            self.loads.append(load)
            layer.router.register_forward_hook(self._load_hook(load))
        self.num_layers = len(layers)
        self.layers = layers

    def buffer_backends(self) -> list[str]:
        """Backends of the ``Buffer`` objects the MoE layers' dispatchers use (``uccl_ep``)."""
        names = set()
        for layer in self.layers:
            buffer = getattr(layer.token_dispatcher, "buffer", None)
            if buffer is not None and hasattr(buffer, "backend"):
                names.add(str(buffer.backend))
        return sorted(names)

    def _timed(self, kind: str, fn, out_bytes: bool):
        def wrapper(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            # Bytes of token rows moved: what dispatch received, what combine sends back.
            src = out if out_bytes else (args[0] if args else next(iter(kwargs.values())))
            t = src[0] if isinstance(src, (tuple, list)) else src
            nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            self.events.append((kind, start, end, nbytes))
            return out

        return wrapper

    @staticmethod
    def _load_hook(load: torch.Tensor):
        def hook(_module, _inputs, output):
            routing_map = output[1]
            load.add_(routing_map.sum(0).to(load.dtype))

        return hook

    def collect(self) -> dict[str, float]:
        """Metrics since the last call (syncs the device; all-reduces loads over the world)."""
        torch.cuda.synchronize()
        time_ms = {"dispatch": 0.0, "combine": 0.0}
        nbytes = {"dispatch": 0, "combine": 0}
        for kind, start, end, b in self.events:
            time_ms[kind] += start.elapsed_time(end)
            nbytes[kind] += b
        self.events.clear()
        out: dict[str, float] = {}
        if self.num_layers:
            stacked = torch.stack(self.loads)
            dist.all_reduce(stacked)
            mean = stacked.mean(-1).clamp_min(1e-9)
            out["expert_load_imbalance"] = float((stacked.max(-1).values / mean).mean())
            for load in self.loads:
                load.zero_()
            out["dispatch_time_ms"] = time_ms["dispatch"]
            out["combine_time_ms"] = time_ms["combine"]
            for kind in ("dispatch", "combine"):
                if time_ms[kind] > 0:
                    out[f"{kind}_gbps"] = nbytes[kind] / (time_ms[kind] * 1e-3) / 1e9
        return out


# ---- checkpoints --------------------------------------------------------------------------
def _latest(ckpt_dir: Path) -> int | None:
    tracker = ckpt_dir / TRACKER
    return int(tracker.read_text().strip()) if tracker.is_file() else None


def save_checkpoint(ckpt_dir: Path, iteration: int, gpt, optimizer, scheduler) -> Path:
    """Save a distributed checkpoint of ``iteration`` and point the tracker at it."""
    from megatron.core import dist_checkpointing

    path = ckpt_dir / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    state = {"model": gpt.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"])
    state["scheduler"] = scheduler.state_dict()
    state["iteration"] = iteration
    dist_checkpointing.save(state, str(path))
    dist.barrier()
    if dist.get_rank() == 0:
        (ckpt_dir / TRACKER).write_text(str(iteration))
    return path


def load_checkpoint(ckpt_dir: Path, gpt, optimizer, scheduler) -> int:
    """Load the tracker's checkpoint; returns its iteration (0 when there is none)."""
    from megatron.core import dist_checkpointing

    iteration = _latest(ckpt_dir)
    if iteration is None:
        return 0
    path = ckpt_dir / f"iter_{iteration:07d}"
    state = {"model": gpt.sharded_state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state["model"], is_loading=True)
    loaded = dist_checkpointing.load(state, str(path))
    gpt.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(loaded["scheduler"])
    return int(loaded["iteration"])


# ---- the job ------------------------------------------------------------------------------
def _install_dispatcher(dispatcher: str, recipe) -> None:
    if dispatcher != "uccl_ep":
        return
    try:
        from uccl_ep_megatron import megatron_plugin
    except ImportError as exc:
        raise UnsupportedError(
            "the uccl_ep dispatcher plugin (uccl_ep_megatron.megatron_plugin) is not available "
            f"in this install ({exc}); use --dispatcher alltoall"
        ) from exc
    d = recipe.dispatcher
    transport = d.get("transport")
    megatron_plugin.install(
        num_sms=d.get("num_sms"),
        num_proxy_threads=d.get("proxy_threads"),
        transport=None if transport in (None, "auto") else transport,
    )


def train_megatron(recipe, opts, dispatcher: str) -> int:
    """Train ``recipe`` on this torchrun rank; returns 0 (errors raise)."""
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.module import Float16Module
    except ImportError as exc:
        raise UnsupportedError(
            f"training on GPUs needs megatron-core ({exc}): "
            "pip install 'uccl-ep-megatron[megatron]'"
        ) from exc
    from uccl_ep_megatron.flops import (
        mfu,
        param_counts,
        peak_bf16_tflops,
        training_flops_per_token,
    )
    from uccl_ep_megatron.metrics import MetricsLogger
    from uccl_ep_megatron.train import default_run_dir, print_results

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    par = recipe.resolved_parallelism(world)
    if par["pp"] > 1 or par["cp"] > 1 or par["vpp"] > 1:
        raise UnsupportedError(
            f"the built-in train job runs TP/EP/ETP/DP; recipe {recipe.name!r} uses "
            f"PP={par['pp']} VPP={par['vpp']} CP={par['cp']}: run it through Megatron-LM with "
            f"`uccl-ep-megatron launch --recipe {recipe.name} --target megatron`"
        )
    run_dir = [str(opts.run_dir or default_run_dir(recipe.name, dispatcher, "gpu"))]
    dist.broadcast_object_list(run_dir, src=0)  # one directory even if clocks differ
    run_dir = Path(run_dir[0])
    ckpt_dir = Path(opts.checkpoint_dir) if opts.checkpoint_dir else run_dir / "checkpoints"

    _install_dispatcher(dispatcher, recipe)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par["tp"],
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=par["ep"],
        expert_tensor_parallel_size=par["etp"],
    )
    seed = int(recipe.training.get("seed") or 1234)
    torch.manual_seed(seed)  # host-side RNG; the CUDA ones are seeded per parallel rank below
    model_parallel_cuda_manual_seed(seed)
    experts, experts_why = expert_path()
    if rank == 0:
        log_fn = log.warning if experts == "SequentialMLP" else log.info
        log_fn("experts: %s (%s)", experts, experts_why)
    config = transformer_config(recipe, par, dispatcher, experts)
    gpt = build_model(recipe, config).cuda()
    gpu_name = torch.cuda.get_device_name()
    peak = opts.peak_tflops if getattr(opts, "peak_tflops", None) else peak_bf16_tflops(gpu_name)
    built_params = _count_built_params(gpt, par)
    t = recipe.training
    use_dist_opt = bool(recipe.parallelism.get("use_distributed_optimizer"))
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_dist_opt,
        ),
        Float16Module(config, gpt),
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=float(t["lr"]),
            min_lr=float(t.get("min_lr") or 0.0),
            weight_decay=float(t.get("weight_decay") or 0.0),
            adam_beta1=float(t.get("adam_beta1") or 0.9),
            adam_beta2=float(t.get("adam_beta2") or 0.95),
            clip_grad=float(t.get("clip_grad") or 1.0),
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=use_dist_opt,
        ),
        [model],
    )
    iters = int(t["train_iters"])
    gb = int(t["global_batch_size"])
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=float(t["lr"]),
        min_lr=float(t.get("min_lr") or 0.0),
        # Megatron needs warmup < decay; a short run (--iters) shortens the warmup with it.
        lr_warmup_steps=min(int(t.get("lr_warmup_iters") or 0), iters - 1) * gb,
        lr_decay_steps=iters * gb,
        lr_decay_style=t.get("lr_decay_style") or "cosine",
        start_wd=float(t.get("weight_decay") or 0.0),
        end_wd=float(t.get("weight_decay") or 0.0),
        wd_incr_steps=iters * gb,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync

    start = load_checkpoint(ckpt_dir, gpt, optimizer, scheduler) if opts.resume else 0
    probe = MoEProbe(gpt)
    seq = int(recipe.model["seq_length"])
    mb = int(t["micro_batch_size"])
    dp_rank = parallel_state.get_data_parallel_rank()
    data = batches(recipe, par, dp_rank, start, opts.data_path, torch.device("cuda"))
    flops_per_token = training_flops_per_token(recipe.model, seq)
    counts = param_counts(recipe.model)
    save_interval = int(t.get("save_interval") or 0)
    metrics = MetricsLogger(
        run_dir,
        {
            "recipe": recipe.name,
            "dispatcher": dispatcher,
            "world_size": world,
            "parallelism": par,
            "params_total": counts.total,
            "params_active": counts.active,
            "training_flops_per_token": flops_per_token,
            "data": opts.data_path or "synthetic",
            "experts": experts,
            "gpu": gpu_name,
            "peak_bf16_tflops": peak,
            "start_iteration": start,
            "model": recipe.model,
            "training": recipe.training,
        },
        project=opts.wandb_project,
        use_wandb=opts.use_wandb,
        enabled=rank == 0,
    )
    progress = _Progress(rank == 0, start, iters)
    forward_backward = get_forward_backward_func()
    tokens_per_iter = gb * seq
    try:
        for it in range(start + 1, iters + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(
                forward_step_func=_forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=par["num_microbatches"],
                seq_length=seq,
                micro_batch_size=mb,
                decoder_seq_length=seq,
                forward_only=False,
            )
            ok, grad_norm, _ = optimizer.step()
            if ok:
                scheduler.step(increment=gb)
            step_metrics = probe.collect()  # synchronizes the device
            step_time = time.perf_counter() - t0
            loss_sum = torch.stack([r["lm loss"] for r in reduced]).sum(0)
            dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
            tokens_per_s = tokens_per_iter / step_time
            tflops = flops_per_token * tokens_per_s / world / 1e12
            step_metrics.update(
                loss=float(loss_sum[0] / loss_sum[1].clamp_min(1)),
                lr=float(optimizer.param_groups[0]["lr"]),
                grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                step_time_s=step_time,
                tokens_per_s=tokens_per_s,
                tokens_per_s_per_gpu=tokens_per_s / world,
                tflops_per_gpu=tflops,
            )
            if peak is not None:
                step_metrics["mfu"] = mfu(tflops, peak)
            metrics.log(it, step_metrics)
            progress.update(it, step_metrics)
            if save_interval and (it % save_interval == 0 or it == iters):
                save_checkpoint(ckpt_dir, it, gpt, optimizer, scheduler)
        expected = counts.total + counts.mtp_params
        if recipe.model.get("moe_router_enable_expert_bias"):
            # megatron-core keeps the expert bias as a buffer, not a parameter.
            moe_layers = recipe.num_moe_layers + int(recipe.model.get("mtp_num_layers") or 0)
            expected -= moe_layers * int(recipe.model["num_experts"])
        metrics.summary(
            {
                "iterations": iters,
                "dispatcher": dispatcher,
                "world_size": world,
                "model_params_built": built_params,
                "model_params_expected": expected,
                "buffer_backends": ",".join(probe.buffer_backends()) or "none",
                "experts": experts,
                "gpu": gpu_name,
                "peak_bf16_tflops": peak,
            }
        )
        if rank == 0 and probe.buffer_backends():
            print(f"uccl_ep Buffer backend: {', '.join(probe.buffer_backends())}", flush=True)
        if rank == 0 and built_params is not None:
            print(
                f"parameters: megatron-core model {built_params:,}, flops.py {expected:,} "
                f"(main {counts.total:,} + MTP {counts.mtp_params:,} - expert-bias buffers)",
                flush=True,
            )
    finally:
        progress.close()
        metrics.close()
    if rank == 0 and iters > start:
        print_results([run_dir])
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


def _count_built_params(gpt: torch.nn.Module, par: dict[str, int]) -> int | None:
    """Parameters of the whole model: replicated ones once, expert ones summed over EP ranks.

    Only defined without tensor parallelism (TP shards would need their own bookkeeping).
    """
    from megatron.core import parallel_state

    if par["tp"] != 1 or par["etp"] != 1:
        return None
    replicated = sum(p.numel() for p in gpt.parameters() if getattr(p, "allreduce", True))
    expert = torch.tensor(
        [sum(p.numel() for p in gpt.parameters() if not getattr(p, "allreduce", True))],
        dtype=torch.float64,
        device="cuda",
    )
    dist.all_reduce(expert, group=parallel_state.get_expert_model_parallel_group())
    return int(replicated + expert.item())


class _Progress:
    """A rich progress bar with loss, tokens/s and TFLOP/s on rank 0 (a log line per step)."""

    def __init__(self, enabled: bool, start: int, total: int) -> None:
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
        )
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.bar.start()

    def update(self, it: int, m: dict[str, float]) -> None:
        if not self.enabled:
            return
        info = (
            f"loss {m['loss']:.4f} | {m['tokens_per_s']:,.0f} tok/s | "
            f"{m['tflops_per_gpu']:.1f} TFLOP/s/GPU"
        )
        if "mfu" in m:
            info += f" | MFU {100 * m['mfu']:.1f}%"
        if "dispatch_time_ms" in m:
            info += (
                f" | dispatch {m['dispatch_time_ms']:.2f} ms combine {m['combine_time_ms']:.2f} ms"
            )
        self.bar.update(self.task, completed=it, info=info)
        log.info("iter %d: %s", it, info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = [
    "EXPERT_PATHS",
    "MoEProbe",
    "TokenWindows",
    "batches",
    "build_model",
    "expert_config",
    "expert_path",
    "load_checkpoint",
    "save_checkpoint",
    "train_megatron",
    "transformer_config",
]

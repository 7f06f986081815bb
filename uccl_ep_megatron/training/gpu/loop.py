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
from ``telemetry.flops`` (the recipe's real architecture), forward dispatch/combine device time
and host time summed over MoE layers (``telemetry.dispatch``: the same hooks around every
dispatcher's ``token_dispatch`` / ``token_combine``, ``uccl_ep`` and ``alltoall`` alike), their
GB/s (bytes of the received token rows / device time), and expert-load imbalance (``probe``).

The pieces live beside this loop: ``model`` (config translation, TE patches), ``data``,
``checkpoint`` and ``probe``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from uccl_ep_megatron.core.errors import UnsupportedError
from uccl_ep_megatron.telemetry.flops import (
    mfu,
    param_counts,
    peak_bf16_tflops,
    training_flops_per_token,
)
from uccl_ep_megatron.telemetry.metrics import MetricsLogger
from uccl_ep_megatron.training.gpu.checkpoint import (
    check_distributed_optimizer_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from uccl_ep_megatron.training.gpu.data import batches, forward_step
from uccl_ep_megatron.training.gpu.model import build_model, expert_path, transformer_config
from uccl_ep_megatron.training.gpu.probe import MoEProbe
from uccl_ep_megatron.training.results import default_run_dir, print_results

log = logging.getLogger(__name__)


def quiet_other_ranks(rank: int) -> None:
    """Only rank 0 talks: other ranks drop Python warnings (megatron-core's import-time
    ``UserWarning`` about Transformer Engine/Apex would print once per rank) and log records
    below ERROR. Called before megatron-core is imported."""
    if rank == 0:
        return
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)


def _import_megatron() -> SimpleNamespace:
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
    return SimpleNamespace(
        parallel_state=parallel_state,
        DistributedDataParallel=DistributedDataParallel,
        DistributedDataParallelConfig=DistributedDataParallelConfig,
        finalize_model_grads=finalize_model_grads,
        OptimizerConfig=OptimizerConfig,
        get_megatron_optimizer=get_megatron_optimizer,
        OptimizerParamScheduler=OptimizerParamScheduler,
        get_forward_backward_func=get_forward_backward_func,
        model_parallel_cuda_manual_seed=model_parallel_cuda_manual_seed,
        Float16Module=Float16Module,
    )


def _install_dispatcher(dispatcher: str, recipe) -> None:
    if dispatcher == "flex":
        check_flex_available()
    if dispatcher != "uccl_ep":
        return
    try:
        import uccl_ep_megatron.megatron_plugin as megatron_plugin
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
        fp8_dispatch=d.get("fp8_dispatch"),
        sync_free=d.get("sync_free"),
    )


def check_flex_available() -> None:
    """``flex`` runs megatron-core's flex dispatcher on DeepEP (V1): it must import, and be
    DeepEP itself rather than this package's ``deep_ep`` drop-in.

    Raises:
        UnsupportedError: saying what is missing.
    """
    import importlib

    try:
        deep_ep = importlib.import_module("deep_ep")
    except ImportError as exc:
        raise UnsupportedError(
            f"the flex dispatcher runs on DeepEP, and deep_ep does not import ({exc}): install "
            "DeepEP (built with NVSHMEM) or compare with alltoall"
        ) from exc
    if "uccl_ep_megatron" in (getattr(deep_ep, "__file__", None) or deep_ep.__name__):
        raise UnsupportedError(
            "deep_ep is served by uccl_ep_megatron's drop-in here, not DeepEP: flex would run "
            "this package's Buffer; use --dispatcher uccl_ep, or install DeepEP for flex"
        )


def _init_parallel(recipe, world: int, mc: SimpleNamespace) -> dict[str, int]:
    par = recipe.resolved_parallelism(world)
    if par["pp"] > 1 or par["cp"] > 1 or par["vpp"] > 1:
        raise UnsupportedError(
            f"the built-in train job runs TP/EP/ETP/DP; recipe {recipe.name!r} uses "
            f"PP={par['pp']} VPP={par['vpp']} CP={par['cp']}: run it through Megatron-LM with "
            f"`uccl-ep-megatron launch --recipe {recipe.name} --target megatron`"
        )
    mc.parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par["tp"],
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=par["ep"],
        expert_tensor_parallel_size=par["etp"],
    )
    seed = int(recipe.training.get("seed") or 1234)
    torch.manual_seed(seed)  # host-side RNG; the CUDA ones are seeded per parallel rank below
    mc.model_parallel_cuda_manual_seed(seed)
    return par


def _build(recipe, par: dict[str, int], dispatcher: str, mc: SimpleNamespace) -> SimpleNamespace:
    """Model (DDP over Float16Module over GPTModel), optimizer and LR schedule."""
    experts, experts_why = expert_path(recipe.model.get("moe_experts"))
    if dist.get_rank() == 0:
        log_fn = log.warning if experts == "SequentialMLP" else log.info
        log_fn("experts: %s (%s)", experts, experts_why)
    config = transformer_config(recipe, par, dispatcher, experts)
    gpt = build_model(recipe, config, experts).cuda()
    t = recipe.training
    use_dist_opt = bool(recipe.parallelism.get("use_distributed_optimizer"))
    ddp_config = mc.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_dist_opt
    )
    model = mc.DistributedDataParallel(config, ddp_config, mc.Float16Module(config, gpt))
    optimizer = mc.get_megatron_optimizer(
        mc.OptimizerConfig(
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
    iters, gb = int(t["train_iters"]), int(t["global_batch_size"])
    wd = float(t.get("weight_decay") or 0.0)
    scheduler = mc.OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=float(t["lr"]),
        min_lr=float(t.get("min_lr") or 0.0),
        # Megatron needs warmup < decay; a short run (--iters) shortens the warmup with it.
        lr_warmup_steps=min(int(t.get("lr_warmup_iters") or 0), iters - 1) * gb,
        lr_decay_steps=iters * gb,
        lr_decay_style=t.get("lr_decay_style") or "cosine",
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=iters * gb,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = mc.finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync
    return SimpleNamespace(
        config=config,
        gpt=gpt,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        experts=experts,
        iters=iters,
        global_batch=gb,
    )


def dispatch_mode(gpt: torch.nn.Module, dispatcher: str) -> str:
    """What the MoE layers' dispatchers run: ``uccl_ep``'s mode (``exact``, ``sync-free
    dropless`` or ``sync-free with a capacity``), else the dispatcher's own name
    (``alltoall``, ``flex`` on DeepEP ...)."""
    modes = sorted(
        {
            str(getattr(m.token_dispatcher, "mode_name", dispatcher))
            for m in gpt.modules()
            if getattr(m, "token_dispatcher", None) is not None
        }
    )
    return ",".join(modes) or "no MoE layer"


def _metrics_logger(recipe, opts, run: SimpleNamespace) -> MetricsLogger:
    m = run.meta
    return MetricsLogger(
        run.run_dir,
        {
            "recipe": recipe.name,
            "dispatcher": m["dispatcher"],
            "dispatch_mode": m["dispatch_mode"],
            "fp8_dispatch": m["fp8_dispatch"],
            "world_size": m["world_size"],
            "parallelism": run.par,
            "params_total": run.counts.total,
            "params_active": run.counts.active,
            "training_flops_per_token": run.flops_per_token,
            "data": opts.data_path or "synthetic",
            "experts": run.built.experts,
            "gpu": m["gpu"],
            "peak_bf16_tflops": run.peak,
            "start_iteration": run.start,
            "model": recipe.model,
            "training": recipe.training,
        },
        project=opts.wandb_project,
        use_wandb=opts.use_wandb,
        enabled=dist.get_rank() == 0,
    )


def _step(run: SimpleNamespace, data, mc: SimpleNamespace) -> dict[str, float]:
    """One iteration: forward/backward over the micro-batches, optimizer and LR step; metrics."""
    b = run.built
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    b.model.zero_grad_buffer()
    b.optimizer.zero_grad()
    reduced = run.forward_backward(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[b.model],
        num_microbatches=run.par["num_microbatches"],
        seq_length=run.seq,
        micro_batch_size=run.micro_batch,
        decoder_seq_length=run.seq,
        forward_only=False,
    )
    ok, grad_norm, _ = b.optimizer.step()
    if ok:
        b.scheduler.step(increment=b.global_batch)
    step_metrics = run.probe.collect()  # synchronizes the device
    step_time = time.perf_counter() - t0
    loss_sum = torch.stack([r["lm loss"] for r in reduced]).sum(0)
    dist.all_reduce(loss_sum, group=mc.parallel_state.get_data_parallel_group())
    tokens_per_s = b.global_batch * run.seq / step_time
    tflops = run.flops_per_token * tokens_per_s / run.meta["world_size"] / 1e12
    step_metrics.update(
        loss=float(loss_sum[0] / loss_sum[1].clamp_min(1)),
        lr=float(b.optimizer.param_groups[0]["lr"]),
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        step_time_s=step_time,
        tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / run.meta["world_size"],
        tflops_per_gpu=tflops,
    )
    if run.peak is not None:
        step_metrics["mfu"] = mfu(tflops, run.peak)
    return step_metrics


def _summarize(recipe, run: SimpleNamespace, metrics: MetricsLogger) -> None:
    expected = run.counts.total + run.counts.mtp_params
    if recipe.model.get("moe_router_enable_expert_bias"):
        # megatron-core keeps the expert bias as a buffer, not a parameter.
        moe_layers = recipe.num_moe_layers + int(recipe.model.get("mtp_num_layers") or 0)
        expected -= moe_layers * int(recipe.model["num_experts"])
    backends = run.probe.buffer_backends()
    metrics.summary(
        {
            **run.meta,
            "iterations": run.built.iters,
            "model_params_built": run.built_params,
            "model_params_expected": expected,
            "buffer_backends": ",".join(backends) or "none",
            "experts": run.built.experts,
            "peak_bf16_tflops": run.peak,
        }
    )
    if dist.get_rank() != 0:
        return
    if backends:
        print(f"uccl_ep Buffer backend: {', '.join(backends)}", flush=True)
    if run.built_params is not None:
        print(
            f"parameters: megatron-core model {run.built_params:,}, flops.py {expected:,} "
            f"(main {run.counts.total:,} + MTP {run.counts.mtp_params:,} - expert-bias buffers)",
            flush=True,
        )


def _prepare(recipe, opts, dispatcher: str, mc: SimpleNamespace) -> SimpleNamespace:
    """Everything the loop needs, on this rank: directories, parallel state, model, checkpoint,
    data, probe and the per-step constants."""
    world = dist.get_world_size()
    run_dir = [str(opts.run_dir or default_run_dir(recipe.name, dispatcher, "gpu"))]
    dist.broadcast_object_list(run_dir, src=0)  # one directory even if clocks differ
    run_dir = Path(run_dir[0])
    ckpt_dir = Path(opts.checkpoint_dir) if opts.checkpoint_dir else run_dir / "checkpoints"
    save_interval = int(recipe.training.get("save_interval") or 0)
    if recipe.parallelism.get("use_distributed_optimizer") and (save_interval or opts.resume):
        check_distributed_optimizer_checkpoints()
    _install_dispatcher(dispatcher, recipe)
    par = _init_parallel(recipe, world, mc)
    built = _build(recipe, par, dispatcher, mc)
    gpu_name = torch.cuda.get_device_name()
    start = 0
    if opts.resume:
        start = load_checkpoint(ckpt_dir, built.gpt, built.optimizer, built.scheduler)
    seq = int(recipe.model["seq_length"])
    dp_rank = mc.parallel_state.get_data_parallel_rank()
    options = _dispatcher_options(dispatcher)
    return SimpleNamespace(
        run_dir=run_dir,
        ckpt_dir=ckpt_dir,
        par=par,
        built=built,
        start=start,
        seq=seq,
        micro_batch=int(recipe.training["micro_batch_size"]),
        data=batches(recipe, par, dp_rank, start, opts.data_path, torch.device("cuda")),
        flops_per_token=training_flops_per_token(recipe.model, seq),
        counts=param_counts(recipe.model),
        peak=opts.peak_tflops if getattr(opts, "peak_tflops", None) else peak_bf16_tflops(gpu_name),
        built_params=_count_built_params(built.gpt, par),
        probe=MoEProbe(built.gpt),
        forward_backward=mc.get_forward_backward_func(),
        save_interval=save_interval,
        meta={
            "dispatcher": dispatcher,
            "dispatch_mode": dispatch_mode(built.gpt, dispatcher),
            "fp8_dispatch": bool(getattr(options, "fp8_dispatch", False)),
            "world_size": world,
            "gpu": gpu_name,
        },
    )


def _dispatcher_options(dispatcher: str):
    if dispatcher != "uccl_ep":
        return None
    from uccl_ep_megatron.token_dispatcher.options import get_options

    return get_options()


def train_megatron(recipe, opts, dispatcher: str) -> int:
    """Train ``recipe`` on this torchrun rank; returns 0 (errors raise)."""
    quiet_other_ranks(int(os.environ.get("RANK", "0")))
    mc = _import_megatron()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", timeout=timedelta(minutes=10))
    rank = dist.get_rank()
    run = _prepare(recipe, opts, dispatcher, mc)
    metrics = _metrics_logger(recipe, opts, run)
    iters = run.built.iters
    progress = _Progress(rank == 0, run.start, iters, run.meta, run.built.experts)
    try:
        for it in range(run.start + 1, iters + 1):
            step_metrics = _step(run, run.data, mc)
            metrics.log(it, step_metrics)
            progress.update(it, step_metrics)
            if run.save_interval and (it % run.save_interval == 0 or it == iters):
                b = run.built
                save_checkpoint(run.ckpt_dir, it, b.gpt, b.optimizer, b.scheduler)
        _summarize(recipe, run, metrics)
    finally:
        progress.close()
        metrics.close()
    if rank == 0 and iters > run.start:
        print_results([run.run_dir])
    dist.barrier()
    mc.parallel_state.destroy_model_parallel()
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

    def __init__(
        self, enabled: bool, start: int, total: int, meta: dict | None = None, experts: str = ""
    ) -> None:
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        if meta is not None:
            fp8 = "FP8" if meta.get("fp8_dispatch") else "BF16"
            print(
                f"training on {meta['world_size']} x {meta['gpu']}: dispatcher "
                f"{meta['dispatcher']} ({meta['dispatch_mode']}, {fp8} dispatch), experts "
                f"{experts}",
                flush=True,
            )
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
                f" | dispatch {m['dispatch_time_ms']:.2f} ms (host {m['dispatch_host_ms']:.2f})"
                f" combine {m['combine_time_ms']:.2f} ms (host {m['combine_host_ms']:.2f})"
            )
        self.bar.update(self.task, completed=it, info=info)
        log.info("iter %d: %s", it, info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = ["check_flex_available", "dispatch_mode", "quiet_other_ranks", "train_megatron"]

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
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from uccl_ep_megatron.core.errors import UnsupportedError
from uccl_ep_megatron.training.gpu.checkpoint import load_checkpoint, save_checkpoint
from uccl_ep_megatron.training.gpu.data import batches, forward_step
from uccl_ep_megatron.training.gpu.model import build_model, expert_path, transformer_config
from uccl_ep_megatron.training.gpu.probe import MoEProbe
from uccl_ep_megatron.training.results import default_run_dir, print_results

log = logging.getLogger(__name__)


def _install_dispatcher(dispatcher: str, recipe) -> None:
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
    from uccl_ep_megatron.telemetry.flops import (
        mfu,
        param_counts,
        peak_bf16_tflops,
        training_flops_per_token,
    )
    from uccl_ep_megatron.telemetry.metrics import MetricsLogger

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
                forward_step_func=forward_step,
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
                f" | dispatch {m['dispatch_time_ms']:.2f} ms (host {m['dispatch_host_ms']:.2f})"
                f" combine {m['combine_time_ms']:.2f} ms (host {m['combine_host_ms']:.2f})"
            )
        self.bar.update(self.task, completed=it, info=info)
        log.info("iter %d: %s", it, info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


__all__ = ["train_megatron"]

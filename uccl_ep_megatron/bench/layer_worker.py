"""What one rank of ``bench layer`` does (``bench/layer.py`` says what is measured and how)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch


def _shape(a: dict[str, Any]) -> Any:
    from uccl_ep_megatron.bench.moe_layer import LayerShape

    return LayerShape(
        a["hidden"],
        a["experts"],
        a["topk"],
        a["ffn"],
        shared_ffn=a["shared_ffn"],
        deepseek_router=a["router"] == "deepseek",
    )


def _build_layers(shape: Any, world: int, a: dict[str, Any], skipped: dict) -> dict[str, Any]:
    """One ``MoELayer`` per expert module that runs here, all with the same weights."""
    from uccl_ep_megatron.bench.moe_layer import build_layer, copy_weights
    from uccl_ep_megatron.token_dispatcher.grouped_experts import grouped_mm_unavailable

    wanted = [m.strip() for m in a["expert_modules"].split(",") if m.strip()]
    base = build_layer(shape, "alltoall", world, "SequentialMLP")
    layers = {}
    for name in wanted:
        if name == "TorchGroupedMLP" and grouped_mm_unavailable() is not None:
            skipped[name] = grouped_mm_unavailable()
            continue
        if name == "SequentialMLP":
            layers[name] = base
        else:
            layers[name] = build_layer(shape, "alltoall", world, name)
            copy_weights(base, layers[name])
    return layers


def _dispatcher(name: str, layer: Any, a: dict[str, Any]) -> Any:
    """A token dispatcher of kind ``name`` for ``layer``'s experts (the layer's own config with
    another ``moe_token_dispatcher_type``)."""
    from megatron.core.transformer.moe import token_dispatcher as td
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.token_dispatcher.dispatcher import UcclEpTokenDispatcher
    from uccl_ep_megatron.token_dispatcher.options import get_options, restore_options, set_options

    kind = {"alltoall": "alltoall", "flex": "flex"}.get(name, "uccl_ep")
    config = dataclasses.replace(layer.config, moe_token_dispatcher_type=kind)
    args = (layer.num_local_experts, layer.local_expert_indices)
    pgs = get_default_pg_collection()
    if kind == "alltoall":
        return td.MoEAlltoAllTokenDispatcher(*args, config=config, pg_collection=pgs)
    if kind == "flex":
        return td.MoEFlexTokenDispatcher(*args, config=config, pg_collection=pgs)
    saved = get_options()
    try:
        # Dispatchers read the options when built; the drop log would outlast the run.
        # sync-free: with a per-expert capacity when the factor is > 0, else dropless.
        factor = (a["capacity_factor"] or None) if name == "sync-free" else None
        set_options(capacity_factor=factor, sync_free=name == "sync-free", drop_log_interval=0)
        disp = UcclEpTokenDispatcher(
            *args, config=config, pg_collection=pgs, buffers=megatron_plugin.buffer_cache()
        )
    finally:
        restore_options(saved)
    if disp.mode != name:
        raise RuntimeError(f"uccl_ep dispatcher built in {disp.mode} mode, not {name}")
    disp.set_experts(layer.experts)  # as the plugin's MoELayer does (may refuse the experts)
    return disp


def _flex_unavailable() -> str | None:
    from uccl_ep_megatron.core.errors import UnsupportedError
    from uccl_ep_megatron.training.gpu.loop import check_flex_available

    try:
        check_flex_available()
    except UnsupportedError as exc:
        return str(exc)
    return None


class _DispatchTimes:
    """CUDA events around a dispatcher's ``token_dispatch`` / ``token_combine`` while on."""

    def __init__(self, disp: Any) -> None:
        self.on = False
        self.events: dict[str, list[tuple[Any, Any]]] = {"dispatch": [], "combine": []}
        for kind in self.events:
            setattr(disp, f"token_{kind}", self._wrap(kind, getattr(disp, f"token_{kind}")))

    def _wrap(self, kind: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events[kind].append((start, end))
            return out

        return timed

    def mean_ms(self, kind: str) -> float:
        torch.cuda.synchronize()
        pairs = self.events[kind]
        return sum(s.elapsed_time(e) for s, e in pairs) / len(pairs) if pairs else 0.0


def _variants(layers: dict, a: dict[str, Any], skipped: dict) -> dict[str, tuple[Any, Any, Any]]:
    """``dispatcher/experts`` -> (layer, dispatcher, its timer)."""
    wanted = [d.strip() for d in a["dispatchers"].split(",") if d.strip()]
    if "flex" in wanted and _flex_unavailable() is not None:
        skipped["flex"] = _flex_unavailable()
        wanted.remove("flex")
    from uccl_ep_megatron.core.errors import UnsupportedError

    out = {}
    for experts, layer in layers.items():
        for name in list(wanted):
            try:
                disp = _dispatcher(name, layer, a)
            except UnsupportedError as exc:
                if name != "sync-free":
                    raise
                # Dropless sync-free mode needs experts that take GPU counts: said, not run.
                skipped[f"sync-free/{experts}"] = str(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - the baseline's own limits, reported
                if name != "flex":
                    raise
                # megatron-core's flex dispatcher has its own requirements per release (its
                # backend option, TPxEP > 1): this run compares without it and says why.
                skipped["flex"] = f"megatron-core's flex dispatcher could not be built: {exc}"
                wanted.remove(name)
                out = {k: v for k, v in out.items() if not k.startswith("flex/")}
                continue
            out[f"{name}/{experts}"] = (layer, disp, _DispatchTimes(disp))
    return out


def _step(variant: tuple[Any, Any, Any], x: torch.Tensor, grad: torch.Tensor) -> None:
    from uccl_ep_megatron.bench.moe_layer import fwd_bwd

    layer, disp, _ = variant
    layer.token_dispatcher = disp
    fwd_bwd(layer, x, grad)
    layer.zero_grad(set_to_none=True)


def _time_rounds(variants: dict, x: torch.Tensor, grad: torch.Tensor, a: dict) -> dict:
    import torch.distributed as dist

    for variant in variants.values():
        for _ in range(a["warmup"]):
            _step(variant, x, grad)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(a["iters"]):
        for name, variant in variants.items():
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            dist.barrier()
            torch.cuda.synchronize()
            start.record()
            _step(variant, x, grad)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return times


def _extra(name: str, variant: tuple, x: torch.Tensor, grad: torch.Tensor, a: dict) -> dict:
    """Host syncs, dispatch/combine device time and dropped pairs of one variant."""
    from uccl_ep_megatron.bench.moe_layer import count_host_syncs

    _, disp, timer = variant
    sync_free = name.startswith("sync-free/")
    dropped_before = disp.dropped_pairs() if sync_free else 0
    syncs = count_host_syncs(lambda: _step(variant, x, grad), a["profile_iters"])
    dropped = (disp.dropped_pairs() - dropped_before) / a["profile_iters"] if sync_free else 0.0
    timer.on = True
    for _ in range(a["profile_iters"]):
        _step(variant, x, grad)
    timer.on = False
    return {
        **syncs,
        "dispatch_ms": timer.mean_ms("dispatch"),
        "combine_ms": timer.mean_ms("combine"),
        "dropped": dropped,
        "capacity": disp.capacity(x.shape[0]) if sync_free else None,
        "bounded_rows": disp.bounded_rows(x.shape[0]) if sync_free else None,
    }


def measure_rank(rank: int, world: int, a: dict[str, Any]) -> dict[str, Any]:
    """Build, time and profile every variant on this rank (EP = ``world``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from uccl_ep_megatron import megatron_plugin

    _check_release()
    megatron_plugin.install(backend=a["backend"])
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    try:
        skipped: dict[str, str] = {}
        shape = _shape(a)
        variants = _variants(_build_layers(shape, world, a, skipped), a, skipped)
        g = torch.Generator(device="cuda").manual_seed(42 + rank)
        x = torch.randn(a["tokens"], 1, shape.hidden, device="cuda", generator=g).bfloat16()
        grad = torch.randn(x.shape, device="cuda", generator=g).bfloat16() * 1e-2
        times = _time_rounds(variants, x, grad, a)
        extra = {name: _extra(name, v, x, grad, a) for name, v in variants.items()}
        return {
            "times": times,
            "extra": extra,
            "skipped": skipped,
            "gpu": torch.cuda.get_device_name(),
        }
    finally:
        megatron_plugin.buffer_cache().clear()
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()


# megatron-core 0.14 names the dispatcher's process-group argument differently; the bench needs
# 0.15+ (``pg_collection``), checked here so that the error names the release.
def _check_release() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if "pg_collection" not in inspect.signature(MoEAlltoAllTokenDispatcher.__init__).parameters:
        from uccl_ep_megatron.core.errors import UnsupportedError

        raise UnsupportedError("bench layer needs megatron-core 0.15 or newer (pg_collection)")

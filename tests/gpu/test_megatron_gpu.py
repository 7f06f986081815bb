"""DeepSeek-V3-shaped MoE layer under ``alltoall`` and ``uccl_ep`` at EP = min(2, GPUs).

On a one-GPU machine this runs at EP=1: Megatron's ``alltoall`` dispatcher and its parallel
state need NCCL for EP > 1 (gloo has no all-to-all of CUDA tensors), and NCCL refuses two ranks
on one GPU, so the layer cannot run with ranks sharing a GPU.

Both layers get identical weights (state dict copy) and inputs; outputs and every gradient
(input, router, routed experts, shared expert) must match within bf16 tolerance. Then both are
timed (forward + backward) and tokens/s are reported side by side. Runs the ``uccl_ep``
dispatcher on each available ``Buffer`` backend (``kernels`` when built, ``reference``).

Shape (DeepSeek-V3 MoE block): hidden 7168, 256 routed experts of FFN 2048 (SwiGLU), top-8
with 8 groups / top-4 groups, sigmoid scores with expert bias, scaling 2.5, fp32 router, one
shared expert of FFN 2048, BF16. Experts are Megatron's ``SequentialMLP`` (no Transformer
Engine needed). ``UCCL_EP_MEGATRON_GPU_TOKENS`` sets tokens per rank (default 4096).
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch

from uccl_ep_megatron.bench.moe_layer import fwd_bwd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_common import kernels_built  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
WORLD = min(2, torch.cuda.device_count())  # EP over 2 GPUs, or EP=1 on one

HERE = os.path.abspath(__file__)
HIDDEN = 7168  # DEEPSEEK_V3.hidden (uccl_ep_megatron.bench.moe_layer)
ITERS = 5


def _layer(dispatcher: str, ep: int):
    from uccl_ep_megatron.bench.moe_layer import DEEPSEEK_V3, build_layer

    return build_layer(DEEPSEEK_V3, dispatcher, ep)


def _tokens_per_s(layer, x, grad, tokens, world):
    torch.cuda.synchronize()
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(ITERS):
        fwd_bwd(layer, x, grad)
        layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    dist.barrier()
    dt = (time.perf_counter() - t0) / ITERS
    return tokens * world / dt, dt


def w_equivalence(rank, world, backend, tokens):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from uccl_ep_megatron.token_dispatcher import UcclEpTokenDispatcher

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.bench.moe_layer import copy_weights
    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics

    megatron_plugin.install(backend=backend)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    try:
        ref = _layer("alltoall", world)
        ours = _layer("uccl_ep", world)
        assert isinstance(ours.token_dispatcher, UcclEpTokenDispatcher)
        copy_weights(ref, ours)

        g = torch.Generator(device="cuda").manual_seed(42 + rank)
        x = torch.randn(tokens, 1, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        grad = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=g) * 1e-2

        out_ref, dx_ref = fwd_bwd(ref, x, grad)
        out_ours, dx_ours = fwd_bwd(ours, x, grad)
        used_backend = ours.token_dispatcher.buffer.backend

        def diff(a, b):
            a, b = a.float(), b.float()
            abs_d = (a - b).abs().max().item()
            rel_d = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            return abs_d, rel_d

        report = {"output": diff(out_ours, out_ref), "input_grad": diff(dx_ours, dx_ref)}
        ref_params = dict(ref.named_parameters())
        worst_param = ("", 0.0, 0.0)
        grads_checked = 0
        for name, p in ours.named_parameters():
            q = ref_params[name]
            if q.grad is None:
                assert p.grad is None, f"{name}: gradient only under uccl_ep"
                continue
            assert p.grad is not None, f"{name}: no gradient under uccl_ep"
            a, r = diff(p.grad, q.grad)
            grads_checked += 1
            if r > worst_param[2]:
                worst_param = (name, a, r)
        report["worst_param_grad"] = worst_param
        report["params_with_grad"] = grads_checked

        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        _tokens_per_s(ref, x, grad, tokens, world)  # warm-up
        tps_ref, dt_ref = _tokens_per_s(ref, x, grad, tokens, world)
        _tokens_per_s(ours, x, grad, tokens, world)
        dispatch_metrics.enable(True)
        dispatch_metrics.collect()
        tps_ours, dt_ours = _tokens_per_s(ours, x, grad, tokens, world)
        step = dispatch_metrics.collect().summary()
        dispatch_metrics.enable(False)
        report.update(
            backend=used_backend,
            tokens_per_rank=tokens,
            alltoall_tokens_per_s=tps_ref,
            uccl_ep_tokens_per_s=tps_ours,
            alltoall_step_ms=dt_ref * 1e3,
            uccl_ep_step_ms=dt_ours * 1e3,
            uccl_ep_dispatch_ms_per_step=step.get("dispatch_time_ms", 0.0) / ITERS,
            uccl_ep_combine_ms_per_step=step.get("combine_time_ms", 0.0) / ITERS,
            uccl_ep_dispatch_gbps=step.get("dispatch_gbps", 0.0),
            uccl_ep_combine_gbps=step.get("combine_gbps", 0.0),
            expert_load_imbalance=step.get("local_expert_load_imbalance", 0.0),
        )
        dist.barrier()
        return report
    finally:
        megatron_plugin.buffer_cache().clear()
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_deepseek_v3_moe_layer_alltoall_vs_uccl_ep(backend):
    pytest.importorskip("megatron.core")
    if backend == "kernels" and not kernels_built():
        pytest.skip("_C was built without a GPU toolchain: no kernels backend")
    from dist_utils import DistPool

    tokens = int(os.environ.get("UCCL_EP_MEGATRON_GPU_TOKENS", "4096"))
    pool = DistPool(WORLD, gpus=torch.cuda.device_count())
    try:
        reports = pool.run(HERE, "w_equivalence", backend, tokens)
    finally:
        pool.close()
    out_dir = os.environ.get("OUT")
    line = json.dumps({"backend": backend, "ranks": reports})
    print(line)
    if out_dir:
        with open(os.path.join(out_dir, f"megatron_gpu_{backend}.json"), "w") as f:
            f.write(line)
    r0 = reports[0]
    print(
        f"{backend}: alltoall {r0['alltoall_tokens_per_s']:.0f} tok/s vs uccl_ep "
        f"{r0['uccl_ep_tokens_per_s']:.0f} tok/s; max rel diff out {r0['output'][1]:.2e} "
        f"dx {r0['input_grad'][1]:.2e} worst param {r0['worst_param_grad']}"
    )
    for r in reports:
        assert r["backend"] == backend, r
        # bf16 tolerance: relative Frobenius error of a bf16 GEMM chain (eps 2^-8 ~ 4e-3).
        assert r["output"][1] < 1e-2, r
        assert r["input_grad"][1] < 1e-2, r
        assert r["worst_param_grad"][2] < 2e-2, r
        assert r["params_with_grad"] > 0, r

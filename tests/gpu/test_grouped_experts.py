"""``TorchGroupedMLP`` (PyTorch grouped_mm experts) on GPUs, against megatron-core's
``SequentialMLP`` with the same weights.

- One GPU: output, input, probability and weight gradients equal ``SequentialMLP``'s within
  bf16 tolerance, with counts on the CPU and on the GPU, uneven segments (not multiples of 8)
  and an expert that gets no row (its weight gradients must be exactly zero).
- No host sync: forward + backward run under ``torch.cuda.set_sync_debug_mode("error")`` with
  GPU counts and with CPU counts; ``SequentialMLP`` with GPU counts (its ``.tolist()``) is the
  positive control that must raise there.
- A whole MoE layer at EP = min(4, GPUs): ``uccl_ep`` (exact, sync-free with a capacity
  that drops nothing, and sync-free without a capacity) + ``TorchGroupedMLP`` against
  ``alltoall`` + ``SequentialMLP``: outputs and every gradient (input, router, shared expert,
  routed experts) within bf16 tolerance; with FP8 dispatch (exact and dropless sync-free)
  within E4M3's rounding.
- FP8 dispatch round trip on the ``kernels`` backend at EP = min(4, GPUs): ``dispatch_fp8``
  equals ``ops.dispatch`` of the dequantized input exactly (rows, ids, weights, counts) and so
  do the gradients it sends back.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
HERE = os.path.abspath(__file__)
COUNTS = [37, 0, 129, 90, 1, 7, 64, 200]  # uneven, one empty expert


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def groups():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from uccl_ep_megatron.token_dispatcher.grouped_experts import grouped_mm_unavailable

    torch.cuda.set_device(0)
    why = grouped_mm_unavailable("cuda:0")
    assert why is None, why  # H100/H200 with torch >= 2.8 must run it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(7)
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _pair(groups, hidden: int = 1024, ffn: int = 512):
    import torch.nn.functional as F
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig
    from uccl_ep_megatron.token_dispatcher.grouped_experts import TorchGroupedMLP

    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        num_moe_experts=len(COUNTS),
        moe_ffn_hidden_size=ffn,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
    )
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    seq = SequentialMLP(len(COUNTS), config, sub, pg_collection=groups).cuda()
    grouped = TorchGroupedMLP(len(COUNTS), config, pg_collection=groups)
    grouped.load_sequential_state(seq)
    return seq, grouped


def _inputs(hidden: int = 1024):
    g = torch.Generator(device="cuda").manual_seed(11)
    rows = sum(COUNTS)
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    probs = torch.rand(rows, device="cuda", generator=g)
    grad = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    return x, probs, grad


def _run(module, x, tpe, probs, grad):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, _ = module(x, tpe, probs)
    out.backward(grad)
    return out.detach(), x.grad, probs.grad


@pytest.mark.parametrize("counts_on", ["cpu", "cuda"])
def test_grouped_experts_match_sequential_mlp(groups, counts_on):
    from uccl_ep_megatron.bench.moe_layer import expert_grads

    seq, grouped = _pair(groups)
    x, probs, grad = _inputs()
    want = _run(seq, x, torch.tensor(COUNTS), probs, grad)
    got = _run(grouped, x, torch.tensor(COUNTS, device=counts_on), probs, grad)
    for name, a, b in zip(("output", "input grad", "probs grad"), got, want, strict=True):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))

    class _Layer:  # expert_grads reads layer.experts
        def __init__(self, experts):
            self.experts = experts

    ref = expert_grads(_Layer(seq))
    for name, g in expert_grads(_Layer(grouped)).items():
        assert _rel(g, ref[name]) < 2e-2, (name, _rel(g, ref[name]))
        assert g[1].abs().max().item() == 0, f"{name}: the empty expert got a gradient"


def test_grouped_experts_never_wait_for_the_gpu(groups):
    seq, grouped = _pair(groups)
    x, probs, grad = _inputs()
    cpu_counts, gpu_counts = torch.tensor(COUNTS), torch.tensor(COUNTS, device="cuda")
    for counts in (cpu_counts, gpu_counts):  # warm-up: pinned host blocks, kernels, autograd
        _run(grouped, x, counts, probs, grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for counts in (cpu_counts, gpu_counts):
            x1 = x.clone().requires_grad_(True)
            out, _ = grouped(x1, counts, probs)
            out.backward(grad)
        with pytest.raises(RuntimeError, match="synchroniz"):  # positive control
            seq(x, gpu_counts, probs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


# ---- a whole MoE layer at EP = min(4, GPUs) ----------------------------------------------------
SHAPE_ARGS = dict(hidden=2048, num_experts=64, topk=8, ffn=1024, shared_ffn=1024)
TOKENS = 2048


def w_layer(rank: int, world: int, mode: str) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from uccl_ep_megatron.token_dispatcher.options import get_options, restore_options, set_options

    from uccl_ep_megatron import megatron_plugin
    from uccl_ep_megatron.bench.moe_layer import (
        LayerShape,
        build_layer,
        copy_weights,
        expert_grads,
        fwd_bwd,
    )

    shape = LayerShape(**SHAPE_ARGS, deepseek_router=True)
    megatron_plugin.install(backend="kernels")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234)
    saved = get_options()
    try:
        ref = build_layer(shape, "alltoall", world, "SequentialMLP")
        # A capacity of every token of every rank per expert: sync-free mode drops nothing.
        factor = shape.num_experts / shape.topk if mode == "sync-free" else None
        fp8 = mode.endswith("-fp8")
        dropless = mode.startswith("sync-free-dropless")
        set_options(
            capacity_factor=factor, drop_log_interval=0, fp8_dispatch=fp8, sync_free=dropless
        )
        ours = build_layer(shape, "uccl_ep", world, "TorchGroupedMLP")
        d = ours.token_dispatcher
        want = "sync-free dropless" if dropless else mode.removesuffix("-fp8")
        assert d.mode_name.removesuffix(" with a capacity") == want, d.mode_name
        copy_weights(ref, ours)
        g = torch.Generator(device="cuda").manual_seed(42 + rank)
        x = torch.randn(TOKENS, 1, shape.hidden, device="cuda", generator=g).bfloat16()
        grad = torch.randn(x.shape, device="cuda", generator=g).bfloat16() * 1e-2
        out_ref, dx_ref = fwd_bwd(ref, x, grad)
        out, dx = fwd_bwd(ours, x, grad)
        report = {"output": _rel(out, out_ref), "input_grad": _rel(dx, dx_ref)}
        ref_params = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            if name.startswith("experts."):
                continue
            q = ref_params[name]
            assert (p.grad is None) == (q.grad is None), f"{name}: gradient on one side only"
            if p.grad is not None:
                report[name] = _rel(p.grad, q.grad)
        want = expert_grads(ref)
        for name, g_ours in expert_grads(ours).items():
            report[f"experts.{name}"] = _rel(g_ours, want[name])
        report["dropped"] = ours.token_dispatcher.dropped_pairs()
        return report
    finally:
        restore_options(saved)
        megatron_plugin.buffer_cache().clear()
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()


@pytest.mark.parametrize(
    "mode", ["exact", "sync-free", "sync-free-dropless", "exact-fp8", "sync-free-dropless-fp8"]
)
def test_moe_layer_uccl_ep_grouped_vs_alltoall_sequential(mode):
    from dist_utils import DistPool

    world = min(4, torch.cuda.device_count())
    pool = DistPool(world, gpus=torch.cuda.device_count())
    try:
        reports = pool.run(HERE, "w_layer", mode)
    finally:
        pool.close()
    print(mode, reports[0])
    # bf16: a GEMM chain's relative error (eps 2^-8). FP8 dispatch adds E4M3's rounding of
    # the expert inputs (3 mantissa bits: at most 2^-4 of a value, about 2% RMS).
    fp8 = mode.endswith("-fp8")
    tight, loose = (6e-2, 1e-1) if fp8 else (1e-2, 2e-2)
    for r in reports:
        assert r.pop("dropped") == 0, r
        bad = {
            k: v for k, v in r.items() if v > (tight if k in ("output", "input_grad") else loose)
        }
        assert not bad, (mode, bad)
    if fp8:  # and FP8 really ran: not bit-equal to bf16 dispatch
        assert reports[0]["output"] > 1e-4, reports[0]


def w_fp8_round_trip(rank: int, world: int) -> bool:
    from uccl_ep_megatron.token_dispatcher import fp8

    from uccl_ep_megatron.api import ops
    from uccl_ep_megatron.api.buffer import Buffer

    hidden, tokens, topk, experts = 7168, 512, 8, 8 * world
    g = torch.Generator(device="cuda").manual_seed(10 + rank)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    scores = torch.rand(tokens, experts, device="cuda", generator=g)
    idx = scores.topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, device="cuda", generator=g)
    nvl = max(
        c.get_nvl_buffer_size_hint(hidden * 2, world)
        for c in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world))
    )
    buf = Buffer(None, nvl, 0, backend="kernels")
    x_q = fp8.dequantize(*fp8.quantize(x), torch.bfloat16)
    gx = gw = None
    outs = {}
    for name in ("fp8", "bf16"):
        xi = (x if name == "fp8" else x_q).clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        call = fp8.dispatch_fp8 if name == "fp8" else ops.dispatch
        recv, ridx, rw, counts, _ = call(buf, xi, idx, wi, experts)
        if gx is None:
            gen = torch.Generator(device="cuda").manual_seed(5 + rank)
            gx = torch.randn(recv.shape, device="cuda", generator=gen).bfloat16()
            gw = torch.rand(rw.shape, device="cuda", generator=gen)
        torch.autograd.backward([recv, rw], [gx, gw])
        outs[name] = (recv.detach(), ridx, rw.detach(), counts, xi.grad, wi.grad)
    # What arrives is byte for byte the same; the gradients went through two combines of the
    # same layout (equal up to the kernels' summation order).
    for a, b in zip(outs["fp8"][:4], outs["bf16"][:4], strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (a, b)
    for a, b in zip(outs["fp8"][4:], outs["bf16"][4:], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    return bool(outs["fp8"][0].shape[0] > 0)


def test_fp8_dispatch_round_trip_on_the_kernels_backend():
    from dist_utils import DistPool

    world = min(4, torch.cuda.device_count())
    if world < 2:
        pytest.skip("FP8 dispatch between ranks needs 2 GPUs")
    pool = DistPool(world, gpus=torch.cuda.device_count())
    try:
        assert all(pool.run(HERE, "w_fp8_round_trip"))
    finally:
        pool.close()

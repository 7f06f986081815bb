"""UcclEpTokenDispatcher driven directly (as Megatron's own dispatcher tests do), gloo + reference.

Round trip over a (TP, EP) grid: dispatch -> scale by probs -> combine equals the input times
the token's routed probability mass, and the gradients w.r.t. the input and the routing probs
equal their closed forms. The per-expert rows, their order, their probabilities and
``tokens_per_expert`` are checked against an oracle built from every rank's inputs
(all-gathered), never from the dispatcher. Functions named ``w_*`` run on every rank.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

from conftest import get_pool  # noqa: E402

HERE = os.path.abspath(__file__)
LOCAL_EXPERTS = 3
TOPK = 2
HIDDEN = 16


# ---- helpers run on the ranks ----------------------------------------------------------------
def _groups(rank: int, world: int, tp: int):
    """Megatron's expert-side layout: tp fastest, then ep (rank = ep_rank * tp + tp_rank)."""
    import torch.distributed as dist

    ep = world // tp
    tp_group = ep_group = None
    for e in range(ep):
        g = dist.new_group([e * tp + t for t in range(tp)])
        if rank // tp == e:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([e * tp + t for e in range(ep)])
        if rank % tp == t:
            ep_group = g
    tp_ep_group = dist.new_group(list(range(world)))
    return tp_group, ep_group, tp_ep_group


def _make_dispatcher(rank, world, tp, groups=None, buffers=None, options=None, **config_overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    from uccl_ep_megatron.token_dispatcher import UcclEpOptions, UcclEpTokenDispatcher

    try:
        from megatron.core.process_groups_config import ProcessGroupCollection as PGs
    except ImportError:  # megatron-core 0.14
        from megatron.core.process_groups_config import ModelCommProcessGroups as PGs

    ep = world // tp
    tp_group, ep_group, tp_ep_group = groups or _groups(rank, world, tp)
    kwargs = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        num_moe_experts=LOCAL_EXPERTS * ep,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=8,
        add_bias_linear=False,
        moe_token_dispatcher_type="uccl_ep",
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
    )
    kwargs.update(config_overrides)
    config = TransformerConfig(**kwargs)
    pgs = PGs(ep=ep_group, expt_tp=tp_group, tp_ep=tp_ep_group)
    num_local = config.num_moe_experts // ep
    local = [(rank // tp) * num_local + i for i in range(num_local)]
    # The reference backend explicitly: these tests are about the dispatcher, on CPU.
    options = options or UcclEpOptions(backend="reference")
    d = UcclEpTokenDispatcher(num_local, local, config, pgs, options=options, buffers=buffers)
    return d, config


def _inputs(seed: int, rank: int, world: int, tp: int, tokens: int, dtype):
    """Routing with k distinct experts per token, some tokens dropped to fewer (capacity)."""
    ep = world // tp
    num_experts = LOCAL_EXPERTS * ep
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(2, tokens // 2, HIDDEN, generator=g).to(dtype)  # [S, B, H] like Megatron
    scores = torch.rand(tokens, num_experts, generator=g)
    top = scores.topk(min(TOPK, num_experts), dim=-1).indices
    routing_map = torch.zeros(tokens, num_experts, dtype=torch.bool)
    routing_map.scatter_(1, top, True)
    drop = torch.rand(tokens, generator=g) < 0.2
    routing_map[drop, top[drop, 0]] = False  # capacity-dropped slot
    probs = torch.rand(tokens, num_experts, generator=g) * routing_map
    return x, routing_map, probs


def _oracle(rank, world, tp, seed, tokens, dtype, align):
    """Expected per-expert rows/probs and counts on this rank, from every rank's inputs."""
    ep_slot = rank // tp
    rows = {le: [] for le in range(LOCAL_EXPERTS)}
    prob_rows = {le: [] for le in range(LOCAL_EXPERTS)}
    for src in range(world):  # receive order: source rank, then source token order
        x, rm, p = _inputs(seed, src, world, tp, tokens, dtype)
        x = x.reshape(-1, HIDDEN)
        for le in range(LOCAL_EXPERTS):
            e = ep_slot * LOCAL_EXPERTS + le
            # A token is received once even if it picked several local experts; rows of an
            # expert keep the token's receive order.
            rows[le].append(x[rm[:, e]])
            prob_rows[le].append(p[rm[:, e], e])
    out_rows, out_probs, counts = [], [], []
    for le in range(LOCAL_EXPERTS):
        r = torch.cat(rows[le])
        pr = torch.cat(prob_rows[le])
        n = r.shape[0]
        padded = -(-n // align) * align
        out_rows += [r, torch.zeros(padded - n, HIDDEN, dtype=r.dtype)]
        out_probs += [pr, torch.zeros(padded - n)]
        counts.append(padded)
    return torch.cat(out_rows), torch.cat(out_probs), counts


# ---- worker bodies ---------------------------------------------------------------------------
def w_round_trip(rank, world, tp, seed, dtype_name, align, sync=False):
    dtype = getattr(torch, dtype_name)
    tokens = 10
    dispatcher, _ = _make_dispatcher(rank, world, tp)
    dispatcher.align = align
    x, routing_map, probs = _inputs(seed, rank, world, tp, tokens, dtype)
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)

    h, token_probs = dispatcher.dispatch_preprocess(x, routing_map, probs)
    assert token_probs.dtype == torch.float32
    if sync:
        flags = dict(async_finish=False, allocate_on_comm_stream=False)
    else:
        flags = {}  # MoELayer's call: the defaults async_finish=allocate_on_comm_stream=True
    recv_x, recv_probs = dispatcher.token_dispatch(h, token_probs, **flags)
    rows, tokens_per_expert, permuted_probs = dispatcher.dispatch_postprocess(recv_x, recv_probs)

    exp_rows, exp_probs, exp_counts = _oracle(rank, world, tp, seed, tokens, dtype, align)
    assert tokens_per_expert.device.type == "cpu" and tokens_per_expert.dtype == torch.int64
    assert tokens_per_expert.tolist() == exp_counts
    assert torch.equal(rows.detach(), exp_rows), "per-expert rows or their order differ"
    assert torch.allclose(permuted_probs.detach(), exp_probs)

    # The experts: scale by the routing prob; each of the TP shards contributes 1/tp.
    expert_out = rows * permuted_probs.unsqueeze(-1).to(rows.dtype) / tp
    y = dispatcher.combine_preprocess(expert_out)
    y = dispatcher.token_combine(y, **flags)
    y = dispatcher.combine_postprocess(y)
    assert y.shape == x.shape and y.dtype == x.dtype

    mass = (probs.detach() * routing_map).sum(-1).reshape(x.shape[:-1] + (1,))
    expected = (x.detach().float() * mass).to(dtype)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(y.detach(), expected, **tol)

    g = torch.Generator().manual_seed(seed + 7 + rank)
    grad_out = torch.randn(x.shape, generator=g).to(dtype)
    (y.float() * grad_out.float()).sum().backward()
    torch.testing.assert_close(x.grad, (grad_out.float() * mass).to(dtype), **tol)
    dot = (grad_out.float() * x.detach().float()).sum(-1).reshape(-1, 1)
    expected_pgrad = dot * routing_map
    ptol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(probs.grad, expected_pgrad, **ptol)
    return tokens_per_expert.tolist()


def w_two_layers_interleaved(rank, world, tp):
    """Two layers share one Buffer; forward of both, then backward in reverse (as training)."""
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

    groups = _groups(rank, world, tp)  # one model: every layer gets the same process groups
    buffers = BufferCache()
    d1, _ = _make_dispatcher(rank, world, tp, groups, buffers)
    d2, _ = _make_dispatcher(rank, world, tp, groups, buffers)
    x, rm, p = _inputs(3, rank, world, tp, 8, torch.float32)
    x = x.requires_grad_(True)

    def layer(d, inp):
        h, tp_ = d.dispatch_preprocess(inp, rm, p)
        rx, rp = d.token_dispatch(h, tp_)
        rows, _, pp = d.dispatch_postprocess(rx, rp)
        out = d.combine_preprocess(rows * pp.unsqueeze(-1) / tp)
        return d.combine_postprocess(d.token_combine(out))

    y = layer(d2, layer(d1, x))
    assert d1.buffer is d2.buffer, "layers must share the group's Buffer"
    mass = (p * rm).sum(-1).reshape(x.shape[:-1] + (1,))
    torch.testing.assert_close(y.detach(), x.detach() * mass * mass, atol=1e-6, rtol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (mass * mass).expand_as(x), atol=1e-6, rtol=1e-5)
    buffers.clear()


def w_metrics(rank, world):
    """Per-layer records: bytes of received rows, unpadded tokens per local expert, times."""
    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics

    dispatch_metrics.collect()  # drop anything earlier tests left
    dispatch_metrics.enable(True)
    try:
        d, _ = _make_dispatcher(rank, world, 1)
        d.layer_number = 5
        d.align = 4
        x, rm, p = _inputs(21, rank, world, 1, 10, torch.float32)
        h, tp_ = d.dispatch_preprocess(x, rm, p)
        rx, rp = d.token_dispatch(h, tp_)
        rows, _, pp = d.dispatch_postprocess(rx, rp)
        d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * pp.unsqueeze(-1))))
        step = dispatch_metrics.collect()
    finally:
        dispatch_metrics.enable(False)
    assert list(step.layers) == [5]
    m = step.layers[5]
    received = rx.shape[0]
    assert m.calls == 1
    assert m.dispatch_bytes == m.combine_bytes == received * HIDDEN * 4
    _, _, padded = _oracle(rank, world, 1, 21, 10, torch.float32, 1)  # align 1: true counts
    assert m.tokens_per_local_expert == padded
    assert m.dispatch_ms > 0 and m.combine_ms > 0
    summary = step.summary()
    assert summary["dispatch_time_ms"] == m.dispatch_ms
    expected_imbalance = max(padded) / (sum(padded) / len(padded))
    assert abs(summary["local_expert_load_imbalance"] - expected_imbalance) < 1e-9
    assert abs(summary["dispatch_gbps"] - m.dispatch_bytes / m.dispatch_ms / 1e6) < 1e-9
    assert "layer5/combine_gbps" in step.per_layer()
    assert dispatch_metrics.collect().layers == {}, "collect() must reset"


def w_instrumented_backward(rank, world):
    """``telemetry.dispatch.instrument`` on the dispatcher: the layer's output and gradients are
    the uninstrumented ones, and each call's backward is recorded once."""
    from uccl_ep_megatron.telemetry import dispatch as dispatch_metrics

    dispatch_metrics.collect()
    dispatch_metrics.enable(True)
    try:
        d, _ = _make_dispatcher(rank, world, 1)
        dispatch_metrics.instrument(d, 6)
        x, rm, p = _inputs(23, rank, world, 1, 12, torch.float32)
        x = x.requires_grad_(True)
        p = p.requires_grad_(True)
        h, tp_ = d.dispatch_preprocess(x, rm, p)
        rx, rp = d.token_dispatch(h, tp_)
        rows, _, pp = d.dispatch_postprocess(rx, rp)
        y = d.combine_postprocess(d.token_combine(d.combine_preprocess(rows * pp.unsqueeze(-1))))
        g = torch.Generator().manual_seed(31 + rank)
        grad_out = torch.randn(x.shape, generator=g)
        (y * grad_out).sum().backward()
        step = dispatch_metrics.collect()
    finally:
        dispatch_metrics.enable(False)
    mass = (p.detach() * rm).sum(-1).reshape(x.shape[:-1] + (1,))
    torch.testing.assert_close(y.detach(), x.detach() * mass, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x.grad, grad_out * mass, atol=1e-6, rtol=1e-5)
    dot = (grad_out * x.detach()).sum(-1).reshape(-1, 1)
    torch.testing.assert_close(p.grad, dot * rm, atol=1e-5, rtol=1e-5)
    m = step.layers[6]
    assert m.calls == 1 and m.backward_calls == 2
    assert m.dispatch_backward_ms > 0 and m.combine_backward_ms > 0
    summary = step.summary()
    assert summary["dispatch_backward_time_ms"] == m.dispatch_backward_ms
    assert summary["combine_backward_time_ms"] == m.combine_backward_ms


def w_rejects(rank, world):
    from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError

    d, _ = _make_dispatcher(rank, world, 1)
    with pytest.raises(InvalidInputError, match="before dispatch_preprocess"):
        d.token_dispatch(torch.zeros(4, HIDDEN))
    from uccl_ep_megatron.token_dispatcher.dispatcher import flex_overlaps_shared_experts

    if not flex_overlaps_shared_experts():  # as megatron-core's flex (0.19+ overlaps it)
        with pytest.raises(UnsupportedError, match="moe_shared_expert_overlap"):
            d.set_shared_experts(object())
    with pytest.raises(UnsupportedError, match="routed copies per token exceeds"):
        _make_dispatcher(rank, world, 1, moe_router_topk=33, num_moe_experts=66)


# ---- tests -----------------------------------------------------------------------------------
GRID = [(1, 2), (2, 1), (1, 3), (2, 2), (1, 4)]


@pytest.mark.parametrize("tp,ep", GRID, ids=[f"tp{t}-ep{e}" for t, e in GRID])
def test_round_trip_fp32(tp, ep):
    counts = get_pool(tp * ep).run(HERE, "w_round_trip", tp, 11, "float32", 1)
    # Every token-expert pair lands somewhere exactly once per TP copy.
    assert sum(sum(c) for c in counts) > 0


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["tp1-ep2", "tp2-ep2"])
def test_round_trip_bf16(tp, ep):
    get_pool(tp * ep).run(HERE, "w_round_trip", tp, 5, "bfloat16", 1)


def test_round_trip_synchronous_flags():
    get_pool(2).run(HERE, "w_round_trip", 1, 13, "float32", 1, True)


@pytest.mark.parametrize("align", [4, 16])
def test_round_trip_with_quantization_padding(align):
    counts = get_pool(2).run(HERE, "w_round_trip", 1, 9, "float32", align)
    assert all(c % align == 0 for per_rank in counts for c in per_rank)


def test_layers_share_buffer_and_backprop_through_both():
    get_pool(4).run(HERE, "w_two_layers_interleaved", 2)


def test_metrics_hooks_record_per_layer():
    get_pool(2).run(HERE, "w_metrics")


def test_instrumented_calls_time_their_backward_and_keep_the_gradients():
    get_pool(2).run(HERE, "w_instrumented_backward")


def test_bad_use_is_rejected():
    get_pool(2).run(HERE, "w_rejects")


def test_quantization_alignment_from_config():
    """Megatron's own alignment rule for the installed release (FP8 needs TE to construct, so
    the recipe is set on a built config, as Megatron-LM's FP8 context would see it)."""
    import dataclasses

    from megatron.core.transformer.transformer_config import TransformerConfig
    from uccl_ep_megatron.token_dispatcher.dispatcher import quantization_alignment

    config = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=TOPK,
        moe_ffn_hidden_size=8,
        add_bias_linear=False,
    )
    assert quantization_alignment(config) == 1  # padding off
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    flag = (
        "moe_router_padding_for_quantization"
        if "moe_router_padding_for_quantization" in names
        else "moe_router_padding_for_fp8"  # 0.14/0.15
    )
    setattr(config, flag, True)
    assert quantization_alignment(config) >= 1  # no FP8/FP4: 16 before 0.19, none from 0.19
    config.fp8 = "e4m3"
    for recipe, align in (("delayed", 16), ("tensorwise", 16), ("blockwise", 16), ("mxfp8", 32)):
        config.fp8_recipe = recipe
        assert quantization_alignment(config) == align, recipe

"""``TorchGroupedMLP`` (grouped_mm experts) against megatron-core's ``SequentialMLP`` on CPU.

Runs where this torch has a CPU grouped_mm (2.9+); the GPU version of the equality test, with
GPU counts and the no-host-sync check, is ``tests/gpu/test_grouped_experts.py``. The config
checks and the "unavailable" error run everywhere megatron-core imports.
"""

from __future__ import annotations

import inspect
import socket

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

from uccl_ep_megatron.token_dispatcher import grouped_experts as ge  # noqa: E402

from uccl_ep_megatron.core.errors import InvalidInputError, UnsupportedError  # noqa: E402

CPU_GROUPED = ge.grouped_mm_unavailable("cpu") is None
needs_cpu_grouped = pytest.mark.skipif(
    not CPU_GROUPED, reason=f"no CPU grouped_mm here: {ge.grouped_mm_unavailable('cpu')}"
)


@pytest.fixture(scope="module")
def groups():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import process_groups_config as pgc

    if dist.is_initialized():
        pytest.skip("a process group from another test is still up")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    try:
        # megatron-core 0.14 names the collection ModelCommProcessGroups.
        collection = getattr(pgc, "ProcessGroupCollection", None) or pgc.ModelCommProcessGroups
        yield collection.use_mpu_process_groups()
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_ffn_hidden_size=48,
        ffn_hidden_size=48,
        moe_router_topk=2,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _pair(groups, config):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    kw = (
        "pg_collection"
        if "pg_collection" in inspect.signature(SequentialMLP).parameters
        else "model_comm_pgs"
    )
    seq = SequentialMLP(4, config, sub, **{kw: groups})
    grouped = ge.TorchGroupedMLP(4, config, pg_collection=groups)
    grouped.load_sequential_state(seq)
    return seq, grouped


def _run(module, x, tpe, probs, grad):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = module(x, tpe, probs)
    assert bias is None
    out.backward(grad)
    return out.detach(), x.grad, probs.grad


@needs_cpu_grouped
@pytest.mark.parametrize("gated", [True, False])
def test_matches_sequential_mlp_with_an_empty_expert(groups, gated):
    config = _config(gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu)
    seq, grouped = _pair(groups, config)
    g = torch.Generator().manual_seed(3)
    tpe = torch.tensor([9, 0, 13, 6])  # expert 1 gets no row: its gradient must be zero
    x = torch.randn(28, 64, generator=g).bfloat16()
    probs = torch.rand(28, generator=g)
    grad = torch.randn(28, 64, generator=g).bfloat16()
    want = _run(seq, x, tpe, probs, grad)
    got = _run(grouped, x, tpe, probs, grad)
    for name, a, b in zip(("output", "input grad", "probs grad"), want, got, strict=True):
        torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2, msg=name)
    for attr, stacked in (("linear_fc1", grouped.weight1), ("linear_fc2", grouped.weight2)):
        ref = torch.stack([getattr(e, attr).weight.grad for e in seq.local_experts])
        torch.testing.assert_close(stacked.grad.float(), ref.float(), rtol=2e-2, atol=2e-2)
    assert grouped.weight1.grad[1].abs().max() == 0 and grouped.weight2.grad[1].abs().max() == 0


@needs_cpu_grouped
def test_counts_that_do_not_cover_the_rows_are_refused(groups):
    _, grouped = _pair(groups, _config())
    x = torch.randn(10, 64).bfloat16()
    with pytest.raises(InvalidInputError, match="sums to 9 but the experts got 10 rows"):
        grouped(x, torch.tensor([3, 3, 3, 0]), torch.rand(10))
    with pytest.raises(InvalidInputError, match="3 entries for 4 local experts"):
        grouped(x, torch.tensor([3, 3, 4]), torch.rand(10))


@needs_cpu_grouped
def test_sharded_state_dict_places_experts_on_the_global_axis(groups):
    _, grouped = _pair(groups, _config())
    sd = grouped.sharded_state_dict("mlp.experts.", ((0, 2, 5),))
    w1, w2 = sd["mlp.experts.weight1"], sd["mlp.experts.weight2"]
    assert w1.global_shape == (5, 4, 96, 64) and w1.global_offset == (2, 0, 0, 0)
    assert w2.global_shape == (5, 4, 64, 48) and w2.replica_id == (0, 0, 0)


@needs_cpu_grouped
@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(add_bias_linear=True), "no biases"),
        (dict(hidden_size=60, num_attention_heads=4), "hidden_size=60 must be a multiple of 8"),
        (dict(moe_ffn_hidden_size=44, ffn_hidden_size=44), "moe_ffn_hidden_size=44"),
        (dict(params_dtype=torch.float32, bf16=False), "bf16 weights"),
    ],
)
def test_unsupported_configs_name_the_setting(groups, overrides, match):
    # Set after the config is made: megatron-core 0.14 already refuses MoE biases there.
    config = _config(**{k: v for k, v in overrides.items() if k != "add_bias_linear"})
    if "add_bias_linear" in overrides:
        config.add_bias_linear = overrides["add_bias_linear"]
    with pytest.raises(UnsupportedError, match=match):
        ge.TorchGroupedMLP(4, config, pg_collection=groups)


def test_without_grouped_mm_it_refuses_to_build(groups, monkeypatch):
    monkeypatch.setattr(ge, "_grouped_mm_fn", lambda: None)
    ge._probe.cache_clear()
    try:
        with pytest.raises(UnsupportedError, match="has no grouped_mm.*use SequentialMLP"):
            ge.TorchGroupedMLP(4, _config(), pg_collection=groups)
    finally:
        ge._probe.cache_clear()


@needs_cpu_grouped
def test_a_rank_without_rows_gets_zero_gradients(groups):
    _, grouped = _pair(groups, _config())
    x = torch.zeros(0, 64, dtype=torch.bfloat16, requires_grad=True)
    out, _ = grouped(x, torch.zeros(4, dtype=torch.int64), torch.zeros(0))
    assert out.shape == (0, 64)
    out.sum().backward()
    assert grouped.weight1.grad.abs().max() == 0 and grouped.weight2.grad.abs().max() == 0

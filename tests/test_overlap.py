"""Megatron's EP overlap (``--overlap-moe-expert-parallel-comm``) with the ``uccl_ep`` dispatcher,
on CPU (gloo, ``reference`` backend; ``tests/gpu/test_overlap_gpu.py`` runs the schedule itself).

* the flag is accepted for ``uccl_ep`` once the plugin is installed, megatron-core's other
  overlap checks still apply, other dispatchers and an uninstalled plugin are as before;
  ``--moe-shared-expert-overlap`` is accepted exactly where megatron-core's ``flex`` takes it;
* the dispatcher's split methods under the overlap config give what the synchronous path gives
  (outputs and gradients, against the plain dispatcher and the closed form), while the inputs
  the schedule frees after a node's forward (dispatch input, received rows, combine input) are
  freed as Megatron frees them; every Buffer call of the overlap config is asynchronous, every
  call of the plain one synchronous;
* Megatron's ``MoELayer`` built from the overlap config has the overlap dispatcher, and its
  dispatcher and experts compute what the plain layer's do (the router needs a GPU).
Functions named ``w_*`` run on every rank.
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
from test_megatron_dispatcher import (  # noqa: E402
    HIDDEN,
    _groups,
    _inputs,
    _make_dispatcher,
)

HERE = os.path.abspath(__file__)
OVERLAP_MESSAGE = "overlap_moe_expert_parallel_comm is supported with alltoall/flex"


def _config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=1,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=8,
        add_bias_linear=False,
        moe_token_dispatcher_type="uccl_ep",
        expert_model_parallel_size=2,
        bf16=True,
        overlap_moe_expert_parallel_comm=True,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# ---- the flag --------------------------------------------------------------------------------
def test_overlap_flag_accepts_uccl_ep_and_megatrons_other_checks_still_apply(plugin):
    cfg = _config()
    assert cfg.moe_token_dispatcher_type == "uccl_ep"
    assert cfg.overlap_moe_expert_parallel_comm
    # Checks of the overlap that do not name a dispatcher run as before.
    with pytest.raises(AssertionError, match="only supported with expert model parallelism"):
        _config(expert_model_parallel_size=1)
    with pytest.raises(AssertionError, match="only supported with bf16 or fp16"):
        _config(bf16=False)
    with pytest.raises(AssertionError, match="full recomputation"):
        _config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    # A config that fails keeps its own type (the check reads it as another one only inside).
    cfg = _config(overlap_moe_expert_parallel_comm=False)
    assert cfg.moe_token_dispatcher_type == "uccl_ep"


def test_overlap_flag_is_unchanged_for_other_dispatchers_and_without_the_plugin(plugin):
    with pytest.raises(AssertionError, match=OVERLAP_MESSAGE):
        _config(moe_token_dispatcher_type="allgather")
    assert _config(moe_token_dispatcher_type="alltoall").moe_token_dispatcher_type == "alltoall"
    plugin.uninstall()
    with pytest.raises(AssertionError, match=OVERLAP_MESSAGE):
        _config()


def test_shared_expert_overlap_is_accepted_where_flex_overlaps_the_shared_expert(plugin):
    from uccl_ep_megatron.token_dispatcher.dispatcher import flex_overlaps_shared_experts

    shared = dict(
        overlap_moe_expert_parallel_comm=False,
        moe_shared_expert_intermediate_size=16,
        moe_shared_expert_overlap=True,
    )
    flex_ok = flex_overlaps_shared_experts()
    try:
        _config(moe_token_dispatcher_type="flex", **shared)
        flex_accepts = True
    except ValueError:
        flex_accepts = False
    assert flex_accepts == flex_ok, "the feature test disagrees with megatron-core's own check"
    if flex_ok:
        assert _config(**shared).moe_token_dispatcher_type == "uccl_ep"
    else:
        with pytest.raises(ValueError, match="moe_shared_expert_overlap only works"):
            _config(**shared)
    # With the EP overlap, megatron-core refuses the shared-expert overlap for every dispatcher.
    with pytest.raises(AssertionError, match="disable moe_shared_expert_overlap"):
        _config(**{**shared, "overlap_moe_expert_parallel_comm": True})


def test_a_failed_install_leaves_the_config_checks_as_they_were(monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    from uccl_ep_megatron import megatron_plugin

    def broken(*_args):
        raise RuntimeError("injected failure after the config patch")

    megatron_plugin.uninstall()
    before = TransformerConfig.__post_init__
    monkeypatch.setattr(megatron_plugin, "_patch_moe_layer", broken)
    with pytest.raises(RuntimeError, match="injected"):
        megatron_plugin.install()
    assert TransformerConfig.__post_init__ is before
    with pytest.raises(AssertionError, match=OVERLAP_MESSAGE):
        _config()


# ---- the dispatcher's split methods ----------------------------------------------------------
def _spy_buffer(calls: list[tuple[int, str, bool, bool]]):
    """Record (Buffer id, method, async_finish, previous_event given) of every Buffer call in
    ``calls`` (the calls still run); returns the undo."""
    from uccl_ep_megatron.api.buffer import Buffer

    saved = {}
    for name in ("get_dispatch_layout", "dispatch", "combine"):
        original = saved[name] = getattr(Buffer, name)

        def spy(self, *args, _name=name, _original=original, **kwargs):
            calls.append(
                (
                    id(self),
                    _name,
                    bool(kwargs.get("async_finish", False)),
                    kwargs.get("previous_event") is not None,
                )
            )
            return _original(self, *args, **kwargs)

        setattr(Buffer, name, spy)
    return lambda: [setattr(Buffer, n, f) for n, f in saved.items()]


def _free(*tensors: torch.Tensor) -> None:
    """What Megatron's schedule node does to its inputs after the node's forward."""
    for t in tensors:
        t.untyped_storage().resize_(0)


def _layer_pass(d, x, rm, p, tp, free: bool):
    """One MoE layer through the dispatcher's split methods, node by node as the overlap
    schedule calls them; ``free``: each node's inputs freed after it, as the schedule does."""
    h, token_probs = d.dispatch_preprocess(x, rm, p)
    if free:
        assert h.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    recv_x, recv_probs = d.token_dispatch(h, token_probs)
    if free:
        _free(h, token_probs)
    rows, tokens_per_expert, pp = d.dispatch_postprocess(recv_x, recv_probs)
    if free:
        _free(recv_x)
    expert_in = d.combine_preprocess(rows * pp.unsqueeze(-1).to(rows.dtype) / tp)
    y = d.token_combine(expert_in)
    if free:
        _free(expert_in)
    return d.combine_postprocess(y), tokens_per_expert


def w_split_under_overlap(rank, world, tp, seed):
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

    from uccl_ep_megatron import megatron_plugin

    groups = _groups(rank, world, tp)
    buffers = BufferCache()
    plain, _ = _make_dispatcher(rank, world, tp, groups, buffers)
    megatron_plugin.install()  # the overlap config's check
    try:
        ours, cfg = _make_dispatcher(
            rank, world, tp, groups, buffers, bf16=True, overlap_moe_expert_parallel_comm=True
        )
    finally:
        megatron_plugin.uninstall()
    assert cfg.moe_token_dispatcher_type == "uccl_ep"
    assert ours.overlap and not plain.overlap
    assert ours.buffer_options.arena_bytes == 0 and plain.buffer_options.arena_bytes is None
    x0, rm, p0 = _inputs(seed, rank, world, tp, 12, torch.float32)
    g = torch.Generator().manual_seed(seed + 101 + rank)
    grad_out = torch.randn(x0.shape, generator=g)
    results, calls = [], []
    undo = _spy_buffer(calls)
    try:
        for d, free in ((plain, False), (ours, True)):
            x, p = x0.clone().requires_grad_(True), p0.clone().requires_grad_(True)
            y, counts = _layer_pass(d, x, rm, p, tp, free)
            (y * grad_out).sum().backward()
            results.append((y.detach(), counts, x.grad, p.grad))
    finally:
        undo()
    (y_a, c_a, gx_a, gp_a), (y_b, c_b, gx_b, gp_b) = results
    assert torch.equal(c_a, c_b)
    for a, b in ((y_a, y_b), (gx_a, gx_b), (gp_a, gp_b)):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    # Independent of either: dispatch -> scale by probs -> combine is x times its prob mass.
    mass = (p0 * rm).sum(-1).reshape(x0.shape[:-1] + (1,))
    torch.testing.assert_close(y_b, x0 * mass, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gx_b, grad_out * mass, atol=1e-6, rtol=1e-5)

    by_buffer = {id(plain.buffer): [], id(ours.buffer): []}
    for buf, name, is_async, has_event in calls:
        by_buffer[buf].append((name, is_async, has_event))
    # Forward: layout, dispatch, combine; backward: combine (of the dispatch), cached dispatch.
    expected = ["get_dispatch_layout", "dispatch", "combine", "dispatch", "combine"]
    for buf, want_async in ((plain.buffer, False), (ours.buffer, True)):
        seen = by_buffer[id(buf)]
        assert sorted(n for n, _, _ in seen) == sorted(expected), seen
        assert all(a == want_async and e == want_async for _, a, e in seen), seen
    assert plain.buffer is not ours.buffer, "the overlap config's Buffer has no receive arena"
    buffers.clear()


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["tp1-ep2", "tp2-ep2"])
def test_split_methods_under_overlap_equal_the_synchronous_path(tp, ep):
    get_pool(tp * ep).run(HERE, "w_split_under_overlap", tp, 17)


# ---- MoELayer --------------------------------------------------------------------------------
def _through_experts(layer, x, rm, p):
    """The layer's dispatcher and experts on given routing (the router needs a GPU)."""
    d = layer.token_dispatcher
    h, token_probs = d.dispatch_preprocess(x, rm, p)
    rows, tokens_per_expert, pp = d.dispatch_postprocess(*d.token_dispatch(h, token_probs))
    out, _ = layer.experts(rows, tokens_per_expert, pp)
    return d.combine_postprocess(d.token_combine(d.combine_preprocess(out)))


def w_moe_layer_overlap_config(rank, world):
    from megatron.core import parallel_state as ps
    from test_megatron_plugin import _moe_layer
    from uccl_ep_megatron.token_dispatcher import UcclEpTokenDispatcher, reset_options

    from uccl_ep_megatron import megatron_plugin

    megatron_plugin.install(backend="reference")
    ps.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=world)
    try:
        common = {"moe_token_dispatcher_type": "uccl_ep", "num_moe_experts": 2 * world}
        torch.manual_seed(7 + rank)  # different experts per rank
        plain, _ = _moe_layer(common)
        overlap = dict(
            common, bf16=True, overlap_moe_expert_parallel_comm=True, expert_model_parallel_size=2
        )
        ours, cfg = _moe_layer(overlap)
        assert isinstance(ours.token_dispatcher, UcclEpTokenDispatcher)
        assert ours.token_dispatcher.overlap and not plain.token_dispatcher.overlap
        assert cfg.moe_token_dispatcher_type == "uccl_ep"
        ours.load_state_dict(plain.state_dict())
        g = torch.Generator().manual_seed(40 + rank)
        num_experts = cfg.num_moe_experts
        x0 = torch.randn(6, 1, HIDDEN, generator=g)
        top = torch.rand(6, num_experts, generator=g).topk(2, dim=-1).indices
        rm = torch.zeros(6, num_experts, dtype=torch.bool).scatter_(1, top, True)
        p = torch.rand(6, num_experts, generator=g) * rm
        gy = torch.randn(6, 1, HIDDEN, generator=g)
        out = []
        for layer in (plain, ours):
            x = x0.clone().requires_grad_(True)
            y = _through_experts(layer, x, rm, p)
            (y * gy).sum().backward()
            out.append((y.detach(), x.grad, [w.grad for w in layer.experts.parameters()]))
        (y_a, gx_a, gw_a), (y_b, gx_b, gw_b) = out
        torch.testing.assert_close(y_b, y_a, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(gx_b, gx_a, atol=1e-6, rtol=1e-5)
        for a, b in zip(gw_a, gw_b, strict=True):
            torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)
    finally:
        ps.destroy_model_parallel()
        megatron_plugin.uninstall()
        reset_options()
        megatron_plugin.buffer_cache().clear()


def test_moe_layer_with_the_overlap_config_computes_what_the_plain_one_does():
    get_pool(2).run(HERE, "w_moe_layer_overlap_config")

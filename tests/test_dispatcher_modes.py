"""The dispatcher's two modes on CPU (gloo + reference backend), against oracles built from every
rank's inputs: exact mode equals the dropless closed form; sync-free mode gives every local expert
exactly C rows (``tokens_per_expert == [C] * L``), keeps the first C pairs of an expert in
receive order and counts the rest exactly; with Megatron's padded capacity routing nothing is
dropped and the result equals the closed form; sync-free mode without a capacity equals exact
mode and refuses experts that read their counts on the host. Neither mode reads a tensor back
to the host in the dispatcher's own code (the exact mode's one read is the dispatch's, inside
``Buffer``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

pytest.importorskip("megatron.core", reason="megatron-core is not installed")
pytestmark = pytest.mark.megatron

from conftest import get_pool  # noqa: E402
from test_megatron_dispatcher import (  # noqa: E402
    LOCAL_EXPERTS,
    TOPK,
    _groups,
    _inputs,
    _make_dispatcher,
)

HERE = os.path.abspath(__file__)
TOKENS = 10
_HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def count_host_reads():
    """Calls of tensor -> host conversions made from token_dispatcher's own files."""
    import uccl_ep_megatron.token_dispatcher as td

    root = os.path.dirname(td.__file__)
    calls: list[tuple[str, str, int]] = []
    saved = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def wrap(name, original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(root):
                calls.append((name, caller.f_code.co_filename, caller.f_lineno))
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in saved.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield calls
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def dispatcher_log(level: int | None = logging.INFO):
    """The dispatcher module's log records while inside (at ``level`` and above; ``None``:
    the logger's own level)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("uccl_ep_megatron.token_dispatcher.dispatcher")
    logger.addHandler(handler)
    saved = logger.level
    if level is not None:
        logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


def _run_layer(d, x, routing_map, probs, tp, grad_seed):
    """dispatch -> experts (scale by prob, 1/tp per shard) -> combine, then backward."""
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    h, token_probs = d.dispatch_preprocess(x, routing_map, probs)
    recv_x, recv_probs = d.token_dispatch(h, token_probs)
    rows, tokens_per_expert, permuted_probs = d.dispatch_postprocess(recv_x, recv_probs)
    out = d.combine_preprocess(rows * permuted_probs.unsqueeze(-1).to(rows.dtype) / tp)
    y = d.combine_postprocess(d.token_combine(out))
    g = torch.Generator().manual_seed(grad_seed)
    grad = torch.randn(y.shape, generator=g).to(y.device)
    (y * grad).sum().backward()
    return y.detach().cpu(), x.grad.cpu(), probs.grad.cpu(), tokens_per_expert, grad.cpu()


def _kept(world, tp, seed, capacity, inputs=_inputs):
    """kept[src][t, e]: whether pair (token t of rank src, expert e) gets a row (first C of each
    expert's pairs in receive order: source rank, then token order), and drops per rank."""
    ep = world // tp
    data = [inputs(seed, src, world, tp, TOKENS, torch.float32) for src in range(world)]
    num_experts = LOCAL_EXPERTS * ep
    kept = [torch.zeros(TOKENS, num_experts) for _ in range(world)]
    dropped = [0] * world
    for e in range(num_experts):
        seen = 0
        for src in range(world):
            for t in range(TOKENS):
                if data[src][1][t, e]:
                    kept[src][t, e] = 1.0 if seen < capacity else 0.0
                    seen += 1
        for tp_rank in range(tp):  # every TP shard of the expert's EP slot receives the pairs
            dropped[(e // LOCAL_EXPERTS) * tp + tp_rank] += max(0, seen - capacity)
    return kept, dropped


def w_modes(rank, world, tp, seed, factor, backend="reference"):
    """Both modes on one input; on CPU ranks (gloo), or on GPU ranks (NCCL, ``backend``)."""
    from uccl_ep_megatron.token_dispatcher import UcclEpOptions

    device = "cuda" if backend != "reference" else "cpu"
    groups = _groups(rank, world, tp)
    exact, _ = _make_dispatcher(rank, world, tp, groups, options=UcclEpOptions(backend=backend))
    # No drop log here: on the CPU it reads the counter directly (w_drop_log checks it).
    options = UcclEpOptions(backend=backend, capacity_factor=factor, drop_log_interval=0)
    free, config = _make_dispatcher(rank, world, tp, groups, options=options)
    assert (exact.mode, free.mode) == ("exact", "sync-free")
    x, rm, p = _inputs(seed, rank, world, tp, TOKENS, torch.float32)
    on = (x.to(device), rm.to(device), p.to(device))

    with count_host_reads() as reads_exact:
        y_e, dx_e, dp_e, tpe_e, grad = _run_layer(exact, *on, tp, seed + rank)
    with count_host_reads() as reads_free:
        y_s, dx_s, dp_s, tpe_s, _ = _run_layer(free, *on, tp, seed + rank)
    assert reads_exact == [] and reads_free == [], (reads_exact, reads_free)
    assert free.fused == (device == "cuda"), "GPU ranks must use the fused kernels"

    capacity = math.ceil(TOKENS * TOPK / config.num_moe_experts * factor) * world
    assert free.capacity(TOKENS) == capacity
    assert tpe_s.tolist() == [capacity] * LOCAL_EXPERTS and tpe_s.device.type == "cpu"
    kept, dropped = _kept(world, tp, seed, capacity)
    assert free.dropped_pairs() == dropped[rank]

    mass = (p * kept[rank]).sum(-1).reshape(x.shape[:-1] + (1,))
    torch.testing.assert_close(y_s, x * mass, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx_s, grad * mass, atol=1e-6, rtol=1e-5)
    dot = (grad * x).sum(-1).reshape(-1, 1)
    torch.testing.assert_close(dp_s, dot * kept[rank], atol=1e-5, rtol=1e-5)
    # Exact mode: the dropless closed form.
    full = (p * rm).sum(-1).reshape(x.shape[:-1] + (1,))
    torch.testing.assert_close(y_e, x * full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dp_e, dot * rm, atol=1e-5, rtol=1e-5)
    if dropped[rank] == 0 and sum(dropped) == 0:
        torch.testing.assert_close(y_s, y_e)
        torch.testing.assert_close(dx_s, dx_e)
        torch.testing.assert_close(dp_s, dp_e)
    return dropped[rank], sum(tpe_e.tolist())


def w_dropless(rank, world, tp, seed, backend="reference"):
    """Sync-free mode without a capacity (``sync_free=True``) against exact mode on one input:
    the same outputs and gradients, nothing dropped, the bound of the packed rows; on GPU ranks
    (``backend`` kernels) with no host read in the dispatcher's code and the sizes on the GPU.
    Experts that read their counts on the host are refused, naming the fix."""
    from uccl_ep_megatron.token_dispatcher import UcclEpOptions

    from uccl_ep_megatron.core.errors import UnsupportedError

    device = "cuda" if backend != "reference" else "cpu"
    groups = _groups(rank, world, tp)
    exact, _ = _make_dispatcher(rank, world, tp, groups, options=UcclEpOptions(backend=backend))
    options = UcclEpOptions(backend=backend, sync_free=True, drop_log_interval=0)
    free, config = _make_dispatcher(rank, world, tp, groups, options=options)
    assert (free.mode, free.dropless, free.mode_name) == ("sync-free", True, "sync-free dropless")
    assert (exact.dropless, exact.mode_name) == (False, "exact")
    assert free.capacity(TOKENS) == 0
    from uccl_ep_megatron.token_dispatcher import dispatcher as dispatcher_module

    dispatcher_module._logged.clear()  # once per process: a pooled worker may have said it
    with dispatcher_log() as records:
        # Every received row (world x tokens) can carry min(k, L) of this rank's experts.
        bound = world * TOKENS * min(tp * TOPK, LOCAL_EXPERTS)
        assert free.bounded_rows(TOKENS) == bound
        assert exact.bounded_rows(TOKENS) == 0
    with pytest.raises(UnsupportedError, match="--moe-uccl-ep-grouped-experts"):
        free.set_experts(torch.nn.Identity())
    if device == "cuda":
        free.device_counts = True  # as TorchGroupedMLP's set_experts would
    x, rm, p = _inputs(seed, rank, world, tp, TOKENS, torch.float32)
    on = (x.to(device), rm.to(device), p.to(device))
    y_e, dx_e, dp_e, tpe_e, _ = _run_layer(exact, *on, tp, seed + rank)
    with dispatcher_log() as later, count_host_reads() as reads:
        y_s, dx_s, dp_s, tpe_s, _ = _run_layer(free, *on, tp, seed + rank)
    # The bound's size is said once (when first worked out), with the way out.
    said = [r.getMessage() for r in records + later if "without a capacity gives" in r.getMessage()]
    assert len(said) == 1 and f"{bound} rows per layer" in said[0], said
    assert "--moe-uccl-ep-capacity-factor" in said[0]
    if device == "cuda":
        assert reads == [], reads
        assert tpe_s.device.type == "cuda" and free.fused
    assert tpe_s.tolist() == tpe_e.tolist()
    assert free.dropped_pairs() == 0
    torch.testing.assert_close(y_s, y_e)
    torch.testing.assert_close(dx_s, dx_e)
    torch.testing.assert_close(dp_s, dp_e)
    return sum(tpe_e.tolist())


def _padded_inputs(seed, rank, world, tp, tokens, dtype, factor=1.0):
    """Megatron's router output with --moe-pad-expert-input-to-capacity: every expert column
    holds exactly its capacity of picks, the padding picks with probability 0."""
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

    x, rm, p = _inputs(seed, rank, world, tp, tokens, dtype)
    probs, routing_map = apply_router_token_dropping(p, rm, TOPK, factor, pad_to_capacity=True)
    return x, routing_map, probs


def w_megatron_capacity(rank, world, tp, seed):
    from megatron.core.transformer.moe.moe_utils import get_capacity

    groups = _groups(rank, world, tp)
    d, config = _make_dispatcher(
        rank,
        world,
        tp,
        groups,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
    )
    assert d.mode == "sync-free"
    x, rm, p = _padded_inputs(seed, rank, world, tp, TOKENS, torch.float32)
    assert (rm.sum(0) == rm.sum(0)[0]).all(), "Megatron pads every expert to its capacity"
    with count_host_reads() as reads:
        y, dx, dp, tpe, grad = _run_layer(d, x, rm, p, tp, seed + rank)
    assert reads == [], reads
    per_source = get_capacity(TOKENS * TOPK, config.num_moe_experts, 1.0)
    assert tpe.tolist() == [per_source * world] * LOCAL_EXPERTS  # as alltoall's drop-and-pad
    assert d.dropped_pairs() == 0
    mass = p.sum(-1).reshape(x.shape[:-1] + (1,))  # padding picks carry probability 0
    torch.testing.assert_close(y, x * mass, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx, grad * mass, atol=1e-6, rtol=1e-5)
    real = rm & (p > 0)
    dot = (grad * x).sum(-1).reshape(-1, 1)
    torch.testing.assert_close(dp * real, dot * real, atol=1e-5, rtol=1e-5)


def w_drop_log(rank, world):
    """Every drop_log_interval forwards the dropped pairs so far are logged (when they grew)."""
    from uccl_ep_megatron.token_dispatcher import UcclEpOptions

    with dispatcher_log(level=None) as records:
        options = UcclEpOptions(backend="reference", capacity_factor=0.5, drop_log_interval=2)
        d, _ = _make_dispatcher(rank, world, 1, options=options)
        x, rm, p = _inputs(4, rank, world, 1, TOKENS, torch.float32)
        _run_layer(d, x, rm, p, 1, 0)
        assert records == [], "logged before the interval"
        _run_layer(d, x, rm, p, 1, 0)
    total = d.dropped_pairs()
    _, dropped = _kept(world, 1, 4, d.capacity(TOKENS))
    assert total == 2 * dropped[rank]
    if total:
        assert len(records) == 1 and f" {total} (token, expert) pairs" in records[0].getMessage()
    return total


def w_counter_sees_reads(rank, world):
    """The host-read counter is live: the counting torch path reads back once."""
    from uccl_ep_megatron.token_dispatcher.permute import make_plan

    with count_host_reads() as reads:
        make_plan(torch.tensor([[0, 1], [1, -1]]), 2)
    assert any(name == "tolist" for name, _, _ in reads), reads


# ---- tests -----------------------------------------------------------------------------------
GRID = [(1, 2), (2, 1), (2, 2)]


@pytest.mark.parametrize("tp,ep", GRID, ids=[f"tp{t}-ep{e}" for t, e in GRID])
def test_sync_free_without_drops_equals_exact(tp, ep):
    results = get_pool(tp * ep).run(HERE, "w_modes", tp, 3, 8.0)
    assert all(dropped == 0 for dropped, _ in results)


@pytest.mark.parametrize("tp,ep", GRID, ids=[f"tp{t}-ep{e}" for t, e in GRID])
def test_dropless_sync_free_equals_exact(tp, ep):
    assert sum(get_pool(tp * ep).run(HERE, "w_dropless", tp, 5)) > 0, "nothing was routed"


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["tp1-ep2", "tp2-ep2"])
def test_sync_free_drops_past_capacity_are_counted(tp, ep):
    results = get_pool(tp * ep).run(HERE, "w_modes", tp, 4, 0.5)
    assert sum(dropped for dropped, _ in results) > 0, "the case must drop something"


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["tp1-ep2", "tp2-ep2"])
def test_sync_free_with_megatron_padded_capacity(tp, ep):
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "apply_router_token_dropping"):
        pytest.skip("this megatron-core has no apply_router_token_dropping")
    get_pool(tp * ep).run(HERE, "w_megatron_capacity", tp, 6)


def test_drops_are_logged_every_interval():
    assert sum(get_pool(2).run(HERE, "w_drop_log")) > 0


def test_host_read_counter_counts():
    get_pool(2).run(HERE, "w_counter_sees_reads")


def w_configured_by_arguments(rank, world):
    """num_sms reaches the dispatcher's Configs, not the class-wide Buffer.num_sms; options never
    touch the environment; layers share a Buffer only through a cache they are given."""
    from uccl_ep_megatron.token_dispatcher import UcclEpOptions, set_options
    from uccl_ep_megatron.token_dispatcher.buffer_cache import BufferCache

    from uccl_ep_megatron.api.buffer import Buffer
    from uccl_ep_megatron.core.options import BufferOptions

    before_sms, before_env = Buffer.num_sms, dict(os.environ)
    options = UcclEpOptions(backend="reference", num_sms=8, num_proxy_threads=3, transport="ipc")
    groups = _groups(rank, world, 1)
    cache = BufferCache()
    d1, _ = _make_dispatcher(rank, world, 1, groups, cache, options)
    d2, _ = _make_dispatcher(rank, world, 1, groups, cache, options)
    d3, _ = _make_dispatcher(rank, world, 1, groups, None, options)
    saved = set_options(num_proxy_threads=5)
    set_options(num_proxy_threads=saved.num_proxy_threads)
    assert Buffer.num_sms == before_sms
    assert dict(os.environ) == before_env
    assert d1.dispatch_config.num_sms == d1.combine_config.num_sms == 8
    assert options.buffer_options() == BufferOptions(num_proxy_threads=3, transport="ipc")
    x, rm, p = _inputs(1, rank, world, 1, TOKENS, torch.float32)
    for d in (d1, d2, d3):
        _run_layer(d, x, rm, p, 1, 0)
    assert d1.buffer is d2.buffer and d3.buffer is not d1.buffer


def test_configured_by_arguments_not_globals():
    get_pool(2).run(HERE, "w_configured_by_arguments")


def w_permute_fusion_is_logged(rank, world):
    """--moe-permute-fusion is never silently ignored: the dispatcher logs what runs instead."""
    with dispatcher_log() as records:
        d, config = _make_dispatcher(rank, world, 1)
        # megatron-core refuses the flag at construction without Transformer Engine (as here).
        config.moe_permute_fusion = True
        assert d._use_te_permute() is False
    messages = [r.getMessage() for r in records]
    assert any(
        "--moe-permute-fusion: Transformer Engine's fused permutation is not importable" in m
        and "uccl_ep's fused permute kernels" in m
        for m in messages
    ), messages


def test_permute_fusion_flag_is_logged_not_ignored():
    pytest.importorskip("megatron.core")
    from uccl_ep_megatron.token_dispatcher.permute import megatron_fused_permute_available

    if megatron_fused_permute_available():
        pytest.skip("Transformer Engine is installed: its fused permutation would be used")
    get_pool(2).run(HERE, "w_permute_fusion_is_logged")


def test_sync_free_moe_layer_equals_allgather_and_oracle(tmp_path):
    """Megatron's MoELayer (SequentialMLP experts fed [C] * L rows with zero padding) in
    sync-free mode, through the plugin's flags, against megatron-core's allgather dispatcher
    and the dispatcher-free oracle: output and every gradient (fp32, 1e-5)."""
    from test_megatron_layer import _layer_run

    reports = _layer_run(
        tmp_path,
        "--moe-token-dispatcher-type",
        "uccl_ep",
        "--moe-uccl-ep-backend",
        "reference",
        "--moe-uccl-ep-capacity-factor",
        "4",
        "--moe-router-dtype",
        "fp32",
        "--reference",
        "allgather",
    )
    for r in reports:
        assert r["dispatcher"] == "UcclEpTokenDispatcher"
        # 24 tokens x top-2 / 8 experts x 4 = 24 per source, x 2 ranks: every expert gets 48.
        assert r["tokens_per_expert"] == [48] * 4, r["tokens_per_expert"]
        assert "allgather/grad/router.weight" in r["checks"] and "oracle/output" in r["checks"]

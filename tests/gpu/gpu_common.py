"""Helpers shared by the GPU tests: rank pools on one or more GPUs (ranks share a GPU under
CUDA MPS when there are more ranks than GPUs) and their module fixture, the skip without GPU
kernels, poisoned allocations, the routings and inputs of a dispatch case, a dispatch call from
a layout, and the comparisons against the ``reference`` oracle (exact, with a readable
mismatch, or within bf16 accumulation)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_counts(var: str, default: str) -> list[int]:
    """Rank counts from env ``var`` (comma-separated), e.g. ``UCCL_EP_TEST_RANKS=2,4``."""
    return [int(v) for v in os.environ.get(var, default).split(",") if v.strip()]


def nvl_bytes_for(world: int, hidden: int, element_size: int = 2) -> int:
    """The smallest ``num_nvl_bytes`` a Buffer of ``world`` ranks accepts for this hidden size
    with the default configs (DeepEP's size hints)."""
    from uccl_ep_megatron import Buffer

    hidden_bytes = hidden * max(element_size, 2)
    return max(
        cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
        for cfg in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world))
    )


def make_pool(world: int):
    """A pool of ``world`` ranks on this machine's GPUs, or a skip saying what is missing."""
    from dist_utils import DistPool

    from uccl_ep_megatron.cluster.local import mps_available

    if NUM_GPUS == 0:
        pytest.skip("needs a GPU")
    if world > NUM_GPUS and not mps_available():
        pytest.skip(f"{world} ranks on {NUM_GPUS} GPU(s) share GPUs: needs CUDA MPS")
    return DistPool(world, gpus=NUM_GPUS)


@contextlib.contextmanager
def pool(world: int):
    """``make_pool(world)``, closed on exit."""
    p = make_pool(world)
    try:
        yield p
    finally:
        p.close()


def kernels_built() -> bool:
    """Whether ``_C`` imports and was built with the GPU kernels."""
    try:
        from uccl_ep_megatron import _C
    except ImportError:
        return False
    return _C.build_info["gpu"] != "none"


def require_kernels():
    """``_C``, or a skip when there is no GPU or ``_C`` was built without the GPU kernels."""
    from uccl_ep_megatron import _C

    if not torch.cuda.is_available() or not _C.kernels_built():
        pytest.skip("needs a GPU and a GPU build of uccl_ep_megatron")
    return _C


def pool_fixture(
    worlds: int | Iterable[int],
    ids: Callable[[int], str] = lambda n: f"ranks{n}",
    needs_kernels: bool = False,
):
    """A module-scoped ``gpu_pool`` fixture (assign it to ``gpu_pool``): one pool per entry of
    ``worlds`` (test ids from ``ids``), or, for an int, one pool of that many ranks."""
    params = None if isinstance(worlds, int) else list(worlds)

    @pytest.fixture(scope="module", params=params, ids=ids if params is not None else None)
    def gpu_pool(request):
        if needs_kernels:
            require_kernels()
        with pool(worlds if params is None else request.param) as p:
            yield p

    return gpu_pool


def fill_free_memory(stream, byte: int, large_bytes: int = 3 << 28) -> None:
    """Fill free caching-allocator memory of ``stream``, in its large-block pool
    (``large_bytes``, or half of it until it fits: eight ranks sharing one 80 GB GPU hold most
    of it, and the poison must not be what runs out) and its small-block pool (allocations up
    to 1 MiB), with ``byte``."""
    with torch.cuda.stream(stream):
        large = None
        while large is None and large_bytes >= 1 << 24:
            try:
                large = torch.empty(large_bytes, dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                large_bytes //= 2
        large = torch.empty(0, dtype=torch.uint8, device="cuda") if large is None else large
        small = [torch.empty(1 << 19, dtype=torch.uint8, device="cuda") for _ in range(64)]
        for p in (large, *small):
            p.fill_(byte)
        del large, small


def poison(buf, byte: int = 0xFF) -> None:
    """Fill free memory of the comm stream with ``byte`` (``fill_free_memory``): 0xFF gives
    NaN / -1 patterns; 0x7F gives values that are neither NaN, -1 nor 0, where a test must tell
    the kernels' own poison fill from leftovers. The free bytes of a kernels Buffer's receive
    arena (zero-copy outputs) too."""
    fill_free_memory(buf.get_comm_stream(), byte)
    arena = getattr(getattr(buf, "_backend", None), "recv_arena", None)
    if arena is not None:
        arena.fill_free(byte, buf.get_comm_stream())


# Receive arena of the test Buffers: room for a DeepSeek-V3-sized dispatch and its cached
# re-dispatch at 8 ranks, also when one rank receives every row (skewed routing).
ARENA_BYTES = 1280 << 20


def kernels_buffer(
    nvl_bytes: int, arena: bool = True, arena_bytes: int = ARENA_BYTES, **options: Any
) -> Any:
    """A ``kernels`` Buffer with the receive arena (zero-copy dispatch) on or off, and any
    other ``BufferOptions`` field given."""
    from uccl_ep_megatron import Buffer, BufferOptions

    opts = BufferOptions(arena_bytes=arena_bytes if arena else 0, **options)
    return Buffer(None, nvl_bytes, 0, backend="kernels", options=opts)


def in_arena(buf, t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in ``buf``'s receive arena (a zero-copy output)."""
    arena = buf._backend.recv_arena
    if not arena.enabled or t.numel() == 0:
        return False
    lo = arena.base
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + arena.nbytes


def routing(kind: str, rank: int, world: int, num_tokens: int, num_experts: int, topk: int, gen):
    """``topk_idx`` of a routing ``kind``: "random"; "skewed" (every token picks expert 0, half
    also the last rank's first expert); "local" (no token leaves its rank); "to_rank0" (every
    rank but 0 receives nothing); "remote" (every token goes to the rank half a world away:
    with two virtual nodes, it leaves its node); "every_rank" (each token picks an expert of
    every rank, so its combine sums a row from each; needs topk >= world); "holes" (random
    with -1 slots, and a tenth of the tokens going nowhere)."""
    scores = torch.rand(num_tokens, num_experts, generator=gen, device="cuda")
    epr = num_experts // world
    if kind == "skewed":
        scores[:, 0] += 2.0
        scores[: num_tokens // 2, epr * (world - 1)] += 1.5
    elif kind == "local":
        scores[:, rank * epr : (rank + 1) * epr] += 10.0
    elif kind == "to_rank0":
        scores[:, :epr] += 10.0
    elif kind == "every_rank":
        assert topk >= world
        scores[:, ::epr] += 10.0
    elif kind == "remote":
        other = (rank + world // 2) % world
        scores[:, other * epr : (other + 1) * epr] += 10.0
    idx = scores.topk(topk, dim=1).indices
    if kind in ("local", "to_rank0", "remote"):
        assert topk <= epr
    if kind == "holes":
        holes = torch.rand(num_tokens, topk, generator=gen, device="cuda") < 0.3
        idx = torch.where(holes, torch.full_like(idx, -1), idx)
        idx[: max(1, num_tokens // 10)] = -1
    return idx


def inputs(rank: int, world: int, params: dict, gen):
    """(x as passed to dispatch, bf16 x, topk_idx, topk_weights, num_experts) of a case:
    ``params`` holds tokens, hidden, routing and optionally experts (8 per rank), topk (4),
    idx_dtype (int64) and fp8 (x as FP8 rows with one scale per 128 columns)."""
    num_tokens, hidden = params["tokens"], params["hidden"]
    num_experts, topk = params.get("experts", 8 * world), params.get("topk", 4)
    idx = routing(params["routing"], rank, world, num_tokens, num_experts, topk, gen)
    idx = idx.to(params.get("idx_dtype", torch.int64))
    w = torch.rand(num_tokens, topk, generator=gen, device="cuda")
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    x_in = x
    if params.get("fp8"):
        scales = torch.rand(num_tokens, hidden // 128, generator=gen, device="cuda")
        x_in = (x.float().to(torch.float8_e4m3fn), scales)
    return x_in, x, idx, w, num_experts


def combine_inputs(recv_x, received: int | None, num_bias: int = 0, num_tokens: int = 0, gen=None):
    """(rows to combine, bias tensors): the received rows transformed, NaN on the padding rows
    past ``received`` (a sync-free call's; ``None``: no padding), which combine must ignore;
    ``num_bias`` random ``[num_tokens, hidden]`` bias tensors drawn from ``gen``."""
    y = (recv_x.float() * 0.5 + 1.0).to(torch.bfloat16)
    if received is not None:
        y[received:] = float("nan")
    hidden = recv_x.shape[1]
    bias = tuple(
        torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
        for _ in range(num_bias)
    )
    return y, bias


def assert_same(name: str, a, b) -> None:
    """``a`` and ``b`` are equal bit for bit (FP8 compared as bytes), or both None."""
    if a is None or b is None:
        assert a is None and b is None, f"{name}: {a is None=} {b is None=}"
        return
    if isinstance(a, list):
        assert a == b, f"{name}: {a} != {b}"
        return
    if a.device != b.device:  # the oracle of a gloo pool hands back CPU tensors in handles
        a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    )
    if a.dtype.itemsize == 1 and a.is_floating_point():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    if not torch.equal(a, b):
        bad = (a != b).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: mismatch at {bad} ({int((a != b).sum())} elements)")


def dispatch(buf, x, layout, topk_idx, topk_w, **kw):
    """``buf.dispatch`` with the four layout tensors of ``get_dispatch_layout``."""
    from uccl_ep_megatron.bench.inputs import dispatch_kwargs

    return buf.dispatch(x, **dispatch_kwargs(layout, topk_idx, topk_w), **kw)


def assert_layout_same(got, want) -> None:
    """The four tensors of ``get_dispatch_layout`` are equal."""
    names = ("per_rank", "per_rdma", "per_expert", "in_rank")
    for name, a, b in zip(names, got, want, strict=True):
        assert_same(f"layout.{name}", a, b)


def assert_recv_same(got, want, fp8: bool = False, count: int | None = None) -> None:
    """The received rows (and FP8 scales), top-k ids and weights of two dispatch results.

    With ``count``, rows are compared up to it: the intranode kernels leave sync-free padding
    rows of ``recv_x`` (and of the FP8 scales) unwritten, as DeepEP does; ids and weights are
    compared in full, padding included (-1 and 0)."""
    n = count
    if fp8:
        assert_same("recv_x", got[0][0][:n], want[0][0][:n])
        assert_same("recv_scales", got[0][1][:n], want[0][1][:n])
    else:
        assert_same("recv_x", got[0][:n], want[0][:n])
    assert_same("recv_topk_idx", got[1], want[1])
    assert_same("recv_topk_weights", got[2], want[2])


def assert_combine_close(
    x, weights, ref_x, ref_weights, exact: bool = False, magnitude=None
) -> None:
    """Combined rows within bf16 accumulation of the oracle's (equal when ``exact``), and
    combined weights within fp32 rounding. ``magnitude``: the oracle's combine of the summands'
    absolute values (biases included); the rows may then differ by 2^-7 of it and no more: the
    internode kernels round each node's partial sum to bf16 before it crosses (as DeepEP's
    do) and the result once, the oracle only the result, and each rounding errs by at most
    2^-9 of the magnitude. Without it, 1e-2 absolute and relative."""
    if magnitude is None:
        torch.testing.assert_close(x.float(), ref_x.float(), rtol=1e-2, atol=1e-2)
    else:
        diff = (x.float() - ref_x.float().to(x.device)).abs()
        bound = magnitude.float().to(x.device).abs() * 2.0**-7 + 1e-3
        over = diff - bound
        assert not bool((over > 0).any()), (
            f"combined_x: {int((over > 0).sum())} of {x.numel()} elements differ from the "
            f"oracle's by more than 2^-7 of the summands' magnitude (worst by "
            f"{float(over.max()):.4g} at {divmod(int(over.argmax()), x.shape[1])})"
        )
    if exact:
        assert_same("combined_x", x, ref_x)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)


def assert_combined_is_x_times_reached(combined, x, is_token_in_rank) -> None:
    """The self-verifying property: combining the dispatched rows unchanged gives x times the
    number of ranks each token reached."""
    reached = is_token_in_rank.sum(1, keepdim=True).float()
    torch.testing.assert_close(
        combined.float(), (x.float() * reached).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2
    )


def store_meet(name: str, world: int, limit_s: float) -> None:
    """Wait, at most ``limit_s``, until every rank got here: through the default store, no
    collective of the process group, whatever state a failure left it in."""
    import time

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    key = f"meet/{name}"
    store.add(key, 1)
    deadline = time.monotonic() + limit_s
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not all reach {name!r} within {limit_s} s")
        time.sleep(0.01)


def scenario_inputs(rank: int, world: int, hidden: int, seed: int):
    """Rank ``rank``'s tokens of a failure scenario: 64 + 8 * rank tokens, each routed to two
    neighbouring experts of 4 per rank (any rank can rebuild any other rank's from the seed)."""
    num_tokens = 64 + 8 * rank
    gen = torch.Generator(device="cuda").manual_seed(seed + rank)
    idx = torch.randint(0, 4 * world, (num_tokens, 2), device="cuda", generator=gen)
    idx[:, 1] = (idx[:, 0] + 1) % (4 * world)  # distinct experts per token
    w = torch.rand(num_tokens, 2, device="cuda", generator=gen)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    return x, idx, w


def run_keeping_results(pool, target, *args, env=None) -> tuple[dict, str | None, bool]:
    """Run ``target`` (``(module path, function)``, called as ``f(rank, world, *args, tmp)``) on
    the pool's ranks; each rank keeps its result in a file of ``tmp`` (``keep_result``), so the
    survivors' results arrive when a rank dies (the pool then names it). Returns the results by
    rank, the pool's error when a rank died, and whether every rank was alive afterwards."""
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        died = None
        try:
            pool.run(target, *args, tmp, env=env)
        except TimeoutError as exc:
            died = str(exc)
        alive = pool.alive()
        outs = {}
        for r in range(pool.world):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outs[r] = pickle.load(f)
    return outs, died, alive


def keep_result(tmp: str, rank: int, out: Any) -> Any:
    """On a rank: keep ``out`` where ``run_keeping_results`` reads it."""
    import pickle

    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    return out


def raised(fn: Callable[[], Any]) -> tuple[str, str, float]:
    """(class name, message, seconds) of the ``UcclEpError`` that ``fn()`` raises; an
    ``AssertionError`` when it raises none."""
    import time

    from uccl_ep_megatron.core.errors import UcclEpError

    t0 = time.monotonic()
    try:
        fn()
    except UcclEpError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    raise AssertionError(f"no error was raised (after {time.monotonic() - t0:.2f} s)")

"""FP8 dispatch for training (``token_dispatcher.fp8``) on CPU, ``reference`` backend.

- ``quantize`` / ``dequantize``: per-128-channel E4M3 with DeepSeek-V3's scales; the error of
  every element is within half an E4M3 step of its block's scale, values on the E4M3 grid of
  the block survive exactly, and a bad hidden size is refused.
- ``dispatch_fp8`` over 2 gloo ranks equals ``ops.dispatch`` of the dequantized input exactly
  (received rows, ids, weights, counts), and its gradients (straight through the
  quantization, combined in the input's dtype) equal ``ops.dispatch``'s for the same output
  gradient.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from conftest import get_pool  # noqa: E402

from uccl_ep_megatron.core.errors import InvalidInputError  # noqa: E402

HERE = os.path.abspath(__file__)
fp8 = pytest.importorskip("uccl_ep_megatron.token_dispatcher.fp8")


def test_round_trip_error_is_within_half_an_e4m3_step_per_block():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)
    x_fp8, scales = fp8.quantize(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scales.shape == (64, 4)
    blocks = x.view(64, 4, 128)
    amax = blocks.abs().amax(2)
    torch.testing.assert_close(scales, amax / 448.0)  # the oracle: DeepEP's convention
    back = fp8.dequantize(x_fp8, scales, torch.float32).view(64, 4, 128)
    # E4M3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of the value, and the
    # block's largest element maps to 448 exactly.
    err = (back - blocks).abs()
    assert bool((err <= blocks.abs() * 2**-4 + amax.unsqueeze(2) * 2**-9 / 448 + 1e-12).all())
    grid = torch.tensor([448.0, -448.0, 1.0, 0.5, -0.125, 240.0, 0.0] + [2.0] * 121).view(1, 128)
    exact = grid * 0.37
    q, s = fp8.quantize(exact)
    torch.testing.assert_close(fp8.dequantize(q, s, torch.float32), exact, rtol=1e-6, atol=1e-6)
    with pytest.raises(InvalidInputError, match="hidden % 128 == 0, got hidden=100"):
        fp8.quantize(torch.zeros(2, 100))


def w_fp8_dispatch(rank, world):
    from uccl_ep_megatron.api import ops
    from uccl_ep_megatron.api.buffer import Buffer

    hidden, tokens, topk, experts = 256, 12, 3, 4 * world
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float32)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[0, 1] = -1
    w = torch.rand(tokens, topk, generator=g)
    nvl = max(
        c.get_nvl_buffer_size_hint(hidden * 4, world)
        for c in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world))
    )
    buf = Buffer(None, nvl, 0, backend="reference")
    x_q = fp8.dequantize(*fp8.quantize(x), torch.float32)
    grad_seed = torch.Generator().manual_seed(99 + rank)
    outs = {}
    for name in ("fp8", "reference"):
        xi = (x.clone() if name == "fp8" else x_q.clone()).requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        if name == "fp8":
            recv, ridx, rw, counts, _ = fp8.dispatch_fp8(buf, xi, idx, wi, experts)
        else:
            recv, ridx, rw, counts, _ = ops.dispatch(buf, xi, idx, wi, experts)
        gx = torch.randn(recv.shape, generator=torch.Generator().manual_seed(5 + rank))
        gw = torch.rand(rw.shape, generator=grad_seed)
        torch.autograd.backward([recv, rw], [gx, gw])
        outs[name] = (recv.detach(), ridx, rw.detach(), counts, xi.grad, wi.grad)
        grad_seed = torch.Generator().manual_seed(99 + rank)
    for a, b in zip(outs["fp8"], outs["reference"], strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b
    assert outs["fp8"][0].shape[0] > 0  # something arrived
    return True


def test_fp8_dispatch_equals_bf16_dispatch_of_the_dequantized_input():
    assert get_pool(2).run(HERE, "w_fp8_dispatch") == [True, True]

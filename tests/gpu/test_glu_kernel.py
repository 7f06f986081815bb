"""The grouped experts' fused SwiGLU x probability kernels (``csrc/kernels/glu.h``, used by
``TorchGroupedMLP._activation`` on GPUs) against the torch ops they replace, written out here:
``bf16(bf16(bf16(silu(gate)) * linear) * probs)`` and its autograd.

- Forward: bit for bit, on values from 1e-3 to 1e2 with zeros, an infinity and a NaN.
- Backward: the linear half's gradient bit for bit, the gate's within one bf16 step (SiLU's
  derivative, evaluated in the same order, may contract differently), the probabilities'
  within float32 summation-order error (each sum within its length x 2^-24 x its sum of
  magnitudes).
- Padding: rows at or past the last offset are not written, in the output or either
  gradient (poisoned before, still poisoned after), and the rows before it equal the
  reference.
- What takes the kernel: float64 probabilities, a clamp or a linear offset take the torch ops.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.megatron,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def _cfg(**kw):
    base = dict(
        gated_linear_unit=True,
        activation_func=F.silu,
        activation_func_clamp_value=None,
        glu_linear_offset=0.0,
    )
    base.update(kw)
    return types.SimpleNamespace(**base)


def _reference(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, linear = torch.chunk(h, 2, dim=-1)
    return ((F.silu(gate) * linear) * probs.unsqueeze(-1)).to(h.dtype)


def _inputs(rows: int, ffn: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(rows, 2 * ffn, device="cuda", generator=g)
    h = h * 10.0 ** torch.randint(-3, 3, (rows, 1), device="cuda", generator=g)
    h[0, :8] = 0.0
    h[1, 3] = float("inf")
    h[2, ffn + 5] = float("nan")
    probs = torch.rand(rows, device="cuda", generator=g)
    probs[3] = 0.0
    grad = torch.randn(rows, ffn, device="cuda", generator=g).to(torch.bfloat16)
    return h.to(torch.bfloat16), probs, grad


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(
        a[~nan_a].view(torch.int16), b[~nan_b].view(torch.int16)
    )


def _run(h, probs, grad, offs, fused: bool):
    from uccl_ep_megatron.token_dispatcher.grouped_experts import TorchGroupedMLP

    h = h.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    owner = types.SimpleNamespace(config=_cfg())
    if fused:
        out = TorchGroupedMLP._activation(owner, h, probs, offs)
    else:
        out = _reference(h, probs)
    out.backward(grad)
    return out.detach(), h.grad, probs.grad


def test_kernel_equals_the_torch_ops():
    from uccl_ep_megatron.token_dispatcher.grouped_experts import _glu_kernel_fits

    rows, ffn = 1000, 1408
    h, probs, grad = _inputs(rows, ffn, seed=1)
    assert _glu_kernel_fits(_cfg(), h, probs)
    offs = torch.tensor([400, rows], dtype=torch.int32, device="cuda")
    out, gh, gp = _run(h, probs, grad, offs, fused=True)
    ref_out, ref_gh, ref_gp = _run(h, probs, grad, offs, fused=False)
    assert _bits_equal(out, ref_out)
    assert _bits_equal(gh[:, ffn:], ref_gh[:, ffn:])
    finite = ref_gh[:, :ffn].isfinite() & gh[:, :ffn].isfinite()
    assert torch.equal(finite, ref_gh[:, :ffn].isfinite())
    a, b = gh[:, :ffn][finite].float(), ref_gh[:, :ffn][finite].float()
    step = b.abs().clamp_min(1e-30) * 2.0**-7  # one bf16 step (8 significant bits)
    assert ((a - b).abs() <= step).all()
    # The probabilities' gradient sums a row of grad * m (m = the bf16 product) in float32; the
    # order differs, so the bound is float32 rounding of the row's sum of magnitudes.
    ok = ref_gp.isfinite()
    assert torch.equal(ok, gp.isfinite())
    m = (F.silu(h[:, :ffn]) * h[:, ffn:]).float()
    magnitude = (grad.float() * m).abs().sum(-1)
    assert ((gp - ref_gp)[ok].abs() <= magnitude[ok] * 2 * ffn * 2.0**-24).all()


def test_rows_past_the_last_offset_are_not_written():
    from uccl_ep_megatron.token_dispatcher.grouped_experts import _c, _glu_launch_args

    rows, ffn, live = 256, 512, 150
    h, probs, grad = _inputs(rows, ffn, seed=2)
    offs = torch.tensor([100, live], dtype=torch.int32, device="cuda")
    poison = 0x7FC1  # a bf16 NaN no kernel computes
    out = torch.full((rows, ffn), poison, dtype=torch.int16, device="cuda").view(torch.bfloat16)
    gh = torch.full((rows, 2 * ffn), poison, dtype=torch.int16, device="cuda")
    gh = gh.view(torch.bfloat16)
    gp = torch.full((rows,), 7.0, device="cuda")
    args = _glu_launch_args(h, offs)
    _c().glu_probs_forward(h=h.data_ptr(), probs=probs.data_ptr(), out=out.data_ptr(), **args)
    _c().glu_probs_backward(
        grad_out=grad.data_ptr(), h=h.data_ptr(), probs=probs.data_ptr(),
        grad_h=gh.data_ptr(), grad_probs=gp.data_ptr(), **args,
    )  # fmt: skip
    assert (out[live:].view(torch.int16) == poison).all()
    assert (gh[live:].view(torch.int16) == poison).all() and (gp[live:] == 7.0).all()
    ref_out, ref_gh, _ = _run(h[:live], probs[:live], grad[:live], offs, fused=False)
    assert _bits_equal(out[:live], ref_out)
    assert _bits_equal(gh[:live, ffn:], ref_gh[:, ffn:])
    # Through the autograd function: the live rows equal the torch ops' as before.
    out2, gh2, _ = _run(h, probs, grad, offs, fused=True)
    assert _bits_equal(out2[:live], ref_out) and _bits_equal(gh2[:live, ffn:], ref_gh[:, ffn:])


def test_what_takes_the_kernel():
    from uccl_ep_megatron.token_dispatcher.grouped_experts import _glu_kernel_fits

    h, probs, _ = _inputs(16, 64, seed=3)
    assert _glu_kernel_fits(_cfg(), h, probs)
    assert not _glu_kernel_fits(_cfg(), h, probs.double())
    assert not _glu_kernel_fits(_cfg(activation_func_clamp_value=7.0), h, probs)
    assert not _glu_kernel_fits(_cfg(glu_linear_offset=1.0), h, probs)
    assert not _glu_kernel_fits(_cfg(activation_func=F.gelu), h, probs)
    assert not _glu_kernel_fits(_cfg(), h.cpu(), probs.cpu())

"""The FP8 row kernels of FP8 dispatch (``csrc/kernels/fp8.cu``) against torch's ops of the same
definition (``token_dispatcher.fp8.quantize_reference`` / ``dequantize_reference``) on the GPU,
bit for bit: E4M3 codes, float32 scales and the dequantized rows, for bf16, fp16 and fp32 rows,
with blocks of zeros (the 1e-4 floor), tiny and huge magnitudes, a NaN and an infinity (their
blocks dequantize to NaN), no rows, a non-contiguous input, one that is not 16-byte aligned
and codes that are not 8-byte aligned."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]


def _rows(tokens: int, hidden: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g)
    if tokens:
        # Per-block magnitudes from 1e-6 to 1e3, and special blocks.
        blocks = hidden // 128
        scale = 10.0 ** torch.randint(-6, 4, (tokens, blocks, 1), device="cuda", generator=g)
        x = (x.view(tokens, blocks, 128) * scale).view(tokens, hidden)
        x[0, :128] = 0.0  # amax floored at 1e-4
        if tokens > 2:
            x[1, 130] = float("nan")
            x[2, -1] = float("inf")
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal where neither is NaN, and NaN in the same places."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
        a_nan, b_nan = (a & 0x7F) == 0x7F, (b & 0x7F) == 0x7F
    else:
        a_nan, b_nan = a.isnan(), b.isnan()
    keep = ~a_nan
    bits = {2: torch.int16, 4: torch.int32, 1: torch.uint8}[a.element_size()]
    return torch.equal(a_nan, b_nan) and torch.equal(a[keep].view(bits), b[keep].view(bits))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens,hidden", [(4096, 7168), (37, 256), (1, 128), (0, 512)])
def test_kernels_equal_the_reference_bit_for_bit(dtype, tokens, hidden):
    from uccl_ep_megatron.token_dispatcher import fp8

    x = _rows(tokens, hidden, dtype, seed=tokens + hidden)
    x_fp8, scales = fp8.quantize(x)
    ref_fp8, ref_scales = fp8.quantize_reference(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == (tokens, hidden)
    assert scales.dtype == torch.float32 and scales.shape == (tokens, hidden // 128)
    assert _same(x_fp8, ref_fp8)
    assert _same(scales, ref_scales)
    for out_dtype in (dtype, torch.bfloat16):
        y = fp8.dequantize(x_fp8, scales, out_dtype)
        assert y.dtype == out_dtype
        assert _same(y, fp8.dequantize_reference(ref_fp8, ref_scales, out_dtype))
    if tokens > 2:
        # The special blocks: the NaN's scale is NaN, the infinity's infinite (both blocks
        # dequantize to NaN), the zeros' are zero codes at the floored scale.
        assert torch.isnan(scales[1, 1]) and torch.isinf(scales[2, -1])
        assert y[1, 128:256].isnan().all() and y[2, -128:].isnan().all()
        assert scales[0, 0].item() == pytest.approx(1e-4 / 448)
        assert not x_fp8.view(torch.uint8)[0, :128].any()
        finite = ~y.isnan()
        assert finite[3:].all()  # no other block is NaN
        # Half an E4M3 step is at most 1/16 of the value (<= 28 scales), plus the bf16 rounding.
        err = (y[3:].float() - x[3:].float()).abs()
        assert (err <= scales[3:].repeat_interleave(128, dim=1) * 32).all()


def test_kernels_take_a_strided_and_an_unaligned_input():
    from uccl_ep_megatron.token_dispatcher import fp8

    x = _rows(64, 1024, torch.bfloat16, seed=3)
    wide = torch.zeros(64, 1024 + 128, dtype=torch.bfloat16, device="cuda")
    wide[:, 64 : 64 + 1024] = x
    strided = wide[:, 64 : 64 + 1024]
    flat = torch.zeros(64 * 1024 + 1, dtype=torch.bfloat16, device="cuda")
    flat[1:] = x.flatten()
    unaligned = flat[1:].view(64, 1024)  # 2 bytes past an aligned address
    assert not strided.is_contiguous() and unaligned.data_ptr() % 16 == 2
    ref = fp8.quantize_reference(x)
    for t in (strided, unaligned):
        got = fp8.quantize(t)
        assert _same(got[0], ref[0]) and _same(got[1], ref[1])
    # Codes 4 bytes past an 8-byte boundary: the dequantize kernel's word-at-a-time path.
    raw = torch.zeros(64 * 1024 + 4, dtype=torch.uint8, device="cuda")
    raw[4:] = ref[0].view(torch.uint8).flatten()
    codes = raw[4:].view(torch.float8_e4m3fn).view(64, 1024)
    assert codes.data_ptr() % 8 == 4
    want = fp8.dequantize_reference(ref[0], ref[1], torch.bfloat16)
    assert _same(fp8.dequantize(codes, ref[1], torch.bfloat16), want)


def test_kernels_are_what_quantize_runs_on_a_gpu():
    """The GPU path is the kernels' (a positive control: the torch path would not be)."""
    from uccl_ep_megatron.token_dispatcher import fp8

    assert fp8._kernels(torch.empty(1, device="cuda"), torch.bfloat16) is not None
    assert fp8._kernels(torch.empty(1), torch.bfloat16) is None
    assert fp8._kernels(torch.empty(1, device="cuda"), torch.int8) is None


def test_dequantize_leaves_the_rows_past_the_bound_unwritten():
    """A sync-free dispatch's padding rows (at or past ``handle.recv_count``) are not
    dequantized: poisoned before, still poisoned after; the live rows equal the reference;
    a bound that is not an int32 [1] tensor on the rows' device is refused."""
    from uccl_ep_megatron.token_dispatcher import fp8

    from uccl_ep_megatron.core.errors import InvalidInputError

    rows, hidden, live = 300, 1024, 213
    codes, scales = fp8.quantize(_rows(rows, hidden, torch.bfloat16, seed=9))
    bound = torch.tensor([live], dtype=torch.int32, device="cuda")
    want = fp8.dequantize_reference(codes, scales, torch.bfloat16)
    poison = 0x7FC1  # a bf16 NaN no dequantization computes
    out = torch.full((rows, hidden), poison, dtype=torch.int16, device="cuda")
    fp8._kernels(codes, torch.bfloat16).dequantize_fp8(
        x=codes.data_ptr(), scales=scales.data_ptr(), rows=rows, hidden=hidden,
        dtype=fp8._DTYPE_CODES[torch.bfloat16], bound=bound.data_ptr(), out=out.data_ptr(),
        stream=torch.cuda.current_stream().cuda_stream,
    )  # fmt: skip
    assert _same(out[:live].view(torch.bfloat16), want[:live])
    assert (out[live:] == poison).all()
    got = fp8.dequantize(codes, scales, torch.bfloat16, bound)
    assert _same(got[:live], want[:live])
    assert _same(fp8.dequantize(codes, scales, torch.bfloat16, None), want)
    pair = torch.tensor([live, 1], dtype=torch.int32, device="cuda")
    for bad in (bound.long(), bound.cpu(), pair):
        with pytest.raises(InvalidInputError, match="bound must be an int32"):
            fp8.dequantize(codes, scales, torch.bfloat16, bad)

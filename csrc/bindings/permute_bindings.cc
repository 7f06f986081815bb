// The fused permute / unpermute kernels in `_C` (token_dispatcher/permute.py drives them), the
// FP8 row kernels of FP8 dispatch (token_dispatcher/fp8.py) and the grouped experts' SwiGLU
// (token_dispatcher/grouped_experts.py). Bound only when the GPU kernels are built;
// `permute_kernels_built` says which.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

#ifdef UCCL_EP_WITH_GPU
#include "common/errors.h"
#include "kernels/fp8.h"
#include "kernels/glu.h"
#include "kernels/permute.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

#ifdef UCCL_EP_WITH_GPU
namespace {

namespace k = uccl_ep::kernels;

// Tensor pointers come from torch; the sizes say which ones the kernels touch.
void require(intptr_t ptr, bool used, const char* what) {
  if (used && ptr == 0) UCCL_EP_THROW(InvalidArgument, what, " is a null pointer but the sizes say it is used");
}

}  // namespace
#endif

void bind_permute(py::module_& m) {
#ifndef UCCL_EP_WITH_GPU
  m.def("permute_kernels_built", [] { return false; }, "Whether the fused permute kernels were compiled into _C.");
#else
  m.def("permute_kernels_built", [] { return true; }, "Whether the fused permute kernels were compiled into _C.");
  m.def(
      "permute_plan",
      [](intptr_t topk_idx, bool idx_is_64, int num_rows, int num_topk, intptr_t recv_count, int num_experts,
         int align, int capacity, bool packed, int64_t num_out_rows, intptr_t probs, intptr_t pair_dest,
         intptr_t src_row, intptr_t out_probs, intptr_t counts, intptr_t tokens_per_expert, intptr_t offsets,
         intptr_t dropped, intptr_t stream) {
        const bool pairs = num_rows > 0;
        require(topk_idx, pairs, "permute_plan: topk_idx");
        require(pair_dest, pairs, "permute_plan: pair_dest");
        require(probs, pairs && out_probs != 0, "permute_plan: probs");
        require(src_row, num_out_rows > 0, "permute_plan: src_row");
        require(counts, true, "permute_plan: counts");
        require(tokens_per_expert, true, "permute_plan: tokens_per_expert");
        require(offsets, true, "permute_plan: offsets");
        require(dropped, true, "permute_plan: dropped");
        k::permute_plan(topk_idx, idx_is_64, num_rows, num_topk, recv_count, num_experts, align, capacity, packed,
                        num_out_rows, probs, pair_dest, src_row, out_probs, counts, tokens_per_expert, offsets,
                        dropped, stream);
      },
      py::kw_only(), py::arg("topk_idx"), py::arg("idx_is_64"), py::arg("num_rows"), py::arg("num_topk"),
      py::arg("recv_count"), py::arg("num_experts"), py::arg("align"), py::arg("capacity"), py::arg("packed"),
      py::arg("num_out_rows"), py::arg("probs"), py::arg("pair_dest"), py::arg("src_row"), py::arg("out_probs"),
      py::arg("counts"), py::arg("tokens_per_expert"), py::arg("offsets"), py::arg("dropped"), py::arg("stream"),
      "Plan the expert-major permutation on the stream (see csrc/kernels/permute.h).");
  m.def(
      "gather_rows",
      [](intptr_t src, intptr_t row_map, int64_t num_out_rows, intptr_t bound, int64_t row_bytes, intptr_t out,
         intptr_t stream) {
        require(row_map, num_out_rows > 0, "gather_rows: row_map");
        require(out, num_out_rows > 0, "gather_rows: out");
        k::gather_rows(src, row_map, num_out_rows, bound, row_bytes, out, stream);
      },
      py::kw_only(), py::arg("src"), py::arg("row_map"), py::arg("num_out_rows"), py::arg("bound") = 0,
      py::arg("row_bytes"), py::arg("out"), py::arg("stream"),
      "out[o] = src[row_map[o]] (zero row where row_map[o] < 0); rows at or past *bound (a device int32, "
      "0 = none) are not written.");
  m.def(
      "reduce_rows",
      [](intptr_t src, intptr_t pair_dest, int num_rows, int num_topk, int64_t hidden, int dtype, intptr_t out,
         intptr_t src_probs, intptr_t out_probs, intptr_t stream) {
        require(pair_dest, num_rows > 0, "reduce_rows: pair_dest");
        require(out, num_rows > 0, "reduce_rows: out");
        k::reduce_rows(src, pair_dest, num_rows, num_topk, hidden, dtype, out, src_probs, out_probs, stream);
      },
      py::kw_only(), py::arg("src"), py::arg("pair_dest"), py::arg("num_rows"), py::arg("num_topk"),
      py::arg("hidden"), py::arg("dtype"), py::arg("out"), py::arg("src_probs"), py::arg("out_probs"),
      py::arg("stream"),
      "out[i] = fp32 sum of src[pair_dest[i, k]] in slot order, cast to dtype (0 bf16, 1 fp16, 2 fp32).");
  m.def(
      "quantize_fp8",
      [](intptr_t x, int dtype, int64_t rows, int64_t hidden, intptr_t out, intptr_t scales, intptr_t stream) {
        require(x, rows > 0, "quantize_fp8: x");
        require(out, rows > 0, "quantize_fp8: out");
        require(scales, rows > 0, "quantize_fp8: scales");
        k::quantize_fp8(x, dtype, rows, hidden, out, scales, stream);
      },
      py::kw_only(), py::arg("x"), py::arg("dtype"), py::arg("rows"), py::arg("hidden"), py::arg("out"),
      py::arg("scales"), py::arg("stream"),
      "E4M3 codes and float32 scales per 128 channels of x (dtype 0 bf16, 1 fp16, 2 fp32; "
      "csrc/kernels/fp8.h).");
  m.def(
      "dequantize_fp8",
      [](intptr_t x, intptr_t scales, int64_t rows, int64_t hidden, int dtype, intptr_t bound, intptr_t out,
         intptr_t stream) {
        require(x, rows > 0, "dequantize_fp8: x");
        require(scales, rows > 0, "dequantize_fp8: scales");
        require(out, rows > 0, "dequantize_fp8: out");
        k::dequantize_fp8(x, scales, rows, hidden, dtype, bound, out, stream);
      },
      py::kw_only(), py::arg("x"), py::arg("scales"), py::arg("rows"), py::arg("hidden"), py::arg("dtype"),
      py::arg("bound") = 0, py::arg("out"), py::arg("stream"),
      "e4m3 * scale per 128 channels, rounded once to dtype; rows at or past *bound (a device int32, 0 = none) "
      "are not written (fp8.h).");
  m.def(
      "glu_probs_forward",
      [](intptr_t h, intptr_t probs, intptr_t bound, int64_t rows, int64_t ffn, intptr_t out, intptr_t stream) {
        require(h, rows > 0, "glu_probs_forward: h");
        require(probs, rows > 0, "glu_probs_forward: probs");
        require(out, rows > 0, "glu_probs_forward: out");
        k::glu_probs_forward(h, probs, bound, rows, ffn, out, stream);
      },
      py::kw_only(), py::arg("h"), py::arg("probs"), py::arg("bound"), py::arg("rows"), py::arg("ffn"),
      py::arg("out"), py::arg("stream"),
      "out = bf16(bf16(bf16(silu(gate)) * linear) * probs) of bf16 h [rows, 2 * ffn]; rows at or past "
      "*bound are zero (csrc/kernels/glu.h).");
  m.def(
      "glu_probs_backward",
      [](intptr_t grad_out, intptr_t h, intptr_t probs, intptr_t bound, int64_t rows, int64_t ffn, intptr_t grad_h,
         intptr_t grad_probs, intptr_t stream) {
        require(grad_out, rows > 0, "glu_probs_backward: grad_out");
        require(h, rows > 0, "glu_probs_backward: h");
        require(probs, rows > 0, "glu_probs_backward: probs");
        require(grad_h, rows > 0, "glu_probs_backward: grad_h");
        require(grad_probs, rows > 0, "glu_probs_backward: grad_probs");
        k::glu_probs_backward(grad_out, h, probs, bound, rows, ffn, grad_h, grad_probs, stream);
      },
      py::kw_only(), py::arg("grad_out"), py::arg("h"), py::arg("probs"), py::arg("bound"), py::arg("rows"),
      py::arg("ffn"), py::arg("grad_h"), py::arg("grad_probs"), py::arg("stream"),
      "Gradients of glu_probs_forward for h and probs (csrc/kernels/glu.h).");
#endif
}

}  // namespace uccl_ep::bindings

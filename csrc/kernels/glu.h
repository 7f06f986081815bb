// The routed experts' SwiGLU times the routing probability, as TorchGroupedMLP's unfused torch
// ops compute it (token_dispatcher/grouped_experts.py), in one pass each way: bf16 rows h
// [rows, 2F] (gate half first), float32 probs [rows] -> out [rows, F] with
//   out = bf16(float(bf16(bf16(silu(gate)) * linear)) * p),
// each product and the SiLU in float32 and rounded to bf16 where the torch ops round, and the
// gradients of that chain. Rows at or past *bound (a device int32: the grouped GEMMs' last
// offset; null: none) are padding, which no grouped GEMM reads: they are neither read nor
// written, in the outputs or the gradients. Host launch functions: raw device pointers
// (16-byte aligned, F % 8 == 0), sizes and a stream.
#pragma once

#include <cstdint>

namespace uccl_ep::kernels {

void glu_probs_forward(intptr_t h, intptr_t probs, intptr_t bound, int64_t rows, int64_t ffn, intptr_t out,
                       intptr_t stream);

// grad_out [rows, F] bf16 -> grad_h [rows, 2F] bf16 and grad_probs [rows] float32 (the sum over
// the row of grad_out * bf16(bf16(silu(gate)) * linear), in float32).
void glu_probs_backward(intptr_t grad_out, intptr_t h, intptr_t probs, intptr_t bound, int64_t rows, int64_t ffn,
                        intptr_t grad_h, intptr_t grad_probs, intptr_t stream);

}  // namespace uccl_ep::kernels

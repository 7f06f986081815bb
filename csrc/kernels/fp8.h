// FP8 rows as DeepSeek-V3 dispatches them: E4M3 values with one float32 scale per 128 channels
// (amax = max |x| of the block, floored at 1e-4; x is sent as e4m3(x * (448 * (1 / amax))) with
// scale = amax * fl(1 / 448), each operation rounded once in float32; x ~= e4m3 * scale). Host launch
// functions: raw device pointers, sizes and a stream. Results equal torch's ops of
// token_dispatcher/fp8.py (`quantize_reference`, `dequantize_reference`) bit for bit: the same
// float32 operations, each rounded once (fp8_bits.h for the E4M3 rounding). Elements 16-byte
// aligned and codes 8-byte aligned move as vectors; other alignments one element at a time.
#pragma once

#include <cstdint>

namespace uccl_ep::kernels {

// x [rows, hidden] of `dtype` (0 bf16, 1 fp16, 2 fp32; any alignment) -> out [rows, hidden]
// E4M3 codes (4-byte aligned) and scales [rows, hidden / 128] float32. hidden % 128 == 0.
void quantize_fp8(intptr_t x, int dtype, int64_t rows, int64_t hidden, intptr_t out, intptr_t scales,
                  intptr_t stream);

// x [rows, hidden] E4M3 codes (4-byte aligned) and scales [rows, hidden / 128] float32 -> out
// [rows, hidden] of `dtype`: e4m3 * scale in float32, rounded once to dtype. `bound`: an int32
// [1] device pointer (a sync-free dispatch's received row count) or 0; rows at or past *bound
// are not written.
void dequantize_fp8(intptr_t x, intptr_t scales, int64_t rows, int64_t hidden, int dtype, intptr_t bound,
                    intptr_t out, intptr_t stream);

}  // namespace uccl_ep::kernels

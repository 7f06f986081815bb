// Fused permute / unpermute between dispatch's receive layout and the expert-major layout that
// Megatron's experts consume. Host launch functions: raw device pointers, sizes and a stream.
//
// Receive layout: rows [N, H], local expert ids [N, K] (-1 = none), rows at index >= *recv_count
// are padding (sync-free dispatch) and take part in nothing.
// Expert-major layout: one segment per local expert in expert order, tokens inside a segment in
// receive order, each (token, expert) pair once; exact mode pads each segment with zero rows to
// a multiple of `align`, capacity mode gives every segment exactly `capacity` rows (pairs past it
// are dropped and counted). Every output row is written by exactly one thread, and every reduced
// row is summed in top-k slot order, so results are bitwise deterministic.
#pragma once

#include <cstdint>

namespace uccl_ep::kernels {

// Plans the permutation (two launches; no host sync):
//   pair_dest [N*K] int32: output row of each pair, -1 for none / padding / dropped;
//   src_row [num_out_rows] int32: received row of each output row, -1 for padding;
//   out_probs [num_out_rows] fp32 (optional): probs[pair] at its output row, 0 on padding;
//   counts [L] int32: routed pairs per local expert (before capacity);
//   tokens_per_expert [L] int32: rows per segment (aligned counts, or `capacity`; `packed`
//     capacity mode: the kept pairs aligned, at most `capacity`, segments back to back and
//     the rows past the last one padding);
//   offsets [L + 1] int32: segment starts (offsets[L]: the end of the last segment);
//   dropped int64 [1]: incremented by the pairs that got no row (accumulates across calls).
// `recv_count` is an int32 [1] device pointer or 0 (all N rows valid). `capacity` 0 = exact:
// with the host's sizes num_out_rows is their sum; `packed` with capacity 0 is the bounded
// layout, where the host knows only a bound (num_out_rows) and the segments are the aligned
// counts back to back. Segments never extend past num_out_rows; pairs that would are dropped.
void permute_plan(intptr_t topk_idx, bool idx_is_64, int num_rows, int num_topk, intptr_t recv_count,
                  int num_experts, int align, int capacity, bool packed, int64_t num_out_rows, intptr_t probs,
                  intptr_t pair_dest, intptr_t src_row, intptr_t out_probs, intptr_t counts,
                  intptr_t tokens_per_expert, intptr_t offsets, intptr_t dropped, intptr_t stream);

// out[o] = src[row_map[o]], zero where row_map[o] < 0 (bytes copied as they are). `bound`: an
// int32 [1] device pointer (a packed plan's offsets[L]) or 0; rows at or past *bound are left
// as they are, not written.
void gather_rows(intptr_t src, intptr_t row_map, int64_t num_out_rows, intptr_t bound, int64_t row_bytes,
                 intptr_t out, intptr_t stream);

// out[i] = sum over k in slot order of src[pair_dest[i*K + k]] (skipping -1), accumulated in fp32
// and cast to `dtype` (0 bf16, 1 fp16, 2 fp32). With `src_probs`/`out_probs` (both or neither):
// out_probs[i*K + k] = src_probs[pair_dest[i*K + k]], 0 where -1.
void reduce_rows(intptr_t src, intptr_t pair_dest, int num_rows, int num_topk, int64_t hidden, int dtype,
                 intptr_t out, intptr_t src_probs, intptr_t out_probs, intptr_t stream);

}  // namespace uccl_ep::kernels

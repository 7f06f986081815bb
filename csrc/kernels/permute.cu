// Fused permute / unpermute (see permute.h). Three kernels:
//   rank:   one block per local expert walks the pairs in receive order and numbers its own
//           pairs (a block-wide scan per tile), so the order inside a segment is the receive
//           order without sorting and without atomics;
//   place:  segment starts from the counts (redundantly per block: L is small), then each pair
//           gets its output row; block 0 publishes offsets, segment sizes and the drop count;
//   gather / reduce: row copies by output row, and fp32 sums by received row in slot order.
#include "kernels/common.cuh"
#include "kernels/permute.h"

namespace uccl_ep::kernels {
namespace {

constexpr int kRankThreads = 1024;
constexpr int kRowThreads = 256;
constexpr int kMaxGridBlocks = 4096;
// Counts of one row fit in 6 bits (num_topk <= 32 < 64).
constexpr int kCountBits = 6;
constexpr int kPermuteMaxExperts = 4096;  // place's shared memory: (2L + 1) ints

__device__ __forceinline__ int64_t load_id(const void* idx, bool is_64, int64_t i) {
  return is_64 ? static_cast<const int64_t*>(idx)[i] : static_cast<int64_t>(static_cast<const int32_t*>(idx)[i]);
}

__device__ __forceinline__ int valid_rows(const int* recv_count, int num_rows) {
  if (recv_count == nullptr) return num_rows;
  const int n = *recv_count;
  return n < 0 ? 0 : (n > num_rows ? num_rows : n);
}

__global__ void __launch_bounds__(kRankThreads)
    rank_kernel(const void* idx, bool is_64, int num_rows, int num_topk, const int* recv_count, int num_experts,
                int* pair_dest, int* counts) {
  __shared__ int s_warp[kRankThreads / dev::kWarpSize];
  __shared__ int s_tile_total;
  const int expert = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  const int n_warps = blockDim.x / dev::kWarpSize;
  const int n_valid = valid_rows(recv_count, num_rows);
  int base = 0;
  for (int tile = 0; tile < num_rows; tile += blockDim.x) {
    const int row = tile + tid;
    int mine = 0;
    if (row < num_rows) {
      for (int k = 0; k < num_topk; ++k) {
        const int64_t p = static_cast<int64_t>(row) * num_topk + k;
        const int64_t e = load_id(idx, is_64, p);
        const bool valid = row < n_valid && e >= 0 && e < num_experts;
        if (valid && e == expert) {
          ++mine;
        } else if (expert == 0 && !valid) {
          pair_dest[p] = -1;  // a pair no expert block claims: block 0 marks it
        }
      }
    }
    // Exclusive prefix of `mine` inside the warp, one ballot per bit of the count.
    int prefix = 0, warp_total = 0;
    for (int b = 0; b < kCountBits; ++b) {
      const lane_mask_t m = dev::warp_ballot((mine >> b) & 1);
      prefix += dev::popc_mask(m & dev::lanemask_lt()) << b;
      warp_total += dev::popc_mask(m) << b;
    }
    if (lane == 0) s_warp[warp] = warp_total;
    __syncthreads();
    if (tid == 0) {
      int run = 0;
      for (int w = 0; w < n_warps; ++w) {
        const int v = s_warp[w];
        s_warp[w] = run;
        run += v;
      }
      s_tile_total = run;
    }
    __syncthreads();
    if (mine > 0) {
      int next = base + s_warp[warp] + prefix;
      for (int k = 0; k < num_topk; ++k) {
        const int64_t p = static_cast<int64_t>(row) * num_topk + k;
        if (load_id(idx, is_64, p) == expert) pair_dest[p] = next++;  // rank inside the segment
      }
    }
    base += s_tile_total;
    __syncthreads();  // s_warp is rewritten by the next tile
  }
  if (tid == 0) counts[expert] = base;
}

__global__ void __launch_bounds__(kRowThreads)
    place_kernel(const void* idx, bool is_64, int num_rows, int num_topk, int num_experts, int align, int capacity,
                 bool packed, int64_t num_out_rows, const float* probs, int* pair_dest, int* src_row, float* out_probs,
                 const int* counts, int* tokens_per_expert, int* offsets, int64_t* dropped) {
  extern __shared__ int s_off[];  // [L + 1] segment starts
  if (threadIdx.x == 0) {
    int64_t off = 0, lost = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int64_t cnt = counts[e];
      const int64_t aligned = (cnt + align - 1) / align * align;
      // Packed capacity mode: a segment holds its kept pairs (capacity is a multiple of align).
      const int64_t rows = capacity <= 0 ? aligned : (packed && aligned < capacity ? aligned : capacity);
      // Segments end at num_out_rows at the latest, so the sizes and offsets never point past
      // the rows (a bound too small, or host sizes that disagree with the ids, lose pairs).
      const int64_t start = off < num_out_rows ? off : num_out_rows;
      const int64_t end = off + rows < num_out_rows ? off + rows : num_out_rows;
      s_off[e] = static_cast<int>(start);
      if (capacity > 0) {
        lost += cnt > capacity ? cnt - capacity : 0;
      } else {
        // Exact mode and the bounded packed layout: pairs past num_out_rows are lost (none
        // unless the host sizes or the bound disagree with the ids).
        const int64_t over = off + cnt - num_out_rows;
        lost += over <= 0 ? 0 : (over < cnt ? over : cnt);
      }
      if (blockIdx.x == 0) tokens_per_expert[e] = static_cast<int>(end - start);
      off += rows;
    }
    s_off[num_experts] = static_cast<int>(off < num_out_rows ? off : num_out_rows);
    if (blockIdx.x == 0) {
      for (int e = 0; e <= num_experts; ++e) offsets[e] = s_off[e];
      if (lost > 0) atomicAdd(reinterpret_cast<unsigned long long*>(dropped), static_cast<unsigned long long>(lost));
    }
  }
  __syncthreads();
  const int64_t num_pairs = static_cast<int64_t>(num_rows) * num_topk;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < num_pairs;
       p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = pair_dest[p];
    if (r < 0) continue;
    const int e = static_cast<int>(load_id(idx, is_64, p));
    int64_t dest = -1;
    if (capacity > 0) {
      if (r < capacity) dest = s_off[e] + r;
    } else if (s_off[e] + static_cast<int64_t>(r) < num_out_rows) {
      dest = s_off[e] + r;
    }
    pair_dest[p] = static_cast<int>(dest);
    if (dest < 0) continue;
    src_row[dest] = static_cast<int>(p / num_topk);
    if (out_probs != nullptr) out_probs[dest] = probs[p];
  }
}

template <typename V>
__global__ void __launch_bounds__(kRowThreads)
    gather_kernel(const V* src, const int* row_map, int64_t num_out_rows, const int* bound, int64_t row_vecs,
                  V* out) {
  const int lane = threadIdx.x % dev::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / dev::kWarpSize);
  // Packed layouts: rows at or past *bound (the last segment's end) are not written.
  int64_t live = num_out_rows;
  if (bound != nullptr) {
    const int64_t b = *bound;
    live = b < 0 ? 0 : (b < num_out_rows ? b : num_out_rows);
  }
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * (blockDim.x / dev::kWarpSize) + threadIdx.x / dev::kWarpSize;
       o < live; o += warps) {
    const int s = row_map[o];
    V* dst = out + o * row_vecs;
    if (s < 0) {
      for (int64_t j = lane; j < row_vecs; j += dev::kWarpSize) dst[j] = V{};
    } else {
      const V* from = src + static_cast<int64_t>(s) * row_vecs;
      for (int64_t j = lane; j < row_vecs; j += dev::kWarpSize) dst[j] = from[j];
    }
  }
}

// kVec: rows move as 16-byte vectors of raw elements (hidden and pointers allow it).
template <int kDtype, bool kVec>
__global__ void __launch_bounds__(kRowThreads)
    reduce_kernel(const void* src, const int* pair_dest, int num_rows, int num_topk, int64_t hidden, void* out,
                  const float* src_probs, float* out_probs) {
  using E = Elt<kDtype>;
  using raw = typename E::raw;
  constexpr int kPer = kVec ? static_cast<int>(16 / sizeof(raw)) : 1;
  const int lane = threadIdx.x % dev::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / dev::kWarpSize);
  const raw* in = static_cast<const raw*>(src);
  raw* dst = static_cast<raw*>(out);
  const int64_t chunks = hidden / kPer;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * (blockDim.x / dev::kWarpSize) + threadIdx.x / dev::kWarpSize;
       i < num_rows; i += warps) {
    const int* pd = pair_dest + i * num_topk;
    if (out_probs != nullptr && lane < num_topk) {
      const int d = pd[lane];
      out_probs[i * num_topk + lane] = d >= 0 ? src_probs[d] : 0.0f;
    }
    for (int64_t c = lane; c < chunks; c += dev::kWarpSize) {
      float acc[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[j] = 0.0f;
      for (int k = 0; k < num_topk; ++k) {
        const int d = pd[k];
        if (d < 0) continue;
        alignas(16) raw v[kPer];
        if constexpr (kVec) {
          *reinterpret_cast<uint4*>(v) = reinterpret_cast<const uint4*>(in + static_cast<int64_t>(d) * hidden)[c];
        } else {
          v[0] = in[static_cast<int64_t>(d) * hidden + c];
        }
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc[j] += E::to_f(v[j]);
      }
      alignas(16) raw o[kPer];
#pragma unroll
      for (int j = 0; j < kPer; ++j) o[j] = E::from_f(acc[j]);
      if constexpr (kVec) {
        reinterpret_cast<uint4*>(dst + i * hidden)[c] = *reinterpret_cast<const uint4*>(o);
      } else {
        dst[i * hidden + c] = o[0];
      }
    }
  }
}

int row_blocks(int64_t rows) {
  const int64_t per_block = kRowThreads / dev::kWarpSize;
  const int64_t blocks = (rows + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

template <typename V>
void launch_gather(intptr_t src, intptr_t row_map, int64_t rows, intptr_t bound, int64_t row_bytes, intptr_t out,
                   gpuStream_t s) {
  gather_kernel<V><<<row_blocks(rows), kRowThreads, 0, s>>>(
      reinterpret_cast<const V*>(src), reinterpret_cast<const int*>(row_map), rows, reinterpret_cast<const int*>(bound),
      row_bytes / static_cast<int64_t>(sizeof(V)), reinterpret_cast<V*>(out));
}

template <int kDtype>
void launch_reduce(intptr_t src, intptr_t pair_dest, int rows, int topk, int64_t hidden, intptr_t out,
                   intptr_t src_probs, intptr_t out_probs, gpuStream_t s) {
  using raw = typename Elt<kDtype>::raw;
  const bool vec = (hidden * static_cast<int64_t>(sizeof(raw))) % 16 == 0 && src % 16 == 0 && out % 16 == 0;
  auto args = [&](auto kernel) {
    kernel<<<row_blocks(rows), kRowThreads, 0, s>>>(
        reinterpret_cast<const void*>(src), reinterpret_cast<const int*>(pair_dest), rows, topk, hidden,
        reinterpret_cast<void*>(out), reinterpret_cast<const float*>(src_probs), reinterpret_cast<float*>(out_probs));
  };
  if (vec) {
    args(reduce_kernel<kDtype, true>);
  } else {
    args(reduce_kernel<kDtype, false>);
  }
}

}  // namespace

void permute_plan(intptr_t topk_idx, bool idx_is_64, int num_rows, int num_topk, intptr_t recv_count,
                  int num_experts, int align, int capacity, bool packed, int64_t num_out_rows, intptr_t probs,
                  intptr_t pair_dest, intptr_t src_row, intptr_t out_probs, intptr_t counts,
                  intptr_t tokens_per_expert, intptr_t offsets, intptr_t dropped, intptr_t stream) {
  UCCL_EP_CHECK_ARG(num_rows >= 0 && num_topk >= 1 && num_topk < (1 << kCountBits),
                    "permute_plan: num_rows=", num_rows, " num_topk=", num_topk, " (num_topk must be in 1..63)");
  UCCL_EP_CHECK_ARG(num_experts >= 1 && num_experts <= kPermuteMaxExperts, "permute_plan: num_experts=", num_experts,
                    " must be in 1..", kPermuteMaxExperts);
  UCCL_EP_CHECK_ARG(align >= 1 && capacity >= 0 && num_out_rows >= 0 && num_out_rows < (int64_t{1} << 31),
                    "permute_plan: align=", align, " capacity=", capacity, " num_out_rows=", num_out_rows);
  UCCL_EP_CHECK_ARG(capacity == 0 || num_out_rows == static_cast<int64_t>(capacity) * num_experts,
                    "permute_plan: capacity mode needs num_out_rows = capacity x experts, got ", num_out_rows,
                    " for capacity=", capacity, " x ", num_experts);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  if (num_out_rows > 0) {
    GPU_CHECK(gpuMemsetAsync(reinterpret_cast<void*>(src_row), 0xff, sizeof(int) * num_out_rows, s));
    if (out_probs != 0) GPU_CHECK(gpuMemsetAsync(reinterpret_cast<void*>(out_probs), 0, sizeof(float) * num_out_rows, s));
  }
  rank_kernel<<<num_experts, kRankThreads, 0, s>>>(reinterpret_cast<const void*>(topk_idx), idx_is_64, num_rows,
                                                   num_topk, reinterpret_cast<const int*>(recv_count), num_experts,
                                                   reinterpret_cast<int*>(pair_dest), reinterpret_cast<int*>(counts));
  GPU_CHECK(gpuGetLastError());
  const int64_t pairs = static_cast<int64_t>(num_rows) * num_topk;
  int64_t blocks = (pairs + kRowThreads - 1) / kRowThreads;
  blocks = blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks);
  place_kernel<<<static_cast<int>(blocks), kRowThreads, sizeof(int) * (num_experts + 1), s>>>(
      reinterpret_cast<const void*>(topk_idx), idx_is_64, num_rows, num_topk, num_experts, align, capacity, packed,
      num_out_rows, reinterpret_cast<const float*>(probs), reinterpret_cast<int*>(pair_dest),
      reinterpret_cast<int*>(src_row), reinterpret_cast<float*>(out_probs), reinterpret_cast<const int*>(counts),
      reinterpret_cast<int*>(tokens_per_expert), reinterpret_cast<int*>(offsets), reinterpret_cast<int64_t*>(dropped));
  GPU_CHECK(gpuGetLastError());
}

void gather_rows(intptr_t src, intptr_t row_map, int64_t num_out_rows, intptr_t bound, int64_t row_bytes,
                 intptr_t out, intptr_t stream) {
  UCCL_EP_CHECK_ARG(num_out_rows >= 0 && row_bytes > 0, "gather_rows: num_out_rows=", num_out_rows,
                    " row_bytes=", row_bytes);
  if (num_out_rows == 0) return;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const auto aligned = [&](int64_t a) { return row_bytes % a == 0 && src % a == 0 && out % a == 0; };
  if (aligned(16)) {
    launch_gather<uint4>(src, row_map, num_out_rows, bound, row_bytes, out, s);
  } else if (aligned(4)) {
    launch_gather<uint32_t>(src, row_map, num_out_rows, bound, row_bytes, out, s);
  } else if (aligned(2)) {
    launch_gather<uint16_t>(src, row_map, num_out_rows, bound, row_bytes, out, s);
  } else {
    launch_gather<uint8_t>(src, row_map, num_out_rows, bound, row_bytes, out, s);
  }
  GPU_CHECK(gpuGetLastError());
}

void reduce_rows(intptr_t src, intptr_t pair_dest, int num_rows, int num_topk, int64_t hidden, int dtype,
                 intptr_t out, intptr_t src_probs, intptr_t out_probs, intptr_t stream) {
  UCCL_EP_CHECK_ARG(num_rows >= 0 && num_topk >= 1 && num_topk <= dev::kWarpSize && hidden > 0,
                    "reduce_rows: num_rows=", num_rows, " num_topk=", num_topk, " hidden=", hidden);
  UCCL_EP_CHECK_ARG((src_probs == 0) == (out_probs == 0), "reduce_rows: pass src_probs and out_probs together");
  if (num_rows == 0) return;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  switch (dtype) {
    case 0:
      launch_reduce<0>(src, pair_dest, num_rows, num_topk, hidden, out, src_probs, out_probs, s);
      break;
    case 1:
      launch_reduce<1>(src, pair_dest, num_rows, num_topk, hidden, out, src_probs, out_probs, s);
      break;
    case 2:
      launch_reduce<2>(src, pair_dest, num_rows, num_topk, hidden, out, src_probs, out_probs, s);
      break;
    default:
      UCCL_EP_THROW(InvalidArgument, "reduce_rows: dtype code ", dtype, " must be 0 (bf16), 1 (fp16) or 2 (fp32)");
  }
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

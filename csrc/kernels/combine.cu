// Intranode combine: push (entry barrier, then every received row goes back to its source
// rank's staging, ordered by expert rank and position) and reduce (barrier, then each token
// sums its rows in rank order in fp32; rows this rank kept for itself are read in place).
#include <algorithm>

#include "kernels/common.cuh"

namespace uccl_ep::kernels {
namespace {

constexpr int kPushThreads = 512;
constexpr int kReduceThreads = 512;

struct CombineLayout {
  int64_t x, w, end;
};

CombineLayout combine_layout(int64_t rows, int64_t row_bytes, int num_topk) {
  CombineLayout l;
  l.x = static_cast<int64_t>(kDataOffset);
  l.w = align_up(l.x + rows * row_bytes, 256);
  l.end = align_up(l.w + rows * num_topk * 4, 256);
  return l;
}

struct PushParams {
  Peers bufs;
  int rank, num_ranks;
  const uint8_t* x;
  int64_t row_bytes;
  const float* w;
  bool has_w;
  int num_topk;
  const int* prefix;  // device [R, R] rank prefix matrix of the dispatch
  int64_t staging_rows;
  int64_t w_offset;
  StatusRef status;
  int64_t timeout_ns;
  int64_t header;
};

// rows[s][j] of the dispatch: rows rank j received from rank s.
__device__ __forceinline__ int sent_rows(const int* prefix, int R, int s, int j) {
  return prefix[s * R + j] - (s > 0 ? prefix[(s - 1) * R + j] : 0);
}

template <typename V, int kUnroll, bool kTma>
__global__ void __launch_bounds__(kPushThreads) push_kernel(PushParams p) {
  // Offsets from the device matrix (no host copy needed): my rows from source s, and the first
  // row of my region in s's staging (regions ordered by expert rank, mine after lower ranks').
  __shared__ int s_recv_begin[kMaxRanks + 1];
  __shared__ int s_dst_off[kMaxRanks];
  __shared__ int s_overflow;
  __shared__ uint64_t s_seq;
  const int R = p.num_ranks;
  if (threadIdx.x == 0) s_seq = *seq_counter(p.bufs.p[p.rank]) + 1;
  if (threadIdx.x <= R) s_recv_begin[threadIdx.x] = threadIdx.x > 0 ? p.prefix[(threadIdx.x - 1) * R + p.rank] : 0;
  if (threadIdx.x < R) {
    const int s = threadIdx.x;
    int off = 0;
    for (int j = 0; j < p.rank; ++j)
      if (j != s) off += sent_rows(p.prefix, R, s, j);
    s_dst_off[s] = off;
  }
  if (threadIdx.x == 0) {
    // Every rank holds the same matrix, so all find the same overflow and all skip.
    s_overflow = -1;
    for (int s = 0; s < R && s_overflow < 0; ++s) {
      int64_t rows = 0;
      for (int j = 0; j < R; ++j)
        if (j != s) rows += sent_rows(p.prefix, R, s, j);
      if (rows > p.staging_rows) {
        s_overflow = s;
        if (blockIdx.x == 0) record_status(p.status, kStatusCombineOverflow, s, rows, p.staging_rows);
      }
    }
  }
  __syncthreads();
  if (!barrier_block(p.bufs, p.rank, R, s_seq, blockIdx.x == 0, p.status, p.timeout_ns, kSiteCombineEntry,
                     BarrierExtras{true, kCombineHeaderOffset, p.header}))
    return;
  if (s_overflow >= 0) return;
  const int num_recv = s_recv_begin[R];
  const int lane = threadIdx.x % dev::kWarpSize;
  const int warps = blockDim.x / dev::kWarpSize;
  const int nwarps = gridDim.x * warps;
#if UCCL_EP_HAS_TMA
  extern __shared__ __align__(128) uint8_t s_tma[];
  __shared__ uint64_t s_bar[kPushThreads / dev::kWarpSize * kTmaStages];
  TmaPipe pipe;
  if constexpr (kTma) {
    // The rows from one source are contiguous here and in its staging: one byte range per
    // source, its pieces spread over every warp of the grid and pipelined across sources.
    const int warp = threadIdx.x / dev::kWarpSize;
    pipe.init(s_tma + warp * kTmaStages * kTmaChunk, s_bar + warp * kTmaStages, lane);
    for (int s = 0; s < R; ++s) {
      if (s == p.rank) continue;  // the source reads rows it kept for itself in place
      pipe.push_range(p.x + static_cast<int64_t>(s_recv_begin[s]) * p.row_bytes,
                      p.bufs.p[s] + kDataOffset + static_cast<int64_t>(s_dst_off[s]) * p.row_bytes,
                      static_cast<int64_t>(s_recv_begin[s + 1] - s_recv_begin[s]) * p.row_bytes,
                      static_cast<int64_t>(blockIdx.x) * warps + warp, nwarps);
    }
  }
#endif
  // Rows (ld/st path) and their top-k weights, a warp per row.
  for (int i = blockIdx.x * warps + threadIdx.x / dev::kWarpSize; i < num_recv && (!kTma || p.has_w); i += nwarps) {
    int s = 0;
    while (s + 1 < R && s_recv_begin[s + 1] <= i) ++s;
    if (s == p.rank) continue;  // the source reads rows it kept for itself in place
    const int64_t drow = s_dst_off[s] + (i - s_recv_begin[s]);
    uint8_t* base = p.bufs.p[s];
    if constexpr (!kTma) {
      copy_row<V, kUnroll>(p.x + static_cast<int64_t>(i) * p.row_bytes, p.row_bytes,
                           base + kDataOffset + drow * p.row_bytes, lane);
    }
    if (p.has_w) {
      float* dw = reinterpret_cast<float*>(base + p.w_offset);
      for (int k = lane; k < p.num_topk; k += dev::kWarpSize)
        dw[drow * p.num_topk + k] = p.w[static_cast<int64_t>(i) * p.num_topk + k];
    }
  }
#if UCCL_EP_HAS_TMA
  if constexpr (kTma) pipe.drain();  // the stores read shared memory until they are done
#endif
}

struct ReduceParams {
  Peers bufs;
  int rank, num_ranks, num_tokens, num_topk;
  int64_t row_bytes;
  const uint8_t* x;  // local combine input (rows this rank received)
  const float* w;
  const int* send_pos;
  const int* prefix;           // device [R, R] rank prefix matrix of the dispatch
  const uint8_t* st_x;
  const float* st_w;
  const uint8_t* bias0;
  const uint8_t* bias1;
  uint8_t* out;
  float* out_w;
  StatusRef status;
  int64_t timeout_ns;
};

// kRanks bounds the rank loop (2 for EP2, else kMaxRanks) so the per-source load arrays stay
// in registers: more loads in flight per warp is what a local reduce needs.
template <int kDtype, bool kVec, int kUnroll, int kRanks>
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(ReduceParams p) {
  using E = Elt<kDtype>;
  using raw = typename E::raw;
  constexpr int kPerVec = kVec ? 16 / static_cast<int>(sizeof(raw)) : 1;
  using V = typename std::conditional<kVec, int4, raw>::type;
  // First row of each expert rank's rows in my staging (own rows: in my receive layout).
  __shared__ int s_src_off[kMaxRanks];
  __shared__ uint64_t s_seq;
  const int R = p.num_ranks;
  if (threadIdx.x == 0) {
    s_seq = *seq_counter(p.bufs.p[p.rank]) + 2;
    int off = 0;
    for (int r = 0; r < R; ++r) {
      s_src_off[r] = off;
      if (r != p.rank) off += sent_rows(p.prefix, R, p.rank, r);
    }
    s_src_off[p.rank] = p.rank > 0 ? p.prefix[(p.rank - 1) * R + p.rank] : 0;
  }
  __syncthreads();
  const uint64_t seq = s_seq;
  // A failed barrier skips the rows (the loop starts past the end) but still counts the block
  // below, so the sequence advances the same on every rank whatever happened.
  const bool ok = barrier_block(p.bufs, p.rank, p.num_ranks, seq, blockIdx.x == 0, p.status, p.timeout_ns,
                                kSiteCombineDone, BarrierExtras{true});
  const int lane = threadIdx.x % dev::kWarpSize;
  const int warps = blockDim.x / dev::kWarpSize;
  const int nwarps = gridDim.x * warps;
  const int64_t n = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const int t0 = ok ? static_cast<int>(blockIdx.x) * warps + static_cast<int>(threadIdx.x) / dev::kWarpSize
                    : p.num_tokens;
  for (int t = t0; t < p.num_tokens; t += nwarps) {
    const uint8_t* src[kRanks];
    const float* srcw[kRanks];
    unsigned mask = 0;
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      src[r] = nullptr;
      srcw[r] = nullptr;
      if (r < R) {
        const int pos = p.send_pos[static_cast<int64_t>(t) * R + r];
        if (pos >= 0) {
          mask |= 1u << r;
          const int64_t row = s_src_off[r] + pos;
          src[r] = (r == p.rank ? p.x : p.st_x) + row * p.row_bytes;
          // Decide by the output: this rank's own weight tensor is empty (null) when it
          // received nothing, yet peers still return weights for its tokens.
          if (p.out_w != nullptr) srcw[r] = (r == p.rank ? p.w : p.st_w) + row * p.num_topk;
        }
      }
    }
    for (int64_t base = 0; base < n; base += kUnroll * dev::kWarpSize) {
      V v[kRanks][kUnroll];
#pragma unroll
      for (int r = 0; r < kRanks; ++r) {
        if (mask >> r & 1u) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t i = base + u * dev::kWarpSize + lane;
            if (i < n) v[r][u] = dev::ld_stream(reinterpret_cast<const V*>(src[r]) + i);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * dev::kWarpSize + lane;
        if (i >= n) continue;
        float acc[kPerVec];
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) acc[e] = 0.0f;
#pragma unroll
        for (int r = 0; r < kRanks; ++r) {
          if (mask >> r & 1u) {
            const raw* vals = reinterpret_cast<const raw*>(&v[r][u]);
#pragma unroll
            for (int e = 0; e < kPerVec; ++e) acc[e] += E::to_f(vals[e]);
          }
        }
        const uint8_t* biases[2] = {p.bias0, p.bias1};
#pragma unroll
        for (int b = 0; b < 2; ++b) {
          if (biases[b] != nullptr) {
            const V bv = reinterpret_cast<const V*>(biases[b] + static_cast<int64_t>(t) * p.row_bytes)[i];
            const raw* vals = reinterpret_cast<const raw*>(&bv);
#pragma unroll
            for (int e = 0; e < kPerVec; ++e) acc[e] += E::to_f(vals[e]);
          }
        }
        V o;
        raw* ov = reinterpret_cast<raw*>(&o);
#pragma unroll
        for (int e = 0; e < kPerVec; ++e) ov[e] = E::from_f(acc[e]);
        reinterpret_cast<V*>(p.out + static_cast<int64_t>(t) * p.row_bytes)[i] = o;
      }
    }
    if (p.out_w != nullptr) {
      for (int k = lane; k < p.num_topk; k += dev::kWarpSize) {
        float acc = 0.0f;
#pragma unroll
        for (int r = 0; r < kRanks; ++r)
          if (mask >> r & 1u) acc += srcw[r][k];
        p.out_w[static_cast<int64_t>(t) * p.num_topk + k] = acc;
      }
    }
  }
  // Every block read the sequence before its CTA barrier above; the last one to get here
  // advances it past this combine's two barriers, for the next call on this stream.
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* done = seq_done_blocks(p.bufs.p[p.rank]);
    if (atomicAdd(done, 1u) == gridDim.x - 1) {
      *done = 0;
      *seq_counter(p.bufs.p[p.rank]) = seq;
      __threadfence();
    }
  }
}

struct HostPlan {
  Peers peers;
  int64_t staging_rows;
};

HostPlan plan(const CombineArgs& a) {
  UCCL_EP_CHECK_ARG(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks, "num_ranks=", a.num_ranks, " is outside 1..",
                    kMaxRanks);
  UCCL_EP_CHECK_ARG(static_cast<int>(a.buffers.size()) == a.num_ranks, "got ", a.buffers.size(), " buffers for ",
                    a.num_ranks, " ranks");
  UCCL_EP_CHECK_ARG(a.rank_prefix_matrix != 0, "rank_prefix_matrix is a null pointer");
  UCCL_EP_CHECK_ARG(a.staging_rows >= 0, "staging_rows=", a.staging_rows, " must be non-negative");
  UCCL_EP_CHECK_ARG(a.dtype >= 0 && a.dtype <= 2, "combine dtype code ", a.dtype, " is not bf16/fp16/fp32");
  UCCL_EP_CHECK_ARG(a.num_topk <= kMaxTopk, "num_topk=", a.num_topk, " exceeds ", kMaxTopk);
  HostPlan h{};
  const int R = a.num_ranks;
  for (int r = 0; r < R; ++r) h.peers.p[r] = reinterpret_cast<uint8_t*>(a.buffers[r]);
  h.staging_rows = a.staging_rows;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * (a.dtype == 2 ? 4 : 2);
  const int64_t need = combine_layout(h.staging_rows, row_bytes, a.num_topk).end;
  UCCL_EP_CHECK_ARG(need <= a.buffer_bytes, "combine staging needs ", need, " bytes but the buffer has ",
                    a.buffer_bytes);
  return h;
}

}  // namespace

int64_t combine_staging_bytes(int64_t rows, int64_t row_bytes, int num_topk) {
  return combine_layout(rows, row_bytes, num_topk).end;
}

void intranode_combine_push(const CombineArgs& a, intptr_t stream) {
  const HostPlan h = plan(a);
  const int R = a.num_ranks;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * (a.dtype == 2 ? 4 : 2);
  PushParams p{};
  p.bufs = h.peers;
  p.rank = a.rank;
  p.num_ranks = R;
  p.x = reinterpret_cast<const uint8_t*>(a.x);
  p.row_bytes = row_bytes;
  p.w = reinterpret_cast<const float*>(a.topk_weights);
  p.has_w = a.num_topk > 0 && a.topk_weights != 0;
  p.num_topk = a.num_topk;
  p.prefix = reinterpret_cast<const int*>(a.rank_prefix_matrix);
  p.staging_rows = h.staging_rows;
  p.w_offset = combine_layout(h.staging_rows, row_bytes, a.num_topk).w;
  p.status = status_ref(a.status);
  p.timeout_ns = a.timeout_ns;
  p.header = a.header;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const int blocks = std::max(1, a.num_sms);
  const bool vec = row_bytes % 16 == 0 && a.x % 16 == 0;
  if (vec && a.use_tma && tma_supported()) {
#if defined(UCCL_EP_DEVICE_CUDA)
    constexpr int smem = tma_smem_bytes(kPushThreads / dev::kWarpSize);
    GPU_CHECK(cudaFuncSetAttribute(push_kernel<int4, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    push_kernel<int4, 8, true><<<blocks, kPushThreads, smem, s>>>(p);
#endif
  } else if (vec) {
    push_kernel<int4, 8, false><<<blocks, kPushThreads, 0, s>>>(p);
  } else {
    push_kernel<uint8_t, 8, false><<<blocks, kPushThreads, 0, s>>>(p);
  }
  GPU_CHECK(gpuGetLastError());
}

void intranode_combine_reduce(const CombineArgs& a, intptr_t stream) {
  const HostPlan h = plan(a);
  const int R = a.num_ranks;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * (a.dtype == 2 ? 4 : 2);
  const CombineLayout l = combine_layout(h.staging_rows, row_bytes, a.num_topk);
  ReduceParams p{};
  p.bufs = h.peers;
  p.rank = a.rank;
  p.num_ranks = R;
  p.num_tokens = a.num_tokens;
  p.num_topk = a.num_topk;
  p.row_bytes = row_bytes;
  p.x = reinterpret_cast<const uint8_t*>(a.x);
  p.w = reinterpret_cast<const float*>(a.topk_weights);
  p.send_pos = reinterpret_cast<const int*>(a.send_pos);
  p.prefix = reinterpret_cast<const int*>(a.rank_prefix_matrix);
  p.st_x = h.peers.p[a.rank] + l.x;
  p.st_w = reinterpret_cast<const float*>(h.peers.p[a.rank] + l.w);
  p.bias0 = reinterpret_cast<const uint8_t*>(a.bias0);
  p.bias1 = reinterpret_cast<const uint8_t*>(a.bias1);
  p.out = reinterpret_cast<uint8_t*>(a.out);
  p.out_w = reinterpret_cast<float*>(a.out_weights);
  p.status = status_ref(a.status);
  p.timeout_ns = a.timeout_ns;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const int blocks = std::max(1, a.num_sms);
  const bool vec = row_bytes % 16 == 0 && a.x % 16 == 0 && a.out % 16 == 0 && a.bias0 % 16 == 0 && a.bias1 % 16 == 0;
#define UCCL_EP_LAUNCH_REDUCE(DT)                                                    \
  do {                                                                               \
    if (vec && R <= 2) {                                                             \
      reduce_kernel<DT, true, 4, 2><<<blocks, kReduceThreads, 0, s>>>(p);            \
    } else if (vec) {                                                                \
      reduce_kernel<DT, true, 2, kMaxRanks><<<blocks, kReduceThreads, 0, s>>>(p);    \
    } else {                                                                         \
      reduce_kernel<DT, false, 2, kMaxRanks><<<blocks, kReduceThreads, 0, s>>>(p);   \
    }                                                                                \
  } while (0)
  if (a.dtype == 0) {
    UCCL_EP_LAUNCH_REDUCE(0);
  } else if (a.dtype == 1) {
    UCCL_EP_LAUNCH_REDUCE(1);
  } else {
    UCCL_EP_LAUNCH_REDUCE(2);
  }
#undef UCCL_EP_LAUNCH_REDUCE
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

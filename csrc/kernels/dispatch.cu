// Intranode dispatch: notify (count exchange, entry barrier, send positions), then one
// pipelined kernel: sender blocks write each row once to every destination at its final row
// index (own rows straight into the outputs, peer rows into the peer's staging) and publish
// per-chunk progress; receiver blocks copy landed peer chunks into the fresh outputs.
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"

namespace uccl_ep::kernels {

// Byte offsets of the per-call staging sub-regions (identical on every rank for one call).
struct StagingLayout {
  int64_t x, scales, idx, w, src, end;
};

StagingLayout dispatch_staging_layout(int64_t rows, int64_t row_bytes, int num_scales, int num_topk, int idx_size) {
  StagingLayout l;
  l.x = static_cast<int64_t>(kDataOffset);
  l.scales = align_up(l.x + rows * row_bytes, 256);
  l.idx = align_up(l.scales + rows * num_scales * 4, 256);
  l.w = align_up(l.idx + rows * num_topk * idx_size, 256);
  l.src = align_up(l.w + rows * num_topk * 4, 256);
  l.end = align_up(l.src + rows * 4, 256);
  return l;
}

namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kNotifyWarps = kNotifyThreads / dev::kWarpSize;
constexpr int kSendThreads = 512;
constexpr int kSendWarps = kSendThreads / dev::kWarpSize;

// send_pos[t][r] = position of token t among the tokens sent to rank r (an exclusive scan of
// column r of is_token_in_rank), -1 where not sent; one block, tile by tile with warp ballots.
__device__ void scan_send_pos(const bool* in_rank, int num_tokens, int R, int* send_pos) {
  __shared__ int s_running[kMaxRanks];
  __shared__ int s_warp[kNotifyWarps][kMaxRanks];
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  if (tid < kMaxRanks) s_running[tid] = 0;
  __syncthreads();
  for (int tile = 0; tile < num_tokens; tile += blockDim.x) {
    const int t = tile + tid;
    const bool valid = t < num_tokens;
    bool flag[kMaxRanks];
    int lane_pos[kMaxRanks];
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      flag[r] = valid && r < R && in_rank[static_cast<int64_t>(t) * R + r];
      const lane_mask_t b = dev::warp_ballot(flag[r]);
      lane_pos[r] = dev::popc_mask(b & dev::lanemask_lt());
      if (lane == 0) s_warp[warp][r] = dev::popc_mask(b);
    }
    __syncthreads();
    if (tid < R) {
      int running = s_running[tid];
      for (int w = 0; w < kNotifyWarps; ++w) {
        const int v = s_warp[w][tid];
        s_warp[w][tid] = running;
        running += v;
      }
      s_running[tid] = running;
    }
    __syncthreads();
    if (valid) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r)
        if (r < R) send_pos[static_cast<int64_t>(t) * R + r] = flag[r] ? s_warp[warp][r] + lane_pos[r] : -1;
    }
    __syncthreads();
  }
}

// The control slot (kNotifySlots) of the notify with sequence `seq`, and its arrays there.
__device__ __forceinline__ int notify_slot(uint64_t seq) { return static_cast<int>(seq % kNotifySlots); }
__device__ __forceinline__ int* tokens_of(uint8_t* buf, int slot) {
  return reinterpret_cast<int*>(buf + kTokensOffset) + slot * kMaxRanks;
}
__device__ __forceinline__ int* counts_of(uint8_t* buf, int slot) {
  return reinterpret_cast<int*>(buf + kCountsOffset) + slot * kMaxRanks * kMaxRanks;
}
__device__ __forceinline__ int* expert_counts_of(uint8_t* buf, int slot) {
  return reinterpret_cast<int*>(buf + kExpertCountsOffset) + static_cast<int64_t>(slot) * kMaxRanks * kMaxLocalExperts;
}

__device__ __forceinline__ int64_t* id_bounds_of(uint8_t* buf, int slot) {
  return reinterpret_cast<int64_t*>(buf + kIdBoundsOffset) + slot * kMaxRanks * kCheckWords;
}

// Sync-free mode: the first bad input of any rank, judged from data every rank holds alike
// (each rank's checks and the whole count matrix), so every rank records the same error and
// skips the same data movement; nothing reaches the host until its next call reads the word.
// Order: call headers, expert ids of ranks 0..R-1, then layouts, then received row counts.
__device__ void record_input_error(const volatile int64_t* checks, const int* counts_raw, int R, int worst,
                                   int num_experts, const StatusRef& status) {
  const volatile int* counts = counts_raw;
  int64_t code = 0, who = 0, value = 0, extra = 0;
  // Ranks that disagree on the call (packed header, word 5) first: their other checks and
  // counts mean different things.
  for (int r = 1; r < R && code == 0; ++r) {
    if (checks[r * kCheckWords + 5] != checks[5]) code = kStatusHeaderMismatch, who = r, value = 0, extra = 0;
  }
  for (int r = 0; r < R && code == 0; ++r) {
    const int64_t lo = checks[r * kCheckWords], hi = checks[r * kCheckWords + 1];
    if (num_experts > 0 && (lo < -1 || hi >= num_experts)) {
      code = kStatusBadExpertId, who = r, value = lo < -1 ? lo : hi, extra = num_experts;
    }
  }
  for (int r = 0; r < R && code == 0; ++r) {
    const int64_t dest = checks[r * kCheckWords + 2];
    if (dest >= 0) {
      code = kStatusLayoutMismatch, who = r, value = dest;
      extra = (checks[r * kCheckWords + 3] << 32) | (checks[r * kCheckWords + 4] & 0xFFFFFFFFll);
    }
  }
  for (int j = 0; j < R && code == 0; ++j) {
    int64_t rows = 0;
    for (int s = 0; s < R; ++s) rows += counts[s * kMaxRanks + j];
    if (rows > worst) code = kStatusDispatchOverflow, who = j, value = rows, extra = worst;
  }
  if (code != 0) record_status(status, code, who, value, extra);
}

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(Peers bufs, int rank, int num_ranks,
                                                                const int* per_rank, const int* per_expert,
                                                                int experts_per_rank, int alignment,
                                                                int* prefix_out, int* info, StatusRef status,
                                                                int64_t timeout_ns, const bool* in_rank,
                                                                int num_tokens, int* send_pos,
                                                                const void* topk_idx, bool idx_is_64, int num_topk,
                                                                int64_t* out_bounds,
                                                                int num_worst_tokens, int num_experts,
                                                                int64_t header) {
  const int tid = threadIdx.x;
  const int R = num_ranks;
  __shared__ uint64_t s_seq;
  if (tid == 0) {
    // One block: every thread reads s_seq below, so storing the new value now is safe.
    uint64_t* c = seq_counter(bufs.p[rank]);
    s_seq = *c + 1;
    *c = s_seq;
  }
  __syncthreads();
  const uint64_t seq = s_seq;
  const int slot = notify_slot(seq);
  // Tokens is_token_in_rank sends to each rank; the outputs are sized from num_tokens_per_rank,
  // so the two must agree. Before the barrier (a few microseconds for T*R flags), so every rank
  // learns of a mismatch with the counts.
  __shared__ int s_sent[kMaxRanks];
  if (tid < kMaxRanks) s_sent[tid] = 0;
  __syncthreads();
  if (send_pos != nullptr) {
    int local[kMaxRanks] = {};
    for (int t = tid; t < num_tokens; t += blockDim.x) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r)
        if (r < R) local[r] += in_rank[static_cast<int64_t>(t) * R + r] ? 1 : 0;
    }
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r)
      if (r < R && local[r] != 0) atomicAdd(&s_sent[r], local[r]);
  }
  // The id range, reduced over the block (a tree: the barrier below waits for it).
  __shared__ int64_t s_lo[kNotifyThreads], s_hi[kNotifyThreads];
  if (topk_idx != nullptr) {
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    const int64_t n = static_cast<int64_t>(num_tokens) * num_topk;
    for (int64_t i = tid; i < n; i += blockDim.x) {
      const int64_t e = idx_is_64 ? static_cast<const int64_t*>(topk_idx)[i]
                                  : static_cast<int64_t>(static_cast<const int32_t*>(topk_idx)[i]);
      lo = e < lo ? e : lo;
      hi = e > hi ? e : hi;
    }
    s_lo[tid] = lo;
    s_hi[tid] = hi;
    __syncthreads();
    for (int stride = kNotifyThreads / 2; stride > 0; stride >>= 1) {
      if (tid < stride) {
        s_lo[tid] = s_lo[tid + stride] < s_lo[tid] ? s_lo[tid + stride] : s_lo[tid];
        s_hi[tid] = s_hi[tid + stride] > s_hi[tid] ? s_hi[tid + stride] : s_hi[tid];
      }
      __syncthreads();
    }
  }
  __syncthreads();
  if (tid < R) {
    tokens_of(bufs.p[tid], slot)[rank] = num_tokens;
    int bad = -1;
    for (int r = 0; send_pos != nullptr && r < R && bad < 0; ++r)
      if (s_sent[r] != per_rank[r]) bad = r;
    int64_t* b = id_bounds_of(bufs.p[tid], slot) + kCheckWords * rank;
    // No ids (or none to check): (-1, -1), which every check accepts.
    const bool ids = topk_idx != nullptr && num_tokens > 0 && num_topk > 0;
    b[0] = ids ? s_lo[0] : -1;
    b[1] = ids ? s_hi[0] : -1;
    b[2] = bad;
    b[3] = bad >= 0 ? per_rank[bad] : 0;
    b[4] = bad >= 0 ? s_sent[bad] : 0;
    b[5] = header;
  }
  // My row of the count matrix goes to every rank, so each rank sees the whole matrix.
  for (int i = tid; i < R * R; i += blockDim.x) {
    const int r = i / R, j = i % R;
    counts_of(bufs.p[r], slot)[rank * kMaxRanks + j] = per_rank[j];
  }
  if (per_expert != nullptr) {
    for (int i = tid; i < R * experts_per_rank; i += blockDim.x) {
      const int r = i / experts_per_rank, e = i % experts_per_rank;
      expert_counts_of(bufs.p[r], slot)[rank * kMaxLocalExperts + e] = per_expert[r * experts_per_rank + e];
    }
  }
  // A cached dispatch reads nothing back: its header is compared here, on the GPU (the header
  // slot by sequence parity, like the counts).
  const size_t header_offset =
      send_pos == nullptr && header != 0 ? kCachedHeaderOffset + 8ull * kMaxRanks * slot : 0;
  if (!barrier_block(bufs, rank, R, seq, true, status, timeout_ns, kSiteNotify,
                     BarrierExtras{true, header_offset, header}))
    return;
  if (out_bounds != nullptr && tid < kCheckWords * R)
    out_bounds[tid] = reinterpret_cast<const volatile int64_t*>(id_bounds_of(bufs.p[rank], slot))[tid];
  if (num_worst_tokens > 0 && tid == 0)
    record_input_error(reinterpret_cast<const volatile int64_t*>(id_bounds_of(bufs.p[rank], slot)),
                       counts_of(bufs.p[rank], slot), R, num_worst_tokens, num_experts, status);
  // After the barrier, so the scan (a few microseconds) never delays a peer's wait.
  if (send_pos != nullptr) scan_send_pos(in_rank, num_tokens, R, send_pos);

  // Control data is read through volatile loads: peers wrote it, no L1 line may serve it.
  const volatile int* counts = counts_of(bufs.p[rank], slot);
  for (int i = tid; i < R * R; i += blockDim.x) {
    const int s = i / R, j = i % R;
    int sum = 0;
    for (int s2 = 0; s2 <= s; ++s2) sum += counts[s2 * kMaxRanks + j];
    prefix_out[i] = sum;
    info[i] = sum;
  }
  if (per_expert != nullptr) {
    const volatile int* ec = expert_counts_of(bufs.p[rank], slot);
    for (int e = tid; e < experts_per_rank; e += blockDim.x) {
      int sum = 0;
      for (int s = 0; s < R; ++s) sum += ec[s * kMaxLocalExperts + e];
      info[R * R + e] = (sum + alignment - 1) / alignment * alignment;
    }
  }
}

// Per-destination bases of the five row arrays: own outputs for d == rank, peer staging else.
struct RowPtrs {
  uint8_t* x[kMaxRanks];
  float* scales[kMaxRanks];
  uint8_t* idx[kMaxRanks];
  float* w[kMaxRanks];
  int* src[kMaxRanks];
};

struct SendParams {
  Peers bufs;
  RowPtrs dst;
  int rank, num_ranks, num_tokens, experts_per_rank;
  const uint8_t* x;
  int64_t row_bytes;
  const float* scales;
  int num_scales;
  const void* topk_idx;
  bool idx_is_64;
  const float* topk_weights;
  int num_topk;
  const int* prefix;
  const int* send_pos;
  int num_send_blocks;
  // Receive side: own staging (local) and outputs.
  const uint8_t* st_x;
  const float* st_scales;
  const uint8_t* st_idx;
  const float* st_w;
  const int* st_src;
  uint8_t* out_x;
  float* out_scales;
  uint8_t* out_idx;
  float* out_w;
  int* out_src;
  int idx_size;
  int num_out_rows;
  StatusRef status;
  int64_t timeout_ns;
};

__host__ __device__ inline int chunk_tokens(int num_tokens) {
  const int per = (num_tokens + kMaxChunks - 1) / kMaxChunks;
  return per > 64 ? per : 64;
}

__device__ __forceinline__ uint64_t* chunk_flag(uint8_t* buf, int src, int chunk) {
  return reinterpret_cast<uint64_t*>(buf + kChunkFlagsOffset) + static_cast<int64_t>(src) * kMaxChunks + chunk;
}

__device__ __forceinline__ uint64_t pack_chunk(uint64_t seq, int first, int rows) {
  return ((seq & 0xFFFFFFull) << 40) | (static_cast<uint64_t>(first) << 20) | static_cast<uint64_t>(rows);
}

// Sender blocks [0, num_send_blocks) take chunks of consecutive tokens round-robin; each warp
// sends whole tokens (row read once, written to every destination at its final row), then
// the chunk's row range is published to each peer with one release store. Receiver blocks
// copy each peer's chunks out of staging as they land, so the local copy hides under the
// NVLink transfer instead of following it.
template <typename V, int kUnroll, bool kTma>
__global__ void __launch_bounds__(kSendThreads) dispatch_kernel(SendParams p) {
  __shared__ int s_prefix_row[kMaxRanks];  // rows rank r receives from ranks before mine
  __shared__ int s_recv_begin[kMaxRanks + 1];  // my rows from source s: [s_recv_begin[s], [s+1])
  __shared__ int s_failed;
  __shared__ uint64_t s_flag;
  __shared__ uint64_t s_seq;  // this dispatch's notify sequence (tags the chunk flags)
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  const int R = p.num_ranks;
  if (tid == 0) s_seq = *seq_counter(p.bufs.p[p.rank]);
  if (tid == 0) s_failed = status_set(p.status) ? 1 : 0;
  if (tid < R) s_prefix_row[tid] = p.rank > 0 ? p.prefix[(p.rank - 1) * R + tid] : 0;
  // From the device matrix notify wrote, so sync-free calls need no host copy of it.
  if (tid <= R) s_recv_begin[tid] = tid > 0 ? p.prefix[(tid - 1) * R + p.rank] : 0;
  __syncthreads();
  if (s_failed) return;
  const uint64_t seq = s_seq;
#if UCCL_EP_HAS_TMA
  // Sender blocks push rows through it, receiver blocks copy landed chunks out with it.
  extern __shared__ __align__(128) uint8_t s_tma[];
  __shared__ uint64_t s_bar[kSendWarps * kTmaStages];
  TmaPipe pipe;
  if constexpr (kTma) pipe.init(s_tma + warp * kTmaStages * kTmaChunk, s_bar + warp * kTmaStages, lane);
#endif

  if (static_cast<int>(blockIdx.x) < p.num_send_blocks) {
    // ---------------------------------------------------------------- sender
    const int ct = chunk_tokens(p.num_tokens);
    const int nchunks = (p.num_tokens + ct - 1) / ct;
    for (int c = blockIdx.x; c < nchunks; c += p.num_send_blocks) {
      const int t_begin = c * ct, t_end = min(p.num_tokens, t_begin + ct);
      for (int t = t_begin + warp; t < t_end; t += kSendWarps) {
        unsigned mask = 0;
        int row[kMaxRanks];
        uint8_t* dst_x[kMaxRanks];
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
          row[r] = 0;
          dst_x[r] = nullptr;
          if (r < R) {
            const int pos = p.send_pos[static_cast<int64_t>(t) * R + r];
            if (pos >= 0) {
              mask |= 1u << r;
              row[r] = s_prefix_row[r] + pos;
              dst_x[r] = p.dst.x[r] + static_cast<int64_t>(row[r]) * p.row_bytes;
            }
          }
        }
        if (mask == 0) continue;
        if constexpr (kTma) {
#if UCCL_EP_HAS_TMA
          pipe.push_row(p.x + static_cast<int64_t>(t) * p.row_bytes, p.row_bytes, dst_x, mask);
#endif
        } else {
          copy_row_multi<V, kUnroll>(p.x + static_cast<int64_t>(t) * p.row_bytes, p.row_bytes, dst_x, mask, lane);
        }
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
          if (!(mask >> r & 1u)) continue;
          const int64_t drow = row[r];
          for (int s = lane; s < p.num_scales; s += dev::kWarpSize)
            p.dst.scales[r][drow * p.num_scales + s] = p.scales[static_cast<int64_t>(t) * p.num_scales + s];
          if (p.dst.src[r] != nullptr && lane == 0) p.dst.src[r][drow] = t;
          if (p.topk_idx != nullptr) {
            for (int k = lane; k < p.num_topk; k += dev::kWarpSize) {
              const int64_t i = static_cast<int64_t>(t) * p.num_topk + k;
              const int64_t e = p.idx_is_64 ? static_cast<const int64_t*>(p.topk_idx)[i]
                                            : static_cast<int64_t>(static_cast<const int32_t*>(p.topk_idx)[i]);
              const int64_t local = e - static_cast<int64_t>(r) * p.experts_per_rank;
              const bool mine = e >= 0 && local >= 0 && local < p.experts_per_rank;
              const int64_t o = drow * p.num_topk + k;
              if (p.idx_is_64) {
                reinterpret_cast<int64_t*>(p.dst.idx[r])[o] = mine ? local : -1;
              } else {
                reinterpret_cast<int32_t*>(p.dst.idx[r])[o] = mine ? static_cast<int32_t>(local) : -1;
              }
              p.dst.w[r][o] = mine ? p.topk_weights[i] : 0.0f;
            }
          }
        }
      }
#if UCCL_EP_HAS_TMA
      if constexpr (kTma) pipe.drain();  // this warp's bulk stores of the chunk have landed
#endif
      __syncthreads();
      // Publish the chunk's rows to each peer: one system fence (cumulative over the block's
      // stores, ordered by the barrier above) and one release store per peer. A token's
      // position among the rows sent to r grows with t, so the chunk's range is given by its
      // first and last token bound to r: scan in from both ends (usually one load each)
      // instead of walking all of the chunk's tokens while the block waits.
      if (tid < R && tid != p.rank) {
        const int r = tid;
        int first = -1, last = -1;
        for (int t = t_begin; t < t_end && first < 0; ++t) first = p.send_pos[static_cast<int64_t>(t) * R + r];
        for (int t = t_end - 1; first >= 0 && last < 0; --t) last = p.send_pos[static_cast<int64_t>(t) * R + r];
        dev::fence_system();
        dev::st_release_sys(chunk_flag(p.bufs.p[r], p.rank, c),
                            pack_chunk(seq, first < 0 ? 0 : first, first < 0 ? 0 : last - first + 1));
      }
    }
    return;
  }

  // ------------------------------------------------------------------ receiver
  const int j = blockIdx.x - p.num_send_blocks;
  const int nrecv = gridDim.x - p.num_send_blocks;
  const int warps = blockDim.x / dev::kWarpSize;
  const int meta_idx_words = p.num_topk * p.idx_size / 4;
  const volatile int* src_tokens = tokens_of(p.bufs.p[p.rank], notify_slot(seq));
  for (int s = 0; s < R; ++s) {
    if (s == p.rank) continue;
    const int ts = src_tokens[s];
    const int ct = chunk_tokens(ts);
    const int nchunks = (ts + ct - 1) / ct;
    for (int c = j; c < nchunks; c += nrecv) {
      if (tid == 0) {
        const uint64_t* f = chunk_flag(p.bufs.p[p.rank], s, c);
        const uint64_t start = dev::global_timer_ns();
        uint64_t v = dev::ld_acquire_sys(f);
        uint32_t iter = 0;
        while ((v >> 40) != (seq & 0xFFFFFFull)) {
          if ((++iter & 1023u) == 0 && status_set(p.status)) {
            s_failed = 1;
            break;
          }
          if (dev::global_timer_ns() - start > static_cast<uint64_t>(p.timeout_ns)) {
            record_status(p.status, kStatusTimeout, s, static_cast<int64_t>(seq), kSiteDispatchDone);
            s_failed = 1;
            break;
          }
          v = dev::ld_acquire_sys(f);
        }
        s_flag = v;
      }
      __syncthreads();
      if (s_failed) {
#if UCCL_EP_HAS_TMA
        if constexpr (kTma) pipe.drain();  // the stores read shared memory until they are done
#endif
        return;
      }
      const uint64_t v = s_flag;
      const int first = static_cast<int>((v >> 20) & 0xFFFFFu), rows = static_cast<int>(v & 0xFFFFFu);
      const int64_t base = s_recv_begin[s] + first;
#if UCCL_EP_HAS_TMA
      if constexpr (kTma) {
        // The chunk's rows are contiguous in staging and in the outputs: one byte range, its
        // pieces spread over the block's warps and pipelined with the previous chunks'.
        dev::fence_proxy_async();  // the bulk loads below come after the acquire above
        pipe.push_range(p.st_x + base * p.row_bytes, p.out_x + base * p.row_bytes, rows * p.row_bytes, warp, warps);
      }
#endif
      for (int i = warp; i < rows; i += warps) {
        const int64_t r = base + i;
        if constexpr (!kTma) {
          const int64_t n = p.row_bytes / static_cast<int64_t>(sizeof(V));
          const V* src = reinterpret_cast<const V*>(p.st_x + r * p.row_bytes);
          V* dst = reinterpret_cast<V*>(p.out_x + r * p.row_bytes);
          for (int64_t b0 = 0; b0 < n; b0 += kUnroll * dev::kWarpSize) {
            V vv[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int64_t q = b0 + u * dev::kWarpSize + lane;
              if (q < n) vv[u] = dev::ld_cg(src + q);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
              const int64_t q = b0 + u * dev::kWarpSize + lane;
              if (q < n) dst[q] = vv[u];
            }
          }
        }
        for (int k = lane; k < p.num_scales; k += dev::kWarpSize)
          p.out_scales[r * p.num_scales + k] = dev::ld_cg(p.st_scales + r * p.num_scales + k);
        if (p.out_idx != nullptr) {
          for (int k = lane; k < meta_idx_words; k += dev::kWarpSize)
            reinterpret_cast<int*>(p.out_idx)[r * meta_idx_words + k] =
                dev::ld_cg(reinterpret_cast<const int*>(p.st_idx) + r * meta_idx_words + k);
          for (int k = lane; k < p.num_topk; k += dev::kWarpSize)
            p.out_w[r * p.num_topk + k] = dev::ld_cg(p.st_w + r * p.num_topk + k);
        }
        if (p.out_src != nullptr && lane == 0) p.out_src[r] = dev::ld_cg(p.st_src + r);
      }
      __syncthreads();  // s_flag is rewritten for the next chunk
    }
  }
  // num_worst_tokens padding: ids -1, weights 0, source index -1. The rows and their scales are
  // left unwritten (DeepEP's contract: unspecified): at 8 ranks zeroing them was ~1.2 GB of
  // HBM writes per call across the GPU.
  for (int64_t r = s_recv_begin[R] + static_cast<int64_t>(j) * warps + warp; r < p.num_out_rows;
       r += static_cast<int64_t>(nrecv) * warps) {
    if (p.out_idx != nullptr) {
      for (int k = lane; k < meta_idx_words; k += dev::kWarpSize)
        reinterpret_cast<int*>(p.out_idx)[r * meta_idx_words + k] = -1;  // all-ones: -1 as int32 and int64
      for (int k = lane; k < p.num_topk; k += dev::kWarpSize) p.out_w[r * p.num_topk + k] = 0.0f;
    }
    if (p.out_src != nullptr && lane == 0) p.out_src[r] = -1;
  }
#if UCCL_EP_HAS_TMA
  if constexpr (kTma) pipe.drain();  // the stores read shared memory until they are done
#endif
}

Peers make_peers(const std::vector<intptr_t>& buffers, int num_ranks) {
  UCCL_EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks=", num_ranks,
                    " is outside 1..", kMaxRanks, " (the intranode kernels serve one node)");
  UCCL_EP_CHECK_ARG(static_cast<int>(buffers.size()) == num_ranks, "got ", buffers.size(), " buffers for ",
                    num_ranks, " ranks");
  Peers p{};
  for (int r = 0; r < num_ranks; ++r) p.p[r] = reinterpret_cast<uint8_t*>(buffers[r]);
  return p;
}

bool aligned16(intptr_t v) { return v % 16 == 0; }

}  // namespace

// Bulk copies (TMA) exist on sm_90+ NVIDIA GPUs only.
bool tma_supported() {
#if defined(UCCL_EP_DEVICE_CUDA)
  int dev = 0, major = 0;
  GPU_CHECK(cudaGetDevice(&dev));
  GPU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major >= 9;
#else
  return false;
#endif
}

namespace {

// Receiver blocks copy the rows peers staged here into the outputs (read + write each row);
// sender blocks read each token once and write it to every destination. Split the SMs in
// proportion to those bytes, so neither side idles while the other finishes: with top-8 of 256
// experts that is ~40% receivers on 2 ranks but ~55% on 4, where the fixed third used before
// left the receivers with twice the bytes per SM of the senders (bench/NOTES.md).
// Without the counts on the host (sync-free mode) assume every token goes to every rank: that
// gives the same ~40% (2 ranks) / ~55% (4 ranks) split the measured top-8 of 256 workloads had.
int dispatch_recv_blocks(const DispatchArgs& a, int blocks) {
  if (a.num_ranks == 1) return 1;  // padding rows only
  const bool known = a.own_rows >= 0 && a.send_rows >= 0;
  const int64_t R = a.num_ranks;
  const int64_t remote = known ? a.num_recv - a.own_rows : static_cast<int64_t>(a.num_tokens) * (R - 1);
  const int64_t send = a.num_tokens + (known ? a.send_rows : static_cast<int64_t>(a.num_tokens) * R);
  const int64_t recv = 2 * remote;
  if (send + recv == 0) return 1;
  const int64_t share = (static_cast<int64_t>(blocks) * recv + (send + recv) / 2) / (send + recv);
  return static_cast<int>(std::min<int64_t>(blocks - 1, std::max<int64_t>(1, share)));
}

}  // namespace

void intranode_notify(const std::vector<intptr_t>& buffers, int rank, int num_ranks, intptr_t num_tokens_per_rank,
                      intptr_t num_tokens_per_expert, int experts_per_rank, int expert_alignment,
                      intptr_t rank_prefix_matrix, intptr_t out_info, intptr_t status, int64_t timeout_ns,
                      intptr_t is_token_in_rank, int num_tokens, intptr_t send_pos, intptr_t stream,
                      intptr_t topk_idx, bool idx_is_64, int num_topk, intptr_t out_bounds, int num_worst_tokens,
                      int num_experts, int64_t header) {
  const Peers peers = make_peers(buffers, num_ranks);
  UCCL_EP_CHECK_ARG(experts_per_rank <= kMaxLocalExperts, "experts_per_rank=", experts_per_rank,
                    " exceeds the kernels' limit of ", kMaxLocalExperts, " local experts");
  UCCL_EP_CHECK_ARG(expert_alignment >= 1, "expert_alignment=", expert_alignment, " must be >= 1");
  notify_kernel<<<1, kNotifyThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      peers, rank, num_ranks, reinterpret_cast<const int*>(num_tokens_per_rank),
      reinterpret_cast<const int*>(num_tokens_per_expert), experts_per_rank, expert_alignment,
      reinterpret_cast<int*>(rank_prefix_matrix), reinterpret_cast<int*>(out_info), status_ref(status),
      timeout_ns, reinterpret_cast<const bool*>(is_token_in_rank), num_tokens, reinterpret_cast<int*>(send_pos),
      reinterpret_cast<const void*>(topk_idx), idx_is_64, num_topk, reinterpret_cast<int64_t*>(out_bounds),
      num_worst_tokens, num_experts, header);
  GPU_CHECK(gpuGetLastError());
}

int64_t dispatch_staging_bytes(int64_t rows, int64_t row_bytes, int num_scales, int num_topk, int idx_size) {
  return dispatch_staging_layout(rows, row_bytes, num_scales, num_topk, idx_size).end;
}

static void check_dispatch_args(const DispatchArgs& a) {
  UCCL_EP_CHECK_ARG(a.num_topk <= kMaxTopk, "num_topk=", a.num_topk, " exceeds ", kMaxTopk);
  UCCL_EP_CHECK_ARG(a.num_sms >= 1, "num_sms=", a.num_sms, " must be positive");
  UCCL_EP_CHECK_ARG(a.num_recv <= a.staging_rows, "num_recv=", a.num_recv, " exceeds staging_rows=", a.staging_rows);
  UCCL_EP_CHECK_ARG(a.num_out_rows >= a.num_recv, "num_out_rows=", a.num_out_rows, " < num_recv=", a.num_recv);
  const int64_t need =
      dispatch_staging_bytes(a.staging_rows, a.row_bytes, a.num_scales, a.num_topk, a.idx_is_64 ? 8 : 4);
  UCCL_EP_CHECK_ARG(need <= a.buffer_bytes, "dispatch staging needs ", need, " bytes but the buffer has ",
                    a.buffer_bytes);
}

void intranode_dispatch(const DispatchArgs& a, intptr_t stream) {
  check_dispatch_args(a);
  UCCL_EP_CHECK_ARG(a.num_tokens < (1 << 20) && a.num_recv < (1 << 20), "num_tokens=", a.num_tokens,
                    " / num_recv=", a.num_recv, " must stay below 2^20 (chunk flags hold 20-bit rows)");
  const Peers peers = make_peers(a.buffers, a.num_ranks);
  const int idx_size = a.idx_is_64 ? 8 : 4;
  const StagingLayout l = dispatch_staging_layout(a.staging_rows, a.row_bytes, a.num_scales, a.num_topk, idx_size);
  SendParams p{};
  p.bufs = peers;
  for (int r = 0; r < a.num_ranks; ++r) {
    if (r == a.rank) {
      p.dst.x[r] = reinterpret_cast<uint8_t*>(a.recv_x);
      p.dst.scales[r] = reinterpret_cast<float*>(a.recv_scales);
      p.dst.idx[r] = reinterpret_cast<uint8_t*>(a.recv_topk_idx);
      p.dst.w[r] = reinterpret_cast<float*>(a.recv_topk_weights);
      p.dst.src[r] = a.cached ? nullptr : reinterpret_cast<int*>(a.recv_src_idx);
    } else {
      uint8_t* b = peers.p[r];
      p.dst.x[r] = b + l.x;
      p.dst.scales[r] = reinterpret_cast<float*>(b + l.scales);
      p.dst.idx[r] = b + l.idx;
      p.dst.w[r] = reinterpret_cast<float*>(b + l.w);
      // Cached dispatch reuses the handle's source indices; a rank receiving nothing still has
      // a null (empty) recv_src_idx, so decide by `cached`, not by the pointer.
      p.dst.src[r] = a.cached ? nullptr : reinterpret_cast<int*>(b + l.src);
    }
  }
  p.rank = a.rank;
  p.num_ranks = a.num_ranks;
  p.num_tokens = a.num_tokens;
  p.experts_per_rank = a.experts_per_rank;
  p.x = reinterpret_cast<const uint8_t*>(a.x);
  p.row_bytes = a.row_bytes;
  p.scales = reinterpret_cast<const float*>(a.x_scales);
  p.num_scales = a.num_scales;
  p.topk_idx = reinterpret_cast<const void*>(a.topk_idx);
  p.idx_is_64 = a.idx_is_64;
  p.topk_weights = reinterpret_cast<const float*>(a.topk_weights);
  p.num_topk = a.num_topk;
  p.prefix = reinterpret_cast<const int*>(a.rank_prefix_matrix);
  p.send_pos = reinterpret_cast<const int*>(a.send_pos);
  uint8_t* own = peers.p[a.rank];
  p.st_x = own + l.x;
  p.st_scales = reinterpret_cast<const float*>(own + l.scales);
  p.st_idx = own + l.idx;
  p.st_w = reinterpret_cast<const float*>(own + l.w);
  p.st_src = reinterpret_cast<const int*>(own + l.src);
  p.out_x = reinterpret_cast<uint8_t*>(a.recv_x);
  p.out_scales = reinterpret_cast<float*>(a.recv_scales);
  p.out_idx = reinterpret_cast<uint8_t*>(a.recv_topk_idx);
  p.out_w = reinterpret_cast<float*>(a.recv_topk_weights);
  p.out_src = a.cached ? nullptr : reinterpret_cast<int*>(a.recv_src_idx);
  p.idx_size = idx_size;
  p.num_out_rows = a.num_out_rows;
  p.status = status_ref(a.status);
  p.timeout_ns = a.timeout_ns;
  const int blocks = std::max(2, a.num_sms);
  p.num_send_blocks = blocks - dispatch_recv_blocks(a, blocks);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const bool vec = a.row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv_x);
  if (vec && a.use_tma && tma_supported()) {
#if defined(UCCL_EP_DEVICE_CUDA)
    constexpr int smem = tma_smem_bytes(kSendWarps);
    GPU_CHECK(cudaFuncSetAttribute(dispatch_kernel<int4, 8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    dispatch_kernel<int4, 8, true><<<blocks, kSendThreads, smem, s>>>(p);
#endif
  } else if (vec) {
    dispatch_kernel<int4, 8, false><<<blocks, kSendThreads, 0, s>>>(p);
  } else {
    dispatch_kernel<uint8_t, 8, false><<<blocks, kSendThreads, 0, s>>>(p);
  }
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

// Intranode dispatch (after notify, notify.cu): one pipelined kernel. Sender blocks write each
// row once to every destination at its final row index: own rows straight into the outputs,
// a peer's into its outputs in its receive arena when it receives zero-copy, else into its
// staging with per-chunk progress, which a staged rank's receiver blocks copy out as it lands.
#include <algorithm>
#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/dispatch_params.cuh"

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

using namespace dispatch_detail;  // NOLINT(build/namespaces): this file's own helpers

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

// This block's index among the kernel's data blocks, which follow notify's (p.notify_blocks),
// and their number: computed where used from blockIdx and the parameters, which holds no
// register (the 16-byte copy path sits at the 128-register cap).
__device__ __forceinline__ int data_block(const SendParams& p) {
  return static_cast<int>(blockIdx.x) - p.notify_blocks;
}
__device__ __forceinline__ int data_blocks(const SendParams& p) {
  return static_cast<int>(gridDim.x) - p.notify_blocks;
}

// Sender blocks [0, num_send_blocks) take chunks of consecutive tokens round-robin; each warp
// sends whole tokens (row read once, written to every destination at its final row), then
// the chunk's row range is published to each staged peer with one release store. Receiver
// blocks (staged rank only) copy each peer's chunks out of staging as they land, so the local
// copy hides under the NVLink transfer instead of following it. On a zero-copy rank all blocks
// send; the kernel ends once every peer's "done" arrived. When no peer is staged there is
// nothing to publish per chunk: the tokens are then dealt over all sender warps directly.
// Every exit is block-wide (after a barrier on a shared flag), so dispatch_kernel's end runs
// with all of a block's threads. Its blocks are the grid's after notify's (p.notify_blocks).
template <typename V, int kUnroll, bool kTma>
__device__ __forceinline__ void dispatch_blocks(const SendParams& p) {
  __shared__ int s_prefix_row[kMaxRanks];  // rows rank r receives from ranks before mine
  __shared__ int s_recv_begin[kMaxRanks + 1];  // my rows from source s: [s_recv_begin[s], [s+1])
  __shared__ int s_failed;
  __shared__ uint64_t s_flag;
  __shared__ uint64_t s_seq;  // this dispatch's notify sequence (tags the chunk flags)
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  const int R = p.num_ranks;
  if (tid == 0) {
    s_seq = *seq_counter(p.bufs.p[p.rank]);
    s_failed = status_set(p.status) ? 1 : 0;
    // Launched before the host read the counts (launch-ahead): every rank judges the same
    // checks and count matrix alike and all skip the call, which the host then raises (a bad
    // input) or runs again with exact sizes (a rank receives more than num_out_rows).
    if (p.judge && !s_failed) {
      uint8_t* own = p.bufs.p[p.rank];
      const int slot = notify_slot(s_seq);
      s_failed = dispatch_verdict(id_bounds_of(own, slot), counts_of(own, slot), p.num_ranks, p.num_out_rows,
                                  p.num_experts)
                             .code != 0;
    }
  }
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

  publish_entry(p, seq, data_block(p));
  if (data_block(p) < p.num_send_blocks) {
    // ---------------------------------------------------------------- sender
    __shared__ RowPtrs s_dst;
    __shared__ unsigned s_zc;  // destinations receiving zero-copy
    if (tid == 0) s_zc = 0;
    __syncthreads();
    if (!load_entries(p, seq, s_dst, &s_zc)) s_failed = 1;
    __syncthreads();
    if (s_failed) return;
    const unsigned zc = s_zc;
    const int ct = chunk_tokens(p.num_tokens);
    const int nchunks = (p.num_tokens + ct - 1) / ct;
    // A token's metadata goes to every destination from registers, loaded before its row (one
    // load latency per token instead of one per destination and array): scales (<= two per
    // lane; more are read per destination), one top-k id and weight per lane.
    const int K = p.topk_idx != nullptr ? p.num_topk : 0;
    const int S = p.num_scales;
    const bool scales_in_regs = S > 0 && S <= 2 * dev::kWarpSize;
    // Sends tokens t_first, t_first + stride, ... below t_end (this warp's share).
    auto send_tokens = [&](int t_first, int t_end, int stride) {
      // Lane r < R holds the token's position among the rows sent to rank r (-1: not sent),
      // loaded a token ahead.
      int pos_next = -1;
      if (lane < R && t_first < t_end) pos_next = p.send_pos[static_cast<int64_t>(t_first) * R + lane];
      for (int t = t_first; t < t_end; t += stride) {
        const int pos = pos_next;
        const int t_next = t + stride;
        pos_next = lane < R && t_next < t_end ? p.send_pos[static_cast<int64_t>(t_next) * R + lane] : -1;
        const unsigned mask = static_cast<unsigned>(dev::warp_ballot(lane < R && pos >= 0)) & ((1u << R) - 1u);
        if (mask == 0) continue;
        float sc0 = 0.0f, sc1 = 0.0f;
        if (scales_in_regs) {
          const float* sc = p.scales + static_cast<int64_t>(t) * S;
          if (lane < S) sc0 = sc[lane];
          if (lane + dev::kWarpSize < S) sc1 = sc[lane + dev::kWarpSize];
        }
        int64_t e = -1;
        float wt = 0.0f;
        if (lane < K) {
          const int64_t i = static_cast<int64_t>(t) * K + lane;
          e = p.idx_is_64 ? static_cast<const int64_t*>(p.topk_idx)[i]
                          : static_cast<int64_t>(static_cast<const int32_t*>(p.topk_idx)[i]);
          wt = p.topk_weights[i];
        }
        int row[kMaxRanks];
        uint8_t* dst_x[kMaxRanks];
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
          row[r] = 0;
          dst_x[r] = nullptr;
          if (r < R) {
            const int pr = dev::warp_shfl(pos, r);  // R is warp-uniform: every lane takes part
            if (pr >= 0) {
              row[r] = s_prefix_row[r] + pr;
              dst_x[r] = s_dst.x[r] + static_cast<int64_t>(row[r]) * p.row_bytes;
            }
          }
        }
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
          if (scales_in_regs) {
            float* ds = s_dst.scales[r] + drow * S;
            if (lane < S) ds[lane] = sc0;
            if (lane + dev::kWarpSize < S) ds[lane + dev::kWarpSize] = sc1;
          } else {
            for (int s = lane; s < S; s += dev::kWarpSize)
              s_dst.scales[r][drow * S + s] = p.scales[static_cast<int64_t>(t) * S + s];
          }
          if (s_dst.src[r] != nullptr && lane == 0) s_dst.src[r][drow] = t;
          if (lane < K) {
            const int64_t local = e - static_cast<int64_t>(r) * p.experts_per_rank;
            const bool mine = e >= 0 && local >= 0 && local < p.experts_per_rank;
            const int64_t o = drow * K + lane;
            if (p.idx_is_64) {
              reinterpret_cast<int64_t*>(s_dst.idx[r])[o] = mine ? local : -1;
            } else {
              reinterpret_cast<int32_t*>(s_dst.idx[r])[o] = mine ? static_cast<int32_t>(local) : -1;
            }
            s_dst.w[r][o] = mine ? wt : 0.0f;
          }
        }
      }
    };
    // Every peer receives zero-copy (the usual case): no chunk is published, so the tokens are
    // dealt evenly over all sender warps of the grid, without a block barrier per chunk (64-token
    // chunks dealt to 12 blocks left a 6-vs-5.3-chunk tail, and each chunk waited for its slowest
    // warp).
    if ((zc | 1u << p.rank) == (1u << R) - 1u) {
      send_tokens(data_block(p) * kSendWarps + warp, p.num_tokens, p.num_send_blocks * kSendWarps);
#if UCCL_EP_HAS_TMA
      if constexpr (kTma) pipe.drain();  // this warp's bulk stores have landed
#endif
    } else {
      for (int c = data_block(p); c < nchunks; c += p.num_send_blocks) {
        const int t_begin = c * ct, t_end = min(p.num_tokens, t_begin + ct);
        send_tokens(t_begin + warp, t_end, kSendWarps);
#if UCCL_EP_HAS_TMA
        if constexpr (kTma) pipe.drain();  // this warp's bulk stores of the chunk have landed
#endif
        __syncthreads();
        // Publish the chunk's rows to each peer: one system fence (cumulative over the block's
        // stores, ordered by the barrier above) and one release store per peer. A token's
        // position among the rows sent to r grows with t, so the chunk's range is given by its
        // first and last token bound to r: scan in from both ends (usually one load each)
        // instead of walking all of the chunk's tokens while the block waits.
        if (tid < R && tid != p.rank && !(zc >> tid & 1u)) {
          const int r = tid;
          int first = -1, last = -1;
          for (int t = t_begin; t < t_end && first < 0; ++t) first = p.send_pos[static_cast<int64_t>(t) * R + r];
          for (int t = t_end - 1; first >= 0 && last < 0; --t) last = p.send_pos[static_cast<int64_t>(t) * R + r];
          dev::fence_system();
          dev::st_release_sys(chunk_flag(p.bufs.p[r], p.rank, c),
                              pack_chunk(seq, first < 0 ? 0 : first, first < 0 ? 0 : last - first + 1));
        }
      }
    }
    signal_done(p, seq, zc);
    if (!p.zero_copy) return;
    // Zero-copy: no receiver blocks, so the senders fill the padding rows, and block 0 keeps
    // the kernel alive until every peer's rows have landed (stream order is all a consumer
    // of the outputs relies on).
    const int64_t nw = static_cast<int64_t>(data_blocks(p)) * kSendWarps;
    fill_padding(p, s_recv_begin[R], static_cast<int64_t>(data_block(p)) * kSendWarps + warp, nw, lane);
    if (data_block(p) == 0 && tid < R && tid != p.rank)
      wait_at_least(recv_done(p.bufs.p[p.rank]) + tid, seq, tid, kSiteDispatchDone, p.status,
                    PeerAborts{p.bufs, p.rank, R}, p.timeout_ns);
    return;
  }

  // ------------------------------------------------------------------ receiver
  const int j = data_block(p) - p.num_send_blocks;
  const int nrecv = data_blocks(p) - p.num_send_blocks;
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
        const uint64_t tag = seq & 0xFFFFFFull;
        if (!wait_until(chunk_flag(p.bufs.p[p.rank], s, c), [tag](uint64_t v) { return (v >> 40) == tag; },
                        p.status, PeerAborts{p.bufs, p.rank, R}, p.timeout_ns, s, seq, kSiteDispatchDone, &s_flag))
          s_failed = 1;
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
  fill_padding(p, s_recv_begin[R], static_cast<int64_t>(j) * warps + warp, static_cast<int64_t>(nrecv) * warps, lane);
#if UCCL_EP_HAS_TMA
  if constexpr (kTma) pipe.drain();  // the stores read shared memory until they are done
#endif
}

// A notify block of a dispatch kernel that runs notify itself, then its count (whatever
// notify's outcome: a failure is in the status word, which dispatch_blocks reads first): the
// block's writes (the sequence, info, send_pos) before the count, with release. Not inlined, on
// the parameters in place: inlined, it made the 16-byte copy path (at the 128-register cap)
// spill registers.
__device__ __noinline__ void notify_of_dispatch(const SendParams* p) {
  notify_block<kSendThreads>(p->notify, static_cast<int>(blockIdx.x));
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(reinterpret_cast<unsigned long long*>(notify_done_blocks(p->bufs.p[p->rank])), 1ull);
  }
}

// A data block's share of reading notify's checked inputs (its scan slices, with notify's block
// 0), before it waits for notify. Not inlined, for the same reason as notify_of_dispatch.
__device__ __noinline__ void scan_of_dispatch(const SendParams* p) {
  notify_detail::scan_slices<kSendThreads>(p->notify);
}

// The kernel: notify's blocks first when it is folded in (p.notify_blocks), then the data
// blocks, which wait for them as a kernel launched after notify would wait (stream order): thread
// 0 acquires their count and the block barrier hands their writes to every thread. The wait is
// bounded by notify's own (each times out at timeout_ns); twice that is a backstop. Then the
// outputs of a failed call are filled by the last block to finish (no launch of its own), so
// they never hold stale rows.
template <typename V, int kUnroll, bool kTma>
__global__ void __launch_bounds__(kSendThreads) dispatch_kernel(const UCCL_EP_GRID_CONSTANT SendParams p) {
  const int nb = p.notify_blocks;
  if (static_cast<int>(blockIdx.x) < nb) {
    notify_of_dispatch(&p);
  } else {
    if (nb > 0) {
      if (p.notify.scan_blocks > 0) scan_of_dispatch(&p);
      if (threadIdx.x == 0)
        wait_at_least(notify_done_blocks(p.bufs.p[p.rank]), static_cast<uint64_t>(nb), p.rank, kSiteNotify, p.status,
                      PeerAborts{p.bufs, p.rank, p.num_ranks}, 2 * p.timeout_ns);
      __syncthreads();
    }
    dispatch_blocks<V, kUnroll, kTma>(p);
  }
  poison_when_failed(p.status, p.poison, dispatch_done_blocks(p.bufs.p[p.rank]),
                     notify_done_blocks(p.bufs.p[p.rank]));
}

bool aligned16(intptr_t v) { return v % 16 == 0; }

}  // namespace

// Bulk copies (TMA) exist on sm_90+ NVIDIA GPUs only. Asked once per device (per_device_once).
bool tma_supported() {
#if defined(UCCL_EP_DEVICE_CUDA)
  static PerDevice known, sm90;
  return per_device_once(&known, &sm90, [](int dev) {
    int major = 0;
    GPU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    return major >= 9;
  });
#else
  return false;
#endif
}

namespace {

// Receiver blocks copy the rows peers staged here into the outputs (read + write each row);
// sender blocks read each token once and write it to every destination. Split the SMs in
// proportion to those bytes, so neither side idles while the other finishes: with top-8 of 256
// experts that is ~40% receivers on 2 ranks but ~55% on 4, where the fixed third used before
// left the receivers with twice the bytes per SM of the senders (docs/performance.md).
// Without the counts on the host (sync-free mode) assume every token goes to every rank: that
// gives the same ~40% (2 ranks) / ~55% (4 ranks) split the measured top-8 of 256 workloads had.
// A zero-copy rank has no receiver blocks: peers write its outputs, its senders pad.
int dispatch_recv_blocks(const DispatchArgs& a, int blocks) {
  if (a.zero_copy) return 0;
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
  UCCL_EP_CHECK_ARG(a.arenas.empty() || static_cast<int>(a.arenas.size()) == a.num_ranks, "got ", a.arenas.size(),
                    " receive arenas for ", a.num_ranks, " ranks");
  UCCL_EP_CHECK_ARG(!a.zero_copy || !a.arenas.empty(), "zero_copy dispatch without receive arenas");
  UCCL_EP_CHECK_ARG(!a.judge || (!a.cached && a.entry_published), "a launch-ahead dispatch (judge) must be a "
                    "non-cached call whose notify published the receive entry");
  const NotifyArgs* n = a.notify;
  UCCL_EP_CHECK_ARG(n == nullptr || (n->out_info == a.rank_prefix_matrix &&
                                     n->send_pos == (a.cached ? 0 : a.send_pos) && n->rank == a.rank &&
                                     n->num_ranks == a.num_ranks && n->status == a.status),
                    "a dispatch with notify folded in needs notify's out_info as rank_prefix_matrix, its send_pos "
                    "(none when cached), rank, ranks and status");
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
  p.arenas = a.arenas.empty() ? Peers{} : make_peers(a.arenas, a.num_ranks);
  p.zero_copy = a.zero_copy;
  p.entry_published = a.entry_published;
  p.judge = a.judge;
  p.num_experts = a.num_experts;
  p.poison = a.poison;
  if (a.notify != nullptr) {
    p.notify = notify_params(*a.notify);
    p.notify_blocks = notify_blocks(p.notify);
  }
  const int blocks = std::max(2, a.num_sms);
  if (a.notify != nullptr) {  // the data blocks read slices of notify's inputs with its block 0
    p.notify.scan_blocks = notify_scan_blocks(p.notify);
    p.notify.scan_claimers = blocks;
  }
  const intptr_t outs[5] = {a.recv_x, a.recv_scales, a.recv_topk_idx, a.recv_topk_weights,
                            a.cached ? 0 : a.recv_src_idx};
  for (int i = 0; i < 5; ++i) p.recv_off[i] = a.zero_copy && outs[i] != 0 ? outs[i] - a.arenas[a.rank] : -1;
  p.num_send_blocks = blocks - dispatch_recv_blocks(a, blocks);
  const int grid = p.notify_blocks + blocks;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const bool vec = a.row_bytes % 16 == 0 && aligned16(a.x) && aligned16(a.recv_x);
  if (vec && a.use_tma && tma_supported()) {
#if defined(UCCL_EP_DEVICE_CUDA)
    constexpr int smem = tma_smem_bytes(kSendWarps);
    allow_dynamic_smem<dispatch_kernel<int4, 8, true>>(smem);
    dispatch_kernel<int4, 8, true><<<grid, kSendThreads, smem, s>>>(p);
#endif
  } else if (vec) {
    dispatch_kernel<int4, 8, false><<<grid, kSendThreads, 0, s>>>(p);
  } else {
    dispatch_kernel<uint8_t, 8, false><<<grid, kSendThreads, 0, s>>>(p);
  }
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

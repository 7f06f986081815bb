// Intranode combine, one pipelined kernel: an entry barrier (staging reuse, call headers),
// then pusher blocks send every received row back to its source rank's staging (ordered by
// expert rank and position) chunk by chunk, publishing each chunk, while reducer warps (and
// pushers once done) sum each token's rows in rank order in fp32 as soon as the chunks
// holding them have landed (rows this rank kept for itself are read in place).
//
// In place: a rank whose x lies in its receive arena (x_place >= 0; e.g. dispatch's zero-copy
// recv_x, or expert outputs written there) pushes nothing. It says where x is with the entry
// barrier, peers read its rows there directly (one read of each row instead of a read, a
// write and a read), and its kernel ends only after every peer said it is done reading.
//
// By the copy engine (ce_value > 0, 2 ranks): a rank's rows go back by cudaMemcpyAsync on a
// side stream, started once this kernel has passed the entry barrier, with a stream write
// publishing each chunk (kCeFlagsOffset); its SMs only reduce. Its peers learn it from the
// place slot and wait for those words instead.
#include <algorithm>

#include "kernels/common.cuh"

namespace uccl_ep::kernels {
namespace {

constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / dev::kWarpSize;
// Tokens a reducer warp takes at a time from the call's counter: small, so the warps finish
// together (a block-wide tile of 64 tokens left up to ~100 us of tail at 8 ranks).
constexpr int kWarpTokens = 2;

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

struct CombineParams {
  Peers bufs;
  int rank, num_ranks, num_tokens, num_topk;
  int64_t row_bytes;
  const uint8_t* x;  // rows this rank received, in dispatch's receive order
  const float* w;
  bool has_w;        // weights go back with the rows
  const int* send_pos;
  const int* prefix;  // device [R, R] rank prefix matrix of the dispatch
  int64_t staging_rows;
  int64_t w_offset;   // weights in every rank's staging
  const uint8_t* bias0;
  const uint8_t* bias1;
  uint8_t* out;
  float* out_w;
  StatusRef status;
  int64_t timeout_ns;
  int64_t header;
  Peers arenas;            // every rank's receive arena as mapped here (null: none)
  int64_t x_place, w_place;  // this rank's x / weights offsets in its arena (-1: it pushes)
  PoisonRegions poison;    // out and out_w, filled by the last block when the call failed
  uint64_t ce_value;       // its rows go back by the copy engine with this value (0: no)
};

// rows[s][j] of the dispatch: rows rank j received from rank s.
__device__ __forceinline__ int sent_rows(const int* prefix, int R, int s, int j) {
  return prefix[s * R + j] - (s > 0 ? prefix[(s - 1) * R + j] : 0);
}

// Rows per progress chunk of the `rows` rows one rank returns to another.
__device__ __forceinline__ int chunk_rows(int rows) {
  const int per = (rows + kCombineChunks - 1) / kCombineChunks;
  return per > kCombineMinChunkRows ? per : kCombineMinChunkRows;
}

// Tokens handed out to reducer warps so far in this combine (see kSeqOffset).
__device__ __forceinline__ unsigned* reduce_tokens(uint8_t* buf) {
  return reinterpret_cast<unsigned*>(buf + kSeqOffset + 16);
}

__device__ __forceinline__ uint64_t* combine_flag(uint8_t* buf, int expert_rank, int chunk) {
  return reinterpret_cast<uint64_t*>(buf + kCombineFlagsOffset) + expert_rank * kCombineChunks + chunk;
}

__device__ __forceinline__ uint64_t* ce_flag(uint8_t* buf, int expert_rank, int chunk) {
  return reinterpret_cast<uint64_t*>(buf + kCeFlagsOffset) + expert_rank * kCeChunks + chunk;
}

// Per-rank offsets every block derives from the device matrix (no host copy: sync-free calls).
struct Plan {
  int recv_begin[kMaxRanks + 1];  // my rows from source s: x rows [recv_begin[s], [s+1])
  int dst_off[kMaxRanks];         // first row of my region in s's staging (after lower ranks')
  int src_off[kMaxRanks];         // first row of rank r's returned rows (own: in my x)
  int back[kMaxRanks];            // rows rank r returns to me
  int push_blocks;
  int overflow;                   // first rank whose staging is too small, or -1
  uint64_t seq;
  unsigned pull;                  // bit r: rank r combines in place; its rows are read below
  const uint8_t* pull_x[kMaxRanks];  // my first row in rank r's x (bit r of pull set)
  const float* pull_w[kMaxRanks];    // and its weights (null: none)
  uint64_t ce[kMaxRanks];            // rank r's rows come by the copy engine with this value (0: no)
};

__device__ void make_plan(const CombineParams& p, Plan& s) {
  const int R = p.num_ranks, tid = threadIdx.x;
  if (tid <= R) s.recv_begin[tid] = tid > 0 ? p.prefix[(tid - 1) * R + p.rank] : 0;
  if (tid < R) {
    int off = 0;
    for (int j = 0; j < p.rank; ++j)
      if (j != tid) off += sent_rows(p.prefix, R, tid, j);
    s.dst_off[tid] = off;
    s.back[tid] = sent_rows(p.prefix, R, p.rank, tid);
  }
  if (tid < kMaxRanks) s.ce[tid] = 0;
  if (tid == 0) {
    s.seq = *seq_counter(p.bufs.p[p.rank]) + 1;
    int off = 0;
    for (int r = 0; r < R; ++r) {
      s.src_off[r] = off;
      if (r != p.rank) off += sent_rows(p.prefix, R, p.rank, r);
    }
    s.src_off[p.rank] = p.rank > 0 ? p.prefix[(p.rank - 1) * R + p.rank] : 0;
    // Every rank holds the same matrix, so all find the same overflow and all skip.
    s.overflow = -1;
    for (int src = 0; src < R && s.overflow < 0; ++src) {
      int64_t rows = 0;
      for (int j = 0; j < R; ++j)
        if (j != src) rows += sent_rows(p.prefix, R, src, j);
      if (rows > p.staging_rows) {
        s.overflow = src;
        if (blockIdx.x == 0) record_status(p.status, kStatusCombineOverflow, src, rows, p.staging_rows);
      }
    }
    // Rows pushed: those received from peers. Reduce transfers: every returned row read (own
    // included), one row written per token.
    int64_t reduce = p.num_tokens;
    for (int r = 0; r < R; ++r) reduce += sent_rows(p.prefix, R, p.rank, r);
    const int64_t push = p.x_place >= 0 || p.ce_value > 0
                             ? 0
                             : p.prefix[(R - 1) * R + p.rank] - sent_rows(p.prefix, R, p.rank, p.rank);
    s.push_blocks = combine_push_blocks(push, reduce, gridDim.x);
    s.pull = 0;
  }
}

// Before the entry barrier: thread r tells peer r where this rank's x lies (or that it pushes);
// the barrier's fence and signal, by the same thread, publish it.
__device__ __forceinline__ void publish_place(const CombineParams& p, uint64_t seq) {
  const int r = threadIdx.x;
  if (blockIdx.x != 0 || r >= p.num_ranks || r == p.rank) return;
  volatile int64_t* slot = combine_place(p.bufs.p[r], seq, p.rank);
  slot[1] = p.x_place;
  slot[2] = p.w_place;
  slot[3] = static_cast<int64_t>(p.ce_value);
  slot[0] = static_cast<int64_t>(seq);
}

// After the entry barrier: which peers combine in place, and where my rows lie in their x
// (after the rows of lower source ranks, as dispatch placed them).
__device__ void read_places(const CombineParams& p, Plan& s) {
  const int R = p.num_ranks, r = threadIdx.x;
  if (r < R && r != p.rank) {
    const volatile int64_t* slot = combine_place(p.bufs.p[p.rank], s.seq, r);
    const bool current = slot[0] == static_cast<int64_t>(s.seq);
    const int64_t xo = slot[1], wo = slot[2], ce = slot[3];
    s.pull_x[r] = nullptr;
    s.pull_w[r] = nullptr;
    if (current && ce > 0) s.ce[r] = static_cast<uint64_t>(ce);
    if (current && xo >= 0 && p.arenas.p[r] != nullptr) {
      const int64_t first = p.rank > 0 ? p.prefix[(p.rank - 1) * R + r] : 0;
      s.pull_x[r] = p.arenas.p[r] + xo + first * p.row_bytes;
      if (wo >= 0) s.pull_w[r] = reinterpret_cast<const float*>(p.arenas.p[r] + wo) + first * p.num_topk;
      atomicOr(&s.pull, 1u << r);
    }
  }
  __syncthreads();
}

// Pusher block `b` of `nb`: chunk c of the rows from every source before chunk c + 1 of any,
// so each source's reducers get their first rows early. After a chunk's rows (and weights)
// are stored, one system fence (cumulative over the block's stores, ordered by the CTA
// barrier) and one release store of the sequence publish it in the source's control region.
template <typename V, int kUnroll, bool kTma>
__device__ void push_role(const CombineParams& p, const Plan& s, int b, int nb, void* pipe_ptr) {
  const int R = p.num_ranks, tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  int max_chunks = 0;
  for (int src = 0; src < R; ++src) {
    const int n = s.recv_begin[src + 1] - s.recv_begin[src];
    if (src != p.rank) max_chunks = max(max_chunks, (n + chunk_rows(n) - 1) / chunk_rows(n));
  }
  const int peers = R - 1;
  for (int u = b; u < max_chunks * peers; u += nb) {
    const int c = u / peers, k = u % peers, src = k < p.rank ? k : k + 1;
    const int n = s.recv_begin[src + 1] - s.recv_begin[src], ct = chunk_rows(n);
    const int first = c * ct, last = min(n, first + ct);
    if (first >= last) continue;
    uint8_t* base = p.bufs.p[src];
    const int64_t row0 = s.recv_begin[src] + first, drow0 = s.dst_off[src] + first;
#if UCCL_EP_HAS_TMA
    if constexpr (kTma) {
      // The chunk's rows are contiguous here and in the source's staging: one byte range.
      static_cast<TmaPipe*>(pipe_ptr)->push_range(p.x + row0 * p.row_bytes, base + kDataOffset + drow0 * p.row_bytes,
                                                  (last - first) * p.row_bytes, warp, kCombineWarps);
    }
#endif
    for (int i = warp; i < last - first && (!kTma || p.has_w); i += kCombineWarps) {
      if constexpr (!kTma) {
        copy_row<V, kUnroll>(p.x + (row0 + i) * p.row_bytes, p.row_bytes,
                             base + kDataOffset + (drow0 + i) * p.row_bytes, lane);
      }
      if (p.has_w) {
        float* dw = reinterpret_cast<float*>(base + p.w_offset);
        for (int q = lane; q < p.num_topk; q += dev::kWarpSize)
          dw[(drow0 + i) * p.num_topk + q] = p.w[(row0 + i) * p.num_topk + q];
      }
    }
#if UCCL_EP_HAS_TMA
    if constexpr (kTma) static_cast<TmaPipe*>(pipe_ptr)->drain();  // this warp's bulk stores have landed
#endif
    __syncthreads();
    if (tid == 0) {
      dev::fence_system();
      dev::st_release_sys(combine_flag(base, p.rank, c), s.seq);
    }
  }
}

// Sums token t's rows in rank order in fp32 (plus biases), as the two-kernel combine did, so
// results are bit-identical to it. Peer rows are in staging, written while this kernel runs:
// they are read around L1 (ld_cg), so a line fetched for a landed row never serves a later one.
// `lane_pos`: in lane r < R, the token's send position to rank r (-1: not sent there).
template <int kDtype, bool kVec, int kUnroll, int kRanks>
__device__ __forceinline__ void reduce_token(const CombineParams& p, const Plan& s, const uint8_t* st_x,
                                             const float* st_w, int t, int lane_pos, int lane) {
  using E = Elt<kDtype>;
  using raw = typename E::raw;
  constexpr int kPerVec = kVec ? 16 / static_cast<int>(sizeof(raw)) : 1;
  using V = typename std::conditional<kVec, int4, raw>::type;
  const int R = p.num_ranks;
  const int64_t n = p.row_bytes / static_cast<int64_t>(sizeof(V));
  const uint8_t* src[kRanks];
  const float* srcw[kRanks];
  unsigned mask = 0;
#pragma unroll
  for (int r = 0; r < kRanks; ++r) {
    src[r] = nullptr;
    srcw[r] = nullptr;
    if (r < R) {
      const int pos = dev::warp_shfl(lane_pos, r);  // R is warp-uniform: every lane takes part
      if (pos >= 0) {
        mask |= 1u << r;
        if (s.pull >> r & 1u) {
          src[r] = s.pull_x[r] + pos * p.row_bytes;
          if (p.out_w != nullptr) srcw[r] = s.pull_w[r] + static_cast<int64_t>(pos) * p.num_topk;
        } else {
          const int64_t row = s.src_off[r] + pos;
          src[r] = (r == p.rank ? p.x : st_x) + row * p.row_bytes;
          // Decide by the output: this rank's own weight tensor is empty (null) when it
          // received nothing, yet peers still return weights for its tokens.
          if (p.out_w != nullptr) srcw[r] = (r == p.rank ? p.w : st_w) + row * p.num_topk;
        }
      }
    }
  }
  for (int64_t base = 0; base < n; base += kUnroll * dev::kWarpSize) {
    V v[kRanks][kUnroll];
#pragma unroll
    for (int r = 0; r < kRanks; ++r) {
      if (mask >> r & 1u) {
        const V* row = reinterpret_cast<const V*>(src[r]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + u * dev::kWarpSize + lane;
          if (i < n) v[r][u] = r == p.rank ? dev::ld_stream(row + i) : dev::ld_cg(row + i);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * dev::kWarpSize + lane;
      if (i >= n) continue;
      // -0.0 + x is x for every x: the first add folds away, and every sum equals the
      // oracle's (from +0.0) in value.
      float acc[kPerVec];
#pragma unroll
      for (int e = 0; e < kPerVec; ++e) acc[e] = -0.0f;
#pragma unroll
      for (int r = 0; r < kRanks; ++r)
        if (mask >> r & 1u) add_elts<kDtype, kPerVec>(acc, &v[r][u]);
      const uint8_t* biases[2] = {p.bias0, p.bias1};
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        if (biases[b] != nullptr) {
          const V bv = reinterpret_cast<const V*>(biases[b] + static_cast<int64_t>(t) * p.row_bytes)[i];
          add_elts<kDtype, kPerVec>(acc, &bv);
        }
      }
      V o;
      store_elts<kDtype, kPerVec>(&o, acc);
      reinterpret_cast<V*>(p.out + static_cast<int64_t>(t) * p.row_bytes)[i] = o;
    }
  }
  if (p.out_w != nullptr) {
    for (int k = lane; k < p.num_topk; k += dev::kWarpSize) {
      float acc = 0.0f;
#pragma unroll
      for (int r = 0; r < kRanks; ++r)
        if (mask >> r & 1u) acc += r == p.rank ? srcw[r][k] : dev::ld_cg(srcw[r] + k);
      p.out_w[static_cast<int64_t>(t) * p.num_topk + k] = acc;
    }
  }
}

// Reducer warps take kWarpTokens tokens at a time from a counter, so tokens go out in order
// (the order pushers publish in) and a pusher block that is done joins in. Before a token,
// lane r waits for the chunk holding its row from rank r: the row sits at the token's send
// position in r's pushes. Positions grow with the token, so a warp's chunks from r only grow:
// lane r polls a chunk once, then remembers it.
template <int kDtype, bool kVec, int kUnroll, int kRanks>
__device__ void reduce_role(const CombineParams& p, const Plan& s) {
  const int R = p.num_ranks, lane = threadIdx.x % dev::kWarpSize;
  uint8_t* own = p.bufs.p[p.rank];
  const uint8_t* st_x = own + kDataOffset;
  const float* st_w = reinterpret_cast<const float*>(own + p.w_offset);
  unsigned* counter = reduce_tokens(own);
  const bool watch = lane < R && lane != p.rank && s.back[lane] > 0 && !(s.pull >> lane & 1u);
  const uint64_t ce = watch ? s.ce[lane] : 0;  // lane r's rank pushes by the copy engine
  const int ct = !watch ? 1 : ce > 0 ? static_cast<int>(ce_chunk_rows(s.back[lane])) : chunk_rows(s.back[lane]);
  int seen = -1;  // lane r: the last chunk of rank r seen landed
  // Lane r < R: a token's send position to rank r, loaded one token ahead on up to 4 ranks (its
  // latency hides under the previous token's rows; at 8 ranks the extra register spills).
  constexpr bool kAhead = kRanks <= 4;
  auto pos_of = [&](int t) {
    return lane < R && t < p.num_tokens ? p.send_pos[static_cast<int64_t>(t) * R + lane] : -1;
  };
  int t0 = dev::warp_shfl(lane == 0 ? static_cast<int>(atomicAdd(counter, kWarpTokens)) : 0, 0);
  int pos_next = kAhead ? pos_of(t0) : -1;
  while (t0 < p.num_tokens) {
    // The next grab is in flight while this one is reduced.
    const int next = lane == 0 ? static_cast<int>(atomicAdd(counter, kWarpTokens)) : 0;
    const int t_end = min(p.num_tokens, t0 + kWarpTokens);
    for (int t = t0; t < t_end; ++t) {
      const int pos = kAhead ? pos_next : pos_of(t);
      if constexpr (kAhead) pos_next = pos_of(t + 1 < t_end ? t + 1 : dev::warp_shfl(next, 0));  // uniform
      bool failed = false;
      if (watch) {
        if (pos >= 0 && pos / ct != seen) {
          seen = pos / ct;
          failed = ce > 0 ? !wait_at_least(ce_flag(own, lane, seen), ce, lane, kSiteCombineReceive, p.status,
                                           PeerAborts{p.bufs, p.rank, R}, p.timeout_ns)
                          : !wait_flag(combine_flag(own, lane, seen), s.seq, p.status, PeerAborts{p.bufs, p.rank, R},
                                       p.timeout_ns, lane, s.seq, kSiteCombineReceive);
        }
      }
      // The ballot reconverges the warp after the waits; the warp barrier orders the other
      // lanes' row loads after the waiting lanes' acquire.
      if (dev::warp_ballot(failed) != 0) return;
      dev::warp_sync();
      reduce_token<kDtype, kVec, kUnroll, kRanks>(p, s, st_x, st_w, t, pos, lane);
    }
    t0 = dev::warp_shfl(next, 0);
  }
}

// Pushers take the low block indices, so they are scheduled first (reducers wait on them).
template <int kDtype, bool kVec, int kUnroll, int kRanks, bool kTma>
__global__ void __launch_bounds__(kCombineThreads) combine_kernel(CombineParams p) {
  __shared__ Plan s;
  __shared__ int s_last;
  make_plan(p, s);
  __syncthreads();
  const int R = p.num_ranks;
  publish_place(p, s.seq);
  // A failed barrier skips the rows but still counts the block below, so the sequence
  // advances the same on every rank whatever happened.
  const bool ok = barrier_block(p.bufs, p.rank, R, s.seq, blockIdx.x == 0, p.status, p.timeout_ns, kSiteCombineEntry,
                                BarrierExtras{true, kCombineHeaderOffset, p.header}) &&
                  s.overflow < 0;
  // The copy engine's rows may go now (and go even when the barrier failed: the side stream
  // must not wait forever; this call raises then).
  if (p.ce_value > 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    dev::fence_system();
    *reinterpret_cast<volatile uint64_t*>(p.bufs.p[p.rank] + kCeGateOffset) = p.ce_value;
  }
  if (ok) read_places(p, s);
  const int b = blockIdx.x, P = s.push_blocks;
  if (ok && b < P) {
    using V = typename std::conditional<kVec, int4, uint8_t>::type;
#if UCCL_EP_HAS_TMA
    extern __shared__ __align__(128) uint8_t s_tma[];
    __shared__ uint64_t s_bar[kCombineWarps * kTmaStages];
    TmaPipe pipe;
    const int warp = threadIdx.x / dev::kWarpSize, lane = threadIdx.x % dev::kWarpSize;
    if constexpr (kTma) pipe.init(s_tma + warp * kTmaStages * kTmaChunk, s_bar + warp * kTmaStages, lane);
    push_role<V, 8, kTma>(p, s, b, P, &pipe);
#else
    push_role<V, 8, kTma>(p, s, b, P, nullptr);
#endif
  }
  if (ok) reduce_role<kDtype, kVec, kUnroll, kRanks>(p, s);
  // Every block read the sequence before its CTA barrier above; the last one to get here
  // advances it past this combine, for the next call on this stream, and zeroes the token
  // counter (the fence orders the block's grabs, even a failed warp's last, before that).
  __syncthreads();
  uint8_t* own = p.bufs.p[p.rank];
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(seq_done_blocks(own), 1u) == gridDim.x - 1;
    if (s_last) __threadfence();  // every other block's stores and status writes, before ours
  }
  __syncthreads();
  if (!s_last) return;
  // Every block's reads of peers' x are done (their fences, then the counter): tell every peer,
  // whether or not it combined in place (and whatever failed, so no peer waits for nothing);
  // then, in place, keep x alive until every peer has said so.
  const int r = threadIdx.x;
  if (r < R && r != p.rank) {
    dev::fence_system();
    dev::st_release_sys(combine_done(p.bufs.p[r]) + p.rank, s.seq);
    if (p.x_place >= 0)
      wait_at_least(combine_done(own) + r, s.seq, r, kSiteCombineDone, p.status, PeerAborts{p.bufs, p.rank, R},
                    p.timeout_ns);
  }
  __syncthreads();
  // A failed call's outputs are filled here, with no launch of its own (the in-place wait
  // above may have failed too).
  if (status_set(p.status)) fill_poison(p.poison, threadIdx.x, blockDim.x);
  if (threadIdx.x == 0) {
    *seq_done_blocks(own) = 0;
    *reduce_tokens(own) = 0;
    *seq_counter(own) = s.seq;
    __threadfence();
  }
}

struct HostPlan {
  Peers peers;
  int64_t staging_rows;
};

HostPlan plan(const CombineArgs& a) {
  HostPlan h{};
  h.peers = make_peers(a.buffers, a.num_ranks);
  UCCL_EP_CHECK_ARG(a.rank_prefix_matrix != 0, "rank_prefix_matrix is a null pointer");
  UCCL_EP_CHECK_ARG(a.staging_rows >= 0, "staging_rows=", a.staging_rows, " must be non-negative");
  UCCL_EP_CHECK_ARG(a.dtype >= 0 && a.dtype <= 2, "combine dtype code ", a.dtype, " is not bf16/fp16/fp32");
  UCCL_EP_CHECK_ARG(a.num_topk <= kMaxTopk, "num_topk=", a.num_topk, " exceeds ", kMaxTopk);
  h.staging_rows = a.staging_rows;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * (a.dtype == 2 ? 4 : 2);
  const int64_t need = combine_layout(h.staging_rows, row_bytes, a.num_topk).end;
  UCCL_EP_CHECK_ARG(need <= a.buffer_bytes, "combine staging needs ", need, " bytes but the buffer has ",
                    a.buffer_bytes);
  return h;
}

template <int kDtype, bool kVec, int kUnroll, int kRanks>
void launch(const CombineParams& p, int blocks, bool tma, gpuStream_t s) {
#if defined(UCCL_EP_DEVICE_CUDA)
  if constexpr (kVec) {
    if (tma) {
      constexpr int smem = tma_smem_bytes(kCombineWarps);
      allow_dynamic_smem<combine_kernel<kDtype, true, kUnroll, kRanks, true>>(smem);
      combine_kernel<kDtype, true, kUnroll, kRanks, true><<<blocks, kCombineThreads, smem, s>>>(p);
      return;
    }
  }
#endif
  combine_kernel<kDtype, kVec, kUnroll, kRanks, false><<<blocks, kCombineThreads, 0, s>>>(p);
}

// kRanks bounds the reducer's rank loop so its per-source loads stay in registers, and kUnroll
// fills them: with 16-byte loads, 2 x 8 (2 ranks) or 4 x 4 (4 ranks) vectors per lane, ~8 KB in
// flight per warp and ~100-120 registers without spills; 8 ranks keep 8 x 2 (the loads a token
// has in flight grow with the ranks it reached).
template <int kDtype>
void launch_dtype(const CombineParams& p, int R, bool vec, bool tma, int blocks, gpuStream_t s) {
  if (!vec) {
    launch<kDtype, false, 2, kMaxRanks>(p, blocks, false, s);
  } else if (R <= 2) {
    launch<kDtype, true, 8, 2>(p, blocks, tma, s);
  } else if (R <= 4) {
    launch<kDtype, true, 4, 4>(p, blocks, tma, s);
  } else {
    launch<kDtype, true, 2, kMaxRanks>(p, blocks, tma, s);
  }
}

// After the kernel (on its stream `s`): the rows this rank returns go back by the copy engine on
// a.ce_stream, chunk by chunk, each chunk published by a stream write of a.ce_value into the
// peer's kCeFlagsOffset, all once the kernel passed its entry barrier (kCeGateOffset); then `s`
// waits for them (x is read until then).
void push_by_copy_engine(const CombineArgs& a, const CombineParams& p, gpuStream_t s) {
  const intptr_t cs = a.ce_stream;
  auto at = [](const void* ptr, int64_t bytes) { return reinterpret_cast<intptr_t>(ptr) + bytes; };
  stream_wait_at_least(cs, at(p.bufs.p[a.rank], kCeGateOffset), a.ce_value);
  for (int src = 0; src < a.num_ranks; ++src) {
    const int64_t n = src == a.rank ? 0 : a.ce_rows[src];
    if (n <= 0) continue;
    uint8_t* base = p.bufs.p[src];
    const int64_t begin = a.ce_begin[src], dst = a.ce_dst[src];
    if (p.has_w) {
      const int64_t wb = 4ll * p.num_topk;
      copy_on_stream(at(base, p.w_offset + dst * wb), at(p.w, begin * wb), n * wb, cs);
    }
    const int64_t ct = ce_chunk_rows(n);
    for (int64_t first = 0, c = 0; first < n; first += ct, ++c) {
      const int64_t rows = std::min(ct, n - first);
      copy_on_stream(at(base, kDataOffset + (dst + first) * p.row_bytes), at(p.x, (begin + first) * p.row_bytes),
                     rows * p.row_bytes, cs);
      stream_write_word(cs, at(base, kCeFlagsOffset + 8 * (static_cast<int64_t>(a.rank) * kCeChunks + c)),
                        a.ce_value);
    }
  }
  event_record(a.ce_event, cs);
  stream_wait_event(reinterpret_cast<intptr_t>(s), a.ce_event);
}

}  // namespace

int64_t combine_staging_bytes(int64_t rows, int64_t row_bytes, int num_topk) {
  return combine_layout(rows, row_bytes, num_topk).end;
}

void intranode_combine(const CombineArgs& a, intptr_t stream) {
  const HostPlan h = plan(a);
  const int R = a.num_ranks;
  const int64_t row_bytes = static_cast<int64_t>(a.hidden) * (a.dtype == 2 ? 4 : 2);
  CombineParams p{};
  p.bufs = h.peers;
  p.rank = a.rank;
  p.num_ranks = R;
  p.num_tokens = a.num_tokens;
  p.num_topk = a.num_topk;
  p.row_bytes = row_bytes;
  p.x = reinterpret_cast<const uint8_t*>(a.x);
  p.w = reinterpret_cast<const float*>(a.topk_weights);
  p.has_w = a.num_topk > 0 && a.topk_weights != 0;
  p.send_pos = reinterpret_cast<const int*>(a.send_pos);
  p.prefix = reinterpret_cast<const int*>(a.rank_prefix_matrix);
  p.staging_rows = h.staging_rows;
  p.w_offset = combine_layout(h.staging_rows, row_bytes, a.num_topk).w;
  p.bias0 = reinterpret_cast<const uint8_t*>(a.bias0);
  p.bias1 = reinterpret_cast<const uint8_t*>(a.bias1);
  p.out = reinterpret_cast<uint8_t*>(a.out);
  p.out_w = reinterpret_cast<float*>(a.out_weights);
  p.status = status_ref(a.status);
  p.timeout_ns = a.timeout_ns;
  p.header = a.header;
  if (!a.arenas.empty()) p.arenas = make_peers(a.arenas, R);
  p.x_place = a.x_place;
  p.w_place = a.w_place;
  p.poison = a.poison;
  p.ce_value = a.ce_value;
  UCCL_EP_CHECK_ARG(a.x_place < 0 || !a.arenas.empty(), "intranode_combine: x_place=", a.x_place,
                    " without receive arenas");
  if (a.ce_value > 0) {
    UCCL_EP_CHECK_ARG(a.x_place < 0 && a.ce_stream != 0 && a.ce_event != 0 && a.ce_rows.size() == size_t(R) &&
                          a.ce_begin.size() == size_t(R) && a.ce_dst.size() == size_t(R),
                      "intranode_combine: a copy-engine push needs x_place=-1 (got ", a.x_place,
                      "), a side stream, an event and rows, begin and destination for each of ", R, " ranks");
    for (int r = 0; r < R; ++r)
      UCCL_EP_CHECK_ARG(r == a.rank || (a.ce_rows[r] >= 0 && a.ce_begin[r] >= 0 &&
                                        a.ce_begin[r] + a.ce_rows[r] <= a.num_recv && a.ce_dst[r] >= 0 &&
                                        a.ce_dst[r] + a.ce_rows[r] <= h.staging_rows),
                        "intranode_combine: copy-engine rows for rank ", r, ": ", a.ce_rows[r], " from x row ",
                        a.ce_begin[r], " (of ", a.num_recv, ") to staging row ", a.ce_dst[r], " (of ",
                        h.staging_rows, ")");
  }
  auto s = reinterpret_cast<gpuStream_t>(stream);
  // With peers, both roles may have work: at least one block each (combine_push_blocks).
  const int blocks = std::max(R > 1 ? 2 : 1, a.num_sms);
  const bool vec = row_bytes % 16 == 0 && a.x % 16 == 0 && a.out % 16 == 0 && a.bias0 % 16 == 0 && a.bias1 % 16 == 0;
  const bool tma = vec && a.use_tma && tma_supported();
  if (a.dtype == 0) {
    launch_dtype<0>(p, R, vec, tma, blocks, s);
  } else if (a.dtype == 1) {
    launch_dtype<1>(p, R, vec, tma, blocks, s);
  } else {
    launch_dtype<2>(p, R, vec, tma, blocks, s);
  }
  GPU_CHECK(gpuGetLastError());
  if (a.ce_value > 0) push_by_copy_engine(a, p, s);
}

}  // namespace uccl_ep::kernels

// Internode dispatch: the sender blocks (pack each token once per destination node into the
// send ring; own-node tokens go straight over NVLink), the forwarder blocks (copy arrived
// tokens to every local rank hosting one of their experts), and the finish step that moves
// rows local peers staged here into the outputs. Roles: see internode.h.
#include "common/errors.h"
#include "kernels/internode/round.cuh"

namespace uccl_ep::internode {
namespace detail {
namespace {

struct DispatchDev {
  DevCommon c;
  RingLayout rl;
  DispatchSlot ds;
  StageSlot ss;
  int T, K, ns, epr;
  int64_t row_bytes;
  const uint8_t* x;
  const float* scales;
  const void* topk_idx;
  bool idx64;
  const float* topk_w;
  const int* dst_row;
  const int* lists;
  const int* list_count;
  uint8_t* recv_x;
  float* recv_scales;
  void* recv_idx;
  float* recv_w;
  int* recv_src;
  int* plan;
  int plan_T;
  int64_t stage_off;
  const int* recv_rows;    // [L] output rows of each local rank: a slot's row must be below
  const int* recv_prefix;  // [R + 1] first output row from each source
  int64_t place[kPlaceWords];  // where this rank's outputs lie (DispatchArgs::place)
  uint64_t place_seq;
};

// Where a block writes the rows of each local rank j: the outputs themselves (this rank's, or
// a peer's in its arena; null where the call has none), or, when `direct[j]` is false, j's
// NVLink staging.
struct PeerRows {
  uint8_t* x[kMaxLocal];
  float* scales[kMaxLocal];
  uint8_t* idx[kMaxLocal];
  float* w[kMaxLocal];
  int* src[kMaxLocal];
  bool direct[kMaxLocal];
};

// Every thread: the node's placements of this dispatch (block 0 publishes this rank's), turned
// into the block's PeerRows; false in every thread when a wait failed.
__device__ bool load_peer_rows(const DispatchDev& p, PeerRows& d) {
  __shared__ int64_t s_place[kMaxLocal][kPlaceWords];
  const DevCommon& c = p.c;
  if (!exchange_place(c, p.place_seq, p.place, s_place)) return false;
  const int j = threadIdx.x;
  if (j < c.L) {
    if (j == c.local) {
      d.direct[j] = true;
      d.x[j] = p.recv_x;
      d.scales[j] = p.recv_scales;
      d.idx[j] = static_cast<uint8_t*>(p.recv_idx);
      d.w[j] = p.recv_w;
      d.src[j] = p.recv_src;
    } else {
      const int64_t* w = s_place[j];
      d.direct[j] = w[0] == kPlaceArena && c.arena[j] != nullptr;
      auto at = [&](int i) -> uint8_t* { return d.direct[j] && w[1 + i] >= 0 ? c.arena[j] + w[1 + i] : nullptr; };
      d.x[j] = at(0);
      d.scales[j] = reinterpret_cast<float*>(at(1));
      d.idx[j] = at(2);
      d.w[j] = reinterpret_cast<float*>(at(3));
      // A cached dispatch keeps the handles' source indices (this launch's null wins).
      d.src[j] = p.recv_src == nullptr ? nullptr : reinterpret_cast<int*>(at(4));
    }
  }
  __syncthreads();
  return true;
}

// Where token data comes from: the caller's tensors (own-node tokens) or a ring slot.
struct TokenIn {
  const uint8_t* x;
  const float* scales;
  const int* gid32;      // ring slot ids (int32), or
  const int64_t* gid64;  // the caller's int64 ids, or gid32 pointing at the caller's int32 ids
  const float* w;
  int src;
};

// Scales a lane holds in registers: rows of up to 32 x 2 x 128 = 8192 channels (FP8 scales per
// 128; DeepSeek-V3's 7168); wider rows load the rest where they are stored.
constexpr int kScaleRegs = 2;
static_assert(kMaxTopk <= dev::kWarpSize, "a token's top-k entries are one per lane");

// One lane's part of a token's metadata (scale i = lane + 32 u, the top-k entry `lane`), loaded
// before the row is copied: the loads' latencies then overlap the row's instead of following
// the copy one after another (a token's copy is a few dependent round trips, not its bytes).
struct TokenMeta {
  float scales[kScaleRegs];
  int64_t gid;
  float w;
};

__device__ __forceinline__ TokenMeta load_meta(const float* scales, int ns, const int64_t* gid64, const int* gid32,
                                               const float* w, int K, int lane) {
  TokenMeta m{};
#pragma unroll
  for (int u = 0; u < kScaleRegs; ++u) {
    const int i = lane + u * dev::kWarpSize;
    if (i < ns) m.scales[u] = dev::ld_cg(scales + i);
  }
  if (lane < K) {
    m.gid = gid64 ? dev::ld_cg(gid64 + lane) : static_cast<int64_t>(dev::ld_cg(gid32 + lane));
    m.w = dev::ld_cg(w + lane);
  }
  return m;
}

// Stores scales [0, ns) to `d`: the lane's registers, then (rows past kScaleRegs' width) the
// rest loaded from `src`.
__device__ __forceinline__ void store_scales(float* d, const TokenMeta& m, const float* src, int ns, int lane) {
#pragma unroll
  for (int u = 0; u < kScaleRegs; ++u) {
    const int i = lane + u * dev::kWarpSize;
    if (i < ns) d[i] = m.scales[u];
  }
  for (int i = lane + kScaleRegs * dev::kWarpSize; i < ns; i += dev::kWarpSize) d[i] = dev::ld_cg(src + i);
}

// Copies one token to every local rank of this node that hosts one of its experts, at its
// final row: into the outputs directly (this rank's, or a peer's in its arena), into a peer's
// NVLink staging otherwise.
__device__ void forward_token(const DispatchDev& p, const PeerRows& pr, const TokenIn& in,
                              const int (&rows)[kMaxLocal], int lane) {
  const DevCommon& c = p.c;
  uint8_t* dst[kMaxLocal];
  int nd = 0;
  for (int j = 0; j < c.L; ++j) {
    if (rows[j] < 0) continue;
    const int bound = p.recv_rows[j];
    if (rows[j] >= bound) {
      // A corrupted slot must not turn into a wild write: report it and drop the token.
      if (lane == 0) fail(c, kSiteDispatchRow, c.node * c.L + j, bound, -1, rows[j]);
      return;
    }
    dst[nd++] = pr.direct[j] ? pr.x[j] + static_cast<int64_t>(rows[j]) * p.row_bytes
                             : c.nvl[j] + p.stage_off + static_cast<int64_t>(rows[j]) * p.ss.bytes + p.ss.x;
  }
  if (nd == 0) return;
  const TokenMeta m = load_meta(in.scales, p.ns, in.gid64, in.gid32, in.w, p.K, lane);
  warp_copy(dst, nd, in.x, p.row_bytes, lane);
  const int idx_bytes = p.idx64 ? 8 : 4;
  for (int j = 0; j < c.L; ++j) {
    const int r = rows[j];
    if (r < 0) continue;
    const bool mine = pr.direct[j];
    uint8_t* st = mine ? nullptr : c.nvl[j] + p.stage_off + static_cast<int64_t>(r) * p.ss.bytes;
    if (p.ns > 0) {
      float* d = mine ? pr.scales[j] + static_cast<int64_t>(r) * p.ns : reinterpret_cast<float*>(st + p.ss.scales);
      store_scales(d, m, in.scales, p.ns, lane);
    }
    if (p.K > 0 && lane < p.K) {  // K <= kMaxTopk = 32: one entry per lane
      const int rank_j = c.node * c.L + j;
      uint8_t* di = mine ? pr.idx[j] + static_cast<int64_t>(r) * p.K * idx_bytes : st + p.ss.idx;
      float* dw = mine ? pr.w[j] + static_cast<int64_t>(r) * p.K : reinterpret_cast<float*>(st + p.ss.weights);
      const int64_t lid = m.gid - static_cast<int64_t>(rank_j) * p.epr;
      const bool valid = m.gid >= 0 && lid >= 0 && lid < p.epr;
      if (p.idx64) {
        reinterpret_cast<int64_t*>(di)[lane] = valid ? lid : -1;
      } else {
        reinterpret_cast<int*>(di)[lane] = valid ? static_cast<int>(lid) : -1;
      }
      dw[lane] = valid ? m.w : 0.0f;
    }
    if (p.recv_src != nullptr && lane == 0) {
      int* ds = mine ? pr.src[j] + r : reinterpret_cast<int*>(st + p.ss.src);
      *ds = in.src;
    }
  }
}

// Packs token t of this rank into a dispatch ring slot bound for node n (the metadata loaded
// first, as in forward_token).
__device__ void pack_token(const DispatchDev& p, uint8_t* slot, int t, int n, int lane) {
  const int64_t o = static_cast<int64_t>(t) * p.K;
  const float* scales = p.scales + static_cast<int64_t>(t) * p.ns;
  const TokenMeta m = load_meta(scales, p.ns, p.idx64 ? static_cast<const int64_t*>(p.topk_idx) + o : nullptr,
                                p.idx64 ? nullptr : static_cast<const int*>(p.topk_idx) + o, p.topk_w + o, p.K, lane);
  const int row = lane < p.c.L ? p.dst_row[static_cast<int64_t>(t) * p.c.num_ranks + n * p.c.L + lane] : 0;
  uint8_t* d[1] = {slot + p.ds.x};
  warp_copy(d, 1, p.x + static_cast<int64_t>(t) * p.row_bytes, p.row_bytes, lane);
  store_scales(reinterpret_cast<float*>(slot + p.ds.scales), m, scales, p.ns, lane);
  if (lane < p.K) {  // K <= kMaxTopk = 32: one entry per lane
    reinterpret_cast<int*>(slot + p.ds.gid)[lane] = static_cast<int>(m.gid);
    reinterpret_cast<float*>(slot + p.ds.weights)[lane] = m.w;
  }
  if (lane == 0) *reinterpret_cast<int*>(slot + p.ds.src) = t;
  if (lane < p.c.L) reinterpret_cast<int*>(slot + p.ds.rows)[lane] = row;
}

// Token t of this rank bound for its own node: forwarded over NVLink right away.
__device__ void forward_own(const DispatchDev& p, const PeerRows& pr, int t, int lane) {
  const DevCommon& c = p.c;
  int rows[kMaxLocal];
  for (int j = 0; j < c.L; ++j) rows[j] = p.dst_row[static_cast<int64_t>(t) * c.num_ranks + c.node * c.L + j];
  TokenIn in{};
  in.x = p.x + static_cast<int64_t>(t) * p.row_bytes;
  in.scales = p.scales + static_cast<int64_t>(t) * p.ns;
  if (p.K > 0) {
    const int64_t o = static_cast<int64_t>(t) * p.K;
    if (p.idx64) {
      in.gid64 = static_cast<const int64_t*>(p.topk_idx) + o;
    } else {
      in.gid32 = static_cast<const int*>(p.topk_idx) + o;
    }
    in.w = p.topk_w + o;
  }
  in.src = t;
  forward_token(p, pr, in, rows, lane);
}

__device__ void dispatch_sender(const DispatchDev& p, const PeerRows& pr, int ch) {
  const DevCommon& c = p.c;
  const int lane = threadIdx.x % dev::kWarpSize;
  const Range range = channel_range(p.T, c.C, ch);
  const SendKinds kinds{kDispatchHead, kDispatchTail, kDispatchSent, kSiteDispatchSend};
  const int round = ring_send(
      c, p.rl, ch, kinds, [&](int n) { return p.list_count[ch * c.N + n]; },
      [&](int n, int pos, uint8_t* slot) {
        const int t = p.lists[static_cast<int64_t>(n) * p.T + range.begin + pos];
        if (slot == nullptr) {
          forward_own(p, pr, t, lane);
        } else {
          pack_token(p, slot, t, n, lane);
        }
      });
  if (threadIdx.x == 0 && round == kDone) {
    // End-of-stream markers: the forwarders learn this channel sent everything.
    for (int n = 0; n < c.N; ++n) {
      if (n == c.node) continue;
      const int peer = n * c.L + c.local;
      if (!push_cmd(c, ch, make_atomic(peer, counter_index(kDispatchDone, ch, c.node), 1), peer)) break;
    }
  }
}

// Thread 0: the slots available per source node this round (s_avail), or done/stop/wait.
__device__ int plan_forward_round(const DevCommon& c, int ch, const int64_t* s_cons, const int64_t* s_calls,
                                  int* s_fin, int* s_avail, int prev, uint64_t& last_progress) {
  bool all_done = true, any = false;
  int waiting = -1;
  int64_t want = 0, got = 0;
  for (int m = 0; m < c.N; ++m) {
    s_avail[m] = 0;
    if (s_fin[m]) continue;
    // One PCIe read while tokens flow. When none are new, the end marker: it follows every
    // tail update of the stream (one FIFO channel, receiver ordering), so a tail read after
    // seeing the marker is the final one.
    int64_t tail = ld_counter(c.counters + counter_index(kDispatchTail, ch, m));
    int64_t done = -1;
    if (tail == s_cons[m]) {
      done = ld_counter(c.counters + counter_index(kDispatchDone, ch, m));
      tail = ld_counter(c.counters + counter_index(kDispatchTail, ch, m));
    }
    int64_t avail = tail - s_cons[m];
    if (avail < 0 || avail > c.cap) {
      fail(c, kSiteDispatchForward, m * c.L + c.local, s_cons[m], ch, tail);
      avail = 0;
    }
    if (avail == 0 && done >= s_calls[m]) {
      s_fin[m] = 1;
      continue;
    }
    all_done = false;
    if (avail == 0 && waiting < 0) waiting = m, want = s_cons[m] + 1, got = tail;
    s_avail[m] = static_cast<int>(avail);
    any |= avail > 0;
  }
  return settle_round(c, all_done, any, prev, kSiteDispatchForward, waiting * c.L + c.local, want, ch, got,
                      last_progress);
}

__device__ void dispatch_forwarder(const DispatchDev& p, const PeerRows& pr, int ch) {
  const DevCommon& c = p.c;
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  __shared__ int64_t s_cons[kMaxNodes], s_calls[kMaxNodes];
  __shared__ int s_avail[kMaxNodes], s_fin[kMaxNodes];
  __shared__ int s_round;
  if (tid < c.N) {
    s_cons[tid] = c.state[state_index(kDispatchConsumed, ch, tid)];
    s_calls[tid] = c.state[state_index(kDispatchCalls, ch, tid)] + 1;
    s_fin[tid] = tid == c.node;
    s_avail[tid] = 0;
  }
  if (tid == 0) {
    s_round = kGo;
    // Calls are separated by a barrier, so a source's end markers are at most this call's one
    // ahead of what this channel has seen; anything else means corrupted state: fail now
    // rather than wait for a marker that never comes.
    for (int m = 0; m < c.N; ++m) {
      if (m == c.node) continue;
      const int64_t done = ld_counter(c.counters + counter_index(kDispatchDone, ch, m));
      if (done < s_calls[m] - 1 || done > s_calls[m]) {
        fail(c, kSiteDispatchForward, m * c.L + c.local, s_calls[m], ch, done);
        s_round = kStop;
      }
    }
  }
  __syncthreads();
  uint64_t last_progress = dev::global_timer_ns();
  RoundTrace tr(c);
  int round = kGo;
  for (;;) {
    if (tid == 0) {
      s_round = plan_forward_round(c, ch, s_cons, s_calls, s_fin, s_avail, s_round, last_progress);
      tr.planned(s_round);
    }
    round = broadcast_round(s_round);
    if (round == kDone || round == kStop) break;
    if (round != kGo) continue;
    int total = 0;
    for (int m = 0; m < c.N; ++m) total += s_avail[m];
    for (int item = warp; item < total; item += kWarps) {
      int m = 0, i = item;
      while (i >= s_avail[m]) i -= s_avail[m++];
      const uint8_t* slot = c.region + ring_slot_offset(p.rl.recv_offset, p.rl, ch, m, s_cons[m] + i);
      int rows[kMaxLocal];
      const int* srows = reinterpret_cast<const int*>(slot + p.ds.rows);
      for (int j = 0; j < c.L; ++j) rows[j] = dev::ld_cg(srows + j);
      TokenIn in{};
      in.x = slot + p.ds.x;
      in.scales = reinterpret_cast<const float*>(slot + p.ds.scales);
      in.gid32 = reinterpret_cast<const int*>(slot + p.ds.gid);
      in.w = reinterpret_cast<const float*>(slot + p.ds.weights);
      in.src = dev::ld_cg(reinterpret_cast<const int*>(slot + p.ds.src));
      forward_token(p, pr, in, rows, lane);
      if (p.plan != nullptr && lane < c.L && in.src >= 0 && in.src < p.plan_T)
        p.plan[(static_cast<int64_t>(m) * p.plan_T + in.src) * c.L + lane] = rows[lane];
    }
    __syncthreads();
    if (tid == 0) {
      tr.moved();
      // Slots are free again once every warp copied out of them (the barrier above).
      for (int m = 0; m < c.N; ++m) {
        if (s_avail[m] == 0) continue;
        s_cons[m] += s_avail[m];
        if (!push_add(c, ch, m * c.L + c.local, counter_index(kDispatchHead, ch, c.node), s_avail[m])) {
          s_round = kStop;
          break;
        }
      }
      tr.pushed();
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid < c.N) {
    c.state[state_index(kDispatchConsumed, ch, tid)] = s_cons[tid];
    if (round == kDone && tid != c.node) c.state[state_index(kDispatchCalls, ch, tid)] = s_calls[tid];
  }
  tr.store(c);
}

__global__ void __launch_bounds__(kThreads) dispatch_kernel(DispatchDev p) {
  if (rejected(p.c)) return;
  __shared__ PeerRows s_rows;
  if (!load_peer_rows(p, s_rows)) return;
  const int ch = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    dispatch_sender(p, s_rows, ch);
  } else {
    dispatch_forwarder(p, s_rows, ch);
  }
}

// Runs after node_barrier_kernel on the same stream: every peer's staged rows have landed.
__global__ void __launch_bounds__(kThreads) dispatch_finish_kernel(DispatchDev p) {
  if (aborted(p.c)) return;  // a wait failed: nothing reliable to copy
  __shared__ int s_prefix[kMaxRanks + 1];
  const int R = p.c.num_ranks;
  for (int s = threadIdx.x; s <= R; s += blockDim.x) s_prefix[s] = p.recv_prefix[s];
  __syncthreads();
  const int lane = threadIdx.x % dev::kWarpSize;
  const int gw = blockIdx.x * kWarps + threadIdx.x / dev::kWarpSize, nw = gridDim.x * kWarps;
  const int total = s_prefix[R];
  const uint8_t* stage = p.c.nvl[p.c.local] + p.stage_off;
  for (int r = gw; r < total; r += nw) {
    int s = 0;
    while (s_prefix[s + 1] <= r) ++s;
    if (s % p.c.L == p.c.local) continue;  // forwarded by this rank: already in the outputs
    const uint8_t* row = stage + static_cast<int64_t>(r) * p.ss.bytes;
    uint8_t* d[1] = {p.recv_x + static_cast<int64_t>(r) * p.row_bytes};
    warp_copy(d, 1, row + p.ss.x, p.row_bytes, lane);
    for (int i = lane; i < p.ns; i += dev::kWarpSize)
      p.recv_scales[static_cast<int64_t>(r) * p.ns + i] = dev::ld_cg(reinterpret_cast<const float*>(row + p.ss.scales) + i);
    for (int k = lane; k < p.K; k += dev::kWarpSize) {
      if (p.idx64) {
        static_cast<int64_t*>(p.recv_idx)[static_cast<int64_t>(r) * p.K + k] =
            dev::ld_cg(reinterpret_cast<const int64_t*>(row + p.ss.idx) + k);
      } else {
        static_cast<int*>(p.recv_idx)[static_cast<int64_t>(r) * p.K + k] =
            dev::ld_cg(reinterpret_cast<const int*>(row + p.ss.idx) + k);
      }
      p.recv_w[static_cast<int64_t>(r) * p.K + k] = dev::ld_cg(reinterpret_cast<const float*>(row + p.ss.weights) + k);
    }
    if (p.recv_src != nullptr && lane == 0) p.recv_src[r] = dev::ld_cg(reinterpret_cast<const int*>(row + p.ss.src));
  }
}

DispatchDev make_dispatch(const DispatchArgs& a) {
  DispatchDev p{};
  p.c = make_common(a.common);
  UCCL_EP_CHECK_ARG(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row_bytes=", a.row_bytes,
                    " must be a positive multiple of 16 (hidden * element size)");
  UCCL_EP_CHECK_ARG(a.num_topk >= 0 && a.num_topk <= kMaxTopk, "num_topk=", a.num_topk, " exceeds ", kMaxTopk);
  UCCL_EP_CHECK_ARG(a.recv_rows != 0 && a.recv_prefix != 0, "dispatch without its recv_rows / recv_prefix tables");
  UCCL_EP_CHECK_ARG(a.common.num_ranks <= kMaxRanks, "num_ranks=", a.common.num_ranks, " exceeds ", kMaxRanks);
  p.ds = dispatch_slot(a.row_bytes, a.num_scales, a.num_topk, p.c.L);
  p.ss = stage_slot(a.row_bytes, a.num_scales, a.num_topk, a.idx_is_64 ? 8 : 4);
  p.rl = ring_layout(false, a.common.region_bytes, p.c.C, p.c.N, p.c.cap, p.ds.bytes);
  UCCL_EP_CHECK_ARG(p.rl.bytes <= region_half_bytes(a.common.region_bytes), "dispatch rings need ", p.rl.bytes,
                    " bytes but half the RDMA region is ", region_half_bytes(a.common.region_bytes));
  UCCL_EP_CHECK_ARG(static_cast<int64_t>(p.c.chunk) * p.ds.bytes <= cmd_limits::kMaxLength, "a chunk of ",
                    p.c.chunk, " tokens of ", p.ds.bytes, " bytes exceeds one write's ", cmd_limits::kMaxLength,
                    " bytes");
  p.T = a.num_tokens;
  p.K = a.num_topk;
  p.ns = a.num_scales;
  p.epr = a.experts_per_rank;
  p.row_bytes = a.row_bytes;
  p.x = reinterpret_cast<const uint8_t*>(a.x);
  p.scales = reinterpret_cast<const float*>(a.x_scales);
  p.topk_idx = reinterpret_cast<const void*>(a.topk_idx);
  p.idx64 = a.idx_is_64;
  p.topk_w = reinterpret_cast<const float*>(a.topk_weights);
  p.dst_row = reinterpret_cast<const int*>(a.dst_row);
  p.lists = reinterpret_cast<const int*>(a.lists);
  p.list_count = reinterpret_cast<const int*>(a.list_count);
  p.recv_x = reinterpret_cast<uint8_t*>(a.recv_x);
  p.recv_scales = reinterpret_cast<float*>(a.recv_scales);
  p.recv_idx = reinterpret_cast<void*>(a.recv_topk_idx);
  p.recv_w = reinterpret_cast<float*>(a.recv_topk_weights);
  p.recv_src = reinterpret_cast<int*>(a.recv_src_idx);
  p.plan = reinterpret_cast<int*>(a.plan);
  p.plan_T = a.plan_tokens;
  p.stage_off = a.stage_offset;
  p.recv_rows = reinterpret_cast<const int*>(a.recv_rows);
  p.recv_prefix = reinterpret_cast<const int*>(a.recv_prefix);
  for (int i = 0; i < kPlaceWords; ++i) p.place[i] = a.place[i];
  p.place_seq = a.place_seq;
  return p;
}

}  // namespace

std::vector<const void*> dispatch_kernels() {
  return {reinterpret_cast<const void*>(dispatch_kernel), reinterpret_cast<const void*>(dispatch_finish_kernel)};
}

}  // namespace detail

void dispatch(const DispatchArgs& a, intptr_t stream) {
  const detail::DispatchDev p = detail::make_dispatch(a);
  detail::dispatch_kernel<<<2 * p.c.C, detail::kThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(p);
  GPU_CHECK(gpuGetLastError());
}

void dispatch_finish(const DispatchArgs& a, uint64_t barrier_seq, intptr_t stream) {
  const detail::DispatchDev p = detail::make_dispatch(a);
  node_barrier(a.common, barrier_seq, stream);
  if (a.place[0] == kPlaceArena) return;  // the peers wrote their rows into the outputs
  // The barrier is one block (signal and wait are per block); the copy then spreads out.
  detail::dispatch_finish_kernel<<<detail::grid_for(a.out_rows, detail::kWarps), detail::kThreads, 0,
                                   reinterpret_cast<gpuStream_t>(stream)>>>(p);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::internode

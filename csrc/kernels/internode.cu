// Internode HT dispatch/combine kernels (see internode.h for the roles of the blocks).
//
// Each kernel runs 2 * C blocks: even blocks send (push TransferCmds into FIFO channel c % F),
// odd blocks receive (poll the software-atomic counters the proxy bumps). A block decides each
// round on thread 0 (which streams have room or data), all warps then move tokens one warp per
// token, and thread 0 publishes the round with FIFO pushes. Commands of one ring stream always
// go to the same FIFO channel, so the proxy's per-stream sequence numbers order a chunk's
// write before its tail update even on transports that deliver out of order (EFA, ipc with
// the reorder injector).
#include <cstring>

#if defined(__HIP_PLATFORM_AMD__) || defined(USE_ROCM) || defined(UCCL_EP_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda.h>
#include <cuda_fp16.h>
#endif

#include "common/errors.h"
#include "common/gpu.h"
#include "fifo/fifo_device.cuh"
#include "kernels/common.cuh"
#include "kernels/internode.h"

namespace uccl_ep::internode {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / dev::kWarpSize;
constexpr int kBarrierThreads = 256;

// ---- plumbing shared by every kernel ----------------------------------------------------
struct DevCommon {
  int rank, num_ranks, L, N, node, local, C;
  const FifoDeviceHandle* fifos;
  int num_fifos;
  int64_t* counters;
  int64_t* state;
  uint8_t* region;
  uint8_t* nvl[kMaxLocal];
  int cap, chunk;
  int64_t* status;
  uint64_t timeout_ns;
};

DevCommon make_common(const Common& c) {
  UCCL_EP_CHECK_ARG(c.ranks_per_node >= 1 && c.ranks_per_node <= kMaxLocal && c.num_ranks % c.ranks_per_node == 0,
                    "ranks_per_node=", c.ranks_per_node, " must be in [1, ", kMaxLocal, "] and divide num_ranks=",
                    c.num_ranks);
  const int nodes = c.num_ranks / c.ranks_per_node;
  UCCL_EP_CHECK_ARG(nodes >= 2 && nodes <= kMaxNodes, "internode kernels need 2..", kMaxNodes, " nodes, got ", nodes);
  UCCL_EP_CHECK_ARG(c.num_channels >= 1 && c.num_channels <= kMaxChannels, "num_channels=", c.num_channels,
                    " must be in [1, ", kMaxChannels, "] (Config.num_sms / 2)");
  UCCL_EP_CHECK_ARG(c.num_fifos >= 1 && c.fifo_handles && c.counters && c.state && c.region && c.status,
                    "internode launch without FIFO handles, counters, state, region or status");
  UCCL_EP_CHECK_ARG(static_cast<int>(c.nvl.size()) == c.ranks_per_node, "nvl buffers: ", c.nvl.size(),
                    " for ", c.ranks_per_node, " local ranks");
  UCCL_EP_CHECK_ARG(c.cap >= 1 && c.chunk >= 1 && c.chunk <= c.cap, "ring cap=", c.cap, " chunk=", c.chunk);
  DevCommon d{};
  d.rank = c.rank;
  d.num_ranks = c.num_ranks;
  d.L = c.ranks_per_node;
  d.N = nodes;
  d.node = c.rank / c.ranks_per_node;
  d.local = c.rank % c.ranks_per_node;
  d.C = c.num_channels;
  d.fifos = reinterpret_cast<const FifoDeviceHandle*>(c.fifo_handles);
  d.num_fifos = c.num_fifos;
  d.counters = reinterpret_cast<int64_t*>(c.counters);
  d.state = reinterpret_cast<int64_t*>(c.state);
  d.region = reinterpret_cast<uint8_t*>(c.region);
  for (int j = 0; j < c.ranks_per_node; ++j) d.nvl[j] = reinterpret_cast<uint8_t*>(c.nvl[j]);
  d.cap = c.cap;
  d.chunk = c.chunk;
  d.status = reinterpret_cast<int64_t*>(c.status);
  d.timeout_ns = static_cast<uint64_t>(c.timeout_ns);
  return d;
}

__device__ __forceinline__ int64_t ld_counter(const int64_t* p) {
  return static_cast<int64_t>(dev::ld_acquire_sys(reinterpret_cast<const uint64_t*>(p)));
}

__device__ __forceinline__ bool aborted(const DevCommon& p) {
  return *reinterpret_cast<volatile int64_t*>(p.state + kStateAbortWord) != 0;
}

// First failure wins (CAS in device memory, where atomics are cheap and always atomic); its
// details go to the mapped host status words, published by [0] last.
__device__ void fail(const DevCommon& p, int site, int peer, int64_t want, int channel, int64_t got) {
  auto* word = reinterpret_cast<unsigned long long*>(p.state + kStateAbortWord);
  if (atomicCAS(word, 0ull, 1ull) != 0ull) return;
  volatile int64_t* st = p.status;
  st[1] = peer;
  st[2] = want;
  st[3] = site;
  st[4] = channel;
  st[5] = got;
  __threadfence_system();
  st[0] = 1;
  __threadfence_system();
}

// Loads of bytes another agent (proxy DMA, NIC, a peer GPU) wrote during this kernel bypass L1.
template <typename T>
__device__ __forceinline__ T ld_cg(const T* p) {
#if defined(UCCL_EP_DEVICE_HIP)
  return __builtin_nontemporal_load(p);
#else
  return __ldcg(p);
#endif
}

__device__ __forceinline__ void ld_cg16(const uint8_t* p, int4& v) {
#if defined(UCCL_EP_DEVICE_HIP)
  const int* q = reinterpret_cast<const int*>(p);
  v.x = __builtin_nontemporal_load(q);
  v.y = __builtin_nontemporal_load(q + 1);
  v.z = __builtin_nontemporal_load(q + 2);
  v.w = __builtin_nontemporal_load(q + 3);
#else
  v = __ldcg(reinterpret_cast<const int4*>(p));
#endif
}

// Warp copy of `bytes` (multiple of 16) from src to up to kMaxLocal destinations.
__device__ __forceinline__ void warp_copy(uint8_t* const* dst, int ndst, const uint8_t* src, int64_t bytes, int lane) {
  constexpr int kUnroll = 4;
  const int64_t n = bytes / 16;
  for (int64_t base = 0; base < n; base += kUnroll * dev::kWarpSize) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * dev::kWarpSize + lane;
      if (i < n) ld_cg16(src + i * 16, v[u]);
    }
    for (int d = 0; d < ndst; ++d) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = base + u * dev::kWarpSize + lane;
        if (i < n) *reinterpret_cast<int4*>(dst[d] + i * 16) = v[u];
      }
    }
  }
}

// One FIFO push on the channel of ring-channel c; a failed push (proxy stopped, or the FIFO
// stayed full past its deadline) aborts the kernel.
__device__ bool push_cmd(const DevCommon& p, int c, const TransferCmd& cmd, int peer) {
  if (fifo_push(p.fifos[c % p.num_fifos], cmd) == kFifoPushFailed) {
    fail(p, kSiteFifo, peer, 0, c, 0);
    return false;
  }
  return true;
}

// Writes k slots of send ring (c, ring_node) starting at cumulative index `start` into the
// receive ring (c, my node) of `dst_rank`, then adds k to counter `counter` there. A wrapping
// chunk is two writes; the tail atomic rides on the last one (or follows, when k needs more
// than one 11-bit atomic). All in one FIFO channel: the proxy delivers them in this order.
__device__ bool push_chunk(const DevCommon& p, const RingLayout& rl, int c, int ring_node, int dst_rank,
                           int64_t start, int k, int counter) {
  const ChunkPieces pc = chunk_pieces(start, k, rl.cap);
  const bool inline_atomic = k <= kMaxAtomicStep;
  const uint64_t src1 = ring_slot_offset(rl.send_offset, rl, c, ring_node, start);
  const uint64_t dst1 = ring_slot_offset(rl.recv_offset, rl, c, p.node, start);
  const uint32_t len1 = static_cast<uint32_t>(pc.n1 * rl.slot_bytes);
  if (pc.n2 == 0) {
    TransferCmd cmd = inline_atomic ? make_write_atomic(dst_rank, src1, dst1, len1, counter, k)
                                    : make_write(dst_rank, src1, dst1, len1);
    if (!push_cmd(p, c, cmd, dst_rank)) return false;
  } else {
    if (!push_cmd(p, c, make_write(dst_rank, src1, dst1, len1), dst_rank)) return false;
    const uint64_t src2 = ring_slot_offset(rl.send_offset, rl, c, ring_node, start + pc.n1);
    const uint64_t dst2 = ring_slot_offset(rl.recv_offset, rl, c, p.node, start + pc.n1);
    const uint32_t len2 = static_cast<uint32_t>(pc.n2 * rl.slot_bytes);
    TransferCmd cmd = inline_atomic ? make_write_atomic(dst_rank, src2, dst2, len2, counter, k)
                                    : make_write(dst_rank, src2, dst2, len2);
    if (!push_cmd(p, c, cmd, dst_rank)) return false;
  }
  if (!inline_atomic) {
    for (int i = 0; i < atomic_steps(k); ++i) {
      if (!push_cmd(p, c, make_atomic(dst_rank, counter, atomic_step_value(k, i)), dst_rank)) return false;
    }
  }
  return true;
}

// Counter increment of any size as a series of 11-bit software atomics.
__device__ bool push_add(const DevCommon& p, int c, int dst_rank, int counter, int64_t delta) {
  for (int i = 0; i < atomic_steps(delta); ++i) {
    if (!push_cmd(p, c, make_atomic(dst_rank, counter, atomic_step_value(delta, i)), dst_rank)) return false;
  }
  return true;
}

// Round decisions thread 0 broadcasts.
enum RoundState : int { kGo = 0, kWait = 1, kDone = 2, kStop = 3 };

__device__ __forceinline__ void backoff() {
#if defined(UCCL_EP_DEVICE_HIP)
  __builtin_amdgcn_s_sleep(2);
#else
  __nanosleep(128);
#endif
}

// Thread 0's decision for one round of a sender or forwarder loop: stop (prev == kStop marks
// thread 0's own push failure; or another block failed), done, go, or wait (backing off; after
// timeout_ns without progress it fails, naming the stalled peer, `want` and `got`, at `site`).
__device__ int settle_round(const DevCommon& c, bool all_done, bool any, int prev, int site, int peer, int64_t want,
                            int ch, int64_t got, uint64_t& last_progress) {
  if (prev == kStop || aborted(c)) return kStop;
  if (all_done) return kDone;
  if (any) {
    last_progress = fifo_now_ns();
    return kGo;
  }
  if (fifo_now_ns() - last_progress > c.timeout_ns) {
    fail(c, site, peer, want, ch, got);
    return kStop;
  }
  backoff();
  return kWait;
}

// Every thread of the block gets the decision thread 0 wrote to s_round.
__device__ __forceinline__ int broadcast_round(const int& s_round) {
  __syncthreads();
  const int round = s_round;
  // Nobody reads s_round again until thread 0 rewrote it for the next round.
  __syncthreads();
  return round;
}

// Thread 0 of a sender block: the tokens for each node this round (s_k), at most a chunk and
// the room left in node n's ring (head counter `head_kind`); the own node's rows need no ring.
__device__ int plan_send_round(const DevCommon& c, int ch, int head_kind, int site, const int* s_cnt,
                               const int* s_pos, const int64_t* s_sent, int* s_k, int prev,
                               uint64_t& last_progress) {
  bool all_done = true, any = false;
  int blocked = -1;
  int64_t want = 0, got = 0;
  for (int n = 0; n < c.N; ++n) {
    s_k[n] = 0;
    const int remaining = s_cnt[n] - s_pos[n];
    if (remaining <= 0) continue;
    all_done = false;
    int k = remaining < c.chunk ? remaining : c.chunk;
    if (n != c.node) {
      const int64_t head = ld_counter(c.counters + counter_index(head_kind, ch, n));
      const int64_t room = c.cap - (s_sent[n] - head);
      if (room < k) {
        if (blocked < 0) blocked = n, want = s_sent[n] + k - c.cap, got = head;
        k = room > 0 ? static_cast<int>(room) : 0;
      }
    }
    s_k[n] = k;
    any |= k > 0;
  }
  return settle_round(c, all_done, any, prev, site, blocked * c.L + c.local, want, ch, got, last_progress);
}

using kernels::Elt;

// ==== dispatch ============================================================================
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
  int recv_rows[kMaxLocal];  // output rows of each local rank: a slot's row must be below
};

// Where token data comes from: the caller's tensors (own-node tokens) or a ring slot.
struct TokenIn {
  const uint8_t* x;
  const float* scales;
  const int* gid32;      // ring slot ids (int32), or
  const int64_t* gid64;  // the caller's int64 ids, or gid32 pointing at the caller's int32 ids
  const float* w;
  int src;
};

// Copies one token to every local rank of this node that hosts one of its experts, at its
// final row: into this rank's outputs directly, into a peer's NVLink staging otherwise.
__device__ void forward_token(const DispatchDev& p, const TokenIn& in, const int (&rows)[kMaxLocal], int lane) {
  const DevCommon& c = p.c;
  uint8_t* dst[kMaxLocal];
  int nd = 0;
  for (int j = 0; j < c.L; ++j) {
    if (rows[j] < 0) continue;
    if (rows[j] >= p.recv_rows[j]) {
      // A corrupted slot must not turn into a wild write: report it and drop the token.
      if (lane == 0) fail(c, kSiteDispatchRow, c.node * c.L + j, p.recv_rows[j], -1, rows[j]);
      return;
    }
    dst[nd++] = j == c.local ? p.recv_x + static_cast<int64_t>(rows[j]) * p.row_bytes
                             : c.nvl[j] + p.stage_off + static_cast<int64_t>(rows[j]) * p.ss.bytes + p.ss.x;
  }
  if (nd == 0) return;
  warp_copy(dst, nd, in.x, p.row_bytes, lane);
  const int idx_bytes = p.idx64 ? 8 : 4;
  for (int j = 0; j < c.L; ++j) {
    const int r = rows[j];
    if (r < 0) continue;
    const bool mine = j == c.local;
    uint8_t* st = mine ? nullptr : c.nvl[j] + p.stage_off + static_cast<int64_t>(r) * p.ss.bytes;
    if (p.ns > 0) {
      float* d = mine ? p.recv_scales + static_cast<int64_t>(r) * p.ns : reinterpret_cast<float*>(st + p.ss.scales);
      for (int i = lane; i < p.ns; i += dev::kWarpSize) d[i] = ld_cg(in.scales + i);
    }
    if (p.K > 0) {
      const int rank_j = c.node * c.L + j;
      uint8_t* di = mine ? static_cast<uint8_t*>(p.recv_idx) + static_cast<int64_t>(r) * p.K * idx_bytes : st + p.ss.idx;
      float* dw = mine ? p.recv_w + static_cast<int64_t>(r) * p.K : reinterpret_cast<float*>(st + p.ss.weights);
      for (int k = lane; k < p.K; k += dev::kWarpSize) {
        const int64_t gid = in.gid64 ? ld_cg(in.gid64 + k) : static_cast<int64_t>(ld_cg(in.gid32 + k));
        const int64_t lid = gid - static_cast<int64_t>(rank_j) * p.epr;
        const bool valid = gid >= 0 && lid >= 0 && lid < p.epr;
        if (p.idx64) {
          reinterpret_cast<int64_t*>(di)[k] = valid ? lid : -1;
        } else {
          reinterpret_cast<int*>(di)[k] = valid ? static_cast<int>(lid) : -1;
        }
        dw[k] = valid ? ld_cg(in.w + k) : 0.0f;
      }
    }
    if (p.recv_src != nullptr && lane == 0) {
      int* ds = mine ? p.recv_src + r : reinterpret_cast<int*>(st + p.ss.src);
      *ds = in.src;
    }
  }
}

// Packs token t of this rank into a dispatch ring slot bound for node n.
__device__ void pack_token(const DispatchDev& p, uint8_t* slot, int t, int n, int lane) {
  uint8_t* d[1] = {slot + p.ds.x};
  warp_copy(d, 1, p.x + static_cast<int64_t>(t) * p.row_bytes, p.row_bytes, lane);
  float* sc = reinterpret_cast<float*>(slot + p.ds.scales);
  for (int i = lane; i < p.ns; i += dev::kWarpSize) sc[i] = p.scales[static_cast<int64_t>(t) * p.ns + i];
  int* gid = reinterpret_cast<int*>(slot + p.ds.gid);
  float* w = reinterpret_cast<float*>(slot + p.ds.weights);
  for (int k = lane; k < p.K; k += dev::kWarpSize) {
    const int64_t o = static_cast<int64_t>(t) * p.K + k;
    gid[k] = p.idx64 ? static_cast<int>(static_cast<const int64_t*>(p.topk_idx)[o]) : static_cast<const int*>(p.topk_idx)[o];
    w[k] = p.topk_w[o];
  }
  if (lane == 0) *reinterpret_cast<int*>(slot + p.ds.src) = t;
  int* rows = reinterpret_cast<int*>(slot + p.ds.rows);
  for (int j = lane; j < p.c.L; j += dev::kWarpSize) rows[j] = p.dst_row[static_cast<int64_t>(t) * p.c.num_ranks + n * p.c.L + j];
}

__device__ void dispatch_sender(const DispatchDev& p, int ch) {
  const DevCommon& c = p.c;
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  const Range range = channel_range(p.T, c.C, ch);
  __shared__ int s_pos[kMaxNodes], s_k[kMaxNodes], s_cnt[kMaxNodes];
  __shared__ int64_t s_sent[kMaxNodes];
  __shared__ int s_round;
  if (tid < c.N) {
    s_pos[tid] = 0;
    s_cnt[tid] = p.list_count[ch * c.N + tid];
    s_sent[tid] = c.state[state_index(kDispatchSent, ch, tid)];
  }
  if (tid == 0) s_round = kGo;
  __syncthreads();
  uint64_t last_progress = fifo_now_ns();
  int round = kGo;
  for (;;) {
    if (tid == 0) {
      s_round = plan_send_round(c, ch, kDispatchHead, kSiteDispatchSend, s_cnt, s_pos, s_sent, s_k, s_round,
                                last_progress);
    }
    round = broadcast_round(s_round);
    const int st = round;
    if (st == kDone || st == kStop) break;
    if (st == kGo) {
      int total = 0;
      for (int n = 0; n < c.N; ++n) total += s_k[n];
      for (int item = warp; item < total; item += kWarps) {
        int n = 0, i = item;
        while (i >= s_k[n]) i -= s_k[n++];
        const int t = p.lists[static_cast<int64_t>(n) * p.T + range.begin + s_pos[n] + i];
        if (n == c.node) {
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
          forward_token(p, in, rows, lane);
        } else {
          uint8_t* slot = c.region + ring_slot_offset(p.rl.send_offset, p.rl, ch, n, s_sent[n] + i);
          pack_token(p, slot, t, n, lane);
        }
      }
      // The proxy (or NIC) reads the slots once the command is visible: publish them first.
      __threadfence_system();
      __syncthreads();
      if (tid == 0) {
        bool ok = true;
        for (int n = 0; n < c.N && ok; ++n) {
          const int k = s_k[n];
          if (k == 0) continue;
          if (n != c.node) {
            ok = push_chunk(c, p.rl, ch, n, n * c.L + c.local, s_sent[n], k, counter_index(kDispatchTail, ch, c.node));
            s_sent[n] += k;
          }
          s_pos[n] += k;
        }
        if (!ok) s_round = kStop;
      }
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid == 0 && round == kDone) {
    // End-of-stream markers: the forwarders learn this channel sent everything.
    for (int n = 0; n < c.N; ++n) {
      if (n == c.node) continue;
      if (!push_cmd(c, ch, make_atomic(n * c.L + c.local, counter_index(kDispatchDone, ch, c.node), 1), n * c.L + c.local))
        break;
    }
  }
  if (tid < c.N) c.state[state_index(kDispatchSent, ch, tid)] = s_sent[tid];
}

__device__ void dispatch_forwarder(const DispatchDev& p, int ch) {
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
  uint64_t last_progress = fifo_now_ns();
  int round = kGo;
  for (;;) {
    if (tid == 0) {
      bool all_done = true, any = false;
      int waiting = -1;
      int64_t want = 0, got = 0;
      for (int m = 0; m < c.N; ++m) {
        s_avail[m] = 0;
        if (s_fin[m]) continue;
        // The end marker follows every tail update of the stream (one FIFO channel, receiver
        // ordering), so a tail read after seeing the marker is the final one.
        const int64_t done = ld_counter(c.counters + counter_index(kDispatchDone, ch, m));
        const int64_t tail = ld_counter(c.counters + counter_index(kDispatchTail, ch, m));
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
      s_round = settle_round(c, all_done, any, s_round, kSiteDispatchForward, waiting * c.L + c.local, want, ch,
                             got, last_progress);
    }
    round = broadcast_round(s_round);
    const int st = round;
    if (st == kDone || st == kStop) break;
    if (st != kGo) continue;
    int total = 0;
    for (int m = 0; m < c.N; ++m) total += s_avail[m];
    for (int item = warp; item < total; item += kWarps) {
      int m = 0, i = item;
      while (i >= s_avail[m]) i -= s_avail[m++];
      const uint8_t* slot = c.region + ring_slot_offset(p.rl.recv_offset, p.rl, ch, m, s_cons[m] + i);
      int rows[kMaxLocal];
      const int* srows = reinterpret_cast<const int*>(slot + p.ds.rows);
      for (int j = 0; j < c.L; ++j) rows[j] = ld_cg(srows + j);
      TokenIn in{};
      in.x = slot + p.ds.x;
      in.scales = reinterpret_cast<const float*>(slot + p.ds.scales);
      in.gid32 = reinterpret_cast<const int*>(slot + p.ds.gid);
      in.w = reinterpret_cast<const float*>(slot + p.ds.weights);
      in.src = ld_cg(reinterpret_cast<const int*>(slot + p.ds.src));
      forward_token(p, in, rows, lane);
      if (p.plan != nullptr && lane < c.L && in.src >= 0 && in.src < p.plan_T)
        p.plan[(static_cast<int64_t>(m) * p.plan_T + in.src) * c.L + lane] = rows[lane];
    }
    __syncthreads();
    if (tid == 0) {
      // Slots are free again once every warp copied out of them (the barrier above).
      for (int m = 0; m < c.N; ++m) {
        if (s_avail[m] == 0) continue;
        s_cons[m] += s_avail[m];
        if (!push_add(c, ch, m * c.L + c.local, counter_index(kDispatchHead, ch, c.node), s_avail[m])) {
          s_round = kStop;
          break;
        }
      }
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid < c.N) {
    c.state[state_index(kDispatchConsumed, ch, tid)] = s_cons[tid];
    if (round == kDone && tid != c.node) c.state[state_index(kDispatchCalls, ch, tid)] = s_calls[tid];
  }
}

__global__ void __launch_bounds__(kThreads) dispatch_kernel(DispatchDev p) {
  const int ch = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    dispatch_sender(p, ch);
  } else {
    dispatch_forwarder(p, ch);
  }
}

struct FinishDev {
  int local, L;
  int64_t* bstatus;
  DispatchDev d;
  int recv_prefix[kMaxRanks + 1];
  int num_ranks;
};

// Runs after node_barrier_kernel on the same stream: every peer's staged rows have landed.
__global__ void __launch_bounds__(kThreads) dispatch_finish_kernel(FinishDev f) {
  if (kernels::status_set(f.bstatus)) return;  // the barrier timed out: nothing reliable to copy
  const DispatchDev& p = f.d;
  const int lane = threadIdx.x % dev::kWarpSize;
  const int gw = blockIdx.x * kWarps + threadIdx.x / dev::kWarpSize, nw = gridDim.x * kWarps;
  const int total = f.recv_prefix[f.num_ranks];
  const uint8_t* stage = f.d.c.nvl[f.local] + p.stage_off;
  for (int r = gw; r < total; r += nw) {
    int s = 0;
    while (f.recv_prefix[s + 1] <= r) ++s;
    if (s % f.L == f.local) continue;  // forwarded by this rank: already in the outputs
    const uint8_t* row = stage + static_cast<int64_t>(r) * p.ss.bytes;
    uint8_t* d[1] = {p.recv_x + static_cast<int64_t>(r) * p.row_bytes};
    warp_copy(d, 1, row + p.ss.x, p.row_bytes, lane);
    for (int i = lane; i < p.ns; i += dev::kWarpSize)
      p.recv_scales[static_cast<int64_t>(r) * p.ns + i] = ld_cg(reinterpret_cast<const float*>(row + p.ss.scales) + i);
    for (int k = lane; k < p.K; k += dev::kWarpSize) {
      if (p.idx64) {
        static_cast<int64_t*>(p.recv_idx)[static_cast<int64_t>(r) * p.K + k] =
            ld_cg(reinterpret_cast<const int64_t*>(row + p.ss.idx) + k);
      } else {
        static_cast<int*>(p.recv_idx)[static_cast<int64_t>(r) * p.K + k] =
            ld_cg(reinterpret_cast<const int*>(row + p.ss.idx) + k);
      }
      p.recv_w[static_cast<int64_t>(r) * p.K + k] = ld_cg(reinterpret_cast<const float*>(row + p.ss.weights) + k);
    }
    if (p.recv_src != nullptr && lane == 0) p.recv_src[r] = ld_cg(reinterpret_cast<const int*>(row + p.ss.src));
  }
}

// ==== combine =============================================================================
struct CombineDev {
  DevCommon c;
  RingLayout rl;
  CombineSlot cs;  // ring slot and NVLink staging row share this layout
  int dtype, K, T;
  int64_t row_bytes;
  const uint8_t* x;
  const float* w;
  const int* plan;
  int plan_T;
  const int* lists;
  const int* list_count;
  int src_T[kMaxNodes];
  const int* dst_row;
  const int* stream_cum;
  const uint8_t* bias0;
  const uint8_t* bias1;
  uint8_t* out;
  float* out_w;
  int64_t stage_off;
};

// Row r of local rank j's combine input: read in place for this rank, from j's staging else.
__device__ __forceinline__ const uint8_t* input_row(const CombineDev& p, int j, int r) {
  if (j == p.c.local) return p.x + static_cast<int64_t>(r) * p.row_bytes;
  return p.c.nvl[j] + p.stage_off + static_cast<int64_t>(r) * p.cs.bytes + p.cs.x;
}
__device__ __forceinline__ const float* input_w(const CombineDev& p, int j, int r) {
  if (j == p.c.local) return p.w + static_cast<int64_t>(r) * p.K;
  return reinterpret_cast<const float*>(p.c.nvl[j] + p.stage_off + static_cast<int64_t>(r) * p.cs.bytes + p.cs.weights);
}

// fp32 accumulate of one 16-byte vector of elements from `src` into acc.
template <int kDtype>
__device__ __forceinline__ void acc_vec(float (&acc)[16 / sizeof(typename Elt<kDtype>::raw)], const uint8_t* src,
                                        int64_t v) {
  using raw = typename Elt<kDtype>::raw;
  constexpr int E = 16 / sizeof(raw);
  int4 q;
  ld_cg16(src + v * 16, q);
  const raw* e = reinterpret_cast<const raw*>(&q);
#pragma unroll
  for (int i = 0; i < E; ++i) acc[i] += Elt<kDtype>::to_f(e[i]);
}

template <int kDtype>
__device__ __forceinline__ void store_vec(uint8_t* dst, int64_t v, const float (&acc)[16 / sizeof(typename Elt<kDtype>::raw)]) {
  using raw = typename Elt<kDtype>::raw;
  constexpr int E = 16 / sizeof(raw);
  int4 q;
  raw* e = reinterpret_cast<raw*>(&q);
#pragma unroll
  for (int i = 0; i < E; ++i) e[i] = Elt<kDtype>::from_f(acc[i]);
  *reinterpret_cast<int4*>(dst + v * 16) = q;
}

// Partial of this node for token t of source (m, my local): the sum of the local ranks' rows
// (ascending local rank, fp32), written in x's dtype into a combine ring slot.
template <int kDtype>
__device__ void pack_partial(const CombineDev& p, uint8_t* slot, int m, int t, int lane) {
  using raw = typename Elt<kDtype>::raw;
  constexpr int E = 16 / sizeof(raw);
  const int L = p.c.L;
  int rows[kMaxLocal];
  const int* pr = p.plan + (static_cast<int64_t>(m) * p.plan_T + t) * L;
  for (int j = 0; j < L; ++j) rows[j] = pr[j];
  const int64_t nv = p.row_bytes / 16;
  for (int64_t v = lane; v < nv; v += dev::kWarpSize) {
    float acc[E];
#pragma unroll
    for (int i = 0; i < E; ++i) acc[i] = 0.0f;
    for (int j = 0; j < L; ++j)
      if (rows[j] >= 0) acc_vec<kDtype>(acc, input_row(p, j, rows[j]), v);
    store_vec<kDtype>(slot + p.cs.x, v, acc);
  }
  float* w = reinterpret_cast<float*>(slot + p.cs.weights);
  for (int k = lane; k < p.K; k += dev::kWarpSize) {
    float s = 0.0f;
    for (int j = 0; j < L; ++j)
      if (rows[j] >= 0) s += ld_cg(input_w(p, j, rows[j]) + k);
    w[k] = s;
  }
  if (lane == 0) *reinterpret_cast<int*>(slot + p.cs.src) = t;
}

template <int kDtype>
__device__ void combine_forwarder(const CombineDev& p, int ch) {
  const DevCommon& c = p.c;
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  __shared__ int s_pos[kMaxNodes], s_k[kMaxNodes], s_cnt[kMaxNodes], s_begin[kMaxNodes];
  __shared__ int64_t s_sent[kMaxNodes];
  __shared__ int s_round;
  if (tid < c.N) {
    s_pos[tid] = 0;
    s_cnt[tid] = tid == c.node ? 0 : p.list_count[ch * c.N + tid];
    s_begin[tid] = channel_range(p.src_T[tid], c.C, ch).begin;
    s_sent[tid] = c.state[state_index(kCombineSent, ch, tid)];
  }
  if (tid == 0) s_round = kGo;
  __syncthreads();
  uint64_t last_progress = fifo_now_ns();
  int round = kGo;
  for (;;) {
    if (tid == 0) {
      s_round = plan_send_round(c, ch, kCombineHead, kSiteCombineSend, s_cnt, s_pos, s_sent, s_k, s_round,
                                last_progress);
    }
    round = broadcast_round(s_round);
    const int st = round;
    if (st == kDone || st == kStop) break;
    if (st != kGo) continue;
    int total = 0;
    for (int m = 0; m < c.N; ++m) total += s_k[m];
    for (int item = warp; item < total; item += kWarps) {
      int m = 0, i = item;
      while (i >= s_k[m]) i -= s_k[m++];
      const int t = p.lists[static_cast<int64_t>(m) * p.plan_T + s_begin[m] + s_pos[m] + i];
      uint8_t* slot = c.region + ring_slot_offset(p.rl.send_offset, p.rl, ch, m, s_sent[m] + i);
      pack_partial<kDtype>(p, slot, m, t, lane);
    }
    __threadfence_system();
    __syncthreads();
    if (tid == 0) {
      bool ok = true;
      for (int m = 0; m < c.N && ok; ++m) {
        const int k = s_k[m];
        if (k == 0) continue;
        ok = push_chunk(c, p.rl, ch, m, m * c.L + c.local, s_sent[m], k, counter_index(kCombineTail, ch, c.node));
        s_sent[m] += k;
        s_pos[m] += k;
      }
      if (!ok) s_round = kStop;
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid < c.N) c.state[state_index(kCombineSent, ch, tid)] = s_sent[tid];
}

template <int kDtype>
__device__ void combine_receiver(const CombineDev& p, int ch) {
  using raw = typename Elt<kDtype>::raw;
  constexpr int E = 16 / sizeof(raw);
  const DevCommon& c = p.c;
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  const Range range = channel_range(p.T, c.C, ch);
  __shared__ int64_t s_base[kMaxNodes];  // ring position of this call's first partial per node
  __shared__ int s_prev[kMaxNodes];      // partials per node consumed before this window
  __shared__ int s_round;
  if (tid < c.N) {
    s_base[tid] = c.state[state_index(kCombineConsumed, ch, tid)];
    s_prev[tid] = 0;
  }
  if (tid == 0) s_round = kGo;
  __syncthreads();
  // A window never needs more partials from a node than its ring holds: the senders can
  // always deliver a whole window once the previous one was released.
  const int window = c.cap < 4 * kWarps ? c.cap : 4 * kWarps;
  const int64_t nv = p.row_bytes / 16;
  for (int w0 = range.begin; w0 < range.end; w0 += window) {
    const int w1 = w0 + window < range.end ? w0 + window : range.end;
    if (tid == 0) {
      int st = s_round == kStop ? kStop : kGo;  // thread 0's own push failure of the last window
      for (int n = 0; n < c.N && st == kGo; ++n) {
        if (n == c.node) continue;
        const int64_t need = s_base[n] + p.stream_cum[static_cast<int64_t>(w1 - 1) * c.N + n];
        const uint64_t start = fifo_now_ns();
        uint32_t iter = 0;
        for (;;) {
          const int64_t tail = ld_counter(c.counters + counter_index(kCombineTail, ch, n));
          if (tail >= need) break;
          if (aborted(c)) {
            st = kStop;
            break;
          }
          if ((++iter & 63u) == 0 && fifo_now_ns() - start > c.timeout_ns) {
            fail(c, kSiteCombineRecv, n * c.L + c.local, need, ch, tail);
            st = kStop;
            break;
          }
          backoff();
        }
      }
      s_round = st;
    }
    __syncthreads();
    const int st = s_round;
    __syncthreads();  // everyone read it before thread 0 may rewrite it
    if (st == kStop) break;
    for (int t = w0 + warp; t < w1; t += kWarps) {
      // Which ring entry holds token t's partial from node n: its rank in the stream.
      int slot_of[kMaxNodes];
      for (int n = 0; n < c.N; ++n) {
        const int cum = p.stream_cum[static_cast<int64_t>(t) * c.N + n];
        const int before = t > range.begin ? p.stream_cum[static_cast<int64_t>(t - 1) * c.N + n] : 0;
        slot_of[n] = cum > before ? cum - 1 : -1;
      }
      const uint8_t* part[kMaxNodes];
      for (int n = 0; n < c.N; ++n) {
        part[n] = nullptr;
        if (n == c.node || slot_of[n] < 0) continue;
        part[n] = c.region + ring_slot_offset(p.rl.recv_offset, p.rl, ch, n, s_base[n] + slot_of[n]);
        if (lane == 0) {
          const int src = ld_cg(reinterpret_cast<const int*>(part[n] + p.cs.src));
          if (src != t) fail(c, kSiteCombineOrder, n * c.L + c.local, t, ch, src);
        }
      }
      const int* own = p.dst_row + static_cast<int64_t>(t) * c.num_ranks + c.node * c.L;
      for (int64_t v = lane; v < nv; v += dev::kWarpSize) {
        float acc[E];
#pragma unroll
        for (int i = 0; i < E; ++i) acc[i] = 0.0f;
        // Same summation order as the reference: nodes ascending, ranks ascending inside.
        for (int n = 0; n < c.N; ++n) {
          if (n == c.node) {
            for (int j = 0; j < c.L; ++j) {
              const int r = own[j];
              if (r >= 0) acc_vec<kDtype>(acc, input_row(p, j, r), v);
            }
          } else if (part[n] != nullptr) {
            acc_vec<kDtype>(acc, part[n] + p.cs.x, v);
          }
        }
        if (p.bias0) acc_vec<kDtype>(acc, p.bias0 + static_cast<int64_t>(t) * p.row_bytes, v);
        if (p.bias1) acc_vec<kDtype>(acc, p.bias1 + static_cast<int64_t>(t) * p.row_bytes, v);
        store_vec<kDtype>(p.out + static_cast<int64_t>(t) * p.row_bytes, v, acc);
      }
      if (p.out_w != nullptr) {
        for (int k = lane; k < p.K; k += dev::kWarpSize) {
          float s = 0.0f;
          for (int n = 0; n < c.N; ++n) {
            if (n == c.node) {
              for (int j = 0; j < c.L; ++j)
                if (own[j] >= 0) s += ld_cg(input_w(p, j, own[j]) + k);
            } else if (part[n] != nullptr) {
              s += ld_cg(reinterpret_cast<const float*>(part[n] + p.cs.weights) + k);
            }
          }
          p.out_w[static_cast<int64_t>(t) * p.K + k] = s;
        }
      }
    }
    __syncthreads();
    if (tid == 0) {
      for (int n = 0; n < c.N; ++n) {
        if (n == c.node) continue;
        const int cum = p.stream_cum[static_cast<int64_t>(w1 - 1) * c.N + n];
        const int delta = cum - s_prev[n];
        s_prev[n] = cum;
        if (delta > 0 && !push_add(c, ch, n * c.L + c.local, counter_index(kCombineHead, ch, c.node), delta)) {
          s_round = kStop;
          break;
        }
      }
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid < c.N) c.state[state_index(kCombineConsumed, ch, tid)] = s_base[tid] + s_prev[tid];
}

template <int kDtype>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineDev p) {
  const int ch = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    combine_forwarder<kDtype>(p, ch);
  } else {
    combine_receiver<kDtype>(p, ch);
  }
}

struct StageDev {
  kernels::Peers bufs;
  int local, L;
  int64_t* bstatus;
  uint64_t seq;
  int64_t timeout_ns;
  const uint8_t* x;
  const float* w;
  int K, num_recv;
  int64_t row_bytes;
  CombineSlot cs;
  uint8_t* stage;
  bool copy;
};

__global__ void __launch_bounds__(kBarrierThreads) combine_stage_kernel(StageDev s) {
  if (s.copy) {
    const int lane = threadIdx.x % dev::kWarpSize;
    constexpr int kW = kBarrierThreads / dev::kWarpSize;
    const int gw = blockIdx.x * kW + threadIdx.x / dev::kWarpSize, nw = gridDim.x * kW;
    for (int r = gw; r < s.num_recv; r += nw) {
      uint8_t* row = s.stage + static_cast<int64_t>(r) * s.cs.bytes;
      uint8_t* d[1] = {row + s.cs.x};
      warp_copy(d, 1, s.x + static_cast<int64_t>(r) * s.row_bytes, s.row_bytes, lane);
      for (int k = lane; k < s.K; k += dev::kWarpSize)
        reinterpret_cast<float*>(row + s.cs.weights)[k] = s.w[static_cast<int64_t>(r) * s.K + k];
    }
  }
  // Rows must be in place on every block before the signal: one-block barrier kernel after.
}

__global__ void __launch_bounds__(kBarrierThreads) node_barrier_kernel(kernels::Peers bufs, int local, int L,
                                                                        uint64_t seq, int64_t* status,
                                                                        int64_t timeout_ns) {
  kernels::barrier_block(bufs, local, L, seq, true, status, timeout_ns, kSiteNvlBarrier);
}

kernels::Peers peers_of(const DevCommon& d) {
  kernels::Peers b{};
  for (int j = 0; j < d.L; ++j) b.p[j] = d.nvl[j];
  return b;
}

int grid_for(int rows, int warps_per_block) {
  int g = (rows + warps_per_block - 1) / warps_per_block;
  return g < 1 ? 1 : (g > 132 ? 132 : g);
}

}  // namespace

// ==== host side ===========================================================================
intptr_t status_alloc() {
  void* p = nullptr;
  GPU_CHECK(gpuHostAlloc(&p, kStatusWords * sizeof(int64_t), gpuHostAllocMapped));
  std::memset(p, 0, kStatusWords * sizeof(int64_t));
  return reinterpret_cast<intptr_t>(p);
}

void status_free(intptr_t ptr) {
  if (ptr) GPU_CHECK(gpuFreeHost(reinterpret_cast<void*>(ptr)));
}

std::vector<int64_t> status_read(intptr_t ptr) {
  const volatile int64_t* w = reinterpret_cast<const volatile int64_t*>(ptr);
  std::vector<int64_t> out(kStatusWords);
  for (int i = 0; i < kStatusWords; ++i) out[i] = w[i];
  return out;
}

namespace {

DispatchDev make_dispatch(const DispatchArgs& a) {
  DispatchDev p{};
  p.c = make_common(a.common);
  UCCL_EP_CHECK_ARG(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row_bytes=", a.row_bytes,
                    " must be a positive multiple of 16 (hidden * element size)");
  UCCL_EP_CHECK_ARG(a.num_topk >= 0 && a.num_topk <= kMaxTopk, "num_topk=", a.num_topk, " exceeds ", kMaxTopk);
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
  UCCL_EP_CHECK_ARG(static_cast<int>(a.recv_rows.size()) == p.c.L, "recv_rows has ", a.recv_rows.size(),
                    " entries for ", p.c.L, " local ranks");
  for (int j = 0; j < p.c.L; ++j) p.recv_rows[j] = a.recv_rows[j];
  return p;
}

}  // namespace

void dispatch(const DispatchArgs& a, intptr_t stream) {
  DispatchDev p = make_dispatch(a);
  dispatch_kernel<<<2 * p.c.C, kThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(p);
  GPU_CHECK(gpuGetLastError());
}

void dispatch_finish(const DispatchArgs& a, const std::vector<int>& recv_prefix, uint64_t barrier_seq,
                     intptr_t stream) {
  FinishDev f{};
  f.d = make_dispatch(a);
  UCCL_EP_CHECK_ARG(static_cast<int>(recv_prefix.size()) == a.common.num_ranks + 1, "recv_prefix has ",
                    recv_prefix.size(), " entries, expected num_ranks + 1");
  UCCL_EP_CHECK_ARG(a.common.num_ranks <= kMaxRanks, "num_ranks=", a.common.num_ranks, " exceeds ", kMaxRanks);
  f.local = f.d.c.local;
  f.L = f.d.c.L;
  f.bstatus = f.d.c.status;
  f.num_ranks = a.common.num_ranks;
  for (int s = 0; s <= a.common.num_ranks; ++s) f.recv_prefix[s] = recv_prefix[s];
  auto s = reinterpret_cast<gpuStream_t>(stream);
  // The barrier is one block (signal and wait are per block); the copy then spreads out.
  node_barrier_kernel<<<1, kBarrierThreads, 0, s>>>(peers_of(f.d.c), f.local, f.L, barrier_seq, f.bstatus,
                                                    a.common.timeout_ns);
  GPU_CHECK(gpuGetLastError());
  dispatch_finish_kernel<<<grid_for(recv_prefix.back(), kWarps), kThreads, 0, s>>>(f);
  GPU_CHECK(gpuGetLastError());
}

namespace {
CombineDev make_combine(const CombineArgs& a) {
  CombineDev p{};
  p.c = make_common(a.common);
  UCCL_EP_CHECK_ARG(a.dtype >= 0 && a.dtype <= 2, "combine dtype code ", a.dtype, " (0 bf16, 1 fp16, 2 fp32)");
  UCCL_EP_CHECK_ARG(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row_bytes=", a.row_bytes,
                    " must be a positive multiple of 16");
  UCCL_EP_CHECK_ARG(a.num_topk >= 0 && a.num_topk <= kMaxTopk, "num_topk=", a.num_topk);
  UCCL_EP_CHECK_ARG(static_cast<int>(a.src_tokens.size()) == p.c.N, "src_tokens has ", a.src_tokens.size(),
                    " entries for ", p.c.N, " nodes");
  p.cs = combine_slot(a.row_bytes, a.num_topk);
  p.rl = ring_layout(true, a.common.region_bytes, p.c.C, p.c.N, p.c.cap, p.cs.bytes);
  UCCL_EP_CHECK_ARG(p.rl.bytes <= region_half_bytes(a.common.region_bytes), "combine rings need ", p.rl.bytes,
                    " bytes but half the RDMA region is ", region_half_bytes(a.common.region_bytes));
  UCCL_EP_CHECK_ARG(static_cast<int64_t>(p.c.chunk) * p.cs.bytes <= cmd_limits::kMaxLength, "combine chunk too large");
  p.dtype = a.dtype;
  p.K = a.num_topk;
  p.T = a.num_tokens;
  p.row_bytes = a.row_bytes;
  p.x = reinterpret_cast<const uint8_t*>(a.x);
  p.w = reinterpret_cast<const float*>(a.topk_weights);
  p.plan = reinterpret_cast<const int*>(a.plan);
  p.plan_T = a.plan_tokens;
  p.lists = reinterpret_cast<const int*>(a.lists);
  p.list_count = reinterpret_cast<const int*>(a.list_count);
  for (int m = 0; m < p.c.N; ++m) p.src_T[m] = a.src_tokens[m];
  p.dst_row = reinterpret_cast<const int*>(a.dst_row);
  p.stream_cum = reinterpret_cast<const int*>(a.stream_cum);
  p.bias0 = reinterpret_cast<const uint8_t*>(a.bias0);
  p.bias1 = reinterpret_cast<const uint8_t*>(a.bias1);
  p.out = reinterpret_cast<uint8_t*>(a.out);
  p.out_w = reinterpret_cast<float*>(a.out_weights);
  p.stage_off = a.stage_offset;
  return p;
}
}  // namespace

void combine_prepare(const CombineArgs& a, uint64_t barrier_seq, intptr_t stream) {
  const DevCommon d = make_common(a.common);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  StageDev sd{};
  sd.x = reinterpret_cast<const uint8_t*>(a.x);
  sd.w = reinterpret_cast<const float*>(a.topk_weights);
  sd.K = a.topk_weights ? a.num_topk : 0;
  sd.num_recv = a.num_recv;
  sd.row_bytes = a.row_bytes;
  sd.cs = combine_slot(a.row_bytes, a.num_topk);
  sd.stage = d.nvl[d.local] + a.stage_offset;
  sd.copy = a.num_recv > 0;
  if (sd.copy) {
    combine_stage_kernel<<<grid_for(a.num_recv, kBarrierThreads / dev::kWarpSize), kBarrierThreads, 0, s>>>(sd);
    GPU_CHECK(gpuGetLastError());
  }
  node_barrier_kernel<<<1, kBarrierThreads, 0, s>>>(peers_of(d), d.local, d.L, barrier_seq, d.status,
                                                    a.common.timeout_ns);
  GPU_CHECK(gpuGetLastError());
}

void combine(const CombineArgs& a, intptr_t stream) {
  CombineDev p = make_combine(a);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const int blocks = 2 * p.c.C;
  switch (p.dtype) {
    case 0:
      combine_kernel<0><<<blocks, kThreads, 0, s>>>(p);
      break;
    case 1:
      combine_kernel<1><<<blocks, kThreads, 0, s>>>(p);
      break;
    default:
      combine_kernel<2><<<blocks, kThreads, 0, s>>>(p);
      break;
  }
  GPU_CHECK(gpuGetLastError());
}

void node_barrier(const Common& c, uint64_t barrier_seq, intptr_t stream) {
  const DevCommon d = make_common(c);
  node_barrier_kernel<<<1, kBarrierThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      peers_of(d), d.local, d.L, barrier_seq, d.status, c.timeout_ns);
  GPU_CHECK(gpuGetLastError());
}

void preload_kernels() {
#if !defined(UCCL_EP_DEVICE_HIP)
  // cuFuncLoad (driver >= 12.4) loads a function explicitly; through the runtime's entry-point
  // query, so the library needs no link against libcuda. Attribute queries also load it.
  using FuncLoad = CUresult (*)(CUfunction);
  static const FuncLoad func_load = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuFuncLoad", &fn, 12040, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<FuncLoad>(nullptr);
    }
    return reinterpret_cast<FuncLoad>(fn);
  }();
#endif
  const void* kernels[] = {
      reinterpret_cast<const void*>(dispatch_kernel),      reinterpret_cast<const void*>(dispatch_finish_kernel),
      reinterpret_cast<const void*>(combine_kernel<0>),    reinterpret_cast<const void*>(combine_kernel<1>),
      reinterpret_cast<const void*>(combine_kernel<2>),    reinterpret_cast<const void*>(combine_stage_kernel),
      reinterpret_cast<const void*>(node_barrier_kernel),
  };
  for (const void* k : kernels) {
#if defined(UCCL_EP_DEVICE_HIP)
    hipFuncAttributes attr;
    GPU_CHECK(hipFuncGetAttributes(&attr, k));
#else
    cudaFuncAttributes attr;
    GPU_CHECK(cudaFuncGetAttributes(&attr, k));
    if (func_load != nullptr) {
      cudaFunction_t f = nullptr;
      GPU_CHECK(cudaGetFuncBySymbol(&f, k));
      const CUresult r = func_load(reinterpret_cast<CUfunction>(f));
      if (r != CUDA_SUCCESS) {
        UCCL_EP_THROW(GpuError, "cuFuncLoad of an internode kernel failed: CUresult ", static_cast<int>(r));
      }
    }
#endif
  }
}

}  // namespace uccl_ep::internode

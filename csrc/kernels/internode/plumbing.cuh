// Plumbing every internode kernel shares: the launch parameters in device form, the failure
// record, the counter loads, the warp row copy and the FIFO pushes of ring chunks.
// Device helpers (timers, ld_cg, fences) come from kernels/device.cuh only.
#pragma once

#include <cstdint>
#include <vector>

#include "common/gpu.h"
#include "fifo/fifo_device.cuh"
#include "kernels/common.cuh"
#include "kernels/device.cuh"
#include "kernels/internode.h"

namespace uccl_ep::internode::detail {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / dev::kWarpSize;
constexpr int kBarrierThreads = 256;

struct DevCommon {
  int rank, num_ranks, L, N, node, local, C;
  const FifoDeviceHandle* fifos;
  int num_fifos;
  int64_t* counters;
  int64_t* state;
  uint8_t* region;
  uint8_t* nvl[kMaxLocal];
  uint8_t* remote[kMaxNodes];  // Common::remote, or all null
  uint8_t* arena[kMaxLocal];   // Common::arenas, or all null
  int cap, chunk;
  // The internode status words and their device flag (kernels::host_status_alloc's block).
  kernels::StatusRef status;
  uint64_t timeout_ns;
  const int64_t* verdict;  // sync-free call: the GPU check of the call headers (or null)
  uint64_t* trace;         // per-block time accounting (Common::trace), or null
};

// Host side (host.cu): checks a launch's common fields and converts them.
DevCommon make_common(const Common& c);
kernels::Peers peers_of(const DevCommon& d);
int grid_for(int rows, int warps_per_block);
// Loads `kernels` on the current device now (see preload_kernels in internode.h).
void load_kernels(const std::vector<const void*>& kernels);
// The kernels of each translation unit, for preload_kernels.
std::vector<const void*> dispatch_kernels();
std::vector<const void*> combine_kernels();
std::vector<const void*> barrier_kernels();
std::vector<const void*> tables_kernels();
std::vector<const void*> checks_kernels();

__device__ __forceinline__ int64_t ld_counter(const int64_t* p) {
  return static_cast<int64_t>(dev::ld_acquire_sys(reinterpret_cast<const uint64_t*>(p)));
}

__device__ __forceinline__ bool aborted(const DevCommon& p) {
  return kernels::status_set(p.status);
}

// First failure wins (CAS on the device flag, where atomics are cheap and always atomic; the
// intranode record_status, which the NVLink barrier uses, CASes the same word); its details go
// to the mapped host status words, published by [0] last.
__device__ inline void fail(const DevCommon& p, int site, int peer, int64_t want, int channel, int64_t got) {
  auto* word = reinterpret_cast<unsigned long long*>(p.status.flag);
  if (atomicCAS(word, 0ull, 1ull) != 0ull) return;
  volatile int64_t* st = p.status.host;
  st[1] = peer;
  st[2] = want;
  st[3] = site;
  st[4] = channel;
  st[5] = got;
  __threadfence_system();
  st[0] = 1;
  __threadfence_system();
}

// A sync-free call whose call headers the GPU check rejected: thread 0 of block 0 records the
// verdict, and every block returns before moving anything. Every rank reads the same verdict
// (computed from the same all-gathered rows), so all of them skip the call together.
__device__ __forceinline__ bool rejected(const DevCommon& c) {
  if (c.verdict == nullptr || c.verdict[0] == 0) return false;
  if (blockIdx.x == 0 && threadIdx.x == 0)
    fail(c, kSiteAgreement, static_cast<int>(c.verdict[1]), c.verdict[0], -1, c.verdict[2]);
  return true;
}

// The placement words and flag of source `src` in NVLink buffer `buf` (kPlaceFlagsOffset).
__device__ __forceinline__ int64_t* place_words(uint8_t* buf, int src) {
  return reinterpret_cast<int64_t*>(buf + kPlaceWordsOffset) + static_cast<int64_t>(src) * kPlaceWords;
}
__device__ __forceinline__ uint64_t* place_flag(uint8_t* buf, int src) {
  return reinterpret_cast<uint64_t*>(buf + kPlaceFlagsOffset) + src;
}

// Block 0 tells every node peer where this rank's rows of call `seq` lie: the words, then,
// after a system fence, the sequence with release. Threads 0..L-1 (one per peer) call it.
__device__ __forceinline__ void publish_place(const DevCommon& c, uint64_t seq, const int64_t* words) {
  const int j = threadIdx.x;
  if (blockIdx.x != 0 || j >= c.L || j == c.local) return;
  volatile int64_t* w = place_words(c.nvl[j], c.local);
  for (int i = 0; i < kPlaceWords; ++i) w[i] = words[i];
  dev::fence_system();
  dev::st_release_sys(place_flag(c.nvl[j], c.local), seq);
}

// Thread j < L of a block waits for node peer j's placement of call `seq` and copies its words
// into out[j] (its own: `own`). False when the wait failed: another block failed first, or the
// peer's kernel did not start within the timeout (recorded at kSitePlace, naming the peer).
__device__ inline bool load_place(const DevCommon& c, uint64_t seq, const int64_t* own,
                                  int64_t (*out)[kPlaceWords]) {
  const int j = threadIdx.x;
  if (j >= c.L) return true;
  if (j == c.local) {
    for (int i = 0; i < kPlaceWords; ++i) out[j][i] = own[i];
    return true;
  }
  const uint64_t* f = place_flag(c.nvl[c.local], j);
  const uint64_t start = dev::global_timer_ns();
  uint32_t iter = 0;
  uint64_t v;
  while ((v = dev::ld_acquire_sys(f)) < seq) {
    if ((++iter & 1023u) == 0 && aborted(c)) return false;
    const uint64_t waited = dev::global_timer_ns() - start;
    if (waited > c.timeout_ns) {
      fail(c, kSitePlace, c.node * c.L + j, static_cast<int64_t>(seq), -1, static_cast<int64_t>(v));
      return false;
    }
  }
  const volatile int64_t* w = place_words(c.nvl[c.local], j);
  for (int i = 0; i < kPlaceWords; ++i) out[j][i] = w[i];
  return true;
}

// Every thread of the block: the node's placements of call `seq` in s_place (block 0 first
// publishes this rank's own); false in every thread when a wait failed. One rank per node
// (L == 1) has no peer: only its own words.
__device__ inline bool exchange_place(const DevCommon& c, uint64_t seq, const int64_t* own,
                                      int64_t (*s_place)[kPlaceWords]) {
  __shared__ int s_ok;
  if (threadIdx.x == 0) s_ok = 1;
  __syncthreads();
  publish_place(c, seq, own);
  if (!load_place(c, seq, own, s_place)) s_ok = 0;
  __syncthreads();
  return s_ok != 0;
}

// Warp copy of `bytes` (multiple of 16) from src to up to kMaxLocal destinations. Each lane
// keeps 8 vectors in flight: a 14 KB row (hidden 7168, BF16) is 4 round trips of loads, not 7.
__device__ __forceinline__ void warp_copy(uint8_t* const* dst, int ndst, const uint8_t* src, int64_t bytes, int lane) {
  constexpr int kUnroll = 8;
  const int64_t n = bytes / 16;
  for (int64_t base = 0; base < n; base += kUnroll * dev::kWarpSize) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * dev::kWarpSize + lane;
      if (i < n) v[u] = dev::ld_cg16(src + i * 16);
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
__device__ inline bool push_cmd(const DevCommon& p, int c, const TransferCmd& cmd, int peer) {
  if (fifo_push(p.fifos[c % p.num_fifos], cmd) == kFifoPushFailed) {
    fail(p, kSiteFifo, peer, 0, c, 0);
    return false;
  }
  return true;
}

// Counter increment of any size as a series of 11-bit software atomics.
__device__ inline bool push_add(const DevCommon& p, int c, int dst_rank, int counter, int64_t delta) {
  for (int i = 0; i < atomic_steps(delta); ++i) {
    if (!push_cmd(p, c, make_atomic(dst_rank, counter, atomic_step_value(delta, i)), dst_rank)) return false;
  }
  return true;
}

// Writes k slots of send ring (c, ring_node) starting at cumulative index `start` into the
// receive ring (c, my node) of `dst_rank`, then adds k to counter `counter` there. A wrapping
// chunk is two writes; the tail atomic rides on the last one (or follows, when k needs more
// than one 11-bit atomic). All in one FIFO channel: the proxy delivers them in this order.
__device__ inline bool push_chunk(const DevCommon& p, const RingLayout& rl, int c, int ring_node, int dst_rank,
                                  int64_t start, int k, int counter) {
  const ChunkPieces pc = chunk_pieces(start, k, rl.cap);
  const bool inline_atomic = k <= kMaxAtomicStep;
  const int pieces = pc.n2 == 0 ? 1 : 2;
  int64_t at = start;
  for (int piece = 0; piece < pieces; ++piece) {
    const int n = piece == 0 ? pc.n1 : pc.n2;
    const uint64_t src = ring_slot_offset(rl.send_offset, rl, c, ring_node, at);
    const uint64_t dst = ring_slot_offset(rl.recv_offset, rl, c, p.node, at);
    const uint32_t len = static_cast<uint32_t>(n * rl.slot_bytes);
    const bool last = piece == pieces - 1;
    const TransferCmd cmd = last && inline_atomic ? make_write_atomic(dst_rank, src, dst, len, counter, k)
                                                  : make_write(dst_rank, src, dst, len);
    if (!push_cmd(p, c, cmd, dst_rank)) return false;
    at += n;
  }
  return inline_atomic || push_add(p, c, dst_rank, counter, k);
}

}  // namespace uccl_ep::internode::detail

// The dispatch kernel's launch parameters and its zero-copy receive steps (entry publish and
// wait, done signal), kept apart from the kernel body in dispatch.cu.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"
#include "kernels/notify.cuh"

namespace uccl_ep::kernels {
namespace dispatch_detail {

constexpr int kSendThreads = 512;
constexpr int kSendWarps = kSendThreads / dev::kWarpSize;

// Per-destination bases of the five row arrays: own outputs for d == rank; for a peer its
// staging (the launch's) or, once its receive entry says zero-copy, its outputs in its arena.
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
  // Zero-copy receive: every rank's arena as mapped here, and whether this rank's outputs lie
  // in its own; then the byte offsets of out_x, out_scales, out_idx, out_w, out_src there (-1
  // for a missing one), which the receive entry hands to the peers.
  Peers arenas;
  bool zero_copy;
  bool entry_published;  // notify wrote the entry (sync-free and launch-ahead calls)
  bool judge;            // launch-ahead: skip the call on dispatch_verdict (DispatchArgs::judge)
  int num_experts;       // the id range dispatch_verdict checks (judge only)
  int64_t recv_off[5];
  PoisonRegions poison;  // the outputs, filled by the last block to finish when the call failed
  // notify folded in (DispatchArgs::notify): blocks [0, notify_blocks) run it, the data blocks
  // after them wait for it; 0: notify ran before, on the stream.
  int notify_blocks;
  NotifyParams notify;
};

// Data block 0 (`block`) tells every peer where this rank receives (kRecvEntryOffset): the mode
// and offsets, then, after a system fence, the sequence with release (unless notify did:
// sync-free and launch-ahead calls). A staged rank says so too, so every sender knows each
// destination's mode from one word.
__device__ __forceinline__ void publish_entry(const SendParams& p, uint64_t seq, int block) {
  const int d = threadIdx.x;
  if (p.entry_published || block != 0 || d >= p.num_ranks || d == p.rank) return;
  volatile uint64_t* e = recv_entry(p.bufs.p[d], notify_slot(seq), p.rank);
  e[1] = p.zero_copy ? 1 : 0;
#pragma unroll
  for (int i = 0; i < 5; ++i) e[2 + i] = static_cast<uint64_t>(p.recv_off[i]);
  dev::fence_system();
  dev::st_release_sys(const_cast<uint64_t*>(e), seq);
}

// A sender block's destinations: thread d waits for peer d's entry of this dispatch and fills
// dst[d] from it (its outputs in its arena, or the launch's staging pointers), setting bit d of
// *zc_mask for a zero-copy peer. Returns false when a wait failed (recorded).
__device__ __forceinline__ bool load_entries(const SendParams& p, uint64_t seq, RowPtrs& dst, unsigned* zc_mask) {
  const int d = threadIdx.x;
  if (d >= p.num_ranks) return true;
  dst.x[d] = p.dst.x[d];
  dst.scales[d] = p.dst.scales[d];
  dst.idx[d] = p.dst.idx[d];
  dst.w[d] = p.dst.w[d];
  dst.src[d] = p.dst.src[d];
  if (d == p.rank) return true;
  uint64_t* e = recv_entry(p.bufs.p[p.rank], notify_slot(seq), d);
  if (!wait_at_least(e, seq, d, kSiteDispatchEntry, p.status, PeerAborts{p.bufs, p.rank, p.num_ranks}, p.timeout_ns))
    return false;
  const volatile uint64_t* ev = e;
  if (ev[1] != 1) return true;
  uint8_t* base = p.arenas.p[d];
  auto at = [&](int i) -> uint8_t* {
    const int64_t off = static_cast<int64_t>(ev[2 + i]);
    return off < 0 ? nullptr : base + off;
  };
  dst.x[d] = at(0);
  dst.scales[d] = reinterpret_cast<float*>(at(1));
  dst.idx[d] = at(2);
  dst.w[d] = reinterpret_cast<float*>(at(3));
  // A cached dispatch keeps the handle's source indices: the launch's null wins.
  dst.src[d] = p.dst.src[d] == nullptr ? nullptr : reinterpret_cast<int*>(at(4));
  atomicOr(zc_mask, 1u << d);
  return true;
}

// After a sender block's last row: the source's last finishing block tells every zero-copy
// destination that all of this rank's rows have landed (threadfence-reduction pattern: each
// block fences its writes before counting itself, the last one fences again before the release
// stores). The counter is reset for the next dispatch, which follows in stream order.
__device__ __forceinline__ void signal_done(const SendParams& p, uint64_t seq, unsigned zc_mask) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  dev::fence_system();
  unsigned* count = send_done_blocks(p.bufs.p[p.rank]);
  if (atomicAdd(count, 1u) + 1 != static_cast<unsigned>(p.num_send_blocks)) return;
  *count = 0;
  dev::fence_system();
  for (int d = 0; d < p.num_ranks; ++d)
    if (d != p.rank && (zc_mask >> d & 1u)) dev::st_release_sys(recv_done(p.bufs.p[d]) + p.rank, seq);
}

// num_worst_tokens padding rows [begin, num_out_rows), warp `w` of `nw` across the grid: ids -1,
// weights 0, source index -1. The rows and their scales are left unwritten (DeepEP's contract:
// unspecified): at 8 ranks zeroing them was ~1.2 GB of HBM writes per call across the GPU.
__device__ __forceinline__ void fill_padding(const SendParams& p, int64_t begin, int64_t w, int64_t nw, int lane) {
  const int meta_idx_words = p.num_topk * p.idx_size / 4;
  for (int64_t r = begin + w; r < p.num_out_rows; r += nw) {
    if (p.out_idx != nullptr) {
      for (int k = lane; k < meta_idx_words; k += dev::kWarpSize)
        reinterpret_cast<int*>(p.out_idx)[r * meta_idx_words + k] = -1;  // all-ones: -1 as int32 and int64
      for (int k = lane; k < p.num_topk; k += dev::kWarpSize) p.out_w[r * p.num_topk + k] = 0.0f;
    }
    if (p.out_src != nullptr && lane == 0) p.out_src[r] = -1;
  }
}

}  // namespace dispatch_detail
}  // namespace uccl_ep::kernels


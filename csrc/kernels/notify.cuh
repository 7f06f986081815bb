// Intranode notify on the GPU: the count exchange and entry barrier of a dispatch (see
// intranode_notify in intranode.h), with the input checks that travel with the counts and the
// send-position scan. Run by notify's own kernel (notify.cu) or by the first blocks of the
// dispatch kernel (DispatchArgs::notify), whose data blocks wait for them. Other blocks share
// the reading of the checked inputs with block 0 (scan blocks after notify's in its own kernel,
// the data blocks before they wait in the dispatch kernel): slices claimed one by one, so that
// block 0 never waits for a block that has not started.
#pragma once

#include <cstdint>

#include "kernels/common.cuh"

namespace uccl_ep::kernels {

// notify's kernel parameters (notify_params makes them from a NotifyArgs).
struct NotifyParams {
  Peers bufs;
  int rank, num_ranks;
  const int* per_rank;    // num_tokens_per_rank [R]
  const int* per_expert;  // num_tokens_per_expert [R * experts_per_rank] or null
  int experts_per_rank, alignment;
  int* info;  // out_info: [rank_prefix_matrix (R*R) | aligned rows per local expert]
  StatusRef status;
  int64_t timeout_ns;
  const bool* in_rank;  // is_token_in_rank [T, R]
  int num_tokens;
  int* send_pos;  // [T, R], or null (cached: not scanned)
  const void* topk_idx;
  bool idx_is_64;
  int num_topk;
  int64_t* readback;  // the host block's kReadbackWord, or null
  int num_worst_tokens, num_experts;
  int64_t header;
  RecvEntryArgs entry;
  // Slices the expert ids and is_token_in_rank's flags are cut into (kScanPartsOffset), read by
  // block 0 and scan_claimers other blocks (notify's scan blocks after its own, or the data
  // blocks of a dispatch kernel that runs notify); 0: block 0 reads them alone.
  int scan_blocks, scan_claimers;
};

// The checked parameters of `a` (host).
NotifyParams notify_params(const NotifyArgs& a);

// Blocks notify runs on: a second one scans send_pos beside the count exchange (non-cached calls).
__host__ __device__ inline int notify_blocks(const NotifyParams& q) { return q.send_pos != nullptr ? 2 : 1; }

// Scan slices (and notify's own kernel's scan blocks): one per 32 KiB of checked input (ids and
// flags), at most kMaxScanBlocks; none below 64 KiB, where block 0 reads them as fast as it
// waits for a part.
inline int notify_scan_blocks(const NotifyParams& q) {
  const int64_t T = q.num_tokens;
  const int64_t bytes = (q.send_pos != nullptr ? T * q.num_ranks : 0) +
                        (q.topk_idx != nullptr ? T * q.num_topk * (q.idx_is_64 ? 8 : 4) : 0);
  if (bytes < (int64_t{64} << 10)) return 0;
  const int64_t blocks = (bytes + (int64_t{32} << 10) - 1) / (int64_t{32} << 10);
  return static_cast<int>(blocks < kMaxScanBlocks ? blocks : kMaxScanBlocks);
}

namespace notify_detail {

// send_pos[t][r] = position of token t among the tokens sent to rank r (an exclusive scan of
// column r of is_token_in_rank), -1 where not sent; one block, tile by tile with warp ballots.
template <int kThreads>
__device__ void scan_send_pos(const bool* in_rank, int num_tokens, int R, int* send_pos) {
  __shared__ int s_running[kMaxRanks];
  __shared__ int s_warp[kThreads / dev::kWarpSize][kMaxRanks];
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
  if (tid < kMaxRanks) s_running[tid] = 0;
  __syncthreads();
  for (int tile = 0; tile < num_tokens; tile += kThreads) {
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
      for (int w = 0; w < kThreads / dev::kWarpSize; ++w) {
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

__device__ __forceinline__ void take_id(int64_t e, int64_t& lo, int64_t& hi) {
  lo = e < lo ? e : lo;
  hi = e > hi ? e : hi;
}

// Folds the share of the `n` ids at `ids` (int64, or int32 when !is_64) of the thread that is
// `first` of `stride` readers into (lo, hi): 16-byte loads, kLoads of them in flight per thread,
// when the ids are 16-byte aligned (with one load per id each thread waits for every load in
// turn: 64 of them for DeepSeek-V3's 4096 x 8 ids on 512 threads, all before the readback the
// host waits for); the tail and unaligned ids one by one.
__device__ __forceinline__ void id_range(const void* ids, bool is_64, int64_t n, int64_t first, int64_t stride,
                                         int64_t& lo, int64_t& hi) {
  constexpr int kLoads = 4;
  const int per = is_64 ? 2 : 4;  // ids per 16 bytes
  int64_t head = 0;               // ids read as vectors
  if (reinterpret_cast<uintptr_t>(ids) % 16 == 0) {
    const int4* v = static_cast<const int4*>(ids);
    const int64_t nv = n / per;
    head = nv * per;
    for (int64_t base = first; base < nv; base += stride * kLoads) {
      int4 x[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u)
        if (base + u * stride < nv) x[u] = v[base + u * stride];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        if (base + u * stride >= nv) continue;
        if (is_64) {
          take_id(static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint32_t>(x[u].y)) << 32 |
                                       static_cast<uint32_t>(x[u].x)),
                  lo, hi);
          take_id(static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint32_t>(x[u].w)) << 32 |
                                       static_cast<uint32_t>(x[u].z)),
                  lo, hi);
        } else {
          take_id(x[u].x, lo, hi);
          take_id(x[u].y, lo, hi);
          take_id(x[u].z, lo, hi);
          take_id(x[u].w, lo, hi);
        }
      }
    }
  }
  for (int64_t i = head + first; i < n; i += stride)
    take_id(is_64 ? static_cast<const int64_t*>(ids)[i] : static_cast<int64_t>(static_cast<const int32_t*>(ids)[i]),
            lo, hi);
}

// The share of the thread that is `first` of `stride` readers of what notify checks: the tokens
// is_token_in_rank sends to each rank (into sent[], non-cached calls) and the range of the ids.
__device__ __forceinline__ void scan_share(const NotifyParams& q, int64_t first, int64_t stride,
                                           int (&sent)[kMaxRanks], int64_t& lo, int64_t& hi) {
  const int R = q.num_ranks;
  if (q.send_pos != nullptr) {
    for (int64_t t = first; t < q.num_tokens; t += stride) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r)
        if (r < R) sent[r] += q.in_rank[t * R + r] ? 1 : 0;
    }
  }
  if (q.topk_idx != nullptr)
    id_range(q.topk_idx, q.idx_is_64, static_cast<int64_t>(q.num_tokens) * q.num_topk, first, stride, lo, hi);
}

// The block's sums of sent[] into s_sent[] (zeroed, then a block barrier, by the caller) and
// its range into s_range[0..1]; every thread calls it, and every thread sees the results after.
// Each warp folds its own first (one shared atomic per warp and rank); the first warp folds the
// warps' ranges.
template <int kThreads>
__device__ __forceinline__ void reduce_share(const int (&sent)[kMaxRanks], int R, int64_t lo, int64_t hi,
                                             int* s_sent, int64_t* s_range) {
  constexpr int kWarps = kThreads / dev::kWarpSize;
  static_assert(kWarps <= dev::kWarpSize, "the first warp folds one range per warp");
  __shared__ int64_t s_lo[kWarps], s_hi[kWarps];
  const int tid = threadIdx.x, lane = tid % dev::kWarpSize, warp = tid / dev::kWarpSize;
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    if (r < R) {  // R is the same in every lane
      const int sum = dev::warp_sum(sent[r]);
      if (lane == 0 && sum != 0) atomicAdd(&s_sent[r], sum);
    }
  }
  dev::warp_min_max(lo, hi);
  if (lane == 0) {
    s_lo[warp] = lo;
    s_hi[warp] = hi;
  }
  __syncthreads();
  if (warp == 0) {
    lo = lane < kWarps ? s_lo[lane] : INT64_MAX;
    hi = lane < kWarps ? s_hi[lane] : INT64_MIN;
    dev::warp_min_max(lo, hi);
    if (lane == 0) {
      s_range[0] = lo;
      s_range[1] = hi;
    }
  }
  __syncthreads();
}

// Slices of the checked inputs (q.scan_blocks of them) claimed one at a time by this block until
// none is left, each reduced into its part (released with its ready word at GPU scope: only
// block 0, on this GPU, reads it); every thread of block 0 and of the q.scan_claimers other
// blocks calls it (notify's scan blocks, or the data blocks of a dispatch kernel that runs
// notify, before they wait for it), all with kThreads threads. A block that claims a slice is
// running, so block 0 waits only for slices being read; a block that starts late finds none.
// The last block to stop claiming zeroes the claim count for the next launch.
template <int kThreads>
__device__ __forceinline__ void scan_slices(const NotifyParams& q) {
  __shared__ int s_slice;
  __shared__ int s_sent[kMaxRanks];
  __shared__ int64_t s_range[2];
  const int tid = threadIdx.x;
  uint8_t* own = q.bufs.p[q.rank];
  for (;;) {
    if (tid == 0) s_slice = static_cast<int>(atomicAdd(scan_claim_of(own), 1u));
    if (tid < kMaxRanks) s_sent[tid] = 0;
    __syncthreads();
    const int slice = s_slice;
    if (slice >= q.scan_blocks) break;
    int sent[kMaxRanks] = {};
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    scan_share(q, int64_t{slice} * kThreads + tid, int64_t{q.scan_blocks} * kThreads, sent, lo, hi);
    reduce_share<kThreads>(sent, q.num_ranks, lo, hi, s_sent, s_range);
    if (tid == 0) {
      uint64_t* part = scan_part_of(own, slice);
      part[1] = static_cast<uint64_t>(s_range[0]);
      part[2] = static_cast<uint64_t>(s_range[1]);
      for (int r = 0; r < kMaxRanks; r += 2)
        part[3 + r / 2] = static_cast<uint64_t>(static_cast<uint32_t>(s_sent[r])) |
                          static_cast<uint64_t>(static_cast<uint32_t>(s_sent[r + 1])) << 32;
      dev::st_release_gpu(part, 1);
    }
    __syncthreads();  // s_slice and s_sent are reused by the next claim
  }
  if (tid == 0 && atomicAdd(scan_done_of(own), 1u) == static_cast<unsigned>(q.scan_claimers)) {
    *scan_claim_of(own) = 0;
    *scan_done_of(own) = 0;
  }
}

// Block 0's wait for the slices' parts (a thread per part, each wait bounded by the timeout),
// then their sums into s_sent[] and their range into s_range[0..1]; every thread calls it. A
// part's ready word is zeroed once read. False (every thread alike) when a part did not come:
// the timeout is recorded and the peers are told, as a barrier wait that times out does.
__device__ __forceinline__ bool take_scan_parts(const NotifyParams& q, uint64_t seq, int* s_sent,
                                                int64_t* s_range) {
  __shared__ int s_missing;
  __shared__ int64_t s_lo[kMaxScanBlocks], s_hi[kMaxScanBlocks];
  __shared__ int s_part_sent[kMaxScanBlocks][kMaxRanks];
  const int tid = threadIdx.x;
  if (tid == 0) s_missing = 0;
  __syncthreads();
  if (tid < q.scan_blocks) {
    uint64_t* part = scan_part_of(q.bufs.p[q.rank], tid);
    const uint64_t start = dev::global_timer_ns();
    bool came = true;
    while (dev::ld_acquire_gpu(part) != 1) {
      if (dev::global_timer_ns() - start > static_cast<uint64_t>(q.timeout_ns)) {
        came = false;
        break;
      }
    }
    if (came) {
      const volatile uint64_t* w = part;
      s_lo[tid] = static_cast<int64_t>(w[1]);
      s_hi[tid] = static_cast<int64_t>(w[2]);
      for (int r = 0; r < kMaxRanks; r += 2) {
        const uint64_t v = w[3 + r / 2];
        s_part_sent[tid][r] = static_cast<int>(static_cast<uint32_t>(v));
        s_part_sent[tid][r + 1] = static_cast<int>(static_cast<uint32_t>(v >> 32));
      }
      *reinterpret_cast<volatile uint64_t*>(part) = 0;
    } else {
      s_missing = 1;
    }
  }
  __syncthreads();
  if (s_missing != 0) {
    if (tid == 0) time_out(q.status, PeerAborts{q.bufs, q.rank, q.num_ranks}, q.rank, seq, kSiteNotify);
    return false;
  }
  // The first warp sums the parts: a lane per part for the range, a lane per rank for the counts.
  static_assert(kMaxScanBlocks <= dev::kWarpSize && kMaxRanks <= dev::kWarpSize, "a lane per part and rank");
  if (tid < dev::kWarpSize) {
    int64_t lo = tid < q.scan_blocks ? s_lo[tid] : INT64_MAX;
    int64_t hi = tid < q.scan_blocks ? s_hi[tid] : INT64_MIN;
    dev::warp_min_max(lo, hi);
    if (tid < kMaxRanks) {
      int sum = 0;
      for (int i = 0; i < q.scan_blocks; ++i) sum += s_part_sent[i][tid];
      s_sent[tid] += sum;
    }
    if (tid == 0) {
      s_range[0] = lo;
      s_range[1] = hi;
    }
  }
  __syncthreads();
  return true;
}

// A wait of notify's failed (the status words say why): the host spins on the readback, so it
// is told now. Thread 0 of block 0 writes it.
__device__ __forceinline__ void readback_failed(const NotifyParams& q) {
  if (q.readback != nullptr && threadIdx.x == 0) {
    __threadfence_system();
    reinterpret_cast<volatile int64_t*>(q.readback)[0] = -1;
  }
}

}  // namespace notify_detail

// Block `block` (< notify_blocks(q)) of notify, run by kThreads threads (blockDim.x).
template <int kThreads>
__device__ __forceinline__ void notify_block(const NotifyParams& q, int block) {
  using notify_detail::scan_send_pos;
  const int tid = threadIdx.x;
  const int R = q.num_ranks;
  // Block 1 (non-cached calls) scans send_pos while block 0 exchanges the counts and waits at
  // the barrier: the scan reads only this rank's is_token_in_rank, and only the dispatch
  // kernel (or, folded in, its data blocks once notify_done_blocks says so) reads send_pos.
  if (block == 1) {
    scan_send_pos<kThreads>(q.in_rank, q.num_tokens, q.num_ranks, q.send_pos);
    return;
  }
  __shared__ uint64_t s_seq;
  if (tid == 0) {
    // Block 0 alone gets here (block 1 returned above): every thread reads s_seq below, so
    // storing the new value now is safe.
    uint64_t* c = seq_counter(q.bufs.p[q.rank]);
    s_seq = *c + 1;
    *c = s_seq;
  }
  __syncthreads();
  const uint64_t seq = s_seq;
  const int slot = notify_slot(seq);
  // What needs no input scan goes to the peers first (with scan blocks, while they read).
  if (tid < R) tokens_of(q.bufs.p[tid], slot)[q.rank] = q.num_tokens;
  // This rank's receive entry (sync-free calls), published like the dispatch kernel would.
  if (q.entry.on && tid < R && tid != q.rank) {
    volatile uint64_t* e = recv_entry(q.bufs.p[tid], slot, q.rank);
    for (int i = 0; i < kRecvEntryArgs; ++i) e[1 + i] = static_cast<uint64_t>(q.entry.w[i]);
    dev::fence_system();
    dev::st_release_sys(const_cast<uint64_t*>(e), seq);
  }
  // My row of the count matrix goes to every rank, so each rank sees the whole matrix.
  for (int i = tid; i < R * R; i += kThreads) {
    const int r = i / R, j = i % R;
    counts_of(q.bufs.p[r], slot)[q.rank * kMaxRanks + j] = q.per_rank[j];
  }
  if (q.per_expert != nullptr) {
    for (int i = tid; i < R * q.experts_per_rank; i += kThreads) {
      const int r = i / q.experts_per_rank, e = i % q.experts_per_rank;
      expert_counts_of(q.bufs.p[r], slot)[q.rank * kMaxLocalExperts + e] =
          q.per_expert[r * q.experts_per_rank + e];
    }
  }
  // Tokens is_token_in_rank sends to each rank (the outputs are sized from num_tokens_per_rank,
  // so the two must agree) and the range of the ids: read here or by the scan blocks, before
  // the barrier, so every rank learns of a bad input with the counts.
  __shared__ int s_sent[kMaxRanks];
  __shared__ int64_t s_range[2];
  if (tid < kMaxRanks) s_sent[tid] = 0;
  __syncthreads();
  if (q.scan_blocks == 0) {
    int sent[kMaxRanks] = {};
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    notify_detail::scan_share(q, tid, kThreads, sent, lo, hi);
    notify_detail::reduce_share<kThreads>(sent, R, lo, hi, s_sent, s_range);
  } else {
    notify_detail::scan_slices<kThreads>(q);
    if (!notify_detail::take_scan_parts(q, seq, s_sent, s_range)) {
      notify_detail::readback_failed(q);
      return;
    }
  }
  if (tid < R) {
    int bad = -1;
    for (int r = 0; q.send_pos != nullptr && r < R && bad < 0; ++r)
      if (s_sent[r] != q.per_rank[r]) bad = r;
    int64_t* b = id_bounds_of(q.bufs.p[tid], slot) + kCheckWords * q.rank;
    // No ids (or none to check): (-1, -1), which every check accepts.
    const bool ids = q.topk_idx != nullptr && q.num_tokens > 0 && q.num_topk > 0;
    b[0] = ids ? s_range[0] : -1;
    b[1] = ids ? s_range[1] : -1;
    b[2] = bad;
    b[3] = bad >= 0 ? q.per_rank[bad] : 0;
    b[4] = bad >= 0 ? s_sent[bad] : 0;
    b[5] = q.header;
  }
  // A cached dispatch reads nothing back: its header is compared here, on the GPU (the header
  // slot by sequence parity, like the counts).
  const size_t header_offset =
      q.send_pos == nullptr && q.header != 0 ? kCachedHeaderOffset + 8ull * kMaxRanks * slot : 0;
  if (!barrier_block(q.bufs, q.rank, R, seq, true, q.status, q.timeout_ns, kSiteNotify,
                     BarrierExtras{true, header_offset, q.header})) {
    notify_detail::readback_failed(q);
    return;
  }
  if (q.readback != nullptr && tid < kCheckWords * R)
    q.readback[kReadbackChecks + tid] =
        reinterpret_cast<const volatile int64_t*>(id_bounds_of(q.bufs.p[q.rank], slot))[tid];
  // Sync-free mode: every rank records the same first bad input (dispatch_verdict), so the
  // dispatch kernel that follows skips its data movement everywhere; nothing reaches the host
  // until its next call reads the word.
  if (q.num_worst_tokens > 0 && tid == 0) {
    const Verdict v =
        dispatch_verdict(reinterpret_cast<const volatile int64_t*>(id_bounds_of(q.bufs.p[q.rank], slot)),
                         counts_of(q.bufs.p[q.rank], slot), R, q.num_worst_tokens, q.num_experts);
    if (v.code != 0) record_status(q.status, v.code, v.who, v.value, v.extra);
  }

  // Control data is read through volatile loads: peers wrote it, no L1 line may serve it.
  const volatile int* counts = counts_of(q.bufs.p[q.rank], slot);
  for (int i = tid; i < R * R; i += kThreads) {
    const int s = i / R, j = i % R;
    int sum = 0;
    for (int s2 = 0; s2 <= s; ++s2) sum += counts[s2 * kMaxRanks + j];
    q.info[i] = sum;
    if (q.readback != nullptr) q.readback[kReadbackInfo + i] = sum;
  }
  if (q.per_expert != nullptr) {
    const volatile int* ec = expert_counts_of(q.bufs.p[q.rank], slot);
    for (int e = tid; e < q.experts_per_rank; e += kThreads) {
      int sum = 0;
      for (int s = 0; s < R; ++s) sum += ec[s * kMaxLocalExperts + e];
      const int aligned = (sum + q.alignment - 1) / q.alignment * q.alignment;
      q.info[R * R + e] = aligned;
      if (q.readback != nullptr) q.readback[kReadbackInfo + R * R + e] = aligned;
    }
  }
  if (q.readback != nullptr) {
    // A peer that gave up on this barrier may have done so just after this rank passed it
    // (it signals before it waits; its record can land after the barrier's check): look once
    // more, now that the readback took some microseconds, so that the host raises in this call
    // instead of the data kernel stopping with poisoned outputs. One load per peer; it narrows
    // the window, it does not close it (the data kernel's waits still catch what lands later).
    __shared__ int s_late;
    if (tid == 0) s_late = 0;
    __syncthreads();
    if (tid < R && tid != q.rank && abort_of(q.bufs.p[q.rank])[tid] != 0) {
      record_status(q.status, kStatusPeerAbort, tid, static_cast<int64_t>(seq), kSiteNotify);
      s_late = 1;
    }
    __syncthreads();
    // One system fence after the CTA barrier covers every thread's posted host writes (fences
    // are cumulative; the intranode barrier fences the same way), then one store says ready.
    if (tid == 0) {
      __threadfence_system();
      reinterpret_cast<volatile int64_t*>(q.readback)[0] = s_late ? -1 : 1;
    }
  }
}

}  // namespace uccl_ep::kernels

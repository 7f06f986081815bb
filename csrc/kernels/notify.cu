// Intranode notify: the count exchange and entry barrier of a dispatch (see intranode_notify in
// intranode.h), with the input checks that travel with the counts and the send-position scan.
#include <cstdint>

#include "kernels/common.cuh"

namespace uccl_ep::kernels {

namespace {

constexpr int kNotifyThreads = 1024;
constexpr int kNotifyWarps = kNotifyThreads / dev::kWarpSize;

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

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(Peers bufs, int rank, int num_ranks,
                                                                const int* per_rank, const int* per_expert,
                                                                int experts_per_rank, int alignment,
                                                                int* prefix_out, int* info, StatusRef status,
                                                                int64_t timeout_ns, const bool* in_rank,
                                                                int num_tokens, int* send_pos,
                                                                const void* topk_idx, bool idx_is_64, int num_topk,
                                                                int64_t* readback,
                                                                int num_worst_tokens, int num_experts,
                                                                int64_t header, RecvEntryArgs entry) {
  const int tid = threadIdx.x;
  const int R = num_ranks;
  // Block 1 (non-cached calls) scans send_pos while block 0 exchanges the counts and waits at
  // the barrier: the scan reads only this rank's is_token_in_rank, and only the dispatch
  // kernel, which follows this kernel in stream order, reads send_pos.
  if (blockIdx.x == 1) {
    scan_send_pos(in_rank, num_tokens, num_ranks, send_pos);
    return;
  }
  __shared__ uint64_t s_seq;
  if (tid == 0) {
    // Block 0 alone gets here (block 1 returned above): every thread reads s_seq below, so
    // storing the new value now is safe.
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
  // This rank's receive entry (sync-free calls), published like the dispatch kernel would.
  if (entry.on && tid < R && tid != rank) {
    volatile uint64_t* e = recv_entry(bufs.p[tid], slot, rank);
    for (int i = 0; i < kRecvEntryArgs; ++i) e[1 + i] = static_cast<uint64_t>(entry.w[i]);
    dev::fence_system();
    dev::st_release_sys(const_cast<uint64_t*>(e), seq);
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
                     BarrierExtras{true, header_offset, header})) {
    // The host spins on the readback: tell it now (the status words say why).
    if (readback != nullptr && tid == 0) {
      __threadfence_system();
      reinterpret_cast<volatile int64_t*>(readback)[0] = -1;
    }
    return;
  }
  if (readback != nullptr && tid < kCheckWords * R)
    readback[kReadbackChecks + tid] = reinterpret_cast<const volatile int64_t*>(id_bounds_of(bufs.p[rank], slot))[tid];
  // Sync-free mode: every rank records the same first bad input (dispatch_verdict), so the
  // dispatch kernel that follows skips its data movement everywhere; nothing reaches the host
  // until its next call reads the word.
  if (num_worst_tokens > 0 && tid == 0) {
    const Verdict v = dispatch_verdict(reinterpret_cast<const volatile int64_t*>(id_bounds_of(bufs.p[rank], slot)),
                                       counts_of(bufs.p[rank], slot), R, num_worst_tokens, num_experts);
    if (v.code != 0) record_status(status, v.code, v.who, v.value, v.extra);
  }

  // Control data is read through volatile loads: peers wrote it, no L1 line may serve it.
  const volatile int* counts = counts_of(bufs.p[rank], slot);
  for (int i = tid; i < R * R; i += blockDim.x) {
    const int s = i / R, j = i % R;
    int sum = 0;
    for (int s2 = 0; s2 <= s; ++s2) sum += counts[s2 * kMaxRanks + j];
    prefix_out[i] = sum;
    info[i] = sum;
    if (readback != nullptr) readback[kReadbackInfo + i] = sum;
  }
  if (per_expert != nullptr) {
    const volatile int* ec = expert_counts_of(bufs.p[rank], slot);
    for (int e = tid; e < experts_per_rank; e += blockDim.x) {
      int sum = 0;
      for (int s = 0; s < R; ++s) sum += ec[s * kMaxLocalExperts + e];
      const int aligned = (sum + alignment - 1) / alignment * alignment;
      info[R * R + e] = aligned;
      if (readback != nullptr) readback[kReadbackInfo + R * R + e] = aligned;
    }
  }
  if (readback != nullptr) {
    // Each writer fences its posted host writes; after the CTA barrier one store says "ready".
    __threadfence_system();
    // A peer that gave up on this barrier may have done so just after this rank passed it
    // (it signals before it waits; its record can land after the barrier's check): look once
    // more, now that the readback took some microseconds, so that the host raises in this call
    // instead of the data kernel stopping with poisoned outputs. One load per peer; it narrows
    // the window, it does not close it (the data kernel's waits still catch what lands later).
    __shared__ int s_late;
    if (tid == 0) s_late = 0;
    __syncthreads();
    if (tid < R && tid != rank && abort_of(bufs.p[rank])[tid] != 0) {
      record_status(status, kStatusPeerAbort, tid, static_cast<int64_t>(seq), kSiteNotify);
      s_late = 1;
    }
    __syncthreads();
    if (tid == 0) reinterpret_cast<volatile int64_t*>(readback)[0] = s_late ? -1 : 1;
  }
}

}  // namespace

void intranode_notify(const std::vector<intptr_t>& buffers, int rank, int num_ranks, intptr_t num_tokens_per_rank,
                      intptr_t num_tokens_per_expert, int experts_per_rank, int expert_alignment,
                      intptr_t rank_prefix_matrix, intptr_t out_info, intptr_t status, int64_t timeout_ns,
                      intptr_t is_token_in_rank, int num_tokens, intptr_t send_pos, intptr_t stream,
                      intptr_t topk_idx, bool idx_is_64, int num_topk, intptr_t readback, int num_worst_tokens,
                      int num_experts, int64_t header, const std::vector<int64_t>& recv_entry) {
  const Peers peers = make_peers(buffers, num_ranks);
  UCCL_EP_CHECK_ARG(recv_entry.empty() || recv_entry.size() == kRecvEntryArgs, "recv_entry has ",
                    recv_entry.size(), " words; expected ", kRecvEntryArgs, " or none");
  RecvEntryArgs entry{};
  entry.on = !recv_entry.empty();
  for (size_t i = 0; i < recv_entry.size(); ++i) entry.w[i] = recv_entry[i];
  UCCL_EP_CHECK_ARG(experts_per_rank <= kMaxLocalExperts, "experts_per_rank=", experts_per_rank,
                    " exceeds the kernels' limit of ", kMaxLocalExperts, " local experts");
  UCCL_EP_CHECK_ARG(expert_alignment >= 1, "expert_alignment=", expert_alignment, " must be >= 1");
  // A second block scans send_pos beside the count exchange (non-cached calls).
  const int blocks = send_pos != 0 ? 2 : 1;
  notify_kernel<<<blocks, kNotifyThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      peers, rank, num_ranks, reinterpret_cast<const int*>(num_tokens_per_rank),
      reinterpret_cast<const int*>(num_tokens_per_expert), experts_per_rank, expert_alignment,
      reinterpret_cast<int*>(rank_prefix_matrix), reinterpret_cast<int*>(out_info), status_ref(status),
      timeout_ns, reinterpret_cast<const bool*>(is_token_in_rank), num_tokens, reinterpret_cast<int*>(send_pos),
      reinterpret_cast<const void*>(topk_idx), idx_is_64, num_topk, reinterpret_cast<int64_t*>(readback),
      num_worst_tokens, num_experts, header, entry);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

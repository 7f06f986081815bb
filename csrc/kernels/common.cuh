// Pieces shared by the intranode kernels: the peer-buffer table, the cross-rank barrier with
// its timeout, and the warp-wide row copy; the combine element conversions (internode too).
#pragma once

#include <atomic>
#include <cstdint>

#if defined(__HIP_PLATFORM_AMD__) || defined(USE_ROCM) || defined(UCCL_EP_HIP)
#include <hip/hip_fp16.h>
#else
#include <cuda_fp16.h>
#endif

#include "kernels/device.cuh"
#include "kernels/intranode.h"

namespace uccl_ep::kernels {

// Registered buffer base of every rank, passed by value (kernel parameter space).
struct Peers {
  uint8_t* p[kMaxRanks];
};

// The table of `buffers` (one per rank) after checking its size.
inline Peers make_peers(const std::vector<intptr_t>& buffers, int num_ranks) {
  UCCL_EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= kMaxRanks, "num_ranks=", num_ranks,
                    " is outside 1..", kMaxRanks, " (the intranode kernels serve one node)");
  UCCL_EP_CHECK_ARG(static_cast<int>(buffers.size()) == num_ranks, "got ", buffers.size(), " buffers for ",
                    num_ranks, " ranks");
  Peers p{};
  for (int r = 0; r < num_ranks; ++r) p.p[r] = reinterpret_cast<uint8_t*>(buffers[r]);
  return p;
}

// A fact about the current device asked once per device (ids below 64; others every time):
// bit d of `known` says device d was asked, bit d of `value` holds its answer.
using PerDevice = std::atomic<uint64_t>;
template <typename Ask>
bool per_device_once(PerDevice* known, PerDevice* value, Ask ask) {
  int dev = 0;
  GPU_CHECK(gpuGetDevice(&dev));
  if (dev < 0 || dev >= 64) return ask(dev);
  const uint64_t bit = 1ull << dev;
  if (known->load(std::memory_order_acquire) & bit) return (value->load(std::memory_order_relaxed) & bit) != 0;
  const bool v = ask(dev);
  if (v) value->fetch_or(bit, std::memory_order_relaxed);
  known->fetch_or(bit, std::memory_order_release);
  return v;
}

#if defined(UCCL_EP_DEVICE_CUDA)
// Lets `Kernel` launch with `bytes` of dynamic shared memory: one driver call per device
// instead of one before every launch.
template <auto Kernel>
void allow_dynamic_smem(int bytes) {
  static PerDevice known, done;
  per_device_once(&known, &done, [bytes](int) {
    GPU_CHECK(cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return true;
  });
}
#endif

// Site codes reported in the status words (Python maps them to names).
enum BarrierSite : int {
  kSiteNotify = 1,
  kSiteDispatchDone = 2,
  kSiteCombineEntry = 3,
  kSiteCombineReceive = 4,  // a combine reducer waiting for a chunk of the rows a rank returns
  kSiteDispatchEntry = 5,  // a sender waiting for a destination's receive entry (zero-copy)
  kSiteCombineDone = 6,    // a rank combining in place, waiting for a peer to finish reading
};

__device__ __forceinline__ uint64_t* flags_of(uint8_t* buf) {
  return reinterpret_cast<uint64_t*>(buf + kFlagsOffset);
}

__device__ __forceinline__ const volatile uint64_t* abort_of(const uint8_t* buf) {
  return reinterpret_cast<const volatile uint64_t*>(buf + kAbortOffset);
}

// Where a call's failure is recorded: the mapped host words the host reads (layout in
// intranode.h) and a word in device memory the kernels read. Kernels never read the host words
// on their common path: on the H200 hosts we measured, a kernel that reads one mapped host word
// takes ~60 us (docs/performance.md, "Tried, did not pay"). The flag is never cleared (a Buffer whose call
// failed is unusable), so it needs no reset.
struct StatusRef {
  int64_t* host;  // kStatusWords mapped host words (or the internode ones)
  int64_t* flag;  // device word: non-zero once any failure is recorded
};

// The intranode status block: kStatusWords mapped host words, then (host side only) the device
// address of its flag (host_status_alloc).
inline StatusRef status_ref(intptr_t host_words) {
  auto* w = reinterpret_cast<int64_t*>(host_words);
  return StatusRef{w, reinterpret_cast<int64_t*>(w[kStatusFlagWord])};
}

__device__ __forceinline__ bool status_set(const StatusRef& s) {
  return *reinterpret_cast<const volatile int64_t*>(s.flag) != 0;
}

__device__ __forceinline__ uint64_t* seq_counter(uint8_t* buf) { return reinterpret_cast<uint64_t*>(buf + kSeqOffset); }
__device__ __forceinline__ unsigned* seq_done_blocks(uint8_t* buf) {
  return reinterpret_cast<unsigned*>(buf + kSeqOffset + 8);
}
__device__ __forceinline__ unsigned* send_done_blocks(uint8_t* buf) {
  return reinterpret_cast<unsigned*>(buf + kSeqOffset + 12);
}
__device__ __forceinline__ unsigned* dispatch_done_blocks(uint8_t* buf) {
  return reinterpret_cast<unsigned*>(buf + kSeqOffset + 20);
}
__device__ __forceinline__ uint64_t* notify_done_blocks(uint8_t* buf) {
  return reinterpret_cast<uint64_t*>(buf + kSeqOffset + 24);
}

// Fills every region of `r` with its pattern, threads `tid`, `tid + stride`, ... of the caller.
__device__ __forceinline__ void fill_poison(const PoisonRegions& r, int64_t tid, int64_t stride) {
  for (int i = 0; i < r.count; ++i) {
    auto* bytes = reinterpret_cast<uint8_t*>(r.ptr[i]);
    const int64_t words = r.bytes[i] / 8;
    uint64_t* w = reinterpret_cast<uint64_t*>(bytes);
    for (int64_t q = tid; q < words; q += stride) w[q] = r.pattern[i];
    for (int64_t b = words * 8 + tid; b < r.bytes[i]; b += stride)
      bytes[b] = static_cast<uint8_t>(r.pattern[i] >> (8 * (b % 8)));
  }
}

// The end of a kernel whose every block calls this once, as its last step (all of its threads):
// the last block to get here fills `r` when the status is set by then (a wait of the call timed
// out, or an earlier call failed), and zeroes `done` (and `also_zero`, when given: a count the
// blocks raised before) for the next launch on the stream.
__device__ __forceinline__ void poison_when_failed(const StatusRef& status, const PoisonRegions& r, unsigned* done,
                                                   uint64_t* also_zero = nullptr) {
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's output stores and status writes, before the count
    s_last = atomicAdd(done, 1u) == gridDim.x - 1;
    if (s_last) {
      *done = 0;
      if (also_zero != nullptr) *also_zero = 0;
      __threadfence();  // every other block's, before the status read below
    }
  }
  __syncthreads();
  if (s_last && status_set(status)) fill_poison(r, threadIdx.x, blockDim.x);
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
__device__ __forceinline__ unsigned* scan_claim_of(uint8_t* buf) {
  return reinterpret_cast<unsigned*>(buf + kScanPartsOffset);
}
__device__ __forceinline__ unsigned* scan_done_of(uint8_t* buf) {
  return reinterpret_cast<unsigned*>(buf + kScanPartsOffset + 4);
}
__device__ __forceinline__ uint64_t* scan_part_of(uint8_t* buf, int slice) {
  return reinterpret_cast<uint64_t*>(buf + kScanPartsOffset + 64) + 8 * slice;
}
__device__ __forceinline__ int64_t* id_bounds_of(uint8_t* buf, int slot) {
  return reinterpret_cast<int64_t*>(buf + kIdBoundsOffset) + slot * kMaxRanks * kCheckWords;
}

// The first bad input of any rank in a dispatch, judged from data every rank holds alike after
// notify's barrier (each rank's checks and the whole count matrix), so every rank reaches the
// same verdict: {code, rank, value, extra} as the status words say it, code 0 when none.
// Order: call headers, expert ids of ranks 0..R-1, then layouts, then received row counts
// (more than `max_rows` for some rank; max_rows < 0: not checked).
struct Verdict {
  int64_t code, who, value, extra;
};
__device__ inline Verdict dispatch_verdict(const volatile int64_t* checks, const volatile int* counts, int R,
                                           int64_t max_rows, int num_experts) {
  // Ranks that disagree on the call (packed header, word 5) first: their other checks and
  // counts mean different things.
  for (int r = 1; r < R; ++r) {
    if (checks[r * kCheckWords + 5] != checks[5]) return {kStatusHeaderMismatch, r, 0, 0};
  }
  for (int r = 0; r < R; ++r) {
    const int64_t lo = checks[r * kCheckWords], hi = checks[r * kCheckWords + 1];
    if (num_experts > 0 && (lo < -1 || hi >= num_experts)) return {kStatusBadExpertId, r, lo < -1 ? lo : hi, num_experts};
  }
  for (int r = 0; r < R; ++r) {
    const int64_t dest = checks[r * kCheckWords + 2];
    if (dest >= 0)
      return {kStatusLayoutMismatch, r, dest, (checks[r * kCheckWords + 3] << 32) | (checks[r * kCheckWords + 4] & 0xFFFFFFFFll)};
  }
  for (int j = 0; j < R && max_rows >= 0; ++j) {
    int64_t rows = 0;
    for (int s = 0; s < R; ++s) rows += counts[s * kMaxRanks + j];
    if (rows > max_rows) return {kStatusDispatchOverflow, j, rows, max_rows};
  }
  return {0, 0, 0, 0};
}
// The receive entry words a launch publishes (kernel parameter; see intranode_notify).
struct RecvEntryArgs {
  int64_t w[kRecvEntryArgs];
  bool on;
};

// Source `src`'s receive entry in `buf` (see kRecvEntryOffset), and the done words.
__device__ __forceinline__ uint64_t* recv_entry(uint8_t* buf, int slot, int src) {
  return reinterpret_cast<uint64_t*>(buf + kRecvEntryOffset) + (slot * kMaxRanks + src) * kRecvEntryWords;
}
__device__ __forceinline__ uint64_t* recv_done(uint8_t* buf) {
  return reinterpret_cast<uint64_t*>(buf + kRecvDoneOffset);
}

// Combine in place (kCombinePlaceOffset): {sequence, x offset, weights offset, 0} of `source`'s
// input in its arena, slot by the combine's sequence parity; and the readers' done words
// (kCombineDoneOffset).
__device__ __forceinline__ volatile int64_t* combine_place(uint8_t* buf, uint64_t seq, int source) {
  return reinterpret_cast<volatile int64_t*>(buf + kCombinePlaceOffset) + (seq % kNotifySlots) * kMaxRanks * 4 +
         source * 4;
}
__device__ __forceinline__ uint64_t* combine_done(uint8_t* buf) {
  return reinterpret_cast<uint64_t*>(buf + kCombineDoneOffset);
}

// Records a failure unless one is already recorded: the first failure wins (a CAS on the
// device flag), so the host reports the cause, not a consequence. Word 0 of the host words is
// published last, after the detail words; the host reads them after the kernels are done.
__device__ __forceinline__ void record_status(const StatusRef& s, int64_t code, int64_t w1, int64_t w2, int64_t w3) {
  auto* flag = reinterpret_cast<unsigned long long*>(s.flag);
  if (atomicCAS(flag, 0ull, static_cast<unsigned long long>(code)) != 0ull) return;
  volatile int64_t* st = s.host;
  st[1] = w1;
  st[2] = w2;
  st[3] = w3;
  __threadfence_system();
  st[0] = code;
  __threadfence_system();
}

// Peers' abort records (kAbortOffset) as an intranode wait sees them: it stops when the peer it
// waits for posted one, and, when it times out itself, posts one into every peer, so that a
// peer reaching this call later fails at once instead of waiting for rows this rank never
// sends or passing a barrier this rank signalled before it gave up.
struct PeerAborts {
  const Peers& bufs;
  int rank, num_ranks;
};

__device__ __forceinline__ bool peer_aborted(const PeerAborts& a, int peer) {
  return abort_of(a.bufs.p[a.rank])[peer] != 0;
}

// This rank's wait for `peer` at `site` of barrier `seq` timed out: say so in every peer's
// control region (error path only; one thread, a store per peer).
__device__ __forceinline__ void post_timed_out(const PeerAborts& a, int peer, uint64_t seq, int site) {
  const uint64_t word = abort_word(kAbortTimedOut, 0, static_cast<uint64_t>(site), static_cast<uint64_t>(peer), seq);
  for (int r = 0; r < a.num_ranks; ++r)
    if (r != a.rank) *reinterpret_cast<volatile uint64_t*>(a.bufs.p[r] + kAbortOffset + 8ull * a.rank) = word;
  dev::fence_system();
}

// Records a timeout of this rank's wait for `peer` and tells the peers (see PeerAborts).
__device__ __forceinline__ void time_out(const StatusRef& status, const PeerAborts& a, int peer, uint64_t seq,
                                         int site) {
  post_timed_out(a, peer, seq, site);
  record_status(status, kStatusTimeout, peer, static_cast<int64_t>(seq), site);
}

// Waits until `done(*flag)` holds for a peer's progress word (read with acquire), storing the
// last value read in `*last` when given. Gives up, returning false, when another wait of this
// rank failed (checked every 1024 polls), when `peer` posted an abort record (kStatusPeerAbort,
// checked as often) or after timeout_ns, which records {kStatusTimeout, peer, seq, site} and
// tells every peer (PeerAborts). One thread calls it.
template <typename Done>
__device__ __forceinline__ bool wait_until(const uint64_t* flag, Done done, const StatusRef& status,
                                           const PeerAborts& aborts, int64_t timeout_ns, int peer, uint64_t seq,
                                           int site, uint64_t* last = nullptr) {
  const uint64_t start = dev::global_timer_ns();
  uint32_t iter = 0;
  uint64_t v;
  while (!done(v = dev::ld_acquire_sys(flag))) {
    if ((++iter & 1023u) == 0 && status_set(status)) return false;
    if ((iter & 1023u) == 512 && peer_aborted(aborts, peer)) {
      record_status(status, kStatusPeerAbort, peer, static_cast<int64_t>(seq), site);
      return false;
    }
    if (dev::global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) {
      time_out(status, aborts, peer, seq, site);
      return false;
    }
  }
  if (last != nullptr) *last = v;
  return true;
}

// wait_until *flag == want (a progress flag tagged with the call's sequence).
__device__ __forceinline__ bool wait_flag(const uint64_t* flag, uint64_t want, const StatusRef& status,
                                          const PeerAborts& aborts, int64_t timeout_ns, int peer, uint64_t seq,
                                          int site) {
  return wait_until(flag, [want](uint64_t v) { return v == want; }, status, aborts, timeout_ns, peer, seq, site);
}

// Waits until *f >= want (monotonic sequence words written by `peer`), or records why not:
// a timeout (kStatusTimeout, peer, want, site), an abort record of `peer` or an earlier
// failure. One thread calls it.
__device__ __forceinline__ bool wait_at_least(const uint64_t* f, uint64_t want, int peer, int site,
                                              const StatusRef& status, const PeerAborts& aborts, int64_t timeout_ns) {
  return wait_until(f, [want](uint64_t v) { return v >= want; }, status, aborts, timeout_ns, peer, want, site);
}

// What the intranode barriers do besides waiting (the internode NVL barrier uses none of it:
// its buffers have another layout).
struct BarrierExtras {
  // Peers' abort records (kAbortOffset): stop when one is posted, fail when one is there after
  // the barrier, post this rank's own when a wait times out (see PeerAborts).
  bool watch_abort = false;
  size_t header_offset = 0;  // when non-zero: int64 [kMaxRanks] slots where ranks exchange
  int64_t header = 0;        //   `header` with the signal; a peer's that differs fails the call
};

// Cross-rank barrier on monotonically increasing sequence numbers (never reset, so no
// re-arming race): when `signal`, this block stores `seq` into slot [rank] of every peer's
// flags after fencing its earlier writes; then threads 0..R-1 wait until peer `tid` has
// stored a value >= seq into our slot [tid]. A peer can be at most one barrier ahead, which
// `>=` absorbs. A wait that exceeds `timeout_ns` records (peer, seq, site) in the mapped host
// status words and gives up, so the host raises instead of the GPU hanging; so does a peer's
// abort record or a differing header (`extras`). Returns false when the call failed (the
// caller must then skip its data movement).
__device__ __forceinline__ bool barrier_block(const Peers& bufs, int rank, int num_ranks, uint64_t seq,
                                              bool signal, const StatusRef& status, int64_t timeout_ns, int site,
                                              BarrierExtras extras = {}) {
  __shared__ int s_failed;
  const int tid = threadIdx.x;
  if (tid == 0) s_failed = status_set(status) ? 1 : 0;
  if (signal) {
    // One system fence per signalling thread, after the CTA barrier, covers this block's
    // earlier writes (fences are cumulative). Data written by earlier kernels of the stream is
    // complete at the kernel boundary. A fence in every thread would serialise thousands of
    // MEMBAR.SYS (measured: send kernels 2x slower at 48 SMs than at 24).
    __syncthreads();
    if (tid < num_ranks) {
      if (extras.header_offset != 0)
        reinterpret_cast<volatile int64_t*>(bufs.p[tid] + extras.header_offset)[rank] = extras.header;
      dev::fence_system();
      dev::st_release_sys(flags_of(bufs.p[tid]) + rank, seq);
    }
  } else {
    __syncthreads();
  }
  if (tid < num_ranks && !s_failed) {
    const uint64_t* f = flags_of(bufs.p[rank]) + tid;
    const uint64_t start = dev::global_timer_ns();
    uint32_t iter = 0;
    bool arrived = true;
    while (dev::ld_acquire_sys(f) < seq) {
      // Another block of this rank failed: stop waiting (checked now and then).
      if ((++iter & 1023u) == 0 && status_set(status)) {
        s_failed = 1;
        arrived = false;
        break;
      }
      // A peer that rejected the call never arrives: it says so in our control region.
      if (extras.watch_abort && (iter & 1023u) == 512 && abort_of(bufs.p[rank])[tid] != 0) {
        record_status(status, kStatusPeerAbort, tid, static_cast<int64_t>(seq), site);
        s_failed = 1;
        arrived = false;
        break;
      }
      if (dev::global_timer_ns() - start > static_cast<uint64_t>(timeout_ns)) {
        if (extras.watch_abort) post_timed_out(PeerAborts{bufs, rank, num_ranks}, tid, seq, site);
        record_status(status, kStatusTimeout, tid, static_cast<int64_t>(seq), site);
        s_failed = 1;
        arrived = false;
        break;
      }
    }
    // A peer signals before it waits, so it may have given up on this barrier (or an earlier
    // call) after signalling: its abort record says so. The one load of the common path.
    if (arrived && extras.watch_abort && abort_of(bufs.p[rank])[tid] != 0) {
      record_status(status, kStatusPeerAbort, tid, static_cast<int64_t>(seq), site);
      s_failed = 1;
      arrived = false;
    }
    // The peer's header was written before its signal, which the acquire above has seen.
    if (arrived && extras.header_offset != 0 &&
        reinterpret_cast<const volatile int64_t*>(bufs.p[rank] + extras.header_offset)[tid] != extras.header) {
      record_status(status, kStatusHeaderMismatch, tid, static_cast<int64_t>(seq), site);
      s_failed = 1;
    }
  }
  __syncthreads();
  return !s_failed;
}

// Warp-wide copy of one row of `nbytes` (a multiple of sizeof(V)) to every destination whose
// bit is set in `mask`: the source is read once. Two batches of kUnroll vectors per lane are in
// flight: the next batch's loads are issued before the current one is stored, so a row costs
// about one load latency plus its bytes, not one latency per batch (a warp copies one row at a
// time, so at <= 12 SMs the dispatch was latency-bound: docs/performance.md, "Per SM").
template <typename V, int kUnroll>
__device__ __forceinline__ void copy_row_multi(const uint8_t* src, int64_t nbytes, uint8_t* const (&dst)[kMaxRanks],
                                               unsigned mask, int lane) {
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(V));
  constexpr int64_t kStep = static_cast<int64_t>(kUnroll) * dev::kWarpSize;
  const V* s = reinterpret_cast<const V*>(src);
  V cur[kUnroll], nxt[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t i = u * dev::kWarpSize + lane;
    if (i < n) cur[u] = dev::ld_stream(s + i);
  }
  for (int64_t base = 0; base < n; base += kStep) {
    const int64_t next = base + kStep;
    if (next < n) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = next + u * dev::kWarpSize + lane;
        if (i < n) nxt[u] = dev::ld_stream(s + i);
      }
    }
#pragma unroll
    for (int r = 0; r < kMaxRanks; ++r) {
      if (mask >> r & 1u) {
        V* d = reinterpret_cast<V*>(dst[r]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = base + u * dev::kWarpSize + lane;
          if (i < n) d[i] = cur[u];
        }
      }
    }
    if (next < n) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) cur[u] = nxt[u];
    }
  }
}

template <typename V, int kUnroll>
__device__ __forceinline__ void copy_row(const uint8_t* src, int64_t nbytes, uint8_t* dst, int lane) {
  uint8_t* d[kMaxRanks] = {dst};
  copy_row_multi<V, kUnroll>(src, nbytes, d, 1u, lane);
}

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Element conversions on raw bits (bf16 rounds to nearest even, like torch); kDtype is the
// combine dtype code (0 bf16, 1 fp16, 2 fp32).
template <int kDtype>
struct Elt;
// The 16-bit dtypes also convert two elements at a time from and to a 32-bit word (element 0
// in the low half): one instruction per element or pair instead of several.
template <>
struct Elt<0> {
  using raw = uint16_t;
  __device__ static float to_f(raw b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
  __device__ static raw from_f(float f) {
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<raw>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<raw>(u >> 16);
  }
  __device__ static float2 to_f2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  // Rounds to nearest even as from_f (a NaN comes out as the canonical one on sm_80+).
  __device__ static uint32_t from_f2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(__HIP_PLATFORM_AMD__)
    uint32_t w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
#else
    return static_cast<uint32_t>(from_f(lo)) | static_cast<uint32_t>(from_f(hi)) << 16;
#endif
  }
};
template <>
struct Elt<1> {
  using raw = uint16_t;
  __device__ static float to_f(raw b) { return __half2float(__ushort_as_half(b)); }
  __device__ static raw from_f(float f) { return __half_as_ushort(__float2half_rn(f)); }
  __device__ static float2 to_f2(uint32_t w) {
    return make_float2(to_f(static_cast<raw>(w & 0xffffu)), to_f(static_cast<raw>(w >> 16)));
  }
  __device__ static uint32_t from_f2(float lo, float hi) {
    return static_cast<uint32_t>(from_f(lo)) | static_cast<uint32_t>(from_f(hi)) << 16;
  }
};
template <>
struct Elt<2> {
  using raw = float;
  __device__ static float to_f(raw b) { return b; }
  __device__ static raw from_f(float f) { return f; }
};

// acc[e] += element e of the kN raw elements of dtype kDtype at `v` (registers), a pair per
// 32-bit word for the 16-bit dtypes.
template <int kDtype, int kN>
__device__ __forceinline__ void add_elts(float* acc, const void* v) {
  using E = Elt<kDtype>;
  if constexpr (sizeof(typename E::raw) == 2 && kN % 2 == 0) {
    const uint32_t* w = static_cast<const uint32_t*>(v);
#pragma unroll
    for (int q = 0; q < kN / 2; ++q) {
      const float2 f = E::to_f2(w[q]);
      acc[2 * q] += f.x;
      acc[2 * q + 1] += f.y;
    }
  } else {
    const typename E::raw* r = static_cast<const typename E::raw*>(v);
#pragma unroll
    for (int e = 0; e < kN; ++e) acc[e] += E::to_f(r[e]);
  }
}

// The kN sums of acc as raw elements of dtype kDtype at `out` (registers).
template <int kDtype, int kN>
__device__ __forceinline__ void store_elts(void* out, const float* acc) {
  using E = Elt<kDtype>;
  if constexpr (sizeof(typename E::raw) == 2 && kN % 2 == 0) {
    uint32_t* w = static_cast<uint32_t*>(out);
#pragma unroll
    for (int q = 0; q < kN / 2; ++q) w[q] = E::from_f2(acc[2 * q], acc[2 * q + 1]);
  } else {
    typename E::raw* r = static_cast<typename E::raw*>(out);
#pragma unroll
    for (int e = 0; e < kN; ++e) r[e] = E::from_f(acc[e]);
  }
}

}  // namespace uccl_ep::kernels

namespace uccl_ep::kernels {

// Bulk-copy pipeline per warp (model: docs/performance.md, "Per SM"): kTmaStages stages
// of kTmaChunk bytes, kTmaLoads of them loading while the newest stored stage drains. 16 warps x
// 4 x 3.5 KB = 224 KB of dynamic shared memory per block, 168 KB of loads in flight per SM
// (one 4 KB load per warp before: 64 KB, ~35-45 GB/s per SM at ~1.5-2 us loaded latency).
constexpr int kTmaChunk = 3584;  // 16-byte multiple; a 7168-wide row is 4 (BF16) or 2 (FP8) chunks
constexpr int kTmaStages = 4;
constexpr int kTmaLoads = kTmaStages - 1;
constexpr int tma_smem_bytes(int warps) { return warps * kTmaStages * kTmaChunk; }
static_assert(kTmaChunk % 16 == 0 && kTmaStages <= 32 && kTmaLoads >= 1 && kTmaLoads < kTmaStages,
              "bulk-copy pipeline shape");

#if UCCL_EP_HAS_TMA
// One warp's bulk-copy pipeline. Lane s owns stage s: it issues the stage's load and stores, so
// the bulk groups of lane s (cp.async.bulk groups are per thread) are exactly stage s's stores,
// and waiting for them before the next load into stage s waits for nothing else. Chunks take
// the stages in issue order and are stored in that order; up to kTmaLoads loads are in flight,
// across rows and calls to push (the pipeline drains only in drain()). Every lane of the warp
// makes the same calls with the same arguments; only a chunk's owner lane acts on it.
struct TmaPipe {
  uint8_t* buf;    // the warp's kTmaStages * kTmaChunk bytes of shared memory (16-byte aligned)
  uint64_t* bars;  // the warp's kTmaStages mbarriers
  int lane;
  uint32_t issued, stored;  // chunks loaded / stored so far (equal in every lane)
  uint32_t phase;           // owner lane: parity of its stage's next completion
  // Owner lane: the destinations of its stage's chunk in flight.
  uint8_t* dst[kMaxRanks];
  unsigned mask;
  uint32_t bytes;

  __device__ __forceinline__ void init(uint8_t* smem, uint64_t* warp_bars, int lane_id) {
    buf = smem;
    bars = warp_bars;
    lane = lane_id;
    issued = stored = phase = 0;
    mask = 0;
    bytes = 0;
    if (lane < kTmaStages) dev::mbar_init(&bars[lane], 1);
    __syncwarp();
  }

  // Stores the oldest loaded chunk to its destinations once its load has landed.
  __device__ __forceinline__ void store_one() {
    if (lane == static_cast<int>(stored % kTmaStages)) {
      dev::mbar_wait(&bars[lane], phase);
      phase ^= 1u;
      const uint8_t* s = buf + lane * kTmaChunk;
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r)
        if (mask >> r & 1u) dev::tma_store(dst[r], s, bytes);
      dev::tma_commit();
    }
    ++stored;
  }

  // Queues src[0, n) (n <= kTmaChunk; n, src and every destination 16-byte aligned) for
  // dsts[r] + off of every rank r in `m`.
  __device__ __forceinline__ void push(const uint8_t* src, uint32_t n, uint8_t* const (&dsts)[kMaxRanks], unsigned m,
                                       int64_t off) {
    if (issued - stored == kTmaLoads) store_one();
    if (lane == static_cast<int>(issued % kTmaStages)) {
      dev::tma_wait_read<0>();  // this stage's previous stores have read it
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) dst[r] = m >> r & 1u ? dsts[r] + off : nullptr;
      mask = m;
      bytes = n;
      dev::mbar_expect_tx(&bars[lane], n);
      dev::tma_load(buf + lane * kTmaChunk, src, n, &bars[lane]);
    }
    ++issued;
  }

  // One row of `nbytes` (a 16-byte multiple) to every destination in `m`, chunk by chunk.
  __device__ __forceinline__ void push_row(const uint8_t* src, int64_t nbytes, uint8_t* const (&dsts)[kMaxRanks],
                                           unsigned m) {
    for (int64_t off = 0; off < nbytes; off += kTmaChunk)
      push(src + off, static_cast<uint32_t>(nbytes - off < kTmaChunk ? nbytes - off : kTmaChunk), dsts, m, off);
  }

  // Warp `w` of `nw` copies its share of the contiguous range src[0, nbytes) -> dst[0, nbytes):
  // the kTmaChunk pieces w, w + nw, ...
  __device__ __forceinline__ void push_range(const uint8_t* src, uint8_t* dst, int64_t nbytes, int64_t w,
                                             int64_t nw) {
    uint8_t* const d[kMaxRanks] = {dst};
    for (int64_t off = w * kTmaChunk; off < nbytes; off += nw * kTmaChunk)
      push(src + off, static_cast<uint32_t>(nbytes - off < kTmaChunk ? nbytes - off : kTmaChunk), d, 1u, off);
  }

  // Every queued chunk stored and its writes performed; then a proxy fence, so generic-proxy
  // code after the caller's CTA barrier (the chunk publish's fence and release store, the
  // kernel's end) is ordered after the bulk writes.
  __device__ __forceinline__ void drain() {
    while (stored != issued) store_one();
    dev::tma_wait_all();
    dev::fence_proxy_async();
  }
};
#endif

}  // namespace uccl_ep::kernels

// The per-call checks of the internode path on the GPU, one launch each: the routing check of a
// dispatch's arguments (what get_dispatch_layout computes from topk_idx, against the layout the
// caller passed), the verdict on the all-gathered call headers of a sync-free call, and the
// call-header row itself. Their torch forms (backends/base.py routing_check,
// agreement/verdict.py device_verdict, agreement/row.py encode_row) define them; the GPU tests
// hold these kernels to them.
#include "common/errors.h"
#include "kernels/internode/plumbing.cuh"

namespace uccl_ep::internode {
namespace detail {
namespace {

constexpr int kCheckThreads = 256;
constexpr int kCheckBlocks = 132;

// Order-preserving map of int64 onto uint64 (for unsigned atomic min/max).
__device__ __forceinline__ unsigned long long ordered(int64_t v) {
  return static_cast<unsigned long long>(v) ^ (1ull << 63);
}
__device__ __forceinline__ int64_t unordered(unsigned long long v) { return static_cast<int64_t>(v ^ (1ull << 63)); }

// scratch (uint64; between launches zeroed but for [0], which is all ones: its allocation
// sets that state once and the last block of every launch restores it): [0] min id key,
// [1] max id key, [2] flags (8: is_token_in_rank differs, 16: a token names an expert twice),
// [3] blocks done, then the counts per rank [R], per node [N] and per expert [E].
enum : int { kLo = 0, kHi = 1, kFlags = 2, kDone = 3, kCounts = 4 };

struct TokenCheck {
  unsigned long long lo, hi, flags;
};

// Token t (valid: t < num_tokens; every lane of the warp calls it): its ids into the counts
// (valid ids only, as the layout kernel counts them), its rank set against the caller's
// is_token_in_rank row, and a repeated id. The per-rank and per-node counts are summed over
// the warp first: one atomic per warp and rank or node, not one per token on the same few words.
__device__ TokenCheck check_token(const RoutingCheckArgs& a, unsigned long long* scratch, int t, bool valid) {
  const int R = a.num_ranks, N = R / a.ranks_per_node, E = a.num_experts, epr = E / R;
  const int lane = threadIdx.x % dev::kWarpSize;
  unsigned long long* per_rank = scratch + kCounts;
  unsigned long long* per_node = per_rank + R;
  unsigned long long* per_expert = per_node + N;
  int64_t ids[kMaxTopk];
  TokenCheck c{~0ull, 0ull, 0ull};
  uint32_t ranks = 0, nodes = 0;
  // The ids first, then the atomics: the loads go out together instead of one per atomic.
  const int64_t first = static_cast<int64_t>(t) * a.num_topk;
#pragma unroll 8
  for (int k = 0; valid && k < a.num_topk; ++k)
    ids[k] = a.idx64 ? reinterpret_cast<const int64_t*>(a.topk_idx)[first + k]
                     : static_cast<int64_t>(reinterpret_cast<const int32_t*>(a.topk_idx)[first + k]);
  for (int k = 0; valid && k < a.num_topk; ++k) {
    const int64_t e = ids[k];
    c.lo = min(c.lo, ordered(e));
    c.hi = max(c.hi, ordered(e));
    if (e < 0 || e >= E) continue;
    atomicAdd(&per_expert[e], 1ull);
    ranks |= 1u << static_cast<int>(e / epr);
  }
  if (valid) {
    for (int i = 0; i < a.num_topk; ++i)
      for (int j = i + 1; j < a.num_topk; ++j)
        if (ids[i] >= 0 && ids[i] == ids[j]) c.flags |= 16;
    const bool* given = reinterpret_cast<const bool*>(a.in_rank) + static_cast<int64_t>(t) * R;
    for (int r = 0; r < R; ++r) {
      const bool in = ranks >> r & 1u;
      if (given[r] != in) c.flags |= 8;
      if (in) nodes |= 1u << (r / a.ranks_per_node);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int n = dev::popc_mask(dev::warp_ballot(ranks >> r & 1u));
    if (lane == 0 && n) atomicAdd(&per_rank[r], static_cast<unsigned long long>(n));
  }
  for (int n = 0; n < N; ++n) {
    const int k = dev::popc_mask(dev::warp_ballot(nodes >> n & 1u));
    if (lane == 0 && k) atomicAdd(&per_node[n], static_cast<unsigned long long>(k));
  }
  return c;
}

// The last block: the counts against the caller's (bits 1, 2, 4) and the words of the check.
__device__ void finish_check(const RoutingCheckArgs& a, unsigned long long* scratch) {
  const int R = a.num_ranks, N = R / a.ranks_per_node, E = a.num_experts;
  // Read through L2: other blocks' atomics wrote them.
  const volatile unsigned long long* per_rank = scratch + kCounts;
  const volatile unsigned long long* per_node = per_rank + R;
  const volatile unsigned long long* per_expert = per_node + N;
  __shared__ unsigned int s_bits;
  if (threadIdx.x == 0) s_bits = 0;
  __syncthreads();
  unsigned int bits = 0;
  for (int r = threadIdx.x; r < R; r += blockDim.x)
    if (static_cast<int64_t>(reinterpret_cast<const int*>(a.per_rank)[r]) != static_cast<int64_t>(per_rank[r])) bits |= 1;
  if (a.per_rdma != 0)
    for (int n = threadIdx.x; n < N; n += blockDim.x)
      if (static_cast<int64_t>(reinterpret_cast<const int*>(a.per_rdma)[n]) != static_cast<int64_t>(per_node[n])) bits |= 2;
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (static_cast<int64_t>(reinterpret_cast<const int*>(a.per_expert)[e]) != static_cast<int64_t>(per_expert[e])) bits |= 4;
  if (bits) atomicOr(&s_bits, bits);
  __syncthreads();
  if (threadIdx.x == 0) {
    auto* out = reinterpret_cast<int64_t*>(a.out);
    const bool any = static_cast<int64_t>(a.num_tokens) * a.num_topk > 0;
    const volatile unsigned long long* w = scratch;
    out[0] = any ? unordered(w[kLo]) : 0;
    out[1] = any ? unordered(w[kHi]) : -1;
    out[2] = static_cast<int64_t>(s_bits | static_cast<unsigned int>(w[kFlags]));
  }
  __syncthreads();
  // Every block is done with the scratch: back to its state between launches.
  const int words = kCounts + R + N + E;
  for (int i = threadIdx.x; i < words; i += blockDim.x) scratch[i] = i == kLo ? ~0ull : 0ull;
}

__global__ void __launch_bounds__(kCheckThreads) routing_check_kernel(RoutingCheckArgs a) {
  auto* scratch = reinterpret_cast<unsigned long long*>(a.scratch);
  __shared__ unsigned long long s_lo, s_hi, s_flags;
  __shared__ bool s_last;
  if (threadIdx.x == 0) s_lo = ~0ull, s_hi = 0ull, s_flags = 0ull;
  __syncthreads();
  TokenCheck mine{~0ull, 0ull, 0ull};
  // Whole warps go round (the last round's lanes past the tokens take part in the ballots).
  const int step = gridDim.x * blockDim.x;
  for (int base = blockIdx.x * blockDim.x; base < a.num_tokens; base += step) {
    const int t = base + threadIdx.x;
    const TokenCheck c = check_token(a, scratch, t, t < a.num_tokens);
    mine.lo = min(mine.lo, c.lo);
    mine.hi = max(mine.hi, c.hi);
    mine.flags |= c.flags;
  }
  atomicMin(&s_lo, mine.lo);
  atomicMax(&s_hi, mine.hi);
  atomicOr(&s_flags, mine.flags);
  __threadfence();  // this thread's count atomics are done before the block says it is
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicMin(&scratch[kLo], s_lo);
    atomicMax(&scratch[kHi], s_hi);
    atomicOr(&scratch[kFlags], s_flags);
    __threadfence();
    s_last = atomicAdd(&scratch[kDone], 1ull) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  finish_check(a, scratch);
}

// Rows `rank` receives for its local expert j, summed over the R source rows' per-expert blocks
// (int32 slots from column experts_col) and rounded up to align (local_expert_counts).
__device__ int64_t local_expert_count(const int64_t* rows, int R, int width, int experts_col, int rank,
                                      int experts_per_rank, int j, int align) {
  int64_t n = 0;
  for (int r = 0; r < R; ++r) {
    const auto* block = reinterpret_cast<const int*>(rows + static_cast<int64_t>(r) * width + experts_col);
    n += block[rank * experts_per_rank + j];
  }
  return (n + align - 1) / align * align;
}

// One thread per rank s: each check's (failed, value) in VERDICTS order, then the first failure
// (check-major, lowest rank) for everyone.
__global__ void __launch_bounds__(kMaxRanks) verdict_kernel(VerdictArgs a) {
  constexpr int kChecks = 10;
  __shared__ int64_t s_value[kChecks][kMaxRanks];
  __shared__ int s_first;
  const int R = a.num_ranks, s = threadIdx.x;
  const auto* rows = reinterpret_cast<const int64_t*>(a.rows);
  if (s == 0) s_first = kChecks * R;
  __syncthreads();
  if (s < R) {
    const int64_t* me = rows + static_cast<int64_t>(s) * a.width;
    const int64_t* first = rows;
    const bool dispatch = me[a.col_kind] == a.kind_dispatch;
    int field = -1;
    for (int i = 0; i < a.num_agreed && field < 0; ++i)
      if (me[a.agreed[i]] != first[a.agreed[i]]) field = i;
    const int64_t lo = me[a.checks_col], hi = me[a.checks_col + 1], bits = me[a.checks_col + 2];
    const int64_t worst = me[a.col_worst], tokens = me[a.width - 1];
    int64_t received = 0;
    for (int r = 0; r < R; ++r) received += rows[static_cast<int64_t>(r) * a.width + a.counts_col + s];
    const bool failed[kChecks] = {
        me[a.col_error] != 0,
        me[a.col_magic] != a.magic,
        me[a.col_buffer] != first[a.col_buffer],
        me[a.col_kind] != first[a.col_kind] || me[a.col_seq] != first[a.col_seq],
        field >= 0,
        dispatch && lo <= hi && (lo < -1 || hi >= me[a.col_experts]),
        dispatch && bits != 0,
        dispatch && worst != first[a.col_worst],
        dispatch && received > worst,
        dispatch && tokens > worst,
    };
    const int64_t value[kChecks] = {me[a.col_error], me[a.col_magic], me[a.col_buffer], me[a.col_seq],
                                    field < 0 ? 0 : field, lo < -1 ? lo : hi, bits, worst, received, tokens};
    for (int i = 0; i < kChecks; ++i) {
      s_value[i][s] = value[i];
      if (failed[i]) atomicMin(&s_first, i * R + s);
    }
  }
  // This rank's local experts: every thread sums some over the source ranks (local_expert_counts).
  if (a.expert_out != 0) {
    auto* counts = reinterpret_cast<int*>(a.expert_out);
    const int align = a.alignment > 1 ? a.alignment : 1;
    for (int j = s; j < a.experts_per_rank; j += blockDim.x)
      counts[j] = static_cast<int>(
          local_expert_count(rows, R, a.width, a.experts_col, a.rank, a.experts_per_rank, j, align));
  }
  __syncthreads();
  if (s != 0) return;
  auto* out = reinterpret_cast<int64_t*>(a.out);
  const int at = s_first;
  const bool found = at < kChecks * R;
  out[0] = found ? at / R + 1 : 0;
  out[1] = found ? at % R : 0;
  out[2] = found ? s_value[at / R][at % R] : 0;
}

// The host's part of the gathered rows and this rank's local expert counts (ReadArgs).
__global__ void header_read_kernel(ReadArgs a) {
  const auto* rows = reinterpret_cast<const int64_t*>(a.rows);
  auto* out = reinterpret_cast<int64_t*>(a.host_out);
  const int block = a.counts_col - a.experts_col, host_width = a.width - block;
  const int64_t words = static_cast<int64_t>(a.num_ranks) * host_width;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < words + a.experts_per_rank; i += step) {
    if (i < words) {
      const int64_t r = i / host_width;
      const int w = static_cast<int>(i % host_width);
      out[i] = rows[r * a.width + (w < a.experts_col ? w : w + block)];
      continue;
    }
    const int j = static_cast<int>(i - words);
    const int64_t n = local_expert_count(rows, a.num_ranks, a.width, a.experts_col, a.rank, a.experts_per_rank, j,
                                         a.alignment > 1 ? a.alignment : 1);
    out[i] = n;
    if (a.expert_out != 0) reinterpret_cast<int*>(a.expert_out)[j] = static_cast<int>(n);
  }
}

// One rank's call-header row (RowArgs): one thread per word of the row.
__global__ void encode_row_kernel(RowArgs a) {
  auto* out = reinterpret_cast<int64_t*>(a.out);
  const int checks_col = a.num_fields, experts_col = checks_col + a.num_checks;
  const int counts_col = experts_col + a.expert_slots / 2, width = counts_col + a.num_ranks + 1;
  for (int w = blockIdx.x * blockDim.x + threadIdx.x; w < width; w += gridDim.x * blockDim.x) {
    int64_t v = 0;
    if (w < checks_col) {
      v = a.words[w];
    } else if (w < experts_col) {
      if (a.checks != 0) v = reinterpret_cast<const int64_t*>(a.checks)[w - checks_col];
    } else if (w < counts_col) {
      // Two int32 slots to a word, the lower-numbered slot in the low half (little-endian).
      uint64_t pair = 0;
      for (int h = 0; h < 2; ++h) {
        const int e = 2 * (w - experts_col) + h;
        int64_t n = 0;
        if (a.experts != 0 && e < a.num_experts)
          n = a.experts64 ? reinterpret_cast<const int64_t*>(a.experts)[e] : reinterpret_cast<const int*>(a.experts)[e];
        pair |= static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int>(n))) << (32 * h);
      }
      v = static_cast<int64_t>(pair);
    } else if (w < width - 1) {
      const int r = w - counts_col;
      if (a.counts != 0)
        v = a.counts64 ? reinterpret_cast<const int64_t*>(a.counts)[r] : reinterpret_cast<const int*>(a.counts)[r];
    } else {
      v = a.words[a.num_fields];
    }
    out[w] = v;
  }
}

}  // namespace

std::vector<const void*> checks_kernels() {
  return {reinterpret_cast<const void*>(routing_check_kernel), reinterpret_cast<const void*>(verdict_kernel),
          reinterpret_cast<const void*>(encode_row_kernel), reinterpret_cast<const void*>(header_read_kernel)};
}

}  // namespace detail

int64_t routing_check_scratch_words(int num_ranks, int ranks_per_node, int num_experts) {
  return detail::kCounts + num_ranks + num_ranks / ranks_per_node + num_experts;
}

void routing_check(const RoutingCheckArgs& a, intptr_t stream) {
  UCCL_EP_CHECK_ARG(a.num_ranks >= 1 && a.num_ranks <= 32 && a.ranks_per_node >= 1 &&
                        a.num_ranks % a.ranks_per_node == 0,
                    "routing check: num_ranks=", a.num_ranks, " must be in 1..32 and a multiple of ranks_per_node=",
                    a.ranks_per_node);
  UCCL_EP_CHECK_ARG(a.num_experts >= a.num_ranks && a.num_experts % a.num_ranks == 0, "routing check: num_experts=",
                    a.num_experts, " is not a multiple of ", a.num_ranks, " ranks");
  UCCL_EP_CHECK_ARG(a.num_topk >= 0 && a.num_topk <= kMaxTopk && a.num_tokens >= 0, "routing check: num_topk=",
                    a.num_topk, " (at most ", kMaxTopk, ") num_tokens=", a.num_tokens);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  // The scratch is in its state between launches (see kLo): no memset per call.
  int blocks = (a.num_tokens + detail::kCheckThreads - 1) / detail::kCheckThreads;
  blocks = blocks < 1 ? 1 : (blocks > detail::kCheckBlocks ? detail::kCheckBlocks : blocks);
  detail::routing_check_kernel<<<blocks, detail::kCheckThreads, 0, s>>>(a);
  GPU_CHECK(gpuGetLastError());
}

void call_verdict(const VerdictArgs& a, intptr_t stream) {
  UCCL_EP_CHECK_ARG(a.num_ranks >= 1 && a.num_ranks <= kMaxRanks && a.num_agreed <= kMaxAgreed &&
                        a.counts_col + a.num_ranks < a.width,
                    "call verdict: num_ranks=", a.num_ranks, " agreed fields=", a.num_agreed, " width=", a.width);
  UCCL_EP_CHECK_ARG(a.expert_out == 0 || (a.experts_per_rank >= 0 && a.rank >= 0 && a.rank < a.num_ranks &&
                                           a.experts_col >= 0 &&
                                           a.experts_col * 8 + (a.rank + 1) * a.experts_per_rank * 4 <= a.width * 8),
                    "call verdict: local expert counts of rank ", a.rank, " (", a.experts_per_rank,
                    " experts per rank from column ", a.experts_col, ") outside rows of width ", a.width);
  detail::verdict_kernel<<<1, kMaxRanks, 0, reinterpret_cast<gpuStream_t>(stream)>>>(a);
  GPU_CHECK(gpuGetLastError());
}

void header_read(const ReadArgs& a, intptr_t stream) {
  UCCL_EP_CHECK_ARG(a.num_ranks >= 1 && a.experts_col >= 0 && a.experts_col <= a.counts_col &&
                        a.counts_col < a.width && a.experts_per_rank >= 0 && a.alignment >= 1,
                    "call-header read: ", a.num_ranks, " rows of width ", a.width, ", per-expert block at columns ",
                    a.experts_col, "..", a.counts_col, ", ", a.experts_per_rank, " experts per rank, alignment ",
                    a.alignment);
  UCCL_EP_CHECK_ARG(a.experts_per_rank == 0 ||
                        (a.rank >= 0 && a.rank < a.num_ranks &&
                         (a.rank + 1) * static_cast<int64_t>(a.experts_per_rank) <= 2 * (a.counts_col - a.experts_col)),
                    "call-header read: the local experts of rank ", a.rank, " (", a.experts_per_rank,
                    " per rank) lie outside the rows' ", 2 * (a.counts_col - a.experts_col), " expert slots");
  const int64_t words =
      static_cast<int64_t>(a.num_ranks) * (a.width - (a.counts_col - a.experts_col)) + a.experts_per_rank;
  const int threads = 256;
  const int64_t want = (words + threads - 1) / threads;
  const int blocks = static_cast<int>(want < 1 ? 1 : (want > 64 ? 64 : want));
  detail::header_read_kernel<<<blocks, threads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(a);
  GPU_CHECK(gpuGetLastError());
}

void encode_row(const RowArgs& a, intptr_t stream) {
  UCCL_EP_CHECK_ARG(a.num_fields >= 0 && a.num_fields < kMaxRowWords && a.num_ranks >= 1 && a.num_checks >= 0 &&
                        a.expert_slots >= 0 && a.expert_slots % 2 == 0 && a.num_experts >= 0 &&
                        (a.experts == 0 || a.num_experts <= a.expert_slots),
                    "call-header row: fields=", a.num_fields, " (at most ", kMaxRowWords - 1, ") ranks=", a.num_ranks,
                    " checks=", a.num_checks, " expert slots=", a.expert_slots, " experts=", a.num_experts);
  const int width = a.num_fields + a.num_checks + a.expert_slots / 2 + a.num_ranks + 1;
  const int threads = 256, blocks = (width + threads - 1) / threads;
  detail::encode_row_kernel<<<blocks, threads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(a);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::internode

// The index tables of a call, built on the GPU in one launch each (no host sync, no torch ops):
// every table is a scan over one column of a token mask, one block a column. Their meaning is
// the torch form in backends/internode/tables.py, which the GPU tests compare them with.
#include "common/errors.h"
#include "kernels/internode/plumbing.cuh"

namespace uccl_ep::internode {
namespace detail {
namespace {

// A column's scan walks its tokens in segments of T / kTableThreads per thread, three times
// over: more threads make the walks (dependent byte loads) shorter. The fills are plain stores
// (a sync-free dispatch pads ~0.8 MB at 4096 tokens x 2 ranks): more blocks, more in flight.
constexpr int kTableThreads = 1024;
constexpr int kFillBlocks = 64;

// Where one column's scan writes (each output optional): `lists` the masked tokens of each
// channel's range from that range's start, `count` (stride count_stride) the tokens per
// channel, `cum` (stride cum_stride) each token's inclusive count within its channel, and
// `dst` (stride dst_stride) dst_base + the masked tokens before it, or -1 for unmasked ones.
struct ScanOut {
  int channels = 0;
  int* lists = nullptr;
  int* count = nullptr;
  int count_stride = 0;
  int* cum = nullptr;
  int cum_stride = 0;
  int* dst = nullptr;
  int dst_stride = 0;
  int dst_base = 0;
};

// Scans mask(t) over t < n with the whole block: each thread takes a contiguous segment, the
// segments' counts are scanned in shared memory, and a second walk records where each channel
// range starts (channel_range's split), so a third can write positions within channels.
template <typename Mask>
__device__ void scan_column(Mask mask, int n, const ScanOut& o) {
  __shared__ int s_sum[kTableThreads];
  __shared__ int s_base[kMaxChannels + 1];
  const int tid = threadIdx.x;
  const int seg = (n + kTableThreads - 1) / kTableThreads;
  const int t0 = min(tid * seg, n), t1 = min(t0 + seg, n);
  int mine = 0;
  for (int t = t0; t < t1; ++t) mine += mask(t) ? 1 : 0;
  s_sum[tid] = mine;
  __syncthreads();
  for (int off = 1; off < kTableThreads; off <<= 1) {
    const int v = tid >= off ? s_sum[tid - off] : 0;
    __syncthreads();
    s_sum[tid] += v;
    __syncthreads();
  }
  const int before = s_sum[tid] - mine, total = s_sum[kTableThreads - 1];
  const int C = o.channels;
  const int per = C > 0 ? (n + C - 1) / C : 0;
  if (C > 0) {
    int run = before;
    for (int t = t0; t < t1; ++t) {
      if (t % per == 0) s_base[t / per] = run;
      run += mask(t) ? 1 : 0;
    }
    for (int c = tid; c <= C; c += kTableThreads)
      if (c * per >= n) s_base[c] = total;  // empty ranges (and the end) start at the total
    __syncthreads();
  }
  int run = before;
  for (int t = t0; t < t1; ++t) {
    const int m = mask(t) ? 1 : 0;
    const int c = per > 0 ? t / per : 0;
    const int pos = C > 0 ? run - s_base[c] : run;
    if (m && o.lists) o.lists[c * per + pos] = t;
    if (o.cum) o.cum[static_cast<int64_t>(t) * o.cum_stride] = pos + m;
    if (o.dst) o.dst[static_cast<int64_t>(t) * o.dst_stride] = m ? o.dst_base + run : -1;
    run += m;
  }
  if (o.count)
    for (int c = tid; c < C; c += kTableThreads) o.count[c * o.count_stride] = s_base[c + 1] - s_base[c];
}

// Token t goes to node n: is_token_in_rank [T, R] has one of the node's L ranks set.
struct NodeMask {
  const bool* in_rank;
  int R, L, n;
  __device__ bool operator()(int t) const {
    const bool* row = in_rank + static_cast<int64_t>(t) * R + n * L;
    bool any = false;
    for (int j = 0; j < L; ++j) any |= row[j];
    return any;
  }
};

struct DispatchTablesDev {
  DispatchTablesArgs a;
  int N, node, local;
};

__device__ __forceinline__ int64_t count_of(const DispatchTablesArgs& a, int s, int r) {
  return reinterpret_cast<const int64_t*>(a.rows)[static_cast<int64_t>(s) * a.row_width + a.counts_col + r];
}

// The small tables from the call headers' counts[s][r] (rows rank s sends to rank r).
__device__ void call_tables(const DispatchTablesDev& d) {
  const DispatchTablesArgs& a = d.a;
  const int R = a.num_ranks, L = a.ranks_per_node, me = a.rank;
  auto* prefix = reinterpret_cast<int*>(a.rank_prefix);
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    int64_t acc = 0;
    for (int s = 0; s < R; ++s) {
      acc += count_of(a, s, r);
      prefix[s * R + r] = static_cast<int>(acc);
    }
  }
  __syncthreads();
  auto* recv_prefix = reinterpret_cast<int*>(a.recv_prefix);
  for (int s = threadIdx.x; s < R; s += blockDim.x)
    recv_prefix[s] = prefix[s * R + me] - static_cast<int>(count_of(a, s, me));
  if (threadIdx.x == 0) {
    recv_prefix[R] = prefix[(R - 1) * R + me];
    reinterpret_cast<int*>(a.recv_count)[0] = prefix[(R - 1) * R + me];
  }
  for (int j = threadIdx.x; j < L; j += blockDim.x)
    reinterpret_cast<int*>(a.recv_rows)[j] = prefix[(R - 1) * R + d.node * L + j];
  const auto* rows = reinterpret_cast<const int64_t*>(a.rows);
  for (int m = threadIdx.x; m < d.N; m += blockDim.x)
    reinterpret_cast<int*>(a.src_tokens)[m] =
        static_cast<int>(rows[static_cast<int64_t>(m * L + d.local) * a.row_width + a.row_width - 1]);
}

// words[first], words[first + stride], ... below n set to v (the fill blocks' share).
template <typename W>
__device__ void fill_words(W* words, int64_t n, W v, int64_t first, int64_t stride) {
  for (int64_t i = first; i < n; i += stride) words[i] = v;
}

// Blocks [0, R): dst_row column r; [R, R + N): the stream of node n; R + N: the call tables;
// the rest fill the plan with -1 and a sync-free dispatch's padded outputs. A table whose
// pointer is 0 is skipped.
__global__ void __launch_bounds__(kTableThreads) dispatch_tables_kernel(DispatchTablesDev d) {
  const DispatchTablesArgs& a = d.a;
  const int R = a.num_ranks, L = a.ranks_per_node, T = a.num_tokens;
  const auto* in_rank = reinterpret_cast<const bool*>(a.in_rank);
  const int b = blockIdx.x;
  if (b < R) {
    if (a.dst_row == 0) return;
    __shared__ int s_first;
    if (threadIdx.x == 0) {
      int64_t first = 0;
      for (int s = 0; s < a.rank; ++s) first += count_of(a, s, b);
      s_first = static_cast<int>(first);
    }
    __syncthreads();
    ScanOut o;
    o.dst = reinterpret_cast<int*>(a.dst_row) + b;
    o.dst_stride = R;
    o.dst_base = s_first;
    scan_column([&](int t) { return in_rank[static_cast<int64_t>(t) * R + b]; }, T, o);
  } else if (b < R + d.N) {
    if (a.list_count == 0) return;  // (lists has no address when there are no tokens)
    const int n = b - R;
    ScanOut o;
    o.channels = a.num_channels;
    o.lists = reinterpret_cast<int*>(a.lists) + static_cast<int64_t>(n) * T;
    o.count = reinterpret_cast<int*>(a.list_count) + n;
    o.count_stride = d.N;
    scan_column(NodeMask{in_rank, R, L, n}, T, o);
  } else if (b == R + d.N) {
    if (a.rank_prefix != 0) call_tables(d);
  } else {
    const int64_t stride = static_cast<int64_t>(gridDim.x - (R + d.N + 1)) * blockDim.x;
    const int64_t first = static_cast<int64_t>(b - (R + d.N + 1)) * blockDim.x + threadIdx.x;
    fill_words(reinterpret_cast<int*>(a.plan), a.plan_words, -1, first, stride);
    if (a.pad_ids64)
      fill_words(reinterpret_cast<int64_t*>(a.pad_ids), a.pad_ids_words, int64_t{-1}, first, stride);
    else
      fill_words(reinterpret_cast<int*>(a.pad_ids), a.pad_ids_words, -1, first, stride);
    fill_words(reinterpret_cast<float*>(a.pad_weights), a.pad_weights_words, 0.0f, first, stride);
    fill_words(reinterpret_cast<int*>(a.pad_src), a.pad_src_words, -1, first, stride);
  }
}

// Blocks [0, N): stream positions (cum) of this rank's tokens per node; [N, 2N): the tokens of
// source (m, this local rank) this rank forwards back, from the dispatch's plan.
__global__ void __launch_bounds__(kTableThreads) combine_tables_kernel(CombineTablesArgs a) {
  const int L = a.ranks_per_node, N = a.num_nodes, R = N * L;
  const int b = blockIdx.x;
  if (b < N) {
    const auto* in_rank = reinterpret_cast<const bool*>(a.in_rank);
    ScanOut o;
    o.channels = a.num_channels;
    o.cum = reinterpret_cast<int*>(a.cum) + b;
    o.cum_stride = N;
    scan_column(NodeMask{in_rank, R, L, b}, a.num_tokens, o);
  } else {
    const int m = b - N;
    const int* plan = reinterpret_cast<const int*>(a.plan) + static_cast<int64_t>(m) * a.plan_tokens * L;
    const int n = min(reinterpret_cast<const int*>(a.src_tokens)[m], a.plan_tokens);
    ScanOut o;
    o.channels = a.num_channels;
    o.lists = reinterpret_cast<int*>(a.lists) + static_cast<int64_t>(m) * a.plan_tokens;
    o.count = reinterpret_cast<int*>(a.list_count) + m;
    o.count_stride = N;
    scan_column(
        [&](int t) {
          bool any = false;
          for (int j = 0; j < L; ++j) any |= plan[static_cast<int64_t>(t) * L + j] >= 0;
          return any;
        },
        n, o);
  }
}

}  // namespace

std::vector<const void*> tables_kernels() {
  return {reinterpret_cast<const void*>(dispatch_tables_kernel), reinterpret_cast<const void*>(combine_tables_kernel)};
}

}  // namespace detail

void dispatch_tables(const DispatchTablesArgs& a, intptr_t stream) {
  const int R = a.num_ranks, L = a.ranks_per_node;
  UCCL_EP_CHECK_ARG(L >= 1 && R >= 2 * L && R % L == 0 && R <= kMaxRanks && a.rank >= 0 && a.rank < R,
                    "internode tables: rank=", a.rank, " num_ranks=", R, " ranks_per_node=", L);
  UCCL_EP_CHECK_ARG(a.num_channels >= 1 && a.num_channels <= kMaxChannels, "internode tables: num_channels=",
                    a.num_channels, " must be in [1, ", kMaxChannels, "]");
  const bool full = a.dst_row != 0 || a.rank_prefix != 0;
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && (!full || (a.rows != 0 && a.row_width > a.counts_col + R)),
                    "internode tables: num_tokens=", a.num_tokens, " row_width=", a.row_width, " counts at ",
                    a.counts_col);
  detail::DispatchTablesDev d{a, R / L, a.rank / L, a.rank % L};
  const bool fills = (a.plan != 0 && a.plan_words > 0) || a.pad_ids_words > 0 || a.pad_weights_words > 0 ||
                     a.pad_src_words > 0;
  const int fill = fills ? detail::kFillBlocks : 0;
  detail::dispatch_tables_kernel<<<R + d.N + 1 + fill, detail::kTableThreads, 0,
                                   reinterpret_cast<gpuStream_t>(stream)>>>(d);
  GPU_CHECK(gpuGetLastError());
}

void combine_tables(const CombineTablesArgs& a, intptr_t stream) {
  UCCL_EP_CHECK_ARG(a.ranks_per_node >= 1 && a.num_nodes >= 2 && a.num_nodes <= kMaxNodes,
                    "internode tables: ranks_per_node=", a.ranks_per_node, " num_nodes=", a.num_nodes);
  UCCL_EP_CHECK_ARG(a.num_channels >= 1 && a.num_channels <= kMaxChannels, "internode tables: num_channels=",
                    a.num_channels, " must be in [1, ", kMaxChannels, "]");
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && a.plan_tokens >= 0, "internode tables: num_tokens=", a.num_tokens,
                    " plan_tokens=", a.plan_tokens);
  detail::combine_tables_kernel<<<2 * a.num_nodes, detail::kTableThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      a);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::internode

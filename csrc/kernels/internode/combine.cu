// Internode combine: the forwarder blocks (sum the node's rows of each token this rank
// forwarded into one partial and send it back to the source through the combine ring) and the
// receiver blocks (add the own node's rows and every other node's partial, then the biases).
// Roles: see internode.h.
#include "common/errors.h"
#include "kernels/internode/round.cuh"

namespace uccl_ep::internode {
namespace detail {
namespace {

using kernels::Elt;

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
  const int* src_T;  // [N] tokens of source (m, my local)
  const int* dst_row;
  const int* stream_cum;
  const uint8_t* bias0;
  const uint8_t* bias1;
  uint8_t* out;
  float* out_w;
  int64_t stage_off;
  int64_t place[kPlaceWords];  // where this rank's x and weights lie (CombineArgs::place)
  uint64_t place_seq;
};

// Where a block reads local rank j's combine input: row r of x at x[j] + r * x_stride[j], its
// weights at w[j] + r * w_stride[j] bytes; in place for this rank and for a peer whose input
// lies in its arena, in the peer's NVLink staging else.
struct PeerInputs {
  const uint8_t* x[kMaxLocal];
  const uint8_t* w[kMaxLocal];
  int64_t x_stride[kMaxLocal];
  int64_t w_stride[kMaxLocal];
};

// Every thread: the node's placements of this combine (block 0 publishes this rank's), turned
// into the block's PeerInputs; false in every thread when a wait failed.
__device__ bool load_peer_inputs(const CombineDev& p, PeerInputs& d) {
  __shared__ int64_t s_place[kMaxLocal][kPlaceWords];
  const DevCommon& c = p.c;
  if (!exchange_place(c, p.place_seq, p.place, s_place)) return false;
  const int j = threadIdx.x;
  if (j < c.L) {
    const int64_t* w = s_place[j];
    const int64_t w_row = static_cast<int64_t>(p.K) * sizeof(float);
    if (j == c.local) {
      d.x[j] = p.x;
      d.w[j] = reinterpret_cast<const uint8_t*>(p.w);
      d.x_stride[j] = p.row_bytes;
      d.w_stride[j] = w_row;
    } else if (w[0] == kPlaceArena && c.arena[j] != nullptr) {
      d.x[j] = c.arena[j] + w[1];
      d.w[j] = w[2] >= 0 ? c.arena[j] + w[2] : nullptr;
      d.x_stride[j] = p.row_bytes;
      d.w_stride[j] = w_row;
    } else {
      const uint8_t* stage = c.nvl[j] + p.stage_off;
      d.x[j] = stage + p.cs.x;
      d.w[j] = stage + p.cs.weights;
      d.x_stride[j] = d.w_stride[j] = p.cs.bytes;
    }
  }
  __syncthreads();
  return true;
}

// Row r of local rank j's combine input, and its weights.
__device__ __forceinline__ const uint8_t* input_row(const PeerInputs& in, int j, int r) {
  return in.x[j] + static_cast<int64_t>(r) * in.x_stride[j];
}
__device__ __forceinline__ const float* input_w(const PeerInputs& in, int j, int r) {
  return reinterpret_cast<const float*>(in.w[j] + static_cast<int64_t>(r) * in.w_stride[j]);
}

// 16-byte vectors a lane loads per source row and step: the rows summed here are mostly peers'
// (NVLink reads of ~1 us each), so one vector at a time would leave the link idle.
constexpr int kVecs = 4;
// Source rows whose loads one step issues together, before any is summed: a token's rows are
// summed in one round trip of loads, not one per row (a partial of 2 rows, or the own node's 2
// rows and a partial, took two and three).
constexpr int kGroup = 3;
// Rows one token sums at most: the node's local ranks, the other nodes' partials, two biases.
constexpr int kMaxSources = kMaxLocal + kMaxNodes + 2;

// A lane's fp32 sums of kVecs vectors of a row (vectors base, base + 32, ... of nv); 16-bit
// dtypes convert two elements per 32-bit word (add_elts, store_elts).
template <int kDtype>
struct RowAcc {
  using raw = typename Elt<kDtype>::raw;
  static constexpr int E = 16 / sizeof(raw);
  float a[kVecs][E];

  // Sums start at -0.0, the identity of fp32 addition (-0.0 + x is x, -0.0 included).
  __device__ __forceinline__ RowAcc() {
#pragma unroll
    for (int u = 0; u < kVecs; ++u)
#pragma unroll
      for (int i = 0; i < E; ++i) a[u][i] = -0.0f;
  }
  // Adds rows src[0..ns) in that order (per element: the same order as one row at a time);
  // the loads of up to kGroup rows are issued before any is used.
  __device__ __forceinline__ void add(const uint8_t* const* src, int ns, int64_t base, int64_t nv) {
    for (int s0 = 0; s0 < ns; s0 += kGroup) {
      int4 q[kGroup][kVecs];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (s0 + g >= ns) break;
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          const int64_t v = base + u * dev::kWarpSize;
          if (v < nv) q[g][u] = dev::ld_cg16(src[s0 + g] + v * 16);
        }
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        if (s0 + g >= ns) break;
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          if (base + u * dev::kWarpSize >= nv) continue;
          kernels::add_elts<kDtype, E>(a[u], &q[g][u]);
        }
      }
    }
  }
  __device__ __forceinline__ void store(uint8_t* dst, int64_t base, int64_t nv) const {
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int64_t v = base + u * dev::kWarpSize;
      if (v >= nv) continue;
      int4 q;
      kernels::store_elts<kDtype, E>(&q, a[u]);
      *reinterpret_cast<int4*>(dst + v * 16) = q;
    }
  }
};

// Partial of this node for token t of source (m, my local): the sum of the local ranks' rows
// (ascending local rank, fp32), written in x's dtype into a combine ring slot.
template <int kDtype>
__device__ void pack_partial(const CombineDev& p, const PeerInputs& pin, uint8_t* slot, int m, int t, int lane) {
  const int L = p.c.L;
  int rows[kMaxLocal];
  const uint8_t* src[kMaxLocal];
  int ns = 0;
  const int* pr = p.plan + (static_cast<int64_t>(m) * p.plan_T + t) * L;
  for (int j = 0; j < L; ++j) {
    rows[j] = pr[j];
    if (rows[j] >= 0) src[ns++] = input_row(pin, j, rows[j]);
  }
  const int64_t nv = p.row_bytes / 16;
  for (int64_t base = lane; base < nv; base += kVecs * dev::kWarpSize) {
    RowAcc<kDtype> acc;
    acc.add(src, ns, base, nv);
    acc.store(slot + p.cs.x, base, nv);
  }
  float* w = reinterpret_cast<float*>(slot + p.cs.weights);
  for (int k = lane; k < p.K; k += dev::kWarpSize) {
    float s = 0.0f;
    for (int j = 0; j < L; ++j)
      if (rows[j] >= 0) s += dev::ld_cg(input_w(pin, j, rows[j]) + k);
    w[k] = s;
  }
  if (lane == 0) *reinterpret_cast<int*>(slot + p.cs.src) = t;
}

template <int kDtype>
__device__ void combine_forwarder(const CombineDev& p, const PeerInputs& pin, int ch) {
  const DevCommon& c = p.c;
  const int lane = threadIdx.x % dev::kWarpSize;
  const SendKinds kinds{kCombineHead, kCombineTail, kCombineSent, kSiteCombineSend};
  // Nothing goes back to the own node (its rows are read in place by the receiver).
  ring_send(
      c, p.rl, ch, kinds, [&](int m) { return m == c.node ? 0 : p.list_count[ch * c.N + m]; },
      [&](int m, int pos, uint8_t* slot) {
        const int begin = channel_range(p.src_T[m], c.C, ch).begin;
        const int t = p.lists[static_cast<int64_t>(m) * p.plan_T + begin + pos];
        pack_partial<kDtype>(p, pin, slot, m, t, lane);
      });
}

// Thread 0: waits until the partials of tokens [.., w1) of every other node arrived.
__device__ int wait_window(const CombineDev& p, int ch, int w1, const int64_t* s_base, int prev) {
  const DevCommon& c = p.c;
  if (prev == kStop) return kStop;  // thread 0's own push failure of the last window
  for (int n = 0; n < c.N; ++n) {
    if (n == c.node) continue;
    const int64_t need = s_base[n] + p.stream_cum[static_cast<int64_t>(w1 - 1) * c.N + n];
    const uint64_t start = dev::global_timer_ns();
    uint32_t iter = 0;
    for (;;) {
      const int64_t tail = ld_counter(c.counters + counter_index(kCombineTail, ch, n));
      if (tail >= need) break;
      if (aborted(c)) return kStop;
      const uint64_t waited = dev::global_timer_ns() - start;
      if ((++iter & 63u) == 0 && waited > c.timeout_ns) {
        fail(c, kSiteCombineRecv, n * c.L + c.local, need, ch, tail);
        return kStop;
      }
      dev::poll_pause(waited);
    }
  }
  return kGo;
}

// Token t: the own node's rows and the other nodes' partials summed (nodes ascending, ranks
// ascending inside: the reference's order), plus the biases.
template <int kDtype>
__device__ void reduce_token(const CombineDev& p, const PeerInputs& pin, int ch, const Range& range,
                             const int64_t* s_base, int t, int lane) {
  const DevCommon& c = p.c;
  const uint8_t* part[kMaxNodes];
  for (int n = 0; n < c.N; ++n) {
    part[n] = nullptr;
    if (n == c.node) continue;
    // Which ring entry holds token t's partial from node n: its rank in the stream.
    const int cum = p.stream_cum[static_cast<int64_t>(t) * c.N + n];
    const int before = t > range.begin ? p.stream_cum[static_cast<int64_t>(t - 1) * c.N + n] : 0;
    if (cum <= before) continue;
    part[n] = c.region + ring_slot_offset(p.rl.recv_offset, p.rl, ch, n, s_base[n] + cum - 1);
    if (lane == 0) {
      const int src = dev::ld_cg(reinterpret_cast<const int*>(part[n] + p.cs.src));
      if (src != t) fail(c, kSiteCombineOrder, n * c.L + c.local, t, ch, src);
    }
  }
  const int* own = p.dst_row + static_cast<int64_t>(t) * c.num_ranks + c.node * c.L;
  // The summands in the reference's order: nodes ascending (the own node's rows by local rank,
  // another node's partial), then the biases.
  const uint8_t* src[kMaxSources];
  int ns = 0;
  for (int n = 0; n < c.N; ++n) {
    if (n == c.node) {
      for (int j = 0; j < c.L; ++j)
        if (own[j] >= 0) src[ns++] = input_row(pin, j, own[j]);
    } else if (part[n] != nullptr) {
      src[ns++] = part[n] + p.cs.x;
    }
  }
  if (p.bias0) src[ns++] = p.bias0 + static_cast<int64_t>(t) * p.row_bytes;
  if (p.bias1) src[ns++] = p.bias1 + static_cast<int64_t>(t) * p.row_bytes;
  const int64_t nv = p.row_bytes / 16;
  for (int64_t base = lane; base < nv; base += kVecs * dev::kWarpSize) {
    RowAcc<kDtype> acc;
    acc.add(src, ns, base, nv);
    acc.store(p.out + static_cast<int64_t>(t) * p.row_bytes, base, nv);
  }
  if (p.out_w == nullptr) return;
  for (int k = lane; k < p.K; k += dev::kWarpSize) {
    float s = 0.0f;
    for (int n = 0; n < c.N; ++n) {
      if (n == c.node) {
        for (int j = 0; j < c.L; ++j)
          if (own[j] >= 0) s += dev::ld_cg(input_w(pin, j, own[j]) + k);
      } else if (part[n] != nullptr) {
        s += dev::ld_cg(reinterpret_cast<const float*>(part[n] + p.cs.weights) + k);
      }
    }
    p.out_w[static_cast<int64_t>(t) * p.K + k] = s;
  }
}

template <int kDtype>
__device__ void combine_receiver(const CombineDev& p, const PeerInputs& pin, int ch) {
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
  // always deliver a whole window once the previous one was released. One token per warp: a
  // window is reduced as soon as its partials are in, and the call's last window, reduced after
  // the wire went quiet, costs one token's reduce (four of 64-token windows took ~100 us).
  const int window = c.cap < kWarps ? c.cap : kWarps;
  RoundTrace tr(c);
  for (int w0 = range.begin; w0 < range.end; w0 += window) {
    const int w1 = w0 + window < range.end ? w0 + window : range.end;
    if (tid == 0) {
      s_round = wait_window(p, ch, w1, s_base, s_round);
      // The window's wait is one round: its time counts as waiting.
      tr.planned(kWait);
    }
    if (broadcast_round(s_round) == kStop) break;
    for (int t = w0 + warp; t < w1; t += kWarps) reduce_token<kDtype>(p, pin, ch, range, s_base, t, lane);
    __syncthreads();
    if (tid == 0) {
      tr.moved();
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
      tr.pushed();
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid < c.N) c.state[state_index(kCombineConsumed, ch, tid)] = s_base[tid] + s_prev[tid];
  tr.store(c);
}

template <int kDtype>
__global__ void __launch_bounds__(kThreads) combine_kernel(CombineDev p) {
  if (rejected(p.c)) return;
  __shared__ PeerInputs s_in;
  if (!load_peer_inputs(p, s_in)) return;
  const int ch = blockIdx.x / 2;
  if (blockIdx.x % 2 == 0) {
    combine_forwarder<kDtype>(p, s_in, ch);
  } else {
    combine_receiver<kDtype>(p, s_in, ch);
  }
}

CombineDev make_combine(const CombineArgs& a) {
  CombineDev p{};
  p.c = make_common(a.common);
  UCCL_EP_CHECK_ARG(a.dtype >= 0 && a.dtype <= 2, "combine dtype code ", a.dtype, " (0 bf16, 1 fp16, 2 fp32)");
  UCCL_EP_CHECK_ARG(a.row_bytes > 0 && a.row_bytes % 16 == 0, "row_bytes=", a.row_bytes,
                    " must be a positive multiple of 16");
  UCCL_EP_CHECK_ARG(a.num_topk >= 0 && a.num_topk <= kMaxTopk, "num_topk=", a.num_topk);
  UCCL_EP_CHECK_ARG(a.src_tokens != 0, "combine without its src_tokens table");
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
  p.src_T = reinterpret_cast<const int*>(a.src_tokens);
  p.dst_row = reinterpret_cast<const int*>(a.dst_row);
  p.stream_cum = reinterpret_cast<const int*>(a.stream_cum);
  p.bias0 = reinterpret_cast<const uint8_t*>(a.bias0);
  p.bias1 = reinterpret_cast<const uint8_t*>(a.bias1);
  p.out = reinterpret_cast<uint8_t*>(a.out);
  p.out_w = reinterpret_cast<float*>(a.out_weights);
  p.stage_off = a.stage_offset;
  for (int i = 0; i < kPlaceWords; ++i) p.place[i] = a.place[i];
  p.place_seq = a.place_seq;
  return p;
}

}  // namespace

std::vector<const void*> combine_kernels() {
  return {reinterpret_cast<const void*>(combine_kernel<0>), reinterpret_cast<const void*>(combine_kernel<1>),
          reinterpret_cast<const void*>(combine_kernel<2>)};
}

}  // namespace detail

void combine(const CombineArgs& a, intptr_t stream) {
  const detail::CombineDev p = detail::make_combine(a);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  const int blocks = 2 * p.c.C;
  switch (p.dtype) {
    case 0:
      detail::combine_kernel<0><<<blocks, detail::kThreads, 0, s>>>(p);
      break;
    case 1:
      detail::combine_kernel<1><<<blocks, detail::kThreads, 0, s>>>(p);
      break;
    default:
      detail::combine_kernel<2><<<blocks, detail::kThreads, 0, s>>>(p);
      break;
  }
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::internode

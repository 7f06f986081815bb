// The internode backend's per-call entry points: one binding call per dispatch (the kernel, the
// node barrier and, for outputs outside the receive arena, the staged-row copy, the poison fold)
// and one per combine (staging of an input outside the arena, the kernel, the closing node
// barrier, the poison fold), each taking the torch tensors themselves and a
// per-Buffer context built once. The Python side used to fill ~41 launch-struct fields per call.
//
// Every tensor is read once into a typed view (tensor_view.h) and checked here, before anything
// is launched; the sizes the kernels need (tokens, row bytes, top-k, scales, output rows, plan
// tokens) are read off those views, so no size is passed twice. The index tables themselves are
// built on the GPU (backends/internode/tables.py); only their shapes are checked here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"

#ifdef UCCL_EP_WITH_GPU
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "bindings/pointer_checks.h"
#include "bindings/tensor_view.h"
#include "common/errors.h"
#include "common/gpu.h"
#include "common/registry.h"
#include "fifo/fifo.h"
#include "kernels/internode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

#ifdef UCCL_EP_WITH_GPU
namespace {

namespace in = uccl_ep::internode;
using views::arg;
using views::Dt;
using views::TensorView;

constexpr uint64_t kStatusBytes = in::kStatusWords * sizeof(int64_t);
constexpr uint64_t kMinusOne = ~0ull;
const uint64_t kF32Nan = views::repeat(0x7FC00000u, 4);

// `ptr` must lie in a live `_C` allocation of one of `kinds` ("internode <op>: <name>" on
// failure; the name is built only then, as these checks run at every call).
void check_alloc(intptr_t ptr, uint64_t bytes, std::initializer_list<AllocKind> kinds, const char* op,
                 const std::string& name) {
  const AllocRegistry& reg = AllocRegistry::get();
  if (reg.contains(static_cast<uintptr_t>(ptr), bytes, kinds)) return;
  reg.check(static_cast<uintptr_t>(ptr), bytes, kinds, detail::concat("internode ", op, ": ", name).c_str());
}

// The per-Buffer part of every launch: the group's shape, the proxy's FIFOs and counters, the
// RDMA region, the node's NVLink buffers and the status words, as the launch's own
// `in::Common`. Checked when built, and its `_C` allocations again at each call (a freed one
// must raise, never fault). It also counts the node barriers, whose sequence numbers every
// rank of a node must use alike.
struct Context {
  in::Common base;          // all but the call's ring shape (channels, cap, chunk) and verdict
  TensorView fifo_handles;  // uint8 [num_fifos * sizeof(FifoDeviceHandle)], device memory
  TensorView state;         // int64 [kStateWords], device memory
  int64_t stage_offset = 0;  // where NVLink staging starts in each NVLink buffer
  uint64_t barrier_seq = 0;  // the last node barrier's (or placement's) sequence number
  TensorView trace;          // int64 [words], device memory, or none (set_trace)
  // This rank's receive arena (base.arenas[local] is its own mapping), or 0 bytes: a call's
  // rows lying there are placed for the node peers (kPlaceFlagsOffset).
  intptr_t arena = 0;
  int64_t arena_bytes = 0;

  int num_nodes() const { return base.num_ranks / base.ranks_per_node; }

  void check(const char* op) const {
    const in::Common& b = base;
    UCCL_EP_CHECK_ARG(b.num_ranks >= 1 && b.ranks_per_node >= 1 && b.num_ranks % b.ranks_per_node == 0 &&
                          b.rank >= 0 && b.rank < b.num_ranks,
                      "internode ", op, ": rank=", b.rank, " num_ranks=", b.num_ranks, " ranks_per_node=",
                      b.ranks_per_node);
    UCCL_EP_CHECK_ARG(static_cast<int>(b.nvl.size()) == b.ranks_per_node, "internode ", op, ": got ", b.nvl.size(),
                      " NVLink buffers for ", b.ranks_per_node, " ranks per node");
    UCCL_EP_CHECK_ARG(b.region_bytes > 0, "internode ", op, ": region_bytes=", b.region_bytes, " must be positive");
    check_alloc(b.region, static_cast<uint64_t>(b.region_bytes), {AllocKind::kDeviceBuffer}, op, "region");
    for (size_t j = 0; j < b.nvl.size(); ++j) {
      check_alloc(b.nvl[j], 1, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping}, op, detail::concat("nvl[", j, "]"));
    }
    for (size_t j = 0; j < b.arenas.size(); ++j) {
      check_alloc(b.arenas[j], 1, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping}, op,
                  detail::concat("arenas[", j, "]"));
    }
    UCCL_EP_CHECK_ARG(b.remote.empty() || static_cast<int>(b.remote.size()) == num_nodes(), "internode ", op,
                      ": got ", b.remote.size(), " remote regions for ", num_nodes(), " nodes (one per node, or none)");
    for (size_t n = 0; n < b.remote.size(); ++n) {
      if (b.remote[n] == 0) UCCL_EP_THROW(InvalidArgument, "internode ", op, ": remote[", n, "] is a null pointer");
    }
    check_alloc(b.status, kStatusBytes, {AllocKind::kHostStatus}, op, "status");
    check_alloc(b.counters, in::kNumCounters * sizeof(int64_t), {AllocKind::kMappedCounters}, op, "counters");
  }

  // The launch's common fields: the ring shape comes from the call's Config, and `verdict` is
  // a sync-free call's device verdict (0 without one).
  in::Common common(int num_channels, int cap, int chunk, intptr_t verdict) const {
    in::Common c = base;
    c.num_channels = num_channels;
    c.cap = cap;
    c.chunk = chunk;
    c.verdict = verdict;
    if (!trace.none) {
      const int64_t need = int64_t{2} * num_channels * in::kTraceWords;
      UCCL_EP_CHECK_ARG(trace.size[0] >= need, "internode trace buffer has ", trace.size[0], " words but ",
                        num_channels, " channels need ", need, " (2 blocks a channel, ", in::kTraceWords, " each)");
      c.trace = trace.ptr;
    }
    return c;
  }
};

Context make_context(int rank, int num_ranks, int ranks_per_node, py::handle fifo_handles_t, int num_fifos,
                     intptr_t counters, py::handle state_t, intptr_t region, int64_t region_bytes,
                     std::vector<intptr_t> nvl, int64_t stage_offset, intptr_t status, int64_t timeout_ns,
                     uint64_t barrier_seq, std::vector<intptr_t> remote, std::vector<intptr_t> arenas,
                     int64_t arena_bytes) {
  UCCL_EP_CHECK_ARG(num_fifos >= 1, "internode Context: num_fifos=", num_fifos, " must be positive");
  UCCL_EP_CHECK_ARG(stage_offset >= in::kPlaceEnd && timeout_ns > 0, "internode Context: stage_offset=",
                    stage_offset, " (at least ", in::kPlaceEnd, ": the control area) timeout_ns=", timeout_ns);
  UCCL_EP_CHECK_ARG(arenas.empty() || arena_bytes > 0, "internode Context: ", arenas.size(),
                    " receive arenas of arena_bytes=", arena_bytes);
  UCCL_EP_CHECK_ARG(arenas.empty() || static_cast<int>(arenas.size()) == ranks_per_node, "internode Context: got ",
                    arenas.size(), " receive arenas for ", ranks_per_node, " ranks per node (one per local rank, or none)");
  Context c;
  c.fifo_handles = arg(fifo_handles_t, "internode Context: fifo_handles", false,
                       {int64_t{num_fifos} * static_cast<int64_t>(sizeof(FifoDeviceHandle))}, {Dt::kUInt8});
  c.state = arg(state_t, "internode Context: state", false, {in::kStateWords}, {Dt::kInt64});
  c.stage_offset = stage_offset;
  c.barrier_seq = barrier_seq;
  in::Common& b = c.base;
  b.rank = rank;
  b.num_ranks = num_ranks;
  b.ranks_per_node = ranks_per_node;
  b.fifo_handles = c.fifo_handles.ptr;
  b.num_fifos = num_fifos;
  b.counters = counters;
  b.state = c.state.ptr;
  b.region = region;
  b.region_bytes = region_bytes;
  b.nvl = std::move(nvl);
  b.remote = std::move(remote);
  b.arenas = std::move(arenas);
  if (!b.arenas.empty() && ranks_per_node >= 1 && rank >= 0) {
    c.arena = b.arenas[rank % ranks_per_node];
    c.arena_bytes = arena_bytes;
  }
  b.status = status;
  b.timeout_ns = timeout_ns;
  c.check("Context");
  check_ptr(b.fifo_handles, true, "internode Context: fifo_handles");
  check_ptr(b.state, true, "internode Context: state");
  return c;
}

// The placement words of a call's rows (kPlaceWordsOffset): kind kPlaceArena and each given
// tensor's byte offset in this rank's arena (-1 for an absent one) when all of them lie whole
// inside it, else kind 0 (the peers use this rank's staging). Returns the kind.
int64_t place_words(const Context& c, std::initializer_list<const TensorView*> ts, int64_t (&w)[in::kPlaceWords]) {
  for (int i = 0; i < in::kPlaceWords; ++i) w[i] = -1;
  w[0] = 0;
  if (c.arena == 0) return 0;
  const uintptr_t lo = static_cast<uintptr_t>(c.arena), hi = lo + static_cast<uintptr_t>(c.arena_bytes);
  int i = 1;
  for (const TensorView* t : ts) {
    if (!t->none) {
      const uintptr_t p = static_cast<uintptr_t>(t->ptr);
      if (p < lo || p + static_cast<uintptr_t>(t->bytes()) > hi) {
        for (int k = 1; k < in::kPlaceWords; ++k) w[k] = -1;
        return 0;
      }
      w[i] = static_cast<int64_t>(p - lo);
    }
    ++i;
  }
  w[0] = in::kPlaceArena;
  return w[0];
}

intptr_t verdict_of(py::handle verdict_t, const char* what) {
  return arg(verdict_t, what, true, {3}, {Dt::kInt64}).ptr;
}

// Sizes come from the views, so none is negative; rows must still suit the kernels' copies.
void check_row_bytes(int64_t row_bytes, const char* op) {
  UCCL_EP_CHECK_ARG(row_bytes > 0 && row_bytes % 16 == 0, "internode ", op, ": rows of ", row_bytes,
                    " bytes; the kernels move rows in 16-byte vectors (a positive multiple of 16)");
}

void check_dispatch(const in::DispatchArgs& a, bool cached) {
  check_row_bytes(a.row_bytes, "dispatch");
  const bool send = a.num_tokens > 0, recv = a.out_rows > 0;
  check_ptr(a.recv_rows, true, "internode dispatch: recv_rows");
  check_ptr(a.recv_prefix, true, "internode dispatch: recv_prefix");
  check_ptr(a.x, send, "internode dispatch: x");
  check_ptr(a.x_scales, send && a.num_scales > 0, "internode dispatch: x_scales");
  check_ptr(a.topk_idx, send && a.num_topk > 0, "internode dispatch: topk_idx");
  check_ptr(a.topk_weights, send && a.num_topk > 0, "internode dispatch: topk_weights");
  check_ptr(a.dst_row, send, "internode dispatch: dst_row");
  check_ptr(a.lists, send, "internode dispatch: lists");
  check_ptr(a.list_count, true, "internode dispatch: list_count");
  check_ptr(a.recv_x, recv, "internode dispatch: recv_x");
  check_ptr(a.recv_scales, recv && a.num_scales > 0, "internode dispatch: recv_scales");
  check_ptr(a.recv_topk_idx, recv && a.num_topk > 0, "internode dispatch: recv_topk_idx");
  check_ptr(a.recv_topk_weights, recv && a.num_topk > 0, "internode dispatch: recv_topk_weights");
  check_ptr(a.recv_src_idx, recv && !cached, "internode dispatch: recv_src_idx");
  check_ptr(a.plan, !cached, "internode dispatch: plan");
}

// The ring shape of a launch, read by name from backends.internode's RingShape, so two of its
// ints can never trade places.
struct Rings {
  int channels, slots, chunk;
};
py::object field(py::handle obj, const char* name) {
  if (!py::hasattr(obj, name)) {
    UCCL_EP_THROW(InvalidArgument, "internode call: ", std::string(py::str(py::type::of(obj).attr("__name__"))),
                  " has no field '", name, "'");
  }
  return obj.attr(name);
}
Rings rings_of(py::handle r) {
  return Rings{field(r, "channels").cast<int>(), field(r, "slots").cast<int>(), field(r, "chunk").cast<int>()};
}

// A dispatch: the sender/forwarder kernel, then (ranks per node > 1) the node barrier and, unless
// the outputs lie in this rank's receive arena (the kernel told the node peers so and they
// wrote there), the copy of rows peers staged here, then the poison fold of the outputs. Top-k (`topk_idx`,
// `topk_weights`, `recv_topk_*`) and FP8 scales (`x_scales`, `recv_scales`) come with their
// outputs or not at all. A cached dispatch reuses the handle's `plan` (only its shape is
// read) and passes `recv_src_idx` None.
bool dispatch_call(Context& c, intptr_t stream, py::handle verdict_t, py::handle rings_t, py::handle t, bool cached,
                   int experts_per_rank) {
  const Rings rings = rings_of(rings_t);
  const int num_channels = rings.channels, cap = rings.slots, chunk = rings.chunk;
  const py::object x_t = field(t, "x"), scales_t = field(t, "x_scales"), idx_t = field(t, "topk_idx"),
                   weights_t = field(t, "topk_weights"), dst_row_t = field(t, "dst_row"),
                   lists_t = field(t, "lists"), list_count_t = field(t, "list_count"), plan_t = field(t, "plan"),
                   recv_rows_t = field(t, "recv_rows"), recv_prefix_t = field(t, "recv_prefix"),
                   recv_x_t = field(t, "recv_x"), recv_scales_t = field(t, "recv_x_scales"),
                   recv_idx_t = field(t, "recv_topk_idx"), recv_w_t = field(t, "recv_topk_weights"),
                   recv_src_t = field(t, "recv_src_idx");
  c.check("dispatch");
  const int64_t R = c.base.num_ranks, L = c.base.ranks_per_node, N = c.num_nodes();
  const intptr_t verdict = verdict_of(verdict_t, "internode dispatch: verdict");
  const TensorView x = arg(x_t, "internode dispatch: x", false, {-1, -1},
                           {Dt::kBFloat16, Dt::kFloat16, Dt::kFloat32, Dt::kE4m3, Dt::kE4m3Fnuz});
  const int64_t T = x.size[0], H = x.size[1];
  const TensorView scales = arg(scales_t, "internode dispatch: x_scales", true, {T, -1}, {Dt::kFloat32});
  const int64_t S = scales.none ? 0 : scales.size[1];
  const TensorView idx = arg(idx_t, "internode dispatch: topk_idx", true, {T, -1}, {Dt::kInt64, Dt::kInt32});
  const int64_t K = idx.none ? 0 : idx.size[1];
  const Dt idx_dt = idx.none ? Dt::kInt64 : idx.dtype->dt;
  const TensorView weights = arg(weights_t, "internode dispatch: topk_weights", idx.none, {T, K}, {Dt::kFloat32});
  const TensorView dst_row = arg(dst_row_t, "internode dispatch: dst_row", false, {T, R}, {Dt::kInt32});
  const TensorView lists = arg(lists_t, "internode dispatch: lists", false, {N, T}, {Dt::kInt32});
  const TensorView list_count =
      arg(list_count_t, "internode dispatch: list_count", false, {num_channels, N}, {Dt::kInt32});
  const TensorView plan = arg(plan_t, "internode dispatch: plan", false, {N, -1, L}, {Dt::kInt32});
  const TensorView recv_rows = arg(recv_rows_t, "internode dispatch: recv_rows", false, {L}, {Dt::kInt32});
  const TensorView recv_prefix = arg(recv_prefix_t, "internode dispatch: recv_prefix", false, {R + 1}, {Dt::kInt32});
  const TensorView recv_x = arg(recv_x_t, "internode dispatch: recv_x", false, {-1, H}, {x.dtype->dt});
  const int64_t rows = recv_x.size[0];
  const TensorView recv_scales =
      arg(recv_scales_t, "internode dispatch: recv_scales", scales.none, {rows, S}, {Dt::kFloat32});
  const TensorView recv_idx = arg(recv_idx_t, "internode dispatch: recv_topk_idx", idx.none, {rows, K}, {idx_dt});
  const TensorView recv_w =
      arg(recv_w_t, "internode dispatch: recv_topk_weights", idx.none, {rows, K}, {Dt::kFloat32});
  // A cached dispatch writes no sources: the handle has them.
  const TensorView recv_src =
      cached ? TensorView{} : arg(recv_src_t, "internode dispatch: recv_src_idx", false, {rows}, {Dt::kInt32});

  in::DispatchArgs a;
  a.common = c.common(num_channels, cap, chunk, verdict);
  a.num_tokens = static_cast<int>(T);
  a.experts_per_rank = experts_per_rank;
  a.num_topk = static_cast<int>(K);
  a.num_scales = static_cast<int>(S);
  a.row_bytes = H * x.dtype->itemsize;
  a.x = x.ptr;
  a.x_scales = scales.ptr;
  a.topk_idx = idx.ptr;
  a.topk_weights = weights.ptr;
  a.idx_is_64 = idx_dt == Dt::kInt64;
  a.dst_row = dst_row.ptr;
  a.lists = lists.ptr;
  a.list_count = list_count.ptr;
  a.recv_x = recv_x.ptr;
  a.recv_scales = recv_scales.ptr;
  a.recv_topk_idx = recv_idx.ptr;
  a.recv_topk_weights = recv_w.ptr;
  a.recv_src_idx = recv_src.ptr;
  // A cached dispatch forwards the same tokens to the same rows: the plan stays as it is.
  a.plan = cached ? 0 : plan.ptr;
  a.plan_tokens = static_cast<int>(plan.size[1]);
  a.stage_offset = c.stage_offset;
  a.recv_rows = recv_rows.ptr;
  a.recv_prefix = recv_prefix.ptr;
  a.out_rows = static_cast<int>(rows);
  check_dispatch(a, cached);
  bool placed = false;
  if (L > 1) {
    // A cached dispatch writes no sources (the handle has them): not placed either.
    placed = place_words(c, {&recv_x, &recv_scales, &recv_idx, &recv_w, &recv_src}, a.place) == in::kPlaceArena;
    a.place_seq = ++c.barrier_seq;
  }
  in::dispatch(a, stream);
  if (L > 1) in::dispatch_finish(a, ++c.barrier_seq, stream);
  // A failure inside this call is raised at the next one; until then the outputs say so.
  views::poison(c.base.status, stream,
                {{&recv_x, x.dtype->nan},
                 {&recv_scales, kF32Nan},
                 {&recv_idx, kMinusOne},
                 {&recv_w, 0},
                 {&recv_src, kMinusOne}});
  return placed;
}

void check_combine(const in::CombineArgs& a) {
  check_row_bytes(a.row_bytes, "combine");
  check_ptr(a.x, a.num_recv > 0, "internode combine: x");
  check_ptr(a.topk_weights, a.num_recv > 0 && a.num_topk > 0, "internode combine: topk_weights");
  check_ptr(a.recv_count, a.num_recv > 0, "internode combine: recv_count");
  check_ptr(a.src_tokens, true, "internode combine: src_tokens");
  check_ptr(a.plan, true, "internode combine: plan");
  check_ptr(a.lists, true, "internode combine: lists");
  check_ptr(a.list_count, true, "internode combine: list_count");
  check_ptr(a.dst_row, a.num_tokens > 0, "internode combine: dst_row");
  check_ptr(a.stream_cum, a.num_tokens > 0, "internode combine: stream_cum");
  check_ptr(a.out, a.num_tokens > 0, "internode combine: out");
  check_ptr(a.out_weights, a.num_tokens > 0 && a.num_topk > 0, "internode combine: out_weights");
}

// A combine: (ranks per node > 1, x outside this rank's receive arena) this rank's rows staged
// for its node peers, the kernel (which tells the peers where to read them: staging or arena), a
// closing node barrier (peers read them until then), then the poison fold of the outputs. `num_recv` rows of `x` are combined: the received count, or its
// bound num_worst_tokens (the kernels read the real count from `recv_count` on the device).
// The tables come from the dispatch's handle (`plan`, `src_tokens`, `dst_row`, `recv_count`)
// and from this call's streams (`lists`, `list_count` of the forwarded tokens, `stream_cum`).
bool combine_call(Context& c, intptr_t stream, py::handle verdict_t, py::handle rings_t, py::handle t, int num_recv) {
  const Rings rings = rings_of(rings_t);
  const int num_channels = rings.channels, cap = rings.slots, chunk = rings.chunk;
  const py::object x_t = field(t, "x"), weights_t = field(t, "topk_weights"), bias0_t = field(t, "bias0"),
                   bias1_t = field(t, "bias1"), out_t = field(t, "out"), out_w_t = field(t, "out_weights"),
                   recv_count_t = field(t, "recv_count"), plan_t = field(t, "plan"), lists_t = field(t, "lists"),
                   list_count_t = field(t, "list_count"), src_tokens_t = field(t, "src_tokens"),
                   dst_row_t = field(t, "dst_row"), stream_cum_t = field(t, "stream_cum");
  c.check("combine");
  const int64_t R = c.base.num_ranks, L = c.base.ranks_per_node, N = c.num_nodes();
  const intptr_t verdict = verdict_of(verdict_t, "internode combine: verdict");
  const TensorView x = arg(x_t, "internode combine: x", false, {-1, -1}, {Dt::kBFloat16, Dt::kFloat16, Dt::kFloat32});
  const int64_t H = x.size[1];
  UCCL_EP_CHECK_ARG(num_recv >= 0 && num_recv <= x.size[0], "internode combine: num_recv=", num_recv, " but x has ",
                    x.size[0], " rows");
  const TensorView out = arg(out_t, "internode combine: out", false, {-1, H}, {x.dtype->dt});
  const int64_t T = out.size[0];
  const TensorView weights = arg(weights_t, "internode combine: topk_weights", true, {x.size[0], -1}, {Dt::kFloat32});
  const int64_t K = weights.none ? 0 : weights.size[1];
  const TensorView out_w = arg(out_w_t, "internode combine: out_weights", weights.none, {T, K}, {Dt::kFloat32});
  const TensorView bias0 = arg(bias0_t, "internode combine: bias[0]", true, {T, H}, {x.dtype->dt});
  const TensorView bias1 = arg(bias1_t, "internode combine: bias[1]", true, {T, H}, {x.dtype->dt});
  UCCL_EP_CHECK_ARG(bias1.none || !bias0.none, "internode combine: bias[1] given without bias[0]");
  const TensorView recv_count = arg(recv_count_t, "internode combine: recv_count", false, {1}, {Dt::kInt32});
  const TensorView plan = arg(plan_t, "internode combine: plan", false, {N, -1, L}, {Dt::kInt32});
  const int64_t P = plan.size[1];
  const TensorView lists = arg(lists_t, "internode combine: lists", false, {N, P}, {Dt::kInt32});
  const TensorView list_count =
      arg(list_count_t, "internode combine: list_count", false, {num_channels, N}, {Dt::kInt32});
  const TensorView src_tokens = arg(src_tokens_t, "internode combine: src_tokens", false, {N}, {Dt::kInt32});
  const TensorView dst_row = arg(dst_row_t, "internode combine: dst_row", false, {T, R}, {Dt::kInt32});
  const TensorView stream_cum = arg(stream_cum_t, "internode combine: stream_cum", false, {T, N}, {Dt::kInt32});

  in::CombineArgs a;
  a.common = c.common(num_channels, cap, chunk, verdict);
  a.dtype = x.dtype->dt == Dt::kBFloat16 ? 0 : x.dtype->dt == Dt::kFloat16 ? 1 : 2;
  a.num_topk = static_cast<int>(K);
  a.num_tokens = static_cast<int>(T);
  a.num_recv = num_recv;
  a.recv_count = recv_count.ptr;
  a.row_bytes = H * x.dtype->itemsize;
  a.x = x.ptr;
  a.topk_weights = weights.ptr;
  a.plan = plan.ptr;
  a.plan_tokens = static_cast<int>(P);
  a.lists = lists.ptr;
  a.list_count = list_count.ptr;
  a.src_tokens = src_tokens.ptr;
  a.dst_row = dst_row.ptr;
  a.stream_cum = stream_cum.ptr;
  a.bias0 = bias0.ptr;
  a.bias1 = bias1.ptr;
  a.out = out.ptr;
  a.out_weights = out_w.ptr;
  a.stage_offset = c.stage_offset;
  check_combine(a);
  bool placed = false;
  if (L > 1) {
    placed = place_words(c, {&x, &weights}, a.place) == in::kPlaceArena;
    if (!placed) in::combine_stage(a, stream);
    a.place_seq = ++c.barrier_seq;
  }
  in::combine(a, stream);
  if (L > 1) in::node_barrier(a.common, ++c.barrier_seq, stream);
  views::poison(c.base.status, stream, {{&out, x.dtype->nan}, {&out_w, kF32Nan}});
  return placed;
}

// The index tables of a dispatch in one launch (DispatchTablesTensors, backends/internode/
// launch.py): every output is checked against the shapes the kernels will read. A cached
// dispatch passes None for all but lists and list_count.
void dispatch_tables_call(Context& c, intptr_t stream, int num_channels, int counts_col, py::handle t) {
  c.check("dispatch tables");
  const int64_t R = c.base.num_ranks, L = c.base.ranks_per_node, N = c.num_nodes();
  const TensorView in_rank = arg(field(t, "in_rank"), "internode tables: in_rank", false, {-1, R}, {Dt::kBool});
  const int64_t T = in_rank.size[0];
  const TensorView lists = arg(field(t, "lists"), "internode tables: lists", false, {N, T}, {Dt::kInt32});
  const TensorView count =
      arg(field(t, "list_count"), "internode tables: list_count", false, {num_channels, N}, {Dt::kInt32});
  const TensorView dst = arg(field(t, "dst_row"), "internode tables: dst_row", true, {T, R}, {Dt::kInt32});
  const bool full = !dst.none;
  const TensorView rows = arg(field(t, "rows"), "internode tables: rows", !full, {R, -1}, {Dt::kInt64});
  const TensorView prefix = arg(field(t, "rank_prefix"), "internode tables: rank_prefix", !full, {R, R}, {Dt::kInt32});
  const TensorView recv_rows = arg(field(t, "recv_rows"), "internode tables: recv_rows", !full, {L}, {Dt::kInt32});
  const TensorView recv_prefix =
      arg(field(t, "recv_prefix"), "internode tables: recv_prefix", !full, {R + 1}, {Dt::kInt32});
  const TensorView recv_count = arg(field(t, "recv_count"), "internode tables: recv_count", !full, {1}, {Dt::kInt32});
  const TensorView src_tokens = arg(field(t, "src_tokens"), "internode tables: src_tokens", !full, {N}, {Dt::kInt32});
  const TensorView plan = arg(field(t, "plan"), "internode tables: plan", !full, {N, -1, L}, {Dt::kInt32});
  in::DispatchTablesArgs a;
  a.rank = c.base.rank;
  a.num_ranks = static_cast<int>(R);
  a.ranks_per_node = static_cast<int>(L);
  a.num_channels = num_channels;
  a.num_tokens = static_cast<int>(T);
  a.rows = rows.ptr;
  a.row_width = rows.none ? 0 : static_cast<int>(rows.size[1]);
  a.counts_col = counts_col;
  a.in_rank = in_rank.ptr;
  a.dst_row = dst.ptr;
  a.lists = lists.ptr;
  a.list_count = count.ptr;
  a.rank_prefix = prefix.ptr;
  a.recv_rows = recv_rows.ptr;
  a.recv_prefix = recv_prefix.ptr;
  a.recv_count = recv_count.ptr;
  a.src_tokens = src_tokens.ptr;
  a.plan = plan.ptr;
  a.plan_words = plan.none ? 0 : plan.bytes() / 4;
  // A sync-free dispatch's padded outputs, filled whole by the same launch.
  const TensorView pad_ids =
      arg(field(t, "pad_ids"), "internode tables: pad_ids", true, {-1, -1}, {Dt::kInt64, Dt::kInt32});
  const TensorView pad_w = arg(field(t, "pad_weights"), "internode tables: pad_weights", true, {-1, -1}, {Dt::kFloat32});
  const TensorView pad_src = arg(field(t, "pad_src"), "internode tables: pad_src", true, {-1}, {Dt::kInt32});
  a.pad_ids = pad_ids.ptr;
  a.pad_ids64 = pad_ids.none || pad_ids.dtype->dt == Dt::kInt64;
  a.pad_ids_words = pad_ids.none ? 0 : pad_ids.bytes() / pad_ids.dtype->itemsize;
  a.pad_weights = pad_w.ptr;
  a.pad_weights_words = pad_w.none ? 0 : pad_w.bytes() / 4;
  a.pad_src = pad_src.ptr;
  a.pad_src_words = pad_src.none ? 0 : pad_src.bytes() / 4;
  for (const TensorView* v : {&pad_ids, &pad_w, &pad_src})
    if (v->bytes() > 0) check_ptr(v->ptr, true, "internode tables: a padded output");
  for (const TensorView* v : {&in_rank, &lists, &count, &rows, &dst})
    check_ptr(v->ptr, v->bytes() > 0, "internode tables: a device tensor");
  in::dispatch_tables(a, stream);
}

// The tables of a combine in one launch (CombineTablesTensors).
void combine_tables_call(Context& c, intptr_t stream, int num_channels, py::handle t) {
  c.check("combine tables");
  const int64_t R = c.base.num_ranks, L = c.base.ranks_per_node, N = c.num_nodes();
  const TensorView in_rank = arg(field(t, "in_rank"), "internode tables: in_rank", false, {-1, R}, {Dt::kBool});
  const int64_t T = in_rank.size[0];
  const TensorView plan = arg(field(t, "plan"), "internode tables: plan", false, {N, -1, L}, {Dt::kInt32});
  const int64_t P = plan.size[1];
  const TensorView src = arg(field(t, "src_tokens"), "internode tables: src_tokens", false, {N}, {Dt::kInt32});
  const TensorView cum = arg(field(t, "cum"), "internode tables: cum", false, {T, N}, {Dt::kInt32});
  const TensorView lists = arg(field(t, "lists"), "internode tables: lists", false, {N, P}, {Dt::kInt32});
  const TensorView count =
      arg(field(t, "list_count"), "internode tables: list_count", false, {num_channels, N}, {Dt::kInt32});
  in::CombineTablesArgs a;
  a.ranks_per_node = static_cast<int>(L);
  a.num_nodes = static_cast<int>(N);
  a.num_channels = num_channels;
  a.num_tokens = static_cast<int>(T);
  a.plan_tokens = static_cast<int>(P);
  a.in_rank = in_rank.ptr;
  a.cum = cum.ptr;
  a.plan = plan.ptr;
  a.src_tokens = src.ptr;
  a.lists = lists.ptr;
  a.list_count = count.ptr;
  in::combine_tables(a, stream);
}

// The routing check of one dispatch's arguments (RoutingCheckTensors): one launch; the
// scratch is sized here from the shapes.
void routing_check_call(intptr_t stream, int ranks_per_node, py::handle t) {
  const TensorView in_rank = arg(field(t, "in_rank"), "routing check: is_token_in_rank", false, {-1, -1}, {Dt::kBool});
  const int64_t T = in_rank.size[0], R = in_rank.size[1];
  const TensorView idx = arg(field(t, "topk_idx"), "routing check: topk_idx", false, {T, -1}, {Dt::kInt64, Dt::kInt32});
  const TensorView per_rank = arg(field(t, "per_rank"), "routing check: num_tokens_per_rank", false, {R}, {Dt::kInt32});
  const TensorView per_expert =
      arg(field(t, "per_expert"), "routing check: num_tokens_per_expert", false, {-1}, {Dt::kInt32});
  const int64_t E = per_expert.size[0];
  UCCL_EP_CHECK_ARG(ranks_per_node >= 1 && R % ranks_per_node == 0, "routing check: ranks_per_node=",
                    ranks_per_node, " does not divide ", R, " ranks");
  const TensorView per_rdma = arg(field(t, "per_rdma"), "routing check: num_tokens_per_rdma_rank", true,
                                  {R / ranks_per_node}, {Dt::kInt32});
  const int64_t words = in::routing_check_scratch_words(static_cast<int>(R), ranks_per_node, static_cast<int>(E));
  const TensorView scratch = arg(field(t, "scratch"), "routing check: scratch", false, {-1}, {Dt::kInt64});
  UCCL_EP_CHECK_ARG(scratch.size[0] >= words, "routing check: scratch has ", scratch.size[0], " words, needs ", words);
  const TensorView out = arg(field(t, "out"), "routing check: out", false, {3}, {Dt::kInt64});
  in::RoutingCheckArgs a;
  a.topk_idx = idx.ptr;
  a.idx64 = idx.dtype->dt == Dt::kInt64;
  a.num_tokens = static_cast<int>(T);
  a.num_topk = static_cast<int>(idx.size[1]);
  a.num_experts = static_cast<int>(E);
  a.num_ranks = static_cast<int>(R);
  a.ranks_per_node = ranks_per_node;
  a.per_rank = per_rank.ptr;
  a.per_rdma = per_rdma.ptr;
  a.per_expert = per_expert.ptr;
  a.in_rank = in_rank.ptr;
  a.scratch = scratch.ptr;
  a.out = out.ptr;
  in::routing_check(a, stream);
}

// The verdict on a sync-free call's gathered headers; `columns` (VerdictColumns) names where
// each header field is, read by name.
void verdict_call(intptr_t stream, py::handle rows_t, py::handle out_t, py::handle cols, py::handle expert_out_t,
                  int rank, int alignment) {
  const TensorView rows = arg(rows_t, "call verdict: rows", false, {-1, -1}, {Dt::kInt64});
  const TensorView out = arg(out_t, "call verdict: out", false, {3}, {Dt::kInt64});
  in::VerdictArgs a;
  a.rows = rows.ptr;
  a.num_ranks = static_cast<int>(rows.size[0]);
  a.width = static_cast<int>(rows.size[1]);
  a.col_kind = field(cols, "kind").cast<int>();
  a.col_seq = field(cols, "seq").cast<int>();
  a.col_error = field(cols, "error").cast<int>();
  a.col_magic = field(cols, "magic").cast<int>();
  a.col_buffer = field(cols, "buffer").cast<int>();
  a.col_experts = field(cols, "num_experts").cast<int>();
  a.col_worst = field(cols, "num_worst_tokens").cast<int>();
  const auto agreed = field(cols, "agreed").cast<std::vector<int>>();
  UCCL_EP_CHECK_ARG(static_cast<int>(agreed.size()) <= in::kMaxAgreed, "call verdict: ", agreed.size(),
                    " agreed fields, at most ", in::kMaxAgreed);
  for (size_t i = 0; i < agreed.size(); ++i) a.agreed[i] = agreed[i];
  a.num_agreed = static_cast<int>(agreed.size());
  a.checks_col = field(cols, "checks").cast<int>();
  a.counts_col = field(cols, "counts").cast<int>();
  a.magic = field(cols, "magic_value").cast<int64_t>();
  a.kind_dispatch = field(cols, "kind_dispatch").cast<int>();
  a.out = out.ptr;
  for (int c : {a.col_kind, a.col_seq, a.col_error, a.col_magic, a.col_buffer, a.col_experts, a.col_worst, a.checks_col + 2})
    UCCL_EP_CHECK_ARG(c >= 0 && c < a.width, "call verdict: column ", c, " outside rows of width ", a.width);
  const TensorView experts = arg(expert_out_t, "call verdict: expert_out", true, {-1}, {Dt::kInt32});
  if (!experts.none) {
    a.expert_out = experts.ptr;
    a.experts_col = field(cols, "experts").cast<int>();
    a.rank = rank;
    a.experts_per_rank = static_cast<int>(experts.size[0]);
    a.alignment = alignment;
    UCCL_EP_CHECK_ARG(alignment >= 1, "call verdict: alignment=", alignment, " must be >= 1");
  }
  in::call_verdict(a, stream);
}

// What the host reads of an exact call's gathered headers, into `host_out`: pinned host memory
// (torch's pin_memory=True), which the kernel writes through its device address; the caller
// waits for the stream before reading it.
void header_read_call(intptr_t stream, py::handle rows_t, py::handle host_out_t, py::handle expert_out_t,
                      int experts_col, int counts_col, int rank, int alignment) {
  const TensorView rows = arg(rows_t, "call-header read: rows", false, {-1, -1}, {Dt::kInt64});
  const TensorView host = arg(host_out_t, "call-header read: host_out", false, {-1}, {Dt::kInt64});
  const TensorView experts = arg(expert_out_t, "call-header read: expert_out", true, {-1}, {Dt::kInt32});
  in::ReadArgs a;
  a.rows = rows.ptr;
  a.num_ranks = static_cast<int>(rows.size[0]);
  a.width = static_cast<int>(rows.size[1]);
  a.experts_col = experts_col;
  a.counts_col = counts_col;
  a.rank = rank;
  a.alignment = alignment;
  a.experts_per_rank = experts.none ? 0 : static_cast<int>(experts.size[0]);
  a.expert_out = experts.none ? 0 : experts.ptr;
  const int64_t need = static_cast<int64_t>(a.num_ranks) * (a.width - (counts_col - experts_col)) + a.experts_per_rank;
  UCCL_EP_CHECK_ARG(host.size[0] >= need, "call-header read: host_out holds ", host.size[0], " words; this read needs ",
                    need);
  void* dev = nullptr;
  const bool mapped = gpuHostGetDevicePointer(&dev, reinterpret_cast<void*>(host.ptr), 0) == gpuSuccess && dev;
  if (!mapped) (void)gpuGetLastError();  // not left for the next launch's check to find
  UCCL_EP_CHECK_ARG(mapped,
                    "call-header read: host_out is not pinned host memory the GPU can write (make it with "
                    "torch.empty(..., pin_memory=True))");
  a.host_out = reinterpret_cast<intptr_t>(dev);
  in::header_read(a, stream);
}

// One rank's call-header row on the GPU: `words` (the header fields, then the token count) and
// the optional device parts, each int32 or int64; `out` is the int64 row, its width fixing the
// number of ranks.
void encode_row_call(intptr_t stream, const std::vector<int64_t>& words, int num_checks, int expert_slots,
                     py::handle out_t, py::handle checks_t, py::handle counts_t, py::handle experts_t) {
  const TensorView out = arg(out_t, "call-header row: out", false, {-1}, {Dt::kInt64});
  const int num_fields = static_cast<int>(words.size()) - 1;
  UCCL_EP_CHECK_ARG(num_fields >= 0 && num_fields < in::kMaxRowWords, "call-header row: ", words.size(),
                    " words; at most ", in::kMaxRowWords);
  in::RowArgs a;
  for (size_t i = 0; i < words.size(); ++i) a.words[i] = words[i];
  a.num_fields = num_fields;
  a.num_checks = num_checks;
  a.expert_slots = expert_slots;
  a.num_ranks = static_cast<int>(out.size[0]) - num_fields - num_checks - expert_slots / 2 - 1;
  UCCL_EP_CHECK_ARG(a.num_ranks >= 1, "call-header row: out has ", out.size[0], " words, too few for ",
                    num_fields, " fields, ", num_checks, " check words and ", expert_slots, " expert slots");
  const TensorView checks = arg(checks_t, "call-header row: checks", true, {num_checks}, {Dt::kInt64});
  const TensorView counts = arg(counts_t, "call-header row: counts", true, {a.num_ranks}, {Dt::kInt32, Dt::kInt64});
  const TensorView experts = arg(experts_t, "call-header row: experts", true, {-1}, {Dt::kInt32, Dt::kInt64});
  a.checks = checks.none ? 0 : checks.ptr;
  a.counts = counts.none ? 0 : counts.ptr;
  a.counts64 = !counts.none && counts.dtype->dt == Dt::kInt64;
  a.experts = experts.none ? 0 : experts.ptr;
  a.experts64 = !experts.none && experts.dtype->dt == Dt::kInt64;
  a.num_experts = experts.none ? 0 : static_cast<int>(experts.size[0]);
  a.out = out.ptr;
  in::encode_row(a, stream);
}

}  // namespace
#endif

void bind_internode_calls(py::module_& s) {
#ifdef UCCL_EP_WITH_GPU
  py::class_<Context>(s, "Context",
                      "The per-Buffer part of every internode launch (group shape, FIFOs, counters, RDMA "
                      "region, NVLink buffers, status, timeout; `remote`: every node's peer region when the ipc NIC "
                      "model's senders store ring slots in place; `arenas`: the node's receive arenas as mapped here, "
                      "index = local rank, each `arena_bytes` long) and the node-barrier sequence, checked when built; "
                      "rebuilt (carrying barrier_seq over) after the NVLink buffers grow.")
      .def(py::init(&make_context), py::arg("rank"), py::arg("num_ranks"), py::arg("ranks_per_node"),
           py::arg("fifo_handles"), py::arg("num_fifos"), py::arg("counters"), py::arg("state"), py::arg("region"),
           py::arg("region_bytes"), py::arg("nvl"), py::arg("stage_offset"), py::arg("status"),
           py::arg("timeout_ns"), py::arg("barrier_seq") = 0, py::arg("remote") = std::vector<intptr_t>{},
           py::arg("arenas") = std::vector<intptr_t>{}, py::arg("arena_bytes") = 0)
      .def_readonly("barrier_seq", &Context::barrier_seq)
      .def(
          "set_trace",
          [](Context& c, py::handle t) {
            TensorView v = arg(t, "internode Context.set_trace: buffer", true, {-1}, {Dt::kInt64});
            if (!v.none) check_ptr(v.ptr, true, "internode Context.set_trace: buffer");
            c.trace = v;
          },
          py::arg("buffer"),
          "Every later launch accounts its blocks' time in `buffer` (int64 on the GPU, kTraceWords a "
          "block: entry, exit, go rounds, wait rounds, then ns waiting, planning, moving, pushing); None "
          "stops it.")
      .def_property_readonly("nvl", [](const Context& c) { return c.base.nvl; });
  // Positional (no keyword matching per call); the tensors and the ring shape are read by name.
  s.def("dispatch_call", &dispatch_call,
        "dispatch(ctx, stream, verdict|None, rings, tensors, cached, experts_per_rank): rings is a RingShape "
        "(channels, slots, chunk), tensors an InternodeDispatchTensors (backends/internode/launch.py); the "
        "dispatch kernels and the poison fold of their outputs (NaN rows, -1 ids and sources, 0 weights when a "
        "wait timed out). Returns whether the outputs lie in this rank's receive arena (node peers wrote their rows "
        "there: no staged copy).");
  s.def("dispatch_tables", &dispatch_tables_call,
        "dispatch_tables(ctx, stream, channels, counts_col, tensors): a DispatchTablesTensors "
        "(backends/internode/launch.py); the call's index tables from the gathered call headers in one launch.");
  s.def("combine_tables", &combine_tables_call,
        "combine_tables(ctx, stream, channels, tensors): a CombineTablesTensors; the combine's stream tables "
        "in one launch.");
  s.def("routing_check", &routing_check_call,
        "routing_check(stream, ranks_per_node, tensors): a RoutingCheckTensors; min id, max id and layout bits of "
        "a dispatch's arguments into tensors.out, in one launch. tensors.scratch (int64) must hold zeros but for "
        "word 0, -1, as the launch leaves it: set it so once.");
  s.def("call_verdict", &verdict_call, py::arg("stream"), py::arg("rows"), py::arg("out"), py::arg("columns"),
        py::arg("expert_out") = py::none(), py::arg("rank") = 0, py::arg("alignment") = 1,
        "call_verdict(stream, rows, out, columns, expert_out=None, rank=0, alignment=1): the verdict (code, rank, "
        "value) on a sync-free call's gathered headers into out; columns a VerdictColumns. With expert_out (int32 "
        "[experts per rank]): rank's received rows per local expert from the rows' per-expert blocks, rounded up "
        "to alignment.");
  s.def("header_read", &header_read_call, py::arg("stream"), py::arg("rows"), py::arg("host_out"),
        py::arg("expert_out"), py::arg("experts_col"), py::arg("counts_col"), py::arg("rank") = 0,
        py::arg("alignment") = 1,
        "header_read(stream, rows, host_out, expert_out|None, experts_col, counts_col, rank=0, alignment=1): "
        "every gathered row without its per-expert block, then (with expert_out, int32 [experts per rank]) rank's "
        "received rows per local expert rounded up to alignment, into host_out (int64, pinned host memory) in one "
        "launch; the counts also into expert_out.");
  s.def("encode_row", &encode_row_call,
        "encode_row(stream, words, num_checks, expert_slots, out, checks|None, counts|None, experts|None): one "
        "rank's call-header row into out (int64 [width]) in one launch; words are the header fields, then the "
        "token count.");
  s.def("combine_call", &combine_call,
        "combine(ctx, stream, verdict|None, rings, tensors, num_recv): tensors an InternodeCombineTensors; the "
        "combine kernels and the poison fold of the outputs (NaN when a wait timed out). Returns whether x (and its "
        "weights) lie in this rank's receive arena (node peers read them there: no staging copy).");
#endif
}

}  // namespace uccl_ep::bindings

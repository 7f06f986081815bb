// The intranode backend's per-call entry points: one binding call per step of a dispatch
// (notify, then the data movement, or both in one) and one per combine. Each takes a per-Buffer
// context built once, a typed launch built once per layout (`DispatchLaunch`, `CombineLaunch`,
// intranode_launch.h), the call's rows (`DispatchRows`), and the Python object that holds the
// call's tensors, read by name: a handful of arguments, none of them a loose int in a long list.
//
// `_C` does not link libtorch (docs/architecture.md, "Build"): a tensor is read through the Python
// protocol every torch version keeps (`data_ptr()`, `shape`, `dtype`) into a typed view, and
// every view is checked here, once, before anything is launched (pointers, ranks, shapes,
// dtypes). The arithmetic that follows from the host copy of the rank prefix matrix (rows
// received, sent, kept, staged) lives here too, and nowhere else.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/intranode_launch.h"

#ifdef UCCL_EP_WITH_GPU
#include <Python.h>

#include <atomic>
#include <initializer_list>
#include <string>
#include <utility>

#include "bindings/intranode_calls.h"
#include "bindings/pointer_checks.h"
#include "bindings/tensor_view.h"
#include "common/errors.h"
#include "common/gpu.h"
#include "kernels/intranode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

namespace {

// Words per rank of notify's input checks (kCheckWords of intranode.h): {id min, id max (both -1
// when unchecked), first rank whose num_tokens_per_rank entry differs from is_token_in_rank's
// column (-1: none), that entry, that column's sum, the packed call header}.
constexpr int kNotifyCheckWords = 6;

// Whether the `ranks` rows of notify checks at `w` are all good, so that check_all_ranks
// (backends/intranode/status.py) raises nothing: every id within [-1, num_experts), no layout
// mismatch, one call header on every rank.
bool notify_checks_good(const int64_t* w, int64_t ranks, int64_t num_experts) {
  if (ranks <= 0) return false;
  const int64_t header = w[kNotifyCheckWords - 1];
  for (int64_t r = 0; r < ranks; ++r) {
    const int64_t* row = w + r * kNotifyCheckWords;
    if (row[0] < -1 || row[1] >= num_experts || row[2] >= 0 || row[kNotifyCheckWords - 1] != header) return false;
  }
  return true;
}

}  // namespace

#ifdef UCCL_EP_WITH_GPU
namespace intranode {

namespace k = uccl_ep::kernels;

using views::Dt;
using views::dtype_info;
using views::repeat;
using views::TensorView;

// The 1-D / 2-D form every call below uses: `dim` of the sizes {rows, cols} (-1: any).
TensorView arg(py::handle t, const char* what, bool optional, int dim, int64_t rows, int64_t cols,
               std::initializer_list<Dt> dts) {
  return dim == 1 ? views::arg(t, what, optional, {rows}, dts) : views::arg(t, what, optional, {rows, cols}, dts);
}

// The regions (None/empty skipped) a kernel fills with their patterns when its call failed (a
// wait timed out): k::PoisonRegions, written by the kernel's last block.
void poison_regions(k::PoisonRegions* r, std::initializer_list<std::pair<const TensorView*, uint64_t>> fills) {
  for (const auto& [v, pattern] : fills) r->add(v->ptr, v->bytes(), pattern);
}

constexpr uint64_t kMinusOne = ~0ull;

void check_dispatch(const k::DispatchArgs& a) {
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && a.num_recv >= 0 && a.num_out_rows >= 0 && a.num_topk >= 0 &&
                        a.num_scales >= 0 && a.row_bytes > 0,
                    "dispatch sizes must be non-negative (row_bytes positive): num_tokens=", a.num_tokens,
                    " num_recv=", a.num_recv, " num_out_rows=", a.num_out_rows, " num_topk=", a.num_topk,
                    " num_scales=", a.num_scales, " row_bytes=", a.row_bytes);
  UCCL_EP_CHECK_ARG(a.num_recv <= a.num_out_rows, "intranode_dispatch: num_recv=", a.num_recv,
                    " exceeds the ", a.num_out_rows, " output rows");
  const bool send = a.num_tokens > 0, out = a.num_out_rows > 0;
  check_ptr(a.x, send, "intranode_dispatch: x");
  check_ptr(a.is_token_in_rank, send, "intranode_dispatch: is_token_in_rank");
  check_ptr(a.send_pos, send, "intranode_dispatch: send_pos");
  check_ptr(a.rank_prefix_matrix, true, "intranode_dispatch: rank_prefix_matrix");
  check_ptr(a.recv_x, out, "intranode_dispatch: recv_x");
  check_ptr(a.x_scales, send && a.num_scales > 0, "intranode_dispatch: x_scales");
  check_ptr(a.recv_scales, out && a.num_scales > 0, "intranode_dispatch: recv_scales");
  const bool topk = a.num_topk > 0 && !a.cached;
  check_ptr(a.topk_idx, send && topk, "intranode_dispatch: topk_idx");
  check_ptr(a.topk_weights, send && topk, "intranode_dispatch: topk_weights");
  check_ptr(a.recv_topk_idx, out && topk, "intranode_dispatch: recv_topk_idx");
  check_ptr(a.recv_topk_weights, out && topk, "intranode_dispatch: recv_topk_weights");
  check_ptr(a.recv_src_idx, a.num_recv > 0 && !a.cached, "intranode_dispatch: recv_src_idx");
}

// Rows rank `j` receives from rank `s`, from the row-major rank prefix matrix.
int64_t rows_sent(const std::vector<int64_t>& pm, int num_ranks, int s, int j) {
  return pm[s * num_ranks + j] - (s ? pm[(s - 1) * num_ranks + j] : 0);
}

// A call's tensors are read by name from the Python object that holds them (a DispatchArgs, a
// CombineTensors) instead of from a positional list: no two of them can trade places.
struct FieldNames {
  PyObject* const x = views::interned("x");
  PyObject* const x_scales = views::interned("x_scales");
  PyObject* const topk_idx = views::interned("topk_idx");
  PyObject* const topk_weights = views::interned("topk_weights");
  PyObject* const is_token_in_rank = views::interned("is_token_in_rank");
  PyObject* const num_tokens_per_rank = views::interned("num_tokens_per_rank");
  PyObject* const num_tokens_per_expert = views::interned("num_tokens_per_expert");
  PyObject* const weights = views::interned("weights");
  PyObject* const biases = views::interned("biases");
  PyObject* const out = views::interned("out");
  PyObject* const out_weights = views::interned("out_weights");
};

const FieldNames& names() {
  static const FieldNames n;
  return n;
}

py::object field(py::handle obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj.ptr(), name);
  if (!v) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

// notify's arguments (see k::NotifyArgs) from checked views (notify_call, dispatch_begin); with
// a readback (exact calls), its ready word is cleared here, before the launch.
k::NotifyArgs notify_args(const Context& c, const DispatchLaunch& l, const NotifyViews& v,
                          const std::vector<int64_t>& recv_entry) {
  const int64_t T = v.in_rank.size[0];
  UCCL_EP_CHECK_ARG(recv_entry.empty() || static_cast<int>(recv_entry.size()) == k::kRecvEntryArgs,
                    "intranode_notify: recv_entry has ", recv_entry.size(), " words; expected ", k::kRecvEntryArgs,
                    " or none");
  if (!recv_entry.empty() && recv_entry[0] == 1) {
    UCCL_EP_CHECK_ARG(!c.arenas.empty(), "intranode_notify: a zero-copy recv_entry but no receive arenas");
    for (int i = 1; i < k::kRecvEntryArgs; ++i)
      UCCL_EP_CHECK_ARG(recv_entry[i] >= -1 && recv_entry[i] < c.arena_sizes[c.rank], "intranode_notify: recv_entry[",
                        i, "]=", recv_entry[i], " is outside the ", c.arena_sizes[c.rank], "-byte receive arena");
  }
  check_ptr(v.per_rank.ptr, true, "intranode_notify: num_tokens_per_rank");
  check_ptr(v.info.ptr, true, "intranode_notify: out_info");
  check_ptr(v.in_rank.ptr, !v.send_pos.none && T > 0, "intranode_notify: is_token_in_rank");
  k::NotifyArgs a;
  a.buffers = c.buffers;
  a.rank = c.rank;
  a.num_ranks = c.num_ranks;
  a.num_tokens_per_rank = v.per_rank.ptr;
  a.num_tokens_per_expert = v.per_expert.ptr;
  a.experts_per_rank = l.experts_per_rank;
  a.expert_alignment = l.expert_alignment;
  a.out_info = v.info.ptr;
  a.status = c.status;
  a.timeout_ns = c.timeout_ns;
  a.is_token_in_rank = v.in_rank.ptr;
  a.num_tokens = static_cast<int>(T);
  a.send_pos = v.send_pos.ptr;
  a.topk_idx = v.idx.ptr;
  a.idx_is_64 = v.idx.none || v.idx.dtype->dt == Dt::kInt64;
  a.num_topk = v.idx.none ? 0 : static_cast<int>(v.idx.size[1]);
  a.num_worst_tokens = l.num_worst_tokens;
  a.num_experts = l.num_experts;
  a.header = l.header;
  a.recv_entry = recv_entry;
  if (l.readback()) {
    // Cleared before the launch: the host's store precedes the kernel's.
    auto* w = reinterpret_cast<volatile int64_t*>(c.status);
    w[k::kReadbackWord] = 0;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    a.readback = c.status + static_cast<intptr_t>(sizeof(int64_t)) * k::kReadbackWord;
  }
  return a;
}

void expect_counts(const Context& c, const DispatchLaunch& l, const NotifyViews* v) {
  const int R = c.num_ranks;
  views::expect(v->per_rank, "intranode_notify: num_tokens_per_rank", {R}, {Dt::kInt32});
  if (!(l.experts_per_rank == 0 && v->per_expert.none))
    views::expect(v->per_expert, "intranode_notify: num_tokens_per_expert", {int64_t{l.experts_per_rank} * R},
                  {Dt::kInt32});
}

// num_tokens_per_rank and num_tokens_per_expert (none without local experts) of `inputs`, checked.
void count_views(const Context& c, const DispatchLaunch& l, py::handle inputs, NotifyViews* v) {
  const FieldNames& n = names();
  v->per_rank = views::view_of(field(inputs, n.num_tokens_per_rank), "intranode_notify: num_tokens_per_rank");
  v->per_expert = views::view_of(field(inputs, n.num_tokens_per_expert), "intranode_notify: num_tokens_per_expert");
  expect_counts(c, l, v);
}

// notify (the binding): is_token_in_rank, the counts and topk_idx of `inputs` (a DispatchArgs),
// with `info` and `send_pos` (not read for a cached dispatch), checked, then notify as its own kernel.
void notify_call(const Context& c, const DispatchLaunch& l, intptr_t stream, py::handle inputs, py::handle info_t,
                 py::handle send_pos_t, const std::vector<int64_t>& recv_entry) {
  c.check("intranode_notify");
  const int R = c.num_ranks;
  const FieldNames& n = names();
  NotifyViews v;
  v.in_rank =
      arg(field(inputs, n.is_token_in_rank), "intranode_notify: is_token_in_rank", false, 2, -1, R, {Dt::kBool});
  const int64_t T = v.in_rank.size[0];
  count_views(c, l, inputs, &v);
  v.info = arg(info_t, "intranode_notify: out_info", false, 1, int64_t{R} * R + l.experts_per_rank, -1, {Dt::kInt32});
  if (!l.cached) v.send_pos = arg(send_pos_t, "intranode_notify: send_pos", false, 2, T, R, {Dt::kInt32});
  v.idx = arg(field(inputs, n.topk_idx), "intranode_notify: topk_idx", true, 2, T, -1, {Dt::kInt64, Dt::kInt32});
  k::intranode_notify(notify_args(c, l, v, recv_entry), stream);
}

// Waits for the readback of the notify launched with `readback` (GIL released) and returns its
// state: 1 with `words` = out_info's `num_info` words, then every rank's checks; -1 when its
// barrier failed (the status words say why); 0 when it did not finish within two timeouts (the
// stream is stuck behind earlier work). `words` is left empty unless the state is 1.
int read_back(const Context& c, int num_info, std::vector<int64_t>* words) {
  int state = 0;
  {
    py::gil_scoped_release nogil;
    state = k::host_readback_wait(c.status, 2 * c.timeout_ns);
  }
  words->clear();
  if (state != 1) return state;
  std::atomic_thread_fence(std::memory_order_acquire);
  const volatile int64_t* w = reinterpret_cast<const volatile int64_t*>(c.status) + k::kReadbackWord;
  words->reserve(num_info + c.num_ranks * k::kCheckWords);
  for (int i = 0; i < num_info; ++i) words->push_back(static_cast<int64_t>(w[k::kReadbackInfo + i]));
  for (int i = 0; i < c.num_ranks * k::kCheckWords; ++i)
    words->push_back(static_cast<int64_t>(w[k::kReadbackChecks + i]));
  return state;
}

// (state, words) of read_back, words as a list.
py::tuple read_counts(const Context& c, int num_info) {
  const int R = c.num_ranks;
  UCCL_EP_CHECK_ARG(num_info >= R * R && num_info <= R * R + k::kMaxLocalExperts, "intranode_read_counts: num_info=",
                    num_info, " is not R*R + local experts for R=", R);
  c.check("intranode_read_counts");
  std::vector<int64_t> words;
  const int state = read_back(c, num_info, &words);
  return py::make_tuple(state, py::cast(words));
}

// The view of `rows` x `cols` (0: 1-D) elements of `dt` at `ptr` (none when 0): a place in a
// receive-arena reservation, whose tensors are made after the launches.
TensorView placed(intptr_t ptr, int64_t rows, int64_t cols, const views::DtypeInfo* dt) {
  TensorView v;
  if (ptr == 0) return v;
  v.none = false;
  v.ptr = ptr;
  v.dim = cols > 0 ? 2 : 1;
  v.size[0] = rows;
  v.size[1] = cols;
  v.dtype = dt;
  return v;
}

void expect_inputs(const Context& c, DispatchViews* v) {
  auto expect = [](const TensorView& t, const char* what, bool optional, std::initializer_list<int64_t> shape,
                   std::initializer_list<Dt> dts) {
    if (!(optional && t.none)) views::expect(t, what, shape, dts);
  };
  expect(v->x, "intranode_dispatch: x", false, {-1, -1},
         {Dt::kBFloat16, Dt::kFloat16, Dt::kFloat32, Dt::kE4m3, Dt::kE4m3Fnuz});
  const int64_t T = v->x.size[0];
  expect(v->scales, "intranode_dispatch: x_scales", true, {T, -1}, {Dt::kFloat32});
  expect(v->idx, "intranode_dispatch: topk_idx", true, {T, -1}, {Dt::kInt64, Dt::kInt32});
  const int64_t K = v->idx.none ? 0 : v->idx.size[1];
  expect(v->weights, "intranode_dispatch: topk_weights", v->idx.none, {T, K}, {Dt::kFloat32});
  expect(v->in_rank, "intranode_dispatch: is_token_in_rank", false, {T, c.num_ranks}, {Dt::kBool});
}

// x, x_scales, topk_idx, topk_weights and is_token_in_rank of `inputs` (a DispatchArgs), checked.
void input_views(const Context& c, py::handle inputs, DispatchViews* v) {
  const FieldNames& n = names();
  v->x = views::view_of(field(inputs, n.x), "intranode_dispatch: x");
  v->scales = views::view_of(field(inputs, n.x_scales), "intranode_dispatch: x_scales");
  v->idx = views::view_of(field(inputs, n.topk_idx), "intranode_dispatch: topk_idx");
  v->weights = views::view_of(field(inputs, n.topk_weights), "intranode_dispatch: topk_weights");
  v->in_rank = views::view_of(field(inputs, n.is_token_in_rank), "intranode_dispatch: is_token_in_rank");
  expect_inputs(c, v);
}

// The outputs of a reservation (zero-copy, tensors made after the launch), checked against the
// call it was made for.
void reserved_views(const DispatchLaunch& l, const ReservedOutputs& res, DispatchViews* v) {
  const int64_t H = v->x.size[1], S = v->scales.none ? 0 : v->scales.size[1];
  const int64_t K = v->idx.none ? 0 : v->idx.size[1];
  const int64_t idx_bytes = v->idx.none ? 0 : v->idx.dtype->itemsize;
  const int64_t row_bytes = H * v->x.dtype->itemsize;
  UCCL_EP_CHECK_ARG(res.row_bytes == row_bytes && res.num_scales == S && res.num_topk == K &&
                        res.idx_bytes == idx_bytes && (res.src != 0) == !l.cached,
                    "intranode_dispatch: the reservation was made for rows of ", res.row_bytes, " bytes, ",
                    res.num_scales, " scales, ", res.num_topk, " top-k of ", res.idx_bytes, " bytes",
                    res.src != 0 ? " and sources" : "", ", not for this call's ", row_bytes, ", ", S, ", ", K, " of ",
                    idx_bytes, l.cached ? "" : " and sources");
  const int64_t rows = res.rows;
  v->out_rows = rows;
  v->recv_x = placed(res.x, rows, H, v->x.dtype);
  v->recv_scales = placed(res.scales, rows, S, v->scales.dtype);
  v->recv_idx = placed(res.idx, rows, K, v->idx.dtype);
  v->recv_w = placed(res.w, rows, K, v->weights.dtype);
  v->recv_src = placed(res.src, rows, 0, v->send_pos.dtype);
}

// The outputs of the tuple (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
// recv_src_idx), checked (recv_src_idx is not read for a cached dispatch).
void tuple_views(const DispatchLaunch& l, py::handle outputs, DispatchViews* v) {
  UCCL_EP_CHECK_ARG(PyTuple_Check(outputs.ptr()) && PyTuple_GET_SIZE(outputs.ptr()) == 5,
                    "intranode_dispatch: outputs must be a RecvReservation or the tuple (recv_x, recv_x_scales, "
                    "recv_topk_idx, recv_topk_weights, recv_src_idx)");
  auto out = [&](int i) { return py::handle(PyTuple_GET_ITEM(outputs.ptr(), i)); };
  const int64_t H = v->x.size[1], S = v->scales.none ? 0 : v->scales.size[1];
  const int64_t K = v->idx.none ? 0 : v->idx.size[1];
  const Dt idx_dt = v->idx.none ? Dt::kInt64 : v->idx.dtype->dt;
  v->recv_x = arg(out(0), "intranode_dispatch: recv_x", false, 2, -1, H, {v->x.dtype->dt});
  const int64_t rows = v->recv_x.size[0];
  v->out_rows = rows;
  v->recv_scales = arg(out(1), "intranode_dispatch: recv_scales", v->scales.none, 2, rows, S, {Dt::kFloat32});
  v->recv_idx = arg(out(2), "intranode_dispatch: recv_topk_idx", v->idx.none, 2, rows, K, {idx_dt});
  v->recv_w = arg(out(3), "intranode_dispatch: recv_topk_weights", v->idx.none, 2, rows, K, {Dt::kFloat32});
  if (!l.cached) v->recv_src = arg(out(4), "intranode_dispatch: recv_src_idx", false, 1, rows, -1, {Dt::kInt32});
}

// The dispatch kernel on checked views (dispatch_call, dispatch_begin), with the poison fold of
// its outputs (done by the kernel's last block): a failure inside this call is raised at the
// next one; until then the outputs say so. `zero_copy`: the outputs lie in this rank's arena;
// `entry_published`: notify told the peers where; `judge`: a launch-ahead call; `notify`: notify
// folded into this launch (see k::DispatchArgs).
void dispatch_launch(const Context& c, const DispatchLaunch& l, const DispatchRows& r, intptr_t stream,
                     const DispatchViews& v, bool zero_copy, bool entry_published, bool judge,
                     const k::NotifyArgs* notify = nullptr) {
  k::DispatchArgs a;
  c.fill(a);
  a.num_tokens = static_cast<int>(v.x.size[0]);
  a.experts_per_rank = l.experts_per_rank;
  a.x = v.x.ptr;
  a.row_bytes = v.x.size[1] * v.x.dtype->itemsize;
  a.x_scales = v.scales.ptr;
  a.num_scales = v.scales.none ? 0 : static_cast<int>(v.scales.size[1]);
  a.topk_idx = v.idx.ptr;
  a.idx_is_64 = v.idx.none || v.idx.dtype->dt == Dt::kInt64;
  a.topk_weights = v.weights.ptr;
  a.num_topk = v.idx.none ? 0 : static_cast<int>(v.idx.size[1]);
  a.is_token_in_rank = v.in_rank.ptr;
  a.rank_prefix_matrix = v.info.ptr;
  a.send_pos = v.send_pos.ptr;
  a.cached = l.cached;
  a.recv_x = v.recv_x.ptr;
  a.recv_scales = v.recv_scales.ptr;
  a.recv_topk_idx = v.recv_idx.ptr;
  a.recv_topk_weights = v.recv_w.ptr;
  a.recv_src_idx = l.cached ? 0 : v.recv_src.ptr;
  a.num_recv = static_cast<int>(r.num_recv);
  a.num_out_rows = static_cast<int>(v.out_rows);
  a.own_rows = static_cast<int>(r.own_rows);
  a.send_rows = r.send_rows;
  a.staging_rows = r.staging_rows;
  a.num_sms = l.num_sms;
  a.zero_copy = zero_copy;
  a.entry_published = entry_published;
  a.judge = judge;
  a.num_experts = l.num_experts;
  a.notify = notify;
  // The poison fold: NaN rows and scales, -1 ids and sources, 0 weights when the call failed,
  // written by the kernel's last block.
  const uint64_t f32_nan = repeat(0x7FC00000u, 4);
  poison_regions(&a.poison, {{&v.recv_x, v.x.dtype->nan},
                             {&v.recv_scales, f32_nan},
                             {&v.recv_idx, kMinusOne},
                             {&v.recv_w, 0},
                             {&v.recv_src, kMinusOne}});
  if (zero_copy) c.check_in_arena({&v.recv_x, &v.recv_scales, &v.recv_idx, &v.recv_w, &v.recv_src});
  check_dispatch(a);
  k::intranode_dispatch(a, stream);
}

// The dispatch kernel after its notify, then the poison fold of its outputs. `outputs`: the
// tuple of the five outputs, or a RecvReservation (zero-copy outputs whose tensors are made
// after this launch). The outputs are zero-copy when they lie in this rank's receive arena;
// rows known before notify (`rows.bound`) were published by it, and an exact uncached call
// with such rows is a launch-ahead call, judged by its kernel.
void dispatch_call(const Context& c, const DispatchLaunch& l, const DispatchRows& r, intptr_t stream,
                   py::handle inputs, py::handle info_t, py::handle send_pos_t, py::handle outputs) {
  c.check("intranode_dispatch");
  r.check("intranode_dispatch");
  const int R = c.num_ranks;
  DispatchViews v;
  input_views(c, inputs, &v);
  // notify's out_info: the matrix first, then the per-expert counts.
  v.info = arg(info_t, "intranode_dispatch: rank_prefix_matrix", false, 1, -1, -1, {Dt::kInt32});
  UCCL_EP_CHECK_ARG(v.info.size[0] >= int64_t{R} * R, "intranode_dispatch: rank_prefix_matrix has shape ",
                    shape_text(v.info), "; it needs ", R * R, " entries");
  v.send_pos = arg(send_pos_t, "intranode_dispatch: send_pos", false, 2, v.x.size[0], R, {Dt::kInt32});
  ReservedOutputs res;
  const bool reserved = reserved_outputs(outputs, &res);
  if (reserved) {
    reserved_views(l, res, &v);
  } else {
    tuple_views(l, outputs, &v);
  }
  const bool zero_copy = reserved || c.arena_place(v.recv_x) >= 0;
  dispatch_launch(c, l, r, stream, v, zero_copy, r.bound, r.bound && !l.sync_free() && !l.cached);
}

// DLPack (code, bits) of recv_x's dtype as the receive arena makes it (FP8 rows as uint8).
std::pair<int, int> dlpack_dtype(Dt dt, int itemsize) {
  switch (dt) {
    case Dt::kBFloat16:
      return {4, 16};
    case Dt::kFloat16:
    case Dt::kFloat32:
      return {2, 8 * itemsize};
    default:
      return {1, 8 * itemsize};
  }
}

// A zero-copy dispatch whose output rows are known before notify, in one call: `rows.num_recv`
// is num_worst_tokens (sync-free), the launch-ahead bound of an exact call (judged by its
// kernel, its counts read back by intranode_read_counts), or a cached dispatch's received rows
// (`cached_send_pos` is the handle's send_pos exactly when `launch.cached`). The status word,
// the capture state and the staging size are looked at, one receive-arena block is reserved for
// the outputs and the handle's send_pos and info (a cached dispatch: info only; its source
// indices are the handle's), then notify and the dispatch kernel are launched on `stream`: as
// one kernel for sync-free and cached calls (notify in its first blocks), apart for a
// launch-ahead call.
// Returns the RecvReservation (its tensors are made after this), or None when the call must
// take the step-by-step path: the status word is set (that path raises it), the stream is being
// captured, the staging does not hold `rows.staging_rows`, or the block does not fit.
py::object begin_checked(const Context& c, const DispatchLaunch& l, const DispatchRows& r, intptr_t stream,
                         intptr_t use_stream, py::handle arena, DispatchViews& v, NotifyViews& n,
                         const TensorView& handle_send_pos) {
  c.check("intranode_dispatch_begin");
  const volatile int64_t* status = reinterpret_cast<const volatile int64_t*>(c.status);
  if (status[0] != 0 || arena.is_none() || k::stream_capturing(stream)) return py::none();
  const int R = c.num_ranks;
  const bool judge = !l.sync_free() && !l.cached;  // launch-ahead
  const int64_t rows = r.num_recv;
  r.check("intranode_dispatch_begin");
  UCCL_EP_CHECK_ARG(rows > 0 && r.staging_rows >= rows && (l.cached || (r.own_rows == -1 && r.send_rows == -1)) &&
                        (!l.sync_free() || rows == l.num_worst_tokens),
                    "intranode_dispatch_begin: rows=", rows, " own_rows=", r.own_rows, " send_rows=", r.send_rows,
                    " staging_rows=", r.staging_rows, " num_worst_tokens=", l.num_worst_tokens);
  UCCL_EP_CHECK_ARG(l.cached != handle_send_pos.none,
                    "intranode_dispatch_begin: cached_send_pos is the handle's send_pos of a cached dispatch "
                    "(DispatchLaunch.cached=",
                    l.cached, "), and None otherwise");
  const int64_t T = v.x.size[0], H = v.x.size[1];
  const int64_t S = v.scales.none ? 0 : v.scales.size[1];
  const int64_t K = v.idx.none ? 0 : v.idx.size[1];
  UCCL_EP_CHECK_ARG(!l.cached || v.idx.none, "intranode_dispatch_begin: a cached dispatch takes no topk_idx");
  // Staging for `staging_rows` (a launch-ahead bound is sized with 8-byte ids, as every rank
  // decides alike from what the call header makes equal).
  const int idx_size = v.idx.none || judge ? 8 : v.idx.dtype->itemsize;
  if (k::dispatch_staging_bytes(r.staging_rows, H * v.x.dtype->itemsize, static_cast<int>(S), static_cast<int>(K),
                                idx_size) > c.buffer_bytes)
    return py::none();
  const auto [code, bits] = dlpack_dtype(v.x.dtype->dt, v.x.dtype->itemsize);
  const int64_t num_info = int64_t{R} * R + l.experts_per_rank;
  ReservedOutputs res;
  py::object reservation =
      reserve_outputs(arena, rows, H, code, bits, S, K, v.idx.none ? 64 : 8 * v.idx.dtype->itemsize, !l.cached,
                      ReserveAux{l.cached ? 0 : T, R, num_info}, stream, use_stream, &res);
  if (reservation.is_none()) return reservation;
  const views::DtypeInfo* i32 = n.per_rank.dtype;  // int32 (checked above)
  v.send_pos = l.cached ? handle_send_pos : placed(res.send_pos, T, R, i32);
  v.info = placed(res.info, num_info, 0, i32);
  n.info = v.info;
  n.in_rank = v.in_rank;
  n.send_pos = l.cached ? TensorView{} : v.send_pos;
  n.idx = v.idx;
  const k::NotifyArgs notify = notify_args(c, l, n, std::vector<int64_t>(res.entry.begin(), res.entry.end()));
  v.out_rows = rows;
  v.recv_x = placed(res.x, rows, H, v.x.dtype);
  v.recv_scales = placed(res.scales, rows, S, v.scales.dtype);
  v.recv_idx = placed(res.idx, rows, K, v.idx.dtype);
  v.recv_w = placed(res.w, rows, K, v.weights.dtype);
  v.recv_src = placed(res.src, rows, 0, i32);
  // Sync-free and cached calls run notify in the dispatch kernel's first blocks (one launch
  // less). A launch-ahead call launches it apart, first: the host waits for its readback, which
  // notify's own kernel delivered 8-9 us sooner than the folded blocks did, more than the launch
  // saved (bench/profile_host.py on one H200, docs/performance.md "Host time per call").
  if (judge) k::intranode_notify(notify, stream);
  dispatch_launch(c, l, r, stream, v, true, true, judge, judge ? nullptr : &notify);
  return reservation;
}

// intranode_dispatch_begin (the binding): the tensors of `inputs` (a DispatchArgs) read by name.
py::object dispatch_begin(const Context& c, const DispatchLaunch& l, const DispatchRows& r, intptr_t stream,
                          intptr_t use_stream, py::handle arena, py::handle inputs, py::handle cached_send_pos_t) {
  DispatchViews v;
  input_views(c, inputs, &v);
  NotifyViews n;
  count_views(c, l, inputs, &n);
  const TensorView handle_send_pos =
      arg(cached_send_pos_t, "intranode_dispatch: send_pos", true, 2, v.x.size[0], c.num_ranks, {Dt::kInt32});
  return begin_checked(c, l, r, stream, use_stream, arena, v, n, handle_send_pos);
}

void expect_combine(const Context& c, const DispatchRows& r, CombineViews* v) {
  const int R = c.num_ranks;
  auto expect = [](const TensorView& t, const char* what, bool optional, std::initializer_list<int64_t> shape,
                   std::initializer_list<Dt> dts) {
    if (!(optional && t.none)) views::expect(t, what, shape, dts);
  };
  const TensorView& x = v->x;
  expect(x, "intranode_combine: x", false, {-1, -1}, {Dt::kBFloat16, Dt::kFloat16, Dt::kFloat32});
  const int64_t H = x.size[1];
  UCCL_EP_CHECK_ARG(r.num_recv >= 0 && r.num_recv <= x.size[0], "intranode_combine: num_recv=", r.num_recv,
                    " but x has ", x.size[0], " rows");
  expect(v->out, "intranode_combine: out", false, {-1, H}, {x.dtype->dt});
  const int64_t T = v->out.size[0];
  expect(v->weights, "intranode_combine: topk_weights", true, {x.size[0], -1}, {Dt::kFloat32});
  const int64_t K = v->weights.none ? 0 : v->weights.size[1];
  expect(v->out_w, "intranode_combine: out_weights", v->weights.none, {T, K}, {Dt::kFloat32});
  UCCL_EP_CHECK_ARG(v->num_bias >= 0 && v->num_bias <= 2, "intranode_combine: ", v->num_bias,
                    " bias tensors; at most 2 are supported");
  for (int i = 0; i < v->num_bias; ++i)
    expect(v->bias[i], i == 0 ? "intranode_combine: bias[0]" : "intranode_combine: bias[1]", false, {T, H},
           {x.dtype->dt});
  expect(v->prefix, "intranode_combine: rank_prefix_matrix", false, {R, R}, {Dt::kInt32});
  expect(v->send_pos, "intranode_combine: send_pos", false, {T, R}, {Dt::kInt32});
}

// The combine (the binding): x, weights, biases, out and out_weights of `tensors` (a
// CombineTensors), with the dispatch handle's rank prefix matrix and send_pos; `rows` are the
// dispatch's (num_recv rows of x are combined: the received count, or its bound in sync-free
// mode, whose kernels read the real count from the device matrix; combine_rows of staging).
int combine_call(const Context& c, const CombineLaunch& l, const DispatchRows& r, intptr_t stream,
                 py::handle tensors, py::handle prefix_t, py::handle send_pos_t) {
  c.check("intranode_combine");
  if (reinterpret_cast<const volatile int64_t*>(c.status)[0] != 0) return kCombineStatusSet;
  const FieldNames& n = names();
  CombineViews v;
  v.x = views::view_of(field(tensors, n.x), "intranode_combine: x");
  v.out = views::view_of(field(tensors, n.out), "intranode_combine: out");
  v.weights = views::view_of(field(tensors, n.weights), "intranode_combine: topk_weights");
  v.out_w = views::view_of(field(tensors, n.out_weights), "intranode_combine: out_weights");
  const py::object biases = field(tensors, n.biases);
  const Py_ssize_t num_bias = PySequence_Size(biases.ptr());
  if (num_bias < 0) throw py::error_already_set();
  UCCL_EP_CHECK_ARG(num_bias <= 2, "intranode_combine: ", num_bias, " bias tensors; at most 2 are supported");
  v.num_bias = static_cast<int>(num_bias);
  for (Py_ssize_t i = 0; i < num_bias; ++i) {
    py::object b = py::reinterpret_steal<py::object>(PySequence_GetItem(biases.ptr(), i));
    if (!b) throw py::error_already_set();
    v.bias[i] = views::view_of(b, i == 0 ? "intranode_combine: bias[0]" : "intranode_combine: bias[1]");
  }
  v.prefix = views::view_of(prefix_t, "intranode_combine: rank_prefix_matrix");
  v.send_pos = views::view_of(send_pos_t, "intranode_combine: send_pos");
  expect_combine(c, r, &v);
  return combine_checked(c, l, r, stream, v);
}

int combine_checked(const Context& c, const CombineLaunch& l, const DispatchRows& r, intptr_t stream,
                    const CombineViews& v) {
  const TensorView &x = v.x, &weights = v.weights, &out = v.out, &out_w = v.out_w;
  const TensorView *bias = v.bias;
  const int64_t H = x.size[1], T = out.size[0];
  const int64_t K = weights.none ? 0 : weights.size[1];
  const TensorView &prefix = v.prefix, &send_pos = v.send_pos;
  k::CombineArgs a;
  c.fill(a);
  a.dtype = x.dtype->dt == Dt::kBFloat16 ? 0 : x.dtype->dt == Dt::kFloat16 ? 1 : 2;
  a.hidden = static_cast<int>(H);
  a.x = x.ptr;
  a.topk_weights = weights.ptr;
  a.num_topk = static_cast<int>(K);
  a.num_recv = static_cast<int>(r.num_recv);
  a.rank_prefix_matrix = prefix.ptr;
  a.send_pos = send_pos.ptr;
  a.num_tokens = static_cast<int>(T);
  a.bias0 = bias[0].ptr;
  a.bias1 = bias[1].ptr;
  a.out = out.ptr;
  a.out_weights = out_w.ptr;
  a.staging_rows = r.combine_rows;
  a.num_sms = l.num_sms;
  a.header = l.header;
  UCCL_EP_CHECK_ARG(a.hidden > 0 && a.num_tokens >= 0, "intranode_combine: hidden=", a.hidden,
                    " num_tokens=", a.num_tokens);
  check_ptr(a.x, a.num_recv > 0, "intranode_combine: x");
  check_ptr(a.send_pos, a.num_tokens > 0, "intranode_combine: send_pos");
  check_ptr(a.rank_prefix_matrix, true, "intranode_combine: rank_prefix_matrix");
  check_ptr(a.out, a.num_tokens > 0, "intranode_combine: out");
  check_ptr(a.topk_weights, a.num_recv > 0 && a.num_topk > 0, "intranode_combine: topk_weights");
  check_ptr(a.out_weights, a.num_tokens > 0 && a.num_topk > 0, "intranode_combine: out_weights");
  // In place when x (16-byte aligned rows: peers may read them as vectors) and the weights, if
  // any, lie in this rank's arena.
  if (c.combine_in_place && x.ptr % 16 == 0 && (H * x.dtype->itemsize) % 16 == 0) {
    const int64_t xp = c.arena_place(x), wp = c.arena_place(weights);
    if (xp >= 0 && (weights.none || weights.bytes() == 0 || wp >= 0)) {
      a.x_place = xp;
      a.w_place = wp;
    }
  }
  const bool capturing = k::stream_capturing(stream);
  if (a.x_place < 0 && !capturing && c.by_copy_engine(r)) {
    // Else, at 2 ranks, by the copy engine from where x lies. The rows from the peer follow
    // this rank's own rows when the peer's rank is higher, and start its staging (no third
    // rank's rows come first).
    const int peer = 1 - c.rank;
    a.ce_value = k::next_ce_value();
    a.ce_stream = c.ce_stream;
    a.ce_event = c.ce_event;
    a.ce_rows.assign(2, 0);
    a.ce_begin.assign(2, 0);
    a.ce_dst.assign(2, 0);
    a.ce_rows[peer] = r.num_recv - r.own_rows;
    a.ce_begin[peer] = peer < c.rank ? 0 : r.own_rows;
  }
  poison_regions(&a.poison, {{&out, x.dtype->nan}, {&out_w, repeat(0x7FC00000u, 4)}});
  k::intranode_combine(a, stream);
  return (a.x_place >= 0 ? kCombinedInPlace : 0) | (a.ce_value > 0 ? kCombinedByCopyEngine : 0) |
         (capturing ? kCombineCaptured : 0);
}

// The layout kernel (see k::get_dispatch_layout); sizes come from the views: tokens and top-k
// from topk_idx [T, K], ranks from is_token_in_rank [T, R], experts from the per-expert counts.
void layout_call(intptr_t stream, py::handle idx_t, py::handle per_rank_t, py::handle per_expert_t,
                 py::handle in_rank_t) {
  const TensorView idx = arg(idx_t, "get_dispatch_layout: topk_idx", false, 2, -1, -1, {Dt::kInt64, Dt::kInt32});
  const int64_t T = idx.size[0], K = idx.size[1];
  const TensorView in_rank = arg(in_rank_t, "get_dispatch_layout: is_token_in_rank", false, 2, T, -1, {Dt::kBool});
  const int64_t R = in_rank.size[1];
  const TensorView per_rank =
      arg(per_rank_t, "get_dispatch_layout: num_tokens_per_rank", false, 1, R, -1, {Dt::kInt32});
  const TensorView per_expert =
      arg(per_expert_t, "get_dispatch_layout: num_tokens_per_expert", false, 1, -1, -1, {Dt::kInt32});
  const int64_t E = per_expert.size[0];
  UCCL_EP_CHECK_ARG(R >= 1 && E > 0 && E % R == 0, "get_dispatch_layout: num_experts=", E, " num_ranks=", R);
  check_ptr(idx.ptr, T > 0 && K > 0, "get_dispatch_layout: topk_idx");
  check_ptr(in_rank.ptr, T > 0, "get_dispatch_layout: is_token_in_rank");
  check_ptr(per_rank.ptr, true, "get_dispatch_layout: num_tokens_per_rank");
  check_ptr(per_expert.ptr, true, "get_dispatch_layout: num_tokens_per_expert");
  k::get_dispatch_layout(idx.ptr, idx.dtype->dt == Dt::kInt64, static_cast<int>(T), static_cast<int>(K),
                         static_cast<int>(R), static_cast<int>(E), per_rank.ptr, per_expert.ptr, in_rank.ptr,
                         stream);
}

// The row counts of an exact-mode dispatch on `rank`, from the host copy of the row-major
// rank prefix matrix: (rows received, staging rows of the dispatch (the most any rank
// receives), rows kept for itself, rows sent to all ranks, combine staging rows (the most
// rows any rank gets back from the others)).
DispatchRows exact_rows(const std::vector<int64_t>& pm, int rank, int num_ranks) {
  UCCL_EP_CHECK_ARG(num_ranks >= 1 && rank >= 0 && rank < num_ranks &&
                        pm.size() == static_cast<size_t>(num_ranks) * num_ranks,
                    "intranode_exact_rows: rank=", rank, " num_ranks=", num_ranks, " with ", pm.size(),
                    " prefix entries");
  const int R = num_ranks;
  const int64_t* last = pm.data() + (R - 1) * R;
  const int64_t num_recv = last[rank];
  const int64_t staging = *std::max_element(last, last + R);
  const int64_t own = rows_sent(pm, R, rank, rank);
  int64_t sent = 0;
  for (int j = 0; j < R; ++j) sent += rows_sent(pm, R, rank, j);
  int64_t combine = 0;
  for (int s = 0; s < R; ++s) {
    int64_t back = 0;
    for (int j = 0; j < R; ++j)
      if (j != s) back += rows_sent(pm, R, s, j);
    combine = std::max(combine, back);
  }
  return DispatchRows{num_recv, staging, own, sent, combine, false};
}

static_assert(kNotifyCheckWords == k::kCheckWords, "notify_checks_good reads intranode.h's check rows");

// The end of a launch-ahead dispatch (intranode_dispatch_begin of an exact uncached call with its
// bound `bound`) in one step: its counts read back (as read_counts does) and judged (AheadEnd).
AheadEnd ahead_end(const Context& c, const DispatchLaunch& l, py::handle reservation, int64_t bound) {
  const int R = c.num_ranks;
  UCCL_EP_CHECK_ARG(l.readback(), "intranode_ahead_finish: the launch is not an exact uncached dispatch");
  c.check("intranode_ahead_finish");
  const int num_info = R * R + l.experts_per_rank;
  // The handle's four tensors need no counts: made while notify runs, not after the wait (the
  // host would otherwise spin through those microseconds). A call that ends otherwise takes
  // them from the reservation (RecvReservation.aux).
  reservation_aux_ahead(reservation, c.rank);
  AheadEnd end;
  end.state = read_back(c, num_info, &end.words);
  if (end.state != 1) return end;
  const std::vector<int64_t>& words = end.words;
  std::vector<int64_t> prefix(words.begin(), words.begin() + int64_t{R} * R);
  const int64_t most = *std::max_element(prefix.end() - R, prefix.end());
  const bool clear = reinterpret_cast<const volatile int64_t*>(c.status)[0] == 0;
  if (clear && notify_checks_good(words.data() + num_info, R, l.num_experts) && most <= bound) {
    end.rows = exact_rows(prefix, c.rank, R);
    end.made = reservation_tensors(reservation, end.rows.num_recv, c.rank);
    end.most = most;
    end.prefix = std::move(prefix);
    end.good = true;
  }
  return end;
}

// intranode_ahead_finish (the binding): (1, rank prefix matrix (host tuple), aligned received rows
// per local expert (list), its exact DispatchRows, the most rows any rank receives, the five
// outputs of its received rows, the handle's four tensors) of a good call (AheadEnd::good), else
// read_counts' (state, words): the caller judges them (it raises what failed, or runs the call
// again when a rank exceeded the bound).
py::tuple ahead_finish(const Context& c, const DispatchLaunch& l, py::handle reservation, int64_t bound) {
  AheadEnd end = ahead_end(c, l, reservation, bound);
  if (!end.good) return py::make_tuple(end.state, py::cast(end.words));
  const int R = c.num_ranks;
  py::list per_expert;
  for (int i = R * R; i < R * R + l.experts_per_rank; ++i) per_expert.append(end.words[i]);
  return py::make_tuple(1, py::tuple(py::cast(end.prefix)), per_expert, end.rows, end.most, end.made[0],
                        end.made[1]);
}

}  // namespace intranode
#endif

void bind_intranode_calls(py::module_& m) {
  m.def(
      "notify_checks_good",
      [](const std::vector<int64_t>& words, int64_t num_experts) {
        const auto ranks = static_cast<int64_t>(words.size()) / kNotifyCheckWords;
        return static_cast<int64_t>(words.size()) == ranks * kNotifyCheckWords &&
               notify_checks_good(words.data(), ranks, num_experts);
      },
      py::arg("words"), py::arg("num_experts"),
      "Whether every rank's notify checks (rows of NOTIFY_CHECK_WORDS: id min, id max, first rank whose "
      "num_tokens_per_rank entry differs from is_token_in_rank's column, that entry, that column's sum, the "
      "packed call header) are good: ids within [-1, num_experts), no mismatch, one header.");
  m.attr("NOTIFY_CHECK_WORDS") = kNotifyCheckWords;
#ifdef UCCL_EP_WITH_GPU
  using namespace intranode;
  py::class_<Context>(m, "IntranodeContext",
                      "The per-Buffer part of every intranode launch (buffers, rank, status, timeout), "
                      "checked when built; rebuilt after a buffer regrow.")
      .def(py::init([](std::vector<intptr_t> buffers, int64_t buffer_bytes, int rank, int num_ranks,
                       intptr_t status, int64_t timeout_ns, bool use_tma, std::vector<intptr_t> arenas,
                       std::vector<int64_t> arena_sizes, bool combine_in_place, intptr_t copy_engine_stream) {
             Context c{std::move(buffers), buffer_bytes,           rank,    num_ranks, status, timeout_ns,
                       use_tma,            std::move(arenas), std::move(arena_sizes), combine_in_place};
             c.check("IntranodeContext");
             if (copy_engine_stream != 0 && num_ranks == 2) {
               int device = 0;
               GPU_CHECK(gpuGetDevice(&device));
               c.ce_event = k::event_create(device);
               const intptr_t ev = c.ce_event;
               c.ce_event_owner = std::shared_ptr<void>(nullptr, [ev](void*) {
                 try {
                   k::event_destroy(ev);
                 } catch (...) {  // teardown: nothing to report to
                 }
               });
               c.ce_stream = copy_engine_stream;
               c.copy_engine = true;
             }
             if (!c.arenas.empty()) {
               UCCL_EP_CHECK_ARG(static_cast<int>(c.arenas.size()) == num_ranks && c.arena_sizes.size() == c.arenas.size(),
                                 "IntranodeContext: ", c.arenas.size(), " receive arenas and ", c.arena_sizes.size(),
                                 " sizes for ", num_ranks, " ranks");
               for (int r = 0; r < num_ranks; ++r)
                 check_buffers({c.arenas[r]}, 1, c.arena_sizes[r], "IntranodeContext: receive arena");
             }
             return c;
           }),
           py::kw_only(), py::arg("buffers"), py::arg("buffer_bytes"), py::arg("rank"), py::arg("num_ranks"),
           py::arg("status"), py::arg("timeout_ns"), py::arg("use_tma"), py::arg("arenas") = std::vector<intptr_t>{},
           py::arg("arena_sizes") = std::vector<int64_t>{}, py::arg("combine_in_place") = true,
           py::arg("copy_engine_stream") = 0)
      .def_readonly("buffers", &Context::buffers)
      .def_readwrite("copy_engine", &Context::copy_engine,
                     "Whether a 2-rank combine of an exact dispatch whose x is not read in place sends its rows "
                     "back by the copy engine (needs copy_engine_stream).")
      .def("by_copy_engine", &Context::by_copy_engine, py::arg("rows"),
           "Whether a combine of a dispatch with these DispatchRows whose x is not read in place sends its rows "
           "back by the copy engine.")
      .def_readonly("buffer_bytes", &Context::buffer_bytes);

  py::class_<DispatchLaunch>(m, "DispatchLaunch",
                             "What a dispatch's launches share that its layout and shapes fix, checked when "
                             "built; the backend builds one per layout and reuses it.")
      .def(py::init([](int num_sms, int experts_per_rank, int num_experts, int64_t header, int expert_alignment,
                       int num_worst_tokens, bool cached) {
             DispatchLaunch l{num_sms, experts_per_rank, expert_alignment, num_experts, num_worst_tokens, cached,
                              header};
             l.check();
             return l;
           }),
           py::kw_only(), py::arg("num_sms"), py::arg("experts_per_rank"), py::arg("num_experts"), py::arg("header"),
           py::arg("expert_alignment") = 1, py::arg("num_worst_tokens") = 0, py::arg("cached") = false)
      .def_readonly("num_sms", &DispatchLaunch::num_sms)
      .def_readonly("experts_per_rank", &DispatchLaunch::experts_per_rank)
      .def_readonly("expert_alignment", &DispatchLaunch::expert_alignment)
      .def_readonly("num_experts", &DispatchLaunch::num_experts)
      .def_readonly("num_worst_tokens", &DispatchLaunch::num_worst_tokens)
      .def_readonly("cached", &DispatchLaunch::cached)
      .def_readonly("header", &DispatchLaunch::header);

  py::class_<DispatchRows>(m, "DispatchRows",
                           "The rows of one dispatch and of the combine that returns them: exact "
                           "(intranode_exact_rows) or a bound known before notify (DispatchRows.of_bound).")
      .def(py::init([](int64_t num_recv, int64_t staging_rows, int64_t own_rows, int64_t send_rows,
                       int64_t combine_rows, bool bound) {
             DispatchRows r{num_recv, staging_rows, own_rows, send_rows, combine_rows, bound};
             r.check("DispatchRows");
             return r;
           }),
           py::kw_only(), py::arg("num_recv"), py::arg("staging_rows"), py::arg("own_rows") = -1,
           py::arg("send_rows") = -1, py::arg("combine_rows") = 0, py::arg("bound") = false)
      .def_static(
          "of_bound",
          [](int64_t rows) {
            DispatchRows r = DispatchRows::of_bound(rows);
            r.check("DispatchRows.of_bound");
            return r;
          },
          py::arg("rows"),
          "Rows known before notify (num_worst_tokens, a launch-ahead bound): `rows` received, staged and "
          "returned; the rows kept and sent unknown (-1).")
      .def_readonly("num_recv", &DispatchRows::num_recv)
      .def_readonly("staging_rows", &DispatchRows::staging_rows)
      .def_readonly("own_rows", &DispatchRows::own_rows)
      .def_readonly("send_rows", &DispatchRows::send_rows)
      .def_readonly("combine_rows", &DispatchRows::combine_rows)
      .def_readonly("bound", &DispatchRows::bound)
      .def("__repr__", [](const DispatchRows& r) {
        return detail::concat("DispatchRows(num_recv=", r.num_recv, ", staging_rows=", r.staging_rows,
                              ", own_rows=", r.own_rows, ", send_rows=", r.send_rows, ", combine_rows=",
                              r.combine_rows, ", bound=", r.bound ? "True" : "False", ")");
      });

  py::class_<CombineLaunch>(m, "CombineLaunch",
                            "What a combine's launch shares that its shapes fix (SM budget, call header), "
                            "checked when built; the backend builds one per shape and reuses it.")
      .def(py::init([](int num_sms, int64_t header) {
             CombineLaunch l{num_sms, header};
             l.check();
             return l;
           }),
           py::kw_only(), py::arg("num_sms"), py::arg("header"))
      .def_readonly("num_sms", &CombineLaunch::num_sms)
      .def_readonly("header", &CombineLaunch::header);

  // Positional (no keyword matching per call); each call takes its typed launch and rows.
  m.def("intranode_notify_call", &notify_call,
        "notify(ctx, launch: DispatchLaunch, stream, inputs, out_info, send_pos|None, recv_entry): the counts "
        "exchange and entry barrier of a dispatch, reading is_token_in_rank, num_tokens_per_rank, "
        "num_tokens_per_expert and topk_idx of `inputs` (a DispatchArgs); send_pos is not read for a cached "
        "launch; recv_entry: [] or {mode, 5 arena offsets}, published to every peer before the barrier. An "
        "exact uncached launch also copies the counts and every rank's checks to the host "
        "(intranode_read_counts).");
  m.def("intranode_read_counts", &read_counts, py::arg("ctx"), py::arg("num_info"),
        "(state, words) of the notify launched with readback: state 1 with out_info's num_info words and "
        "every rank's checks, -1 when its barrier failed (status words), 0 when it did not finish in time.");
  m.def("intranode_ahead_finish", &ahead_finish, py::arg("ctx"), py::arg("launch"), py::arg("reservation"),
        py::arg("bound"),
        "The end of a launch-ahead dispatch begun by intranode_dispatch_begin with `bound` rows: (1, rank "
        "prefix matrix (tuple), received rows per local expert (list), DispatchRows, most rows any rank "
        "receives, the five outputs of the received rows, RecvReservation.aux(rank)'s four tensors) when the "
        "status word is clear, every rank's checks are good and no rank exceeds the bound; otherwise "
        "intranode_read_counts' (state, words), to be judged by the caller.");
  m.def("intranode_dispatch_call", &dispatch_call,
        "dispatch(ctx, launch: DispatchLaunch, rows: DispatchRows, stream, inputs, rank_prefix_matrix, send_pos, "
        "outputs): the dispatch kernel after its notify, reading x, x_scales, topk_idx, topk_weights and "
        "is_token_in_rank of `inputs` (a DispatchArgs), and the poison fold of its outputs (NaN rows, -1 ids and "
        "sources, 0 weights when a wait timed out). outputs: the tuple (recv_x, recv_x_scales, recv_topk_idx, "
        "recv_topk_weights, recv_src_idx) or a RecvReservation (zero-copy outputs whose tensors are made after "
        "this launch). Outputs in this rank's receive arena are zero-copy (peers write them directly); rows "
        "known before notify (rows.bound) were published by it, and an exact uncached call with such rows is "
        "launched ahead of its counts: every rank skips it alike when any rank's checks fail or a rank "
        "receives more rows than the outputs hold.");
  m.def("intranode_dispatch_begin", &dispatch_begin,
        "dispatch_begin(ctx, launch: DispatchLaunch, rows: DispatchRows, stream, use_stream, arena "
        "(RecvArenaCore|None), inputs, cached_send_pos|None): a zero-copy dispatch of rows.num_recv output "
        "rows (num_worst_tokens, the launch-ahead bound, or a cached dispatch's received rows) in one call: "
        "one receive-arena block for the outputs and the handle's send_pos/info (info only when cached), "
        "notify and the dispatch kernel. Returns the RecvReservation (tensors: .tensors(rows), .aux()), or "
        "None when the status word is set, the stream is being captured, the staging or the arena does not "
        "hold the rows (take the step-by-step path).");
  m.def("intranode_combine_call", &combine_call,
        "combine(ctx, launch: CombineLaunch, rows: DispatchRows (the dispatch's), stream, tensors, "
        "rank_prefix_matrix, send_pos): push, reduce and the poison fold of the outputs (NaN when a wait timed "
        "out), reading x, weights|None, biases (0-2), out and out_weights|None of `tensors` (a "
        "CombineTensors); when the context allows it and x (and the weights) lie in this rank's receive "
        "arena, peers read its rows there and it pushes none (in place); at 2 ranks the context may push "
        "its rows back by the copy engine instead (IntranodeContext.by_copy_engine). Returns "
        "COMBINED_IN_PLACE or COMBINED_BY_COPY_ENGINE when it did, plus COMBINE_CAPTURED while the stream is "
        "being captured; COMBINE_STATUS_SET, launching nothing, when the status word is set (raise it).");
  m.attr("COMBINED_IN_PLACE") = kCombinedInPlace;
  m.attr("COMBINED_BY_COPY_ENGINE") = kCombinedByCopyEngine;
  m.attr("COMBINE_CAPTURED") = kCombineCaptured;
  m.attr("COMBINE_STATUS_SET") = kCombineStatusSet;
  m.def("dispatch_layout_call", &layout_call,
        "layout(stream, topk_idx, num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank): the layout "
        "kernel into the three output tensors (shared by the intranode and internode backends).");
  m.def("intranode_exact_rows", &exact_rows, py::arg("rank_prefix_matrix"), py::arg("rank"), py::arg("num_ranks"),
        "The DispatchRows of an exact-mode dispatch on `rank` (rows received, dispatch staging rows, rows kept, "
        "rows sent, combine staging rows), from the host rank prefix matrix (row-major).");
  m.def(
      "intranode_fill_word",
      [](py::handle dtype) { return dtype_info(dtype.ptr()).nan; },
      py::arg("dtype"), "The 8-byte word the poison fold writes for NaN in `dtype` (0 if it has none).");
#endif
}

}  // namespace uccl_ep::bindings

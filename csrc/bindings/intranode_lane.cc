// The direct lane of Buffer.dispatch and Buffer.combine in one binding call (`IntranodeLane`).
// api/direct.py takes a synchronous call whose arguments passed every check before straight to
// the backend; its Python, run between a barrier and the first launch, is most of a call's host
// time (docs/performance.md, "Host time per call"). This lane does the same for an uncached
// dispatch that took the one-call path (intranode_dispatch_begin) with the same signature before
// (every tensor's class, device, shape, dtype and contiguity, the two ints and the config), and
// for a combine without bias with the same signature as one before (x's and the weights', the
// handle's rows and tokens, the config), copying x and the weights into the receive arena first
// when they lie outside it, as KernelsBackend._copy_in does (unless the copy engine sends the
// rows back: IntranodeContext.by_copy_engine). It reads each tensor once, for the signature and
// the launch, launches, and returns what Buffer.dispatch or Buffer.combine returns. Anything
// else it leaves to the Python lane by returning None before any effect: a new signature,
// another stream or device, a backend that is not usable, a buffer to grow or rebuild, no
// launch-ahead bound yet, a capture, a block that does not fit. A launch-ahead call whose counts
// are not good (a bad input, a rank over the bound) returns its reservation and readback for the
// backend to judge (`KernelsBackend.ahead_rest`).
#ifdef UCCL_EP_WITH_GPU
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "bindings/bindings.h"
#include "bindings/intranode_calls.h"
#include "common/gpu.h"

namespace uccl_ep::bindings::intranode {
namespace {

using views::interned;

// Attribute names the lane reads or writes, interned once.
struct Names {
  PyObject* const shape = interned("shape");
  PyObject* const dtype = interned("dtype");
  PyObject* const get_device = interned("get_device");
  PyObject* const is_contiguous = interned("is_contiguous");
  PyObject* const view = interned("view");
  PyObject* const aux = interned("aux");
  PyObject* const tensors = interned("tensors");
  // Buffer
  PyObject* const num_sms = interned("num_sms");
  PyObject* const default_configs = interned("_default_configs");
  PyObject* const last_raw = interned("_last_raw");
  PyObject* const backend = interned("_backend");
  PyObject* const calls = interned("_calls");
  PyObject* const direct_calls = interned("_direct_calls");
  // KernelsBackend
  PyObject* const destroyed = interned("_destroyed");
  PyObject* const exited = interned("_exited");
  PyObject* const aborted = interned("_aborted");
  PyObject* const ahead_rows = interned("_ahead_rows");
  PyObject* const note_most = interned("_note_most");
  PyObject* const recv_arena = interned("recv_arena");
  PyObject* const core = interned("core");
  PyObject* const ctx = interned("_ctx");
  PyObject* const ctx_grows = interned("_ctx_grows");
  PyObject* const ipc = interned("_ipc");
  PyObject* const grows = interned("grows");
  PyObject* const last_call = interned("_last_call");
  PyObject* const caller_stream = interned("caller_stream");
  PyObject* const one_call_dispatches = interned("one_call_dispatches");
  PyObject* const ahead_calls = interned("ahead_calls");
  PyObject* const ahead_finishes = interned("ahead_finishes");
  PyObject* const check_usable = interned("_check_usable");
  PyObject* const give_up = interned("_give_up");
  PyObject* const combine_copy_in = interned("_combine_copy_in");
  PyObject* const combine_in_place_calls = interned("combine_in_place_calls");
  PyObject* const combine_copied_in_calls = interned("combine_copied_in_calls");
  PyObject* const combine_copy_engine_calls = interned("combine_copy_engine_calls");
  PyObject* const rows = interned("rows");
  PyObject* const send_pos = interned("send_pos");
  PyObject* const device = interned("device");
  PyObject* const prefix_host = interned("prefix_host");
};

const Names& names() {
  static const Names n;
  return n;
}

void set(py::handle o, PyObject* name, py::handle v) {
  if (PyObject_SetAttr(o.ptr(), name, v.ptr()) < 0) throw py::error_already_set();
}

py::object call0(py::handle o, PyObject* name) {
  PyObject* v = PyObject_CallMethodNoArgs(o.ptr(), name);
  if (!v) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(v);
}

int64_t as_int(py::handle v) {
  const long long n = PyLong_AsLongLong(v.ptr());
  if (n == -1 && PyErr_Occurred()) throw py::error_already_set();
  return n;
}

// Adds one to the int attribute `name` of `o`; returns the new value.
int64_t bump(py::handle o, PyObject* name) {
  const int64_t n = as_int(field(o, name)) + 1;
  set(o, name, py::int_(n));
  return n;
}

// The monotonic clock in ns (time.perf_counter_ns's on Linux).
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One argument as the signature sees it: None, or a tensor's class, device, view (address,
// sizes, dtype) and contiguity.
struct Arg {
  PyTypeObject* type = nullptr;  // nullptr: None
  TensorView view;
  int64_t device = -1;
  bool contiguous = true;

  bool same(const Arg& o) const {
    if (type != o.type) return false;
    if (type == nullptr) return true;
    if (device != o.device || view.dim != o.view.dim || view.dtype != o.view.dtype || contiguous != o.contiguous)
      return false;
    for (int i = 0; i < view.dim; ++i)
      if (view.size[i] != o.view.size[i]) return false;
    return true;
  }
};

// The order of a dispatch's arguments in a signature.
enum { kX, kScales, kPerRank, kPerRdma, kInRank, kPerExpert, kIdx, kWeights, kArgs };

struct Entry {
  Arg args[kArgs];
  PyTypeObject* pair = nullptr;  // x came as this tuple or list (x, x_scales); nullptr: a tensor
  int64_t alignment = 1, worst = 0;
  py::object config, launch, bound_rows, last_call, x_dtype;
  const DispatchLaunch* l = nullptr;  // launch's
};

// A combine's signature: x and its weights, the handle's rows and tokens, the config; no bias.
struct CombineEntry {
  Arg x, weights;
  int64_t rows = 0, tokens = 0;
  py::object config, launch, last_call, x_dtype, w_dtype, device;
  const CombineLaunch* l = nullptr;  // launch's
};

// A cached dispatch's signature: x (and its scales), expert_alignment, the config and the
// handle's num_worst_tokens (the call's own num_worst_tokens is 0).
struct CachedEntry {
  Arg x, scales;
  PyTypeObject* pair = nullptr;
  int64_t alignment = 1, worst = 0;
  py::object config, launch, bound_rows, last_call, x_dtype;
  const DispatchLaunch* l = nullptr;  // launch's
};

// DispatchHandle's fields, by position (backends/base.py).
enum {
  kHandlePrefix = 0,
  kHandleInRank = 1,
  kHandlePerRank = 2,
  kHandleNumRecv = 4,
  kHandleWorst = 5,
  kHandleState = 7,
  kHandleOwner = 8,
  kHandleFields = 12
};

class Lane {
 public:
  Lane(int device, int rank, int64_t uid, py::object tensor_type, py::object handle_type, py::object state_type,
       py::object event_type, py::object error_type, py::object note_wait, py::object current_stream,
       py::object empty)
      : device_(device),
        rank_(rank),
        uid_(uid),
        tensor_type_(std::move(tensor_type)),
        handle_type_(std::move(handle_type)),
        state_type_(std::move(state_type)),
        event_type_(std::move(event_type)),
        error_type_(std::move(error_type)),
        note_wait_(std::move(note_wait)),
        current_stream_(std::move(current_stream)),
        empty_(std::move(empty)) {}

  // Remember the signature of a dispatch that took the one-call path with these arguments, run
  // with `config` (a checked Config), `launch` (its DispatchLaunch) and `last_call` (the backend's
  // description of it). Returns whether it was kept (any argument that the lane does not take,
  // such as a non-contiguous tensor, keeps it out).
  bool learn(py::handle x, py::handle per_rank, py::handle per_rdma, py::handle in_rank, py::handle per_expert,
             py::handle idx, py::handle weights, int64_t alignment, int64_t worst, py::object config,
             py::object launch, py::object last_call) {
    auto made = std::make_shared<Entry>();
    Entry& e = *made;
    if (!read_all(x, per_rank, per_rdma, in_rank, per_expert, idx, weights, e.args, &e.pair)) return false;
    for (int i = 0; i < kArgs; ++i)
      if (!e.args[i].contiguous) return false;
    const Arg& counts = e.args[kPerRank];
    const Arg& experts = e.args[kPerExpert];
    if (counts.type == nullptr || counts.view.dtype->dt != views::Dt::kInt32 ||
        (experts.type != nullptr && experts.view.dtype->dt != views::Dt::kInt32))
      return false;
    e.alignment = alignment;
    e.worst = worst;
    e.config = std::move(config);
    e.l = &launch.cast<const DispatchLaunch&>();
    UCCL_EP_CHECK_ARG(!e.l->cached && e.l->num_worst_tokens == worst && e.l->expert_alignment == alignment,
                      "IntranodeLane.learn: the launch is not this uncached call's");
    e.launch = std::move(launch);
    if (worst > 0) e.bound_rows = py::cast(DispatchRows::of_bound(worst));
    e.last_call = std::move(last_call);
    py::handle x_data = e.pair ? py::handle(PySequence_Fast_GET_ITEM(x.ptr(), 0)) : x;
    e.x_dtype = field(x_data, names().dtype);
    return keep(&entries_, std::move(made), [&](const Entry& old) {
      return old.config.ptr() == e.config.ptr() && matches(old, e.args, e.pair, alignment, worst);
    });
  }

  // Buffer.dispatch(x, handle, ..., config=config) of `buffer` without a previous event or
  // async_finish, its other arguments in `given`: its return value, None (the Python lane), or the
  // tuple (reservation, (state, words), bound rows, seq) of a launch-ahead call to judge.
  py::object dispatch(py::handle buffer, py::handle x, py::handle handle, py::handle given, py::handle config) {
    // given: api/validation.py's DispatchInputs.
    if (!PyTuple_Check(given.ptr()) || PyTuple_GET_SIZE(given.ptr()) != 8) return py::none();
    auto in = [&given](int i) { return py::handle(PyTuple_GET_ITEM(given.ptr(), i)); };
    const py::handle per_rank = in(0), per_rdma = in(1), in_rank = in(2), per_expert = in(3), idx = in(4),
                     weights = in(5), alignment = in(6), worst = in(7);
    bool launched = false;
    try {
      if (!handle.is_none()) {
        if (!per_rank.is_none() || !per_rdma.is_none() || !in_rank.is_none() || !per_expert.is_none() ||
            !idx.is_none() || !weights.is_none())
          return py::none();  // the checks of the general path raise
        return run_cached(buffer, x, handle, alignment, worst, config, &launched);
      }
      return run(buffer, x, per_rank, per_rdma, in_rank, per_expert, idx, weights, alignment, worst, config,
                 &launched);
    } catch (py::error_already_set& e) {
      // As KernelsBackend.dispatch: a rank that leaves a launched call for any reason but an
      // error every rank raises alike tells its peers at once (their kernels would wait for it).
      if (launched && !e.matches(error_type_))
        field(field(buffer, names().backend), names().give_up)("dispatch", e.value());
      throw;
    }
  }

  // Remember the signature of a cached dispatch of `x` (a tensor or the pair (x, scales)) that
  // took the one-call path, its call's num_worst_tokens 0 (`worst`: its handle's). Returns
  // whether it was kept.
  bool learn_cached(py::handle x, int64_t alignment, int64_t worst, py::object config, py::object launch,
                    py::object last_call) {
    auto made = std::make_shared<CachedEntry>();
    CachedEntry& e = *made;
    Arg a[kArgs];
    const py::handle none = py::none();
    if (!read_all(x, none, none, none, none, none, none, a, &e.pair)) return false;
    e.x = a[kX];
    e.scales = a[kScales];
    if (!e.x.contiguous || !e.scales.contiguous) return false;
    e.alignment = alignment;
    e.worst = worst;
    e.config = std::move(config);
    e.l = &launch.cast<const DispatchLaunch&>();
    UCCL_EP_CHECK_ARG(e.l->cached && e.l->num_worst_tokens == worst && e.l->expert_alignment == alignment,
                      "IntranodeLane.learn_cached: the launch is not this cached call's");
    e.launch = std::move(launch);
    if (worst > 0) e.bound_rows = py::cast(DispatchRows::of_bound(worst));
    e.last_call = std::move(last_call);
    py::handle x_data = e.pair ? py::handle(PySequence_Fast_GET_ITEM(x.ptr(), 0)) : x;
    e.x_dtype = field(x_data, names().dtype);
    return keep(&cached_entries_, std::move(made), [&](const CachedEntry& old) {
      return same_cached(old, e.x, e.scales, e.pair, alignment, worst, e.config.ptr());
    });
  }

  // Remember the signature of a combine that launched with these arguments and no bias (`rows`,
  // `tokens`: its handle's rows and tokens; `config`, `launch`, `last_call` as for learn), x and
  // the weights as the caller passed them. Returns whether it was kept.
  bool learn_combine(py::handle x, py::handle weights, int64_t rows, int64_t tokens, py::object config,
                     py::object launch, py::object last_call) {
    auto made = std::make_shared<CombineEntry>();
    CombineEntry& e = *made;
    if (!read_arg(x.ptr(), &e.x) || e.x.type == nullptr || !read_arg(weights.ptr(), &e.weights)) return false;
    if (!e.x.contiguous || !e.weights.contiguous) return false;
    if (e.weights.type != nullptr && e.weights.view.dtype->dt != views::Dt::kFloat32) return false;
    e.rows = rows;
    e.tokens = tokens;
    e.config = std::move(config);
    e.l = &launch.cast<const CombineLaunch&>();
    e.launch = std::move(launch);
    e.last_call = std::move(last_call);
    e.x_dtype = field(x, names().dtype);
    e.w_dtype = e.weights.type == nullptr ? py::none() : field(weights, names().dtype);
    e.device = field(x, names().device);
    return keep(&combine_entries_, std::move(made), [&](const CombineEntry& old) {
      return same_combine(old, e.x, e.weights, rows, tokens, e.config.ptr());
    });
  }

  // Buffer.combine(x, handle, topk_weights, bias, config) of `buffer` without a previous event
  // or async_finish: (combined_x, combined_topk_weights, event), or None (the Python lane).
  py::object combine(py::handle buffer, py::handle x, py::handle handle, py::handle weights, py::handle bias,
                     py::handle config) {
    bool launched = false;
    try {
      return run_combine(buffer, x, handle, weights, bias, config, &launched);
    } catch (py::error_already_set& e) {
      if (launched && !e.matches(error_type_))
        field(field(buffer, names().backend), names().give_up)("combine", e.value());
      throw;
    }
  }

  void clear() {
    entries_.clear();
    cached_entries_.clear();
    combine_entries_.clear();
  }
  size_t size() const { return entries_.size() + cached_entries_.size() + combine_entries_.size(); }
  int64_t calls() const { return calls_; }
  int64_t launched_ns() const { return launched_ns_; }

 private:
  py::object run(py::handle buffer, py::handle x, py::handle per_rank, py::handle per_rdma, py::handle in_rank,
                 py::handle per_expert, py::handle idx, py::handle weights, py::handle alignment, py::handle worst,
                 py::handle config, bool* launched) {
    const Names& n = names();
    if (entries_.empty() || !PyLong_CheckExact(alignment.ptr()) || !PyLong_CheckExact(worst.ptr()))
      return py::none();
    const long long align_v = PyLong_AsLongLong(alignment.ptr());
    const long long worst_v = PyLong_AsLongLong(worst.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return py::none();
    }
    Arg a[kArgs];
    PyTypeObject* pair = nullptr;
    if (!read_all(x, per_rank, per_rdma, in_rank, per_expert, idx, weights, a, &pair)) return py::none();
    py::object defaults;
    PyObject* cfg = config_of(buffer, config, "dispatch", &defaults);
    if (cfg == nullptr) return py::none();
    // Held for the call: a learn while the GIL is released (the wait for the counts) may
    // replace the entry.
    std::shared_ptr<const Entry> e;
    for (const auto& cand : entries_)
      if (cand->config.ptr() == cfg && matches(*cand, a, pair, align_v, worst_v)) e = cand;
    if (!e) return py::none();
    Ready go;
    if (!ready(buffer, &go)) return py::none();
    const py::object& backend = go.backend;
    const Context& c = *go.c;
    py::object rows_obj;
    if (worst_v > 0) {
      rows_obj = e->bound_rows;
    } else {
      const int64_t ahead = as_int(field(backend, n.ahead_rows));
      if (ahead <= 0) return py::none();  // no bound yet: an exact call, counts first
      if (ahead != bound_) {
        bound_rows_ = py::cast(DispatchRows::of_bound(ahead));
        bound_ = ahead;
      }
      rows_obj = bound_rows_;
    }
    const DispatchRows& r = rows_obj.cast<const DispatchRows&>();
    py::object core = field(field(backend, n.recv_arena), n.core);
    if (core.is_none()) return py::none();
    set(backend, n.last_call, e->last_call);
    DispatchViews v;
    v.x = a[kX].view;
    v.scales = a[kScales].view;
    v.idx = a[kIdx].view;
    v.weights = a[kWeights].view;
    v.in_rank = a[kInRank].view;
    expect_inputs(c, &v);
    NotifyViews nv;
    nv.per_rank = a[kPerRank].view;
    nv.per_expert = a[kPerExpert].view;
    expect_counts(c, *e->l, &nv);
    const intptr_t stream = go.stream;
    py::object reservation = begin_checked(c, *e->l, r, stream, stream, core, v, nv, TensorView{});
    if (reservation.is_none()) return py::none();  // the Python lane's step-by-step path
    *launched = true;
    launched_ns_ = now_ns();
    // Launched: what the Python lane records of a call.
    const int64_t seq = bump(buffer, n.calls);
    bump(buffer, n.direct_calls);
    set(backend, n.caller_stream, go.raw);
    bump(backend, n.one_call_dispatches);
    ++calls_;
    if (worst_v > 0) {
      py::tuple aux = py::reinterpret_borrow<py::tuple>(reservation.attr(n.aux)(rank_));
      py::tuple outputs = py::reinterpret_borrow<py::tuple>(call0(reservation, n.tensors));
      return result(*e, per_rank, in_rank, outputs, aux, py::list(), py::none(), rows_obj, r.num_recv, seq);
    }
    AheadEnd end = ahead_end(c, *e->l, reservation, r.num_recv);
    if (!end.good)
      return py::make_tuple(reservation, py::make_tuple(end.state, py::cast(end.words)), rows_obj, seq);
    note_wait_();
    if (!usable(backend)) call0(backend, n.check_usable);  // raises why (a peer exited meanwhile)
    field(backend, n.note_most)(end.most);  // the next call's launch-ahead bound
    bump(backend, n.ahead_calls);
    bump(backend, n.ahead_finishes);
    const int R = c.num_ranks;
    py::list per_expert_counts;
    for (int i = R * R; i < R * R + e->l->experts_per_rank; ++i) per_expert_counts.append(end.words[i]);
    return result(*e, per_rank, in_rank, py::reinterpret_borrow<py::tuple>(end.made[0]),
                  py::reinterpret_borrow<py::tuple>(end.made[1]), per_expert_counts, py::tuple(py::cast(end.prefix)),
                  py::cast(end.rows), end.rows.num_recv, seq);
  }

  // Adds `made` to `entries`, in place of the entry `same` finds; at 64 entries the old ones go
  // first (signatures a caller used and dropped). Returns true (kept).
  template <typename E, typename Same>
  static bool keep(std::vector<std::shared_ptr<const E>>* entries, std::shared_ptr<E> made, Same same) {
    for (auto& old : *entries) {
      if (same(*old)) {
        old = std::move(made);
        return true;
      }
    }
    if (entries->size() >= 64) entries->clear();
    entries->push_back(std::move(made));
    return true;
  }

  // The Config a call runs with: `config`, or for None the Buffer's default of (op,
  // Buffer.num_sms) made earlier (Buffer._direct_config); nullptr when there is none yet (the
  // Python lane makes it). `keep` holds the dict the pointer lies in.
  static PyObject* config_of(py::handle buffer, py::handle config, const char* op, py::object* keep) {
    if (!config.is_none()) return config.ptr();
    const Names& n = names();
    py::object key = py::make_tuple(op, field(buffer, n.num_sms));
    *keep = field(buffer, n.default_configs);
    PyObject* cfg = PyDict_GetItemWithError(keep->ptr(), key.ptr());
    if (cfg == nullptr && PyErr_Occurred()) throw py::error_already_set();
    return cfg;
  }

  // What a call whose signature matched needs before it is served here: the current device is
  // the Buffer's, the caller's stream is its previous call's (else the Python lane orders the
  // call after that stream first), the backend is usable (else it raises why) and its context
  // current (else the buffers grew and it rebuilds the context).
  struct Ready {
    py::object raw, backend, ctx;
    intptr_t stream = 0;
    const Context* c = nullptr;
  };
  bool ready(py::handle buffer, Ready* go) const {
    const Names& n = names();
    int dev = -1;
    if (gpuGetDevice(&dev) != gpuSuccess) {
      (void)gpuGetLastError();
      return false;
    }
    if (dev != device_) return false;
    go->raw = current_stream_(device_);
    const int same_stream = PyObject_RichCompareBool(go->raw.ptr(), field(buffer, n.last_raw).ptr(), Py_EQ);
    if (same_stream < 0) throw py::error_already_set();
    if (!same_stream) return false;
    go->backend = field(buffer, n.backend);
    if (!usable(go->backend)) return false;
    go->ctx = field(go->backend, n.ctx);
    if (go->ctx.is_none()) return false;
    const int same_grows = PyObject_RichCompareBool(field(go->backend, n.ctx_grows).ptr(),
                                                    field(field(go->backend, n.ipc), n.grows).ptr(), Py_EQ);
    if (same_grows < 0) throw py::error_already_set();
    if (!same_grows) return false;
    go->c = &go->ctx.cast<const Context&>();
    go->stream = static_cast<intptr_t>(as_int(go->raw));
    return true;
  }

  static bool same_cached(const CachedEntry& e, const Arg& x, const Arg& scales, PyTypeObject* pair,
                          int64_t alignment, int64_t worst, PyObject* config) {
    return e.config.ptr() == config && e.pair == pair && e.alignment == alignment && e.worst == worst &&
           e.x.same(x) && e.scales.same(scales);
  }

  py::object run_cached(py::handle buffer, py::handle x, py::handle handle, py::handle alignment,
                        py::handle worst_arg, py::handle config, bool* launched) {
    const Names& n = names();
    PyObject* h = handle.ptr();
    if (cached_entries_.empty() || reinterpret_cast<PyObject*>(Py_TYPE(h)) != handle_type_.ptr() ||
        PyTuple_GET_SIZE(h) != kHandleFields || !PyLong_CheckExact(alignment.ptr()) ||
        !PyLong_CheckExact(worst_arg.ptr()))
      return py::none();
    const long long align_v = PyLong_AsLongLong(alignment.ptr());
    const long long worst_v = PyLong_AsLongLong(worst_arg.ptr());
    if (PyErr_Occurred()) {
      PyErr_Clear();
      return py::none();
    }
    if (worst_v != 0 || as_int(PyTuple_GET_ITEM(h, kHandleOwner)) != uid_) return py::none();
    const int64_t worst = as_int(PyTuple_GET_ITEM(h, kHandleWorst));
    Arg a[kArgs];
    PyTypeObject* pair = nullptr;
    const py::handle none = py::none();
    if (!read_all(x, none, none, none, none, none, none, a, &pair)) return py::none();
    py::object defaults;
    PyObject* cfg = config_of(buffer, config, "dispatch", &defaults);
    if (cfg == nullptr) return py::none();
    std::shared_ptr<const CachedEntry> e;
    for (const auto& cand : cached_entries_)
      if (same_cached(*cand, a[kX], a[kScales], pair, align_v, worst, cfg)) e = cand;
    if (!e) return py::none();
    Ready go;
    if (!ready(buffer, &go)) return py::none();
    const py::object& backend = go.backend;
    const Context& c = *go.c;
    py::object core = field(field(backend, n.recv_arena), n.core);
    if (core.is_none()) return py::none();
    // The handle's layout: its sender-side tensors and, for an exact handle, its host matrix.
    DispatchViews v;
    v.x = a[kX].view;
    v.scales = a[kScales].view;
    v.in_rank = views::view_of(PyTuple_GET_ITEM(h, kHandleInRank), "intranode_dispatch: is_token_in_rank");
    if (v.in_rank.none || v.in_rank.size[0] != v.x.size[0]) return py::none();  // the checks raise
    py::object state = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(h, kHandleState));
    py::object rows_obj;
    DispatchRows exact;
    if (worst > 0) {
      rows_obj = e->bound_rows;
    } else {
      py::object prefix_host = field(state, n.prefix_host);
      if (prefix_host.is_none()) return py::none();
      exact = exact_rows(prefix_host.cast<std::vector<int64_t>>(), c.rank, c.num_ranks);
      if (exact.num_recv <= 0) return py::none();  // nothing received: the step-by-step path
    }
    const DispatchRows& r = worst > 0 ? rows_obj.cast<const DispatchRows&>() : exact;
    set(backend, n.last_call, e->last_call);
    expect_inputs(c, &v);
    NotifyViews nv;
    nv.per_rank = views::view_of(PyTuple_GET_ITEM(h, kHandlePerRank), "intranode_notify: num_tokens_per_rank");
    expect_counts(c, *e->l, &nv);
    const TensorView send_pos = views::view_of(field(state, n.send_pos), "intranode_dispatch: send_pos");
    views::expect(send_pos, "intranode_dispatch: send_pos", {v.x.size[0], c.num_ranks}, {views::Dt::kInt32});
    const intptr_t stream = go.stream;
    py::object reservation = begin_checked(c, *e->l, r, stream, stream, core, v, nv, send_pos);
    if (reservation.is_none()) return py::none();
    *launched = true;
    launched_ns_ = now_ns();
    bump(buffer, n.calls);
    bump(buffer, n.direct_calls);
    set(backend, n.caller_stream, go.raw);
    bump(backend, n.one_call_dispatches);
    ++calls_;
    py::tuple outputs = py::reinterpret_borrow<py::tuple>(call0(reservation, n.tensors));
    py::object recv_x = outputs[0];
    if (field(recv_x, n.dtype).ptr() != e->x_dtype.ptr()) recv_x = recv_x.attr(n.view)(e->x_dtype);
    py::object x_out = e->pair ? py::object(py::make_tuple(recv_x, outputs[1])) : recv_x;
    return py::make_tuple(x_out, py::none(), py::none(), py::none(), py::none(), event_type_());
  }

  static bool same_combine(const CombineEntry& e, const Arg& x, const Arg& w, int64_t rows, int64_t tokens,
                           PyObject* config) {
    return e.config.ptr() == config && e.rows == rows && e.tokens == tokens && e.x.same(x) && e.weights.same(w);
  }

  py::object run_combine(py::handle buffer, py::handle x, py::handle handle, py::handle weights, py::handle bias,
                         py::handle config, bool* launched) {
    const Names& n = names();
    PyObject* h = handle.ptr();
    if (combine_entries_.empty() || !bias.is_none() || reinterpret_cast<PyObject*>(Py_TYPE(h)) != handle_type_.ptr() ||
        PyTuple_GET_SIZE(h) != kHandleFields)
      return py::none();
    if (as_int(PyTuple_GET_ITEM(h, kHandleOwner)) != uid_) return py::none();
    const int64_t worst = as_int(PyTuple_GET_ITEM(h, kHandleWorst));
    const int64_t rows = worst > 0 ? worst : as_int(PyTuple_GET_ITEM(h, kHandleNumRecv));
    py::object in_rank_shape = field(PyTuple_GET_ITEM(h, kHandleInRank), n.shape);
    if (!PyTuple_Check(in_rank_shape.ptr()) || PyTuple_GET_SIZE(in_rank_shape.ptr()) < 1) return py::none();
    const int64_t tokens = as_int(PyTuple_GET_ITEM(in_rank_shape.ptr(), 0));
    Arg ax, aw;
    if (!read_arg(x.ptr(), &ax) || ax.type == nullptr || !read_arg(weights.ptr(), &aw)) return py::none();
    py::object defaults;
    PyObject* cfg = config_of(buffer, config, "combine", &defaults);
    if (cfg == nullptr) return py::none();
    std::shared_ptr<const CombineEntry> e;
    for (const auto& cand : combine_entries_)
      if (same_combine(*cand, ax, aw, rows, tokens, cfg)) e = cand;
    if (!e) return py::none();
    Ready go;
    if (!ready(buffer, &go)) return py::none();
    const py::object& backend = go.backend;
    const Context& c = *go.c;
    const intptr_t stream = go.stream;
    if (k::stream_capturing(stream)) return py::none();  // the Python lane records the capture
    const TensorView& xv = ax.view;
    const int64_t row_bytes = xv.size[1] * xv.dtype->itemsize;
    py::object state = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(h, kHandleState));
    py::object rows_obj = field(state, n.rows);
    const DispatchRows& r = rows_obj.cast<const DispatchRows&>();
    const int64_t K = aw.type == nullptr ? 0 : aw.view.size[1];
    if (k::combine_staging_bytes(r.combine_rows, row_bytes, static_cast<int>(K)) > c.buffer_bytes)
      return py::none();  // the Python lane grows the buffers
    if (reinterpret_cast<const volatile int64_t*>(c.status)[0] != 0) return py::none();  // it raises why
    CombineViews v;
    v.x = xv;
    v.weights = aw.view;
    // As KernelsBackend._copy_in: x (or the weights) made outside the arena is copied into an
    // arena block on the call's stream, and the peers read it there (unless the copy engine
    // sends the rows back: it reads them anywhere). The block goes back when `block` dies,
    // after the launch (its reuse waits for the combine on this stream).
    py::object block;
    if (!c.by_copy_engine(r) && PyObject_IsTrue(field(backend, n.combine_copy_in).ptr()) && !c.arenas.empty() &&
        xv.size[0] > 0 && row_bytes % 16 == 0) {
      const intptr_t lo = c.arenas[c.rank], hi = lo + c.arena_sizes[c.rank];
      auto held = [lo, hi](const TensorView& t) { return t.ptr >= lo && t.ptr < hi; };
      const bool copy_x = !held(xv), copy_w = K > 0 && aw.view.numel() > 0 && !held(aw.view);
      if (copy_x || copy_w) {
        block = copy_in(backend, stream, copy_x ? &v.x : nullptr, copy_w ? &v.weights : nullptr);
        if (block.is_none()) return py::none();  // no room: the Python lane pushes
        bump(backend, n.combine_copied_in_calls);
      }
    }
    set(backend, n.last_call, e->last_call);
    py::object out = empty_(tokens, xv.size[1], py::arg("dtype") = e->x_dtype, py::arg("device") = e->device);
    py::object out_w = K == 0 ? py::none()
                              : empty_(tokens, K, py::arg("dtype") = e->w_dtype, py::arg("device") = e->device);
    v.out = views::view_of(out, "intranode_combine: out");
    v.out_w = views::view_of(out_w, "intranode_combine: out_weights");
    v.prefix = views::view_of(PyTuple_GET_ITEM(h, kHandlePrefix), "intranode_combine: rank_prefix_matrix");
    v.send_pos = views::view_of(field(state, n.send_pos), "intranode_combine: send_pos");
    expect_combine(c, r, &v);
    const int done = combine_checked(c, *e->l, r, stream, v);
    *launched = true;
    launched_ns_ = now_ns();
    bump(buffer, n.calls);
    bump(buffer, n.direct_calls);
    set(backend, n.caller_stream, go.raw);
    if (done & kCombinedInPlace) bump(backend, n.combine_in_place_calls);
    if (done & kCombinedByCopyEngine) bump(backend, n.combine_copy_engine_calls);
    ++calls_;
    return py::make_tuple(out, out_w, event_type_());
  }

  // Takes one block of the receive arena for a combine's x and/or weights (null: not copied), copies
  // them into it on `stream` and points their views there. Returns the block's reservation, or
  // None (nothing copied) when the arena is closed, x's dtype is not a combine dtype or the block
  // does not fit.
  static py::object copy_in(py::handle backend, intptr_t stream, TensorView* x, TensorView* w) {
    const Names& n = names();
    py::object core = field(field(backend, n.recv_arena), n.core);
    if (core.is_none()) return py::none();
    // The block as the receive arena lays out a dispatch's outputs: x's rows (or the weights as
    // rows of K floats, when x needs no copy), then the weights in the top-k weights' place.
    const TensorView& rows_of = x != nullptr ? *x : *w;
    int code = 2, bits = 32;  // float32
    switch (rows_of.dtype->dt) {
      case views::Dt::kBFloat16: code = 4, bits = 16; break;
      case views::Dt::kFloat16: bits = 16; break;
      case views::Dt::kFloat32: break;
      default: return py::none();
    }
    const int64_t num_topk = x != nullptr && w != nullptr ? w->size[1] : 0;
    ReservedOutputs at;
    py::object block = reserve_outputs(core, rows_of.size[0], rows_of.size[1], code, bits, 0, num_topk, 64, false,
                                       ReserveAux{}, stream, stream, &at);
    if (block.is_none()) return block;
    if (x != nullptr) {
      k::copy_on_stream(at.x, x->ptr, x->bytes(), stream);
      x->ptr = at.x;
    }
    if (w != nullptr) {
      const intptr_t to = x != nullptr ? at.w : at.x;
      k::copy_on_stream(to, w->ptr, w->bytes(), stream);
      w->ptr = to;
    }
    return block;
  }

  // Each argument's Arg; false for an argument the lane does not take (not None nor a tensor,
  // a tensor of 0 or more than 3 dimensions, x neither a tensor nor a pair).
  bool read_all(py::handle x, py::handle per_rank, py::handle per_rdma, py::handle in_rank, py::handle per_expert,
                py::handle idx, py::handle weights, Arg* a, PyTypeObject** pair) const {
    PyObject* x_data = x.ptr();
    PyObject* x_scales = Py_None;
    if (PyTuple_CheckExact(x.ptr()) || PyList_CheckExact(x.ptr())) {
      if (PySequence_Fast_GET_SIZE(x.ptr()) != 2) return false;
      *pair = Py_TYPE(x.ptr());
      x_data = PySequence_Fast_GET_ITEM(x.ptr(), 0);
      x_scales = PySequence_Fast_GET_ITEM(x.ptr(), 1);
      if (x_scales == Py_None) return false;
    }
    if (x_data == Py_None) return false;
    PyObject* objs[kArgs] = {x_data,        x_scales, per_rank.ptr(), per_rdma.ptr(), in_rank.ptr(),
                             per_expert.ptr(), idx.ptr(), weights.ptr()};
    for (int i = 0; i < kArgs; ++i)
      if (!read_arg(objs[i], &a[i])) return false;
    return true;
  }

  bool read_arg(PyObject* t, Arg* a) const {
    *a = Arg{};
    if (t == Py_None) return true;
    const int is_tensor = PyObject_IsInstance(t, tensor_type_.ptr());
    if (is_tensor < 0) throw py::error_already_set();
    if (!is_tensor) return false;
    const Names& n = names();
    py::object shape = field(t, n.shape);
    if (!PyTuple_Check(shape.ptr())) return false;
    const Py_ssize_t dims = PyTuple_GET_SIZE(shape.ptr());
    if (dims < 1 || dims > views::kMaxViewDims) return false;
    a->type = Py_TYPE(t);
    a->view = views::view_of(t, "IntranodeLane");
    a->device = as_int(call0(t, n.get_device));
    a->contiguous = PyObject_IsTrue(call0(t, n.is_contiguous).ptr()) == 1;
    return true;
  }

  static bool matches(const Entry& e, const Arg* a, PyTypeObject* pair, int64_t alignment, int64_t worst) {
    if (e.pair != pair || e.alignment != alignment || e.worst != worst) return false;
    for (int i = 0; i < kArgs; ++i)
      if (!e.args[i].same(a[i])) return false;
    return true;
  }

  // KernelsBackend._check_usable would pass: not destroyed, no peer exited, no call aborted.
  static bool usable(py::handle backend) {
    const Names& n = names();
    return !PyObject_IsTrue(field(backend, n.destroyed).ptr()) && !PyObject_IsTrue(field(backend, n.exited).ptr()) &&
           field(backend, n.aborted).is_none();
  }

  // What Buffer.dispatch returns (Buffer._dispatch_returns of KernelsBackend._dispatch_result).
  py::object result(const Entry& e, py::handle per_rank, py::handle in_rank, py::tuple outputs,
                    py::tuple aux, py::object expert_counts, py::object prefix_host, py::object rows, int64_t num_recv,
                    int64_t seq) const {
    const Names& n = names();
    py::object recv_x = outputs[0];
    if (field(recv_x, n.dtype).ptr() != e.x_dtype.ptr())  // FP8 rows come as uint8
      recv_x = recv_x.attr(n.view)(e.x_dtype);
    py::object state = state_type_(prefix_host, aux[0], rows);
    const int64_t num_topk = e.args[kIdx].type == nullptr ? 0 : e.args[kIdx].view.size[1];
    py::object handle = handle_type_(aux[1], in_rank, per_rank, outputs[4], num_recv, e.worst, num_topk, state, uid_,
                                     seq, aux[2], aux[3]);
    py::object x_out = e.pair ? py::object(py::make_tuple(recv_x, outputs[1])) : recv_x;
    return py::make_tuple(x_out, outputs[2], outputs[3], expert_counts, handle, event_type_());
  }

  int device_, rank_;
  int64_t uid_;
  py::object tensor_type_, handle_type_, state_type_, event_type_, error_type_, note_wait_, current_stream_, empty_;
  std::vector<std::shared_ptr<const Entry>> entries_;
  std::vector<std::shared_ptr<const CachedEntry>> cached_entries_;
  std::vector<std::shared_ptr<const CombineEntry>> combine_entries_;
  int64_t bound_ = -1;
  py::object bound_rows_;
  int64_t calls_ = 0;
  int64_t launched_ns_ = 0;
};

}  // namespace
}  // namespace uccl_ep::bindings::intranode

namespace uccl_ep::bindings {

namespace py = pybind11;

void bind_intranode_lane(py::module_& m) {
  using intranode::Lane;
  py::class_<Lane>(m, "IntranodeLane",
                   "The direct lane of Buffer.dispatch in one binding call, for an uncached dispatch whose "
                   "signature took the one-call path before (bindings/intranode_lane.cc).")
      .def(py::init<int, int, int64_t, py::object, py::object, py::object, py::object, py::object, py::object,
                    py::object, py::object>(),
           py::kw_only(), py::arg("device"), py::arg("rank"), py::arg("uid"), py::arg("tensor_type"),
           py::arg("handle_type"), py::arg("state_type"), py::arg("event_type"), py::arg("error_type"),
           py::arg("note_wait"), py::arg("current_stream"), py::arg("empty"))
      .def("learn", &Lane::learn, py::arg("x"), py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_rdma_rank"),
           py::arg("is_token_in_rank"), py::arg("num_tokens_per_expert"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("expert_alignment"), py::arg("num_worst_tokens"), py::arg("config"),
           py::arg("launch"), py::arg("last_call"),
           "Remember the signature of a dispatch that took the one-call path with these arguments; "
           "returns whether it was kept.")
      // Positional: Buffer.dispatch calls it on every synchronous uncached call.
      .def("learn_cached", &Lane::learn_cached, py::arg("x"), py::arg("expert_alignment"),
           py::arg("num_worst_tokens"), py::arg("config"), py::arg("launch"), py::arg("last_call"),
           "Remember the signature of a cached dispatch of x (its handle's num_worst_tokens) that took the "
           "one-call path; returns whether it was kept.")
      .def("dispatch", &Lane::dispatch,
           "dispatch(buffer, x, handle, given (a DispatchInputs), config): Buffer.dispatch's return value, None "
           "(take the Python lane), or (reservation, (state, words), bound rows, seq) of a launch-ahead call whose "
           "counts the backend must judge.")
      .def("learn_combine", &Lane::learn_combine, py::arg("x"), py::arg("topk_weights"), py::arg("rows"),
           py::arg("tokens"), py::arg("config"), py::arg("launch"), py::arg("last_call"),
           "Remember the signature of a combine without bias that launched with these arguments (x and the "
           "weights as the caller passed them); returns whether it was kept.")
      .def("combine", &Lane::combine,
           "combine(buffer, x, handle, topk_weights, bias, config): Buffer.combine's return value, or None "
           "(take the Python lane).")
      .def("clear", &Lane::clear, "Forget every signature.")
      .def_property_readonly("size", &Lane::size, "Signatures remembered.")
      .def_property_readonly("calls", &Lane::calls, "Calls this lane launched.")
      .def_property_readonly("launched_ns", &Lane::launched_ns,
                             "The monotonic clock (ns, as time.perf_counter_ns on Linux) when its last call's "
                             "kernels were launched (bench/profile_host.py's split).");
}

}  // namespace uccl_ep::bindings
#endif

// The receive arena's host side in C++ (`_C.RecvArenaCore`): the block allocator of zero-copy
// dispatch and the factory of its output tensors, so a dispatch's five outputs cost one call
// instead of ~15 Python-level torch operations (host time under MPS was the point).
//
// A block holds one dispatch's outputs (recv_x, FP8 scales, top-k ids, weights, source
// indices; each 256-byte aligned). Each output is a torch tensor made from a DLPack capsule
// (`torch._C._from_dlpack`: `_C` does not link libtorch, docs/architecture.md "Build") whose deleter
// drops one reference of the block; the last one hands the block back. Deleters run wherever
// torch frees the storage (any thread, without the GIL), so they only touch C++ state under a
// mutex and make CUDA calls.
//
// Stream order (GPU arenas): a block is handed out on the call's stream (the Buffer's
// communication stream, or the caller's for a synchronous call) for use on the caller's stream.
// When its last tensor dies, an event is recorded on both streams (and on the one note_stream
// named), and a later take of any of its bytes makes its stream wait for
// those events (dropping those already complete): the caching allocator's guarantee for memory
// a tensor used on its allocation stream and on a record_stream'd one. Work on a third stream
// must be ordered before the tensor dies. While either stream is being captured into a CUDA
// graph no event can be recorded: the block is then queued without events and the next take
// records one on its own stream.
//
// A host arena (`cuda=False`) is the same allocator over host memory, with CPU tensors and no
// events: the CPU tests use it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "bindings/bindings.h"
#include "common/errors.h"
#include "common/registry.h"
#ifdef UCCL_EP_WITH_GPU
#include "kernels/intranode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {
namespace {

// ---- DLPack (the stable "legacy" ABI every torch release reads, dlpack.h v0.8) -----------
struct DLDevice {
  int32_t device_type;  // kDLCPU = 1, kDLCUDA = 2, kDLROCM = 10
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

constexpr int32_t kDLCPU = 1;
#if defined(UCCL_EP_HIP)
constexpr int32_t kDLGpu = 10;  // kDLROCM
#else
constexpr int32_t kDLGpu = 2;  // kDLCUDA
#endif

constexpr int64_t kAlign = 256;
int64_t align_up(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

class Arena;

// An event from the arena's pool; back in the pool when no free range refers to it any more.
struct EventBox {
  std::shared_ptr<std::vector<intptr_t>> pool;
  std::shared_ptr<std::mutex> pool_mu;
  intptr_t event = 0;
  ~EventBox() {
    std::lock_guard<std::mutex> lock(*pool_mu);
    pool->push_back(event);
  }
};
using Event = std::shared_ptr<EventBox>;

struct Range {
  int64_t offset = 0, size = 0;
  std::vector<Event> events;  // what the next user of these bytes waits for
};

// One take: the tensors viewing it share it; the last deleter returns it.
struct Block {
  std::shared_ptr<Arena> arena;
  int64_t offset = 0, size = 0;
  intptr_t alloc_stream = 0, use_stream = 0;
  std::atomic<int> refs{0};
};

// One tensor's DLPack record.
struct Managed {
  DLManagedTensor t{};
  int64_t shape[2] = {0, 0};
  int64_t strides[2] = {0, 0};
  Block* block = nullptr;
};

// Byte offsets of a dispatch's outputs inside its block ("-1": absent), and the block size.
// `send_pos` and `info` (int32) are the handle's tensors of a dispatch launched in one call
// (intranode_dispatch_begin): [aux_tokens, aux_ranks] and [aux_info]; absent otherwise.
struct OutputLayout {
  int64_t x = 0, scales = -1, idx = -1, w = -1, src = -1, send_pos = -1, info = -1, end = 0;
};

OutputLayout output_layout(int64_t rows, int64_t row_bytes, int64_t num_scales, int64_t num_topk,
                           int64_t idx_bytes, bool src, const ReserveAux& aux = {}) {
  OutputLayout l;
  int64_t at = align_up(rows * row_bytes);
  if (num_scales > 0) {
    l.scales = at;
    at = align_up(at + rows * num_scales * 4);
  }
  if (num_topk > 0) {
    l.idx = at;
    at = align_up(at + rows * num_topk * idx_bytes);
    l.w = at;
    at = align_up(at + rows * num_topk * 4);
  }
  if (src) {
    l.src = at;
    at = align_up(at + rows * 4);
  }
  if (aux.info > 0) {
    l.send_pos = at;
    at = align_up(at + aux.tokens * aux.ranks * 4);
    l.info = at;
    at = align_up(at + aux.info * 4);
  }
  l.end = at;
  return l;
}

// A block taken for one dispatch whose tensors are made after the launches that fill it
// (`RecvArenaCore.reserve`): it holds one reference of the block until it dies.
struct Reservation {
  Block* block = nullptr;
  intptr_t at = 0;  // the block's device address
  OutputLayout lay;
  int64_t rows = 0, hidden = 0, num_scales = 0, num_topk = 0;
  ReserveAux aux;
  DLDataType x_dt{};
  int idx_bits = 64;
  bool made = false, aux_made = false;
  // The handle tensors made ahead (reservation_aux_ahead) for `aux_rank`, until taken.
  py::object aux_ahead;
  int64_t aux_rank = -1;
  Reservation() = default;
  Reservation(const Reservation&) = delete;
  Reservation& operator=(const Reservation&) = delete;
  ~Reservation();
  py::list entry() const {
    py::list e;
    e.append(1);
    for (int64_t o : {lay.x, lay.scales, lay.idx, lay.w, lay.src}) e.append(o < 0 ? int64_t{-1} : block_offset() + o);
    return e;
  }
  int64_t block_offset() const;
  py::tuple tensors(int64_t rows_made);
  py::tuple aux_tensors(int64_t rank);
  py::tuple make_aux(int64_t rank);
};

class Arena : public std::enable_shared_from_this<Arena> {
  friend struct Reservation;  // makes its tensors

 public:
  Arena(intptr_t base, int64_t capacity, int device, bool cuda)
      : base_(base), capacity_(capacity / kAlign * kAlign), device_(device), cuda_(cuda) {
    UCCL_EP_CHECK_ARG(capacity >= 0 && (base != 0 || capacity == 0) && base % kAlign == 0,
                      "RecvArenaCore: base=", base, " capacity=", capacity, " (base must be ", kAlign,
                      "-byte aligned, non-null when capacity > 0)");
#ifndef UCCL_EP_WITH_GPU
    UCCL_EP_CHECK_ARG(!cuda, "RecvArenaCore: cuda=True needs a GPU build of _C");
#endif
    if (capacity_ > 0) free_.push_back(Range{0, capacity_, {}});
  }

  ~Arena() {
#ifdef UCCL_EP_WITH_GPU
    free_.clear();
    pending_.clear();
    std::lock_guard<std::mutex> lock(*pool_mu_);
    for (intptr_t e : *pool_) {
      try {
        kernels::event_destroy(e);
      } catch (...) {  // teardown: nothing to report to
      }
    }
    pool_->clear();
#endif
  }

  // The outputs of one dispatch as a tuple (recv_x, scales, idx, w, src, entry), or None when
  // the block does not fit. x_code/x_bits: recv_x's DLPack dtype (FP8 comes as uint8).
  py::object outputs(int64_t rows, int64_t hidden, int x_code, int x_bits, int64_t num_scales, int64_t num_topk,
                     int idx_bits, bool with_src, intptr_t stream, intptr_t use_stream) {
    std::unique_ptr<Reservation> r =
        reserve(rows, hidden, x_code, x_bits, num_scales, num_topk, idx_bits, with_src, stream, use_stream);
    if (!r) return py::none();
    py::tuple t = r->tensors(-1);
    return py::make_tuple(t[0], t[1], t[2], t[3], t[4], r->entry());
  }

  // One dispatch's block, its tensors made later (Reservation::tensors), or null when it does
  // not fit.
  std::unique_ptr<Reservation> reserve(int64_t rows, int64_t hidden, int x_code, int x_bits, int64_t num_scales,
                                       int64_t num_topk, int idx_bits, bool with_src, intptr_t stream,
                                       intptr_t use_stream, const ReserveAux& aux = {}) {
    UCCL_EP_CHECK_ARG(rows > 0 && hidden > 0 && x_bits % 8 == 0 && x_bits > 0 && num_scales >= 0 &&
                          num_topk >= 0 && (idx_bits == 32 || idx_bits == 64) && aux.tokens >= 0 &&
                          aux.ranks >= 0 && aux.info >= 0,
                      "RecvArenaCore.outputs: rows=", rows, " hidden=", hidden, " x_bits=", x_bits,
                      " num_scales=", num_scales, " num_topk=", num_topk, " idx_bits=", idx_bits,
                      " aux tokens=", aux.tokens, " ranks=", aux.ranks, " info=", aux.info);
    const int64_t row_bytes = hidden * (x_bits / 8);
    const OutputLayout lay = output_layout(rows, row_bytes, num_scales, num_topk, idx_bits / 8, with_src, aux);
    const std::optional<int64_t> got = take(lay.end, stream);
    if (!got) return nullptr;
    auto r = std::make_unique<Reservation>();
    auto* block = new Block;
    block->arena = shared_from_this();
    block->offset = *got;
    block->size = lay.end;
    block->alloc_stream = stream;
    block->use_stream = use_stream;
    // The reservation's reference: the block outlives a failure half way (each tensor made so
    // far holds one too) and goes back when the last reference drops.
    block->refs.store(1);
    r->block = block;
    r->at = base_ + *got;
    r->lay = lay;
    r->rows = rows;
    r->hidden = hidden;
    r->num_scales = num_scales;
    r->num_topk = num_topk;
    r->aux = aux;
    r->x_dt = DLDataType{static_cast<uint8_t>(x_code), static_cast<uint8_t>(x_bits), 1};
    r->idx_bits = idx_bits;
    return r;
  }

  // Drops one reference of `b`; the last one hands the block back (deleters: any thread).
  static void unref(Block* b) noexcept {
    if (b->refs.fetch_sub(1) == 1) {
      b->arena->release(*b);
      delete b;
    }
  }

  // Every free range (pending frees folded in; those freed during a capture wait for the next
  // take), offset order.
  std::vector<std::pair<int64_t, int64_t>> free_ranges() {
    std::lock_guard<std::mutex> lock(mu_);
    fold_pending(0);
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const Range& r : free_) out.emplace_back(r.offset, r.size);
    return out;
  }

  int live() {
    std::lock_guard<std::mutex> lock(mu_);
    return live_;
  }

  // No more takes. Returns whether no block is alive (the caller frees the memory then); when
  // blocks are alive and `own` is set, the arena frees the memory (device_free, registered
  // allocation) when the last of them dies.
  bool close(bool own) {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    if (live_ == 0) return true;
    own_memory_ = own;
    return false;
  }

  // From now on every block's death is recorded on `stream` too (the Buffer's communication
  // stream once an asynchronous call ran there: it may read blocks taken on the caller's).
  void note_stream(intptr_t stream) { extra_stream_.store(stream, std::memory_order_relaxed); }

  // A block's last tensor died (a deleter: any thread, no GIL, never throws).
  void release(const Block& b) noexcept {
    try {
      Range r{b.offset, b.size, {}};
      bool deferred = false;
#ifdef UCCL_EP_WITH_GPU
      if (cuda_) {
        const intptr_t extra = extra_stream_.load(std::memory_order_relaxed);
        const bool more = extra != 0 && extra != b.alloc_stream && extra != b.use_stream;
        if (kernels::stream_capturing(b.alloc_stream) ||
            (b.use_stream != b.alloc_stream && kernels::stream_capturing(b.use_stream)) ||
            (more && kernels::stream_capturing(extra))) {
          deferred = true;
        } else {
          r.events.push_back(recorded(b.alloc_stream));
          if (b.use_stream != b.alloc_stream) r.events.push_back(recorded(b.use_stream));
          if (more) r.events.push_back(recorded(extra));
        }
      }
#endif
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(r));
      deferred_.push_back(deferred);
      --live_;
      if (closed_ && own_memory_ && live_ == 0) free_memory();
    } catch (...) {  // a deleter must not throw: the block stays out of use
    }
  }

 private:
  std::optional<int64_t> take(int64_t nbytes, intptr_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    UCCL_EP_CHECK_ARG(!closed_, "RecvArenaCore: the arena is closed");
    fold_pending(stream);
    const int64_t size = align_up(nbytes);
    for (size_t i = 0; i < free_.size(); ++i) {
      Range& r = free_[i];
      if (r.size < size) continue;
      drop_done(r.events);
      const int64_t offset = r.offset;
#ifdef UCCL_EP_WITH_GPU
      for (const Event& e : r.events) kernels::stream_wait_event(stream, e->event);
#endif
      if (r.size == size) {
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        r.offset += size;  // the rest keeps the events: its bytes were used by the same frees
        r.size -= size;
      }
      ++live_;
      return offset;
    }
    return std::nullopt;
  }

  // Pending frees into the offset-sorted free list, merged with their neighbours. A block freed
  // during a graph capture gets an event on `stream` (the taking call's) here; 0: no stream.
  void fold_pending(intptr_t stream) {
    std::vector<Range> kept;  // freed during a capture, folded by the next take
    for (size_t k = 0; k < pending_.size(); ++k) {
      Range r = std::move(pending_[k]);
      if (deferred_[k]) {
        if (stream == 0) {
          kept.push_back(std::move(r));
          continue;
        }
#ifdef UCCL_EP_WITH_GPU
        r.events.push_back(recorded(stream));
#endif
      }
      auto it = std::lower_bound(free_.begin(), free_.end(), r.offset,
                                 [](const Range& f, int64_t off) { return f.offset < off; });
      it = free_.insert(it, std::move(r));
      auto next = it + 1;
      if (next != free_.end() && it->offset + it->size == next->offset) {
        it->size += next->size;
        append(it->events, next->events);
        free_.erase(next);
      }
      if (it != free_.begin()) {
        auto prev = it - 1;
        if (prev->offset + prev->size == it->offset) {
          prev->size += it->size;
          append(prev->events, it->events);
          free_.erase(it);
          it = prev;
        }
      }
      // A range never chosen would gather the events of every free merged into it.
      drop_done(it->events);
    }
    pending_ = std::move(kept);
    deferred_.assign(pending_.size(), true);
  }

  static void append(std::vector<Event>& to, const std::vector<Event>& from) {
    to.insert(to.end(), from.begin(), from.end());
  }

  void drop_done(std::vector<Event>& events) {
#ifdef UCCL_EP_WITH_GPU
    events.erase(std::remove_if(events.begin(), events.end(),
                                [](const Event& e) { return kernels::event_done(e->event); }),
                 events.end());
#else
    events.clear();
#endif
  }

#ifdef UCCL_EP_WITH_GPU
  // A pooled event recorded on `stream` now.
  Event recorded(intptr_t stream) {
    intptr_t e = 0;
    {
      std::lock_guard<std::mutex> lock(*pool_mu_);
      if (!pool_->empty()) {
        e = pool_->back();
        pool_->pop_back();
      }
    }
    if (e == 0) e = kernels::event_create(device_);
    auto box = std::make_shared<EventBox>();
    box->pool = pool_;
    box->pool_mu = pool_mu_;
    box->event = e;
    kernels::event_record(e, stream);
    return box;
  }
#endif

  void free_memory() {
#ifdef UCCL_EP_WITH_GPU
    if (!cuda_ || base_ == 0) return;
    AllocRegistry::get().remove(static_cast<uintptr_t>(base_), AllocKind::kDeviceBuffer, "receive arena");
    kernels::device_free_on(device_, base_);
    base_ = 0;
#endif
  }

  py::object make(Block* block, intptr_t ptr, int64_t rows, int64_t cols, DLDataType dt) {
    // Kept for the process (never destroyed after the interpreter is gone).
    static PyObject* const from_dlpack =
        py::object(py::module_::import("torch").attr("_C").attr("_from_dlpack")).release().ptr();
    auto* m = new Managed;
    m->block = block;
    block->refs.fetch_add(1);
    m->shape[0] = rows;
    m->shape[1] = cols;
    m->strides[0] = cols > 0 ? cols : 1;
    m->strides[1] = 1;
    DLTensor& t = m->t.dl_tensor;
    t.data = reinterpret_cast<void*>(ptr);
    t.device = DLDevice{cuda_ ? kDLGpu : kDLCPU, cuda_ ? device_ : 0};
    t.ndim = cols > 0 ? 2 : 1;
    t.dtype = dt;
    t.shape = m->shape;
    t.strides = m->strides;
    t.byte_offset = 0;
    m->t.manager_ctx = m;
    m->t.deleter = [](DLManagedTensor* self) {
      auto* mm = static_cast<Managed*>(self->manager_ctx);
      Block* b = mm->block;
      delete mm;
      unref(b);
    };
    PyObject* cap = PyCapsule_New(&m->t, "dltensor", [](PyObject* c) {
      // Never consumed (torch renames what it takes to "used_dltensor"): free it here.
      if (PyCapsule_IsValid(c, "dltensor")) {
        auto* dl = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(c, "dltensor"));
        dl->deleter(dl);
      }
    });
    if (!cap) {
      m->t.deleter(&m->t);
      throw py::error_already_set();
    }
    py::object capsule = py::reinterpret_steal<py::object>(cap);
    PyObject* made = PyObject_CallOneArg(from_dlpack, capsule.ptr());
    if (!made) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(made);
  }

  intptr_t base_;
  const int64_t capacity_;
  const int device_;
  const bool cuda_;
  std::mutex mu_;
  std::vector<Range> free_;     // offset order, never adjacent
  std::vector<Range> pending_;  // freed, not yet folded
  std::vector<bool> deferred_;  // per pending_: freed during a capture (no events)
  int live_ = 0;
  std::atomic<intptr_t> extra_stream_{0};  // see note_stream
  bool closed_ = false;
  bool own_memory_ = false;
  std::shared_ptr<std::vector<intptr_t>> pool_ = std::make_shared<std::vector<intptr_t>>();
  std::shared_ptr<std::mutex> pool_mu_ = std::make_shared<std::mutex>();
};

Reservation::~Reservation() {
  if (block != nullptr) Arena::unref(block);
}

int64_t Reservation::block_offset() const { return block->offset; }

py::tuple Reservation::tensors(int64_t rows_made) {
  UCCL_EP_CHECK_ARG(!made, "RecvReservation.tensors: the tensors were made already");
  const int64_t n = rows_made < 0 ? rows : rows_made;
  UCCL_EP_CHECK_ARG(n <= rows, "RecvReservation.tensors: rows=", rows_made, " exceeds the ", rows,
                    " rows reserved");
  made = true;
  Arena& a = *block->arena;
  py::object none = py::none();
  py::object x = a.make(block, at + lay.x, n, hidden, x_dt);
  py::object scales = lay.scales < 0 ? none : a.make(block, at + lay.scales, n, num_scales, {2, 32, 1});
  py::object idx =
      lay.idx < 0 ? none : a.make(block, at + lay.idx, n, num_topk, {0, static_cast<uint8_t>(idx_bits), 1});
  py::object w = lay.w < 0 ? none : a.make(block, at + lay.w, n, num_topk, {2, 32, 1});
  py::object src = lay.src < 0 ? none : a.make(block, at + lay.src, n, 0, {0, 32, 1});
  return py::make_tuple(x, scales, idx, w, src);
}

py::tuple Reservation::aux_tensors(int64_t rank) {
  if (aux_ahead) {
    UCCL_EP_CHECK_ARG(rank == aux_rank, "RecvReservation.aux: rank=", rank, " but the tensors were made for rank ",
                      aux_rank);
    py::tuple t = py::reinterpret_steal<py::tuple>(aux_ahead.release());
    return t;
  }
  return make_aux(rank);
}

py::tuple Reservation::make_aux(int64_t rank) {
  UCCL_EP_CHECK_ARG(lay.info >= 0 && !aux_made,
                    "RecvReservation.aux: ", lay.info < 0 ? "this block holds no send_pos/info" : "made already");
  const int64_t R = aux.ranks, words = R * R;
  UCCL_EP_CHECK_ARG(rank < R && aux.info >= words, "RecvReservation.aux: rank=", rank, " of ", R,
                    " ranks, info of ", aux.info, " words (at least ranks^2)");
  aux_made = true;
  Arena& a = *block->arena;
  const DLDataType i32{0, 32, 1};
  py::object send_pos = a.make(block, at + lay.send_pos, aux.tokens, aux.ranks, i32);
  if (rank < 0) return py::make_tuple(send_pos, a.make(block, at + lay.info, aux.info, 0, i32));
  // The handle's views of info [rank prefix matrix (R x R) | received rows per local expert]:
  // the matrix, this rank's received rows (the matrix's last row, column `rank`), the counts.
  const intptr_t info = at + lay.info;
  return py::make_tuple(send_pos, a.make(block, info, R, R, i32),
                        a.make(block, info + 4 * (words - R + rank), 1, 0, i32),
                        a.make(block, info + 4 * words, aux.info - words, 0, i32));
}

}  // namespace

namespace {
void describe(const Reservation& r, ReservedOutputs* out) {
  UCCL_EP_CHECK_ARG(r.block != nullptr, "a receive-arena reservation without a block");
  auto at = [&r](int64_t o) { return o < 0 ? intptr_t{0} : r.at + o; };
  out->x = at(r.lay.x);
  out->scales = at(r.lay.scales);
  out->idx = at(r.lay.idx);
  out->w = at(r.lay.w);
  out->src = at(r.lay.src);
  out->rows = r.rows;
  out->row_bytes = r.hidden * (r.x_dt.bits / 8);
  out->num_scales = r.lay.scales < 0 ? 0 : r.num_scales;
  out->num_topk = r.lay.idx < 0 ? 0 : r.num_topk;
  out->idx_bytes = r.lay.idx < 0 ? 0 : r.idx_bits / 8;
  out->send_pos = at(r.lay.send_pos);
  out->info = at(r.lay.info);
  const int64_t off = r.block_offset();
  out->entry = {1,
                off + r.lay.x,
                r.lay.scales < 0 ? -1 : off + r.lay.scales,
                r.lay.idx < 0 ? -1 : off + r.lay.idx,
                r.lay.w < 0 ? -1 : off + r.lay.w,
                r.lay.src < 0 ? -1 : off + r.lay.src};
}
}  // namespace

bool reserved_outputs(py::handle h, ReservedOutputs* out) {
  if (!py::isinstance<Reservation>(h)) return false;
  describe(h.cast<const Reservation&>(), out);
  return true;
}

void reservation_aux_ahead(py::handle reservation, int64_t rank) {
  Reservation& r = reservation.cast<Reservation&>();
  r.aux_ahead = r.make_aux(rank);
  r.aux_rank = rank;
}

py::tuple reservation_tensors(py::handle reservation, int64_t rows, int64_t rank) {
  Reservation& r = reservation.cast<Reservation&>();
  py::tuple outputs = r.tensors(rows);
  return py::make_tuple(outputs, r.aux_tensors(rank));
}

py::object reserve_outputs(py::handle core, int64_t rows, int64_t hidden, int x_code, int x_bits, int64_t num_scales,
                           int64_t num_topk, int idx_bits, bool with_src, const ReserveAux& aux, intptr_t stream,
                           intptr_t use_stream, ReservedOutputs* out) {
  Arena& a = core.cast<Arena&>();
  std::unique_ptr<Reservation> r =
      a.reserve(rows, hidden, x_code, x_bits, num_scales, num_topk, idx_bits, with_src, stream, use_stream, aux);
  if (!r) return py::none();
  describe(*r, out);
  return py::cast(std::move(r));
}

void bind_recv_arena(py::module_& m) {
  py::class_<Reservation>(m, "RecvReservation",
                          "One dispatch's block of the receive arena whose tensors are made after the launches "
                          "that fill it (RecvArenaCore.reserve); it holds the block until it dies.")
      .def_property_readonly("entry", &Reservation::entry,
                             "The receive entry words {1, offsets of recv_x, scales, ids, weights, sources}.")
      .def("tensors", &Reservation::tensors, py::arg("rows") = -1,
           "(recv_x, scales, topk_idx, weights, src_idx) viewing the block (once), each of its first `rows` rows "
           "(-1: all reserved); each keeps the block alive.")
      .def("aux", &Reservation::aux_tensors, py::arg("rank") = -1,
           "(send_pos [tokens, ranks], info [words]) int32 of a block reserved by intranode_dispatch_begin (once); "
           "with rank >= 0, info as the handle's views instead: (send_pos, rank_prefix_matrix [ranks, ranks], "
           "recv_count [1] (rank's received rows), recv_tokens_per_expert [words - ranks^2]). Each keeps the block "
           "alive.");
  py::class_<Arena, std::shared_ptr<Arena>>(m, "RecvArenaCore",
                                            "The receive arena's block allocator and output factory "
                                            "(bindings/recv_arena.cc).")
      .def(py::init<intptr_t, int64_t, int, bool>(), py::arg("base"), py::arg("capacity"), py::arg("device"),
           py::arg("cuda"))
      .def("outputs", &Arena::outputs, py::arg("rows"), py::arg("hidden"), py::arg("x_code"), py::arg("x_bits"),
           py::arg("num_scales"), py::arg("num_topk"), py::arg("idx_bits"), py::arg("with_src"), py::arg("stream"),
           py::arg("use_stream"),
           "(recv_x, scales, topk_idx, weights, src_idx, entry) viewing one new block, or None when it does not "
           "fit; `stream` waits for the block's earlier users first.")
      .def(
          "reserve",
          [](Arena& a, int64_t rows, int64_t hidden, int x_code, int x_bits, int64_t num_scales, int64_t num_topk,
             int idx_bits, bool with_src, intptr_t stream, intptr_t use_stream, int64_t aux_tokens,
             int64_t aux_ranks, int64_t aux_info) -> py::object {
            std::unique_ptr<Reservation> r = a.reserve(rows, hidden, x_code, x_bits, num_scales, num_topk, idx_bits,
                                                       with_src, stream, use_stream,
                                                       ReserveAux{aux_tokens, aux_ranks, aux_info});
            if (!r) return py::none();
            return py::cast(std::move(r));
          },
          py::arg("rows"), py::arg("hidden"), py::arg("x_code"), py::arg("x_bits"), py::arg("num_scales"),
          py::arg("num_topk"), py::arg("idx_bits"), py::arg("with_src"), py::arg("stream"), py::arg("use_stream"),
          py::arg("aux_tokens") = 0, py::arg("aux_ranks") = 0, py::arg("aux_info") = 0,
          "As outputs, but a RecvReservation whose tensors are made later (after the launches that fill the "
          "block: intranode_dispatch_call takes it in place of recv_x), or None when it does not fit. With "
          "aux_info > 0 the block also holds a dispatch handle's send_pos [aux_tokens, aux_ranks] and info "
          "[aux_info] int32 (RecvReservation.aux), as intranode_dispatch_begin reserves it.")
      .def("note_stream", &Arena::note_stream, py::arg("stream"),
           "Record every later block death on `stream` too (besides the streams each block was taken and used "
           "on): memory handed out for one stream that a later call reads on another.")
      .def("free_ranges", &Arena::free_ranges, "(offset, bytes) of every free range, offset order.")
      .def_property_readonly("live", &Arena::live, "Blocks whose tensors are alive.")
      .def("close", &Arena::close, py::arg("own"),
           "No more takes; True when no block is alive (free the memory now), else False (with `own`, the "
           "arena frees it when the last block dies).");
  m.attr("RECV_ARENA_ALIGN") = kAlign;
}

}  // namespace uccl_ep::bindings

// What the intranode call bindings (intranode_calls.cc) share with the direct lane
// (intranode_lane.cc): the per-Buffer context of every launch, the checked views of a
// dispatch's tensors, and the steps of a one-call dispatch that both take once the views are
// read (through the bindings' named fields, or by the lane from its own arguments).
#pragma once

#ifdef UCCL_EP_WITH_GPU
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <vector>

#include "bindings/intranode_launch.h"
#include "bindings/pointer_checks.h"
#include "bindings/tensor_view.h"
#include "common/errors.h"
#include "kernels/intranode.h"

namespace uccl_ep::bindings::intranode {

namespace py = pybind11;
namespace k = uccl_ep::kernels;
using views::TensorView;

// The per-Buffer part of every launch, checked when it is built (and the buffers and status
// again at each call: the registry makes a freed or regrown buffer raise, never fault).
struct Context {
  std::vector<intptr_t> buffers;
  int64_t buffer_bytes = 0;
  int rank = 0, num_ranks = 0;
  intptr_t status = 0;
  int64_t timeout_ns = 0;
  bool use_tma = false;
  // Receive arenas (zero-copy dispatch), every rank's as mapped here; empty when off.
  std::vector<intptr_t> arenas;
  std::vector<int64_t> arena_sizes;  // bytes of each rank's arena
  // A combine whose x (and weights) lie in this rank's arena is read there by its peers
  // instead of pushed (UCCL_EP_COMBINE_IN_PLACE).
  bool combine_in_place = true;
  // At 2 ranks, a combine of an exact dispatch's rows whose x is not read in place sends them
  // back by the copy engine on this side stream (0: never), its stream waiting for them with
  // the event (UCCL_EP_COMBINE_COPY_ENGINE; docs/performance.md, "A copied-in combine").
  intptr_t ce_stream = 0, ce_event = 0;
  std::shared_ptr<void> ce_event_owner;  // destroys ce_event with the last copy of the context
  bool copy_engine = false;

  // Whether a combine of a dispatch with rows `r` whose x lies outside the arena (or is not read
  // in place) goes back by the copy engine.
  bool by_copy_engine(const DispatchRows& r) const {
    return copy_engine && ce_stream != 0 && num_ranks == 2 && !r.bound && r.own_rows >= 0 &&
           r.num_recv >= r.own_rows;
  }

  // The per-Buffer fields of a launch struct (k::DispatchArgs, k::CombineArgs).
  void fill(k::DispatchArgs& a) const {
    fill_common(a);
    a.arenas = arenas;
  }
  void fill(k::CombineArgs& a) const {
    fill_common(a);
    a.arenas = arenas;
  }

  // Byte offset in this rank's arena of a tensor lying wholly inside it, else -1.
  int64_t arena_place(const TensorView& v) const {
    if (arenas.empty() || v.none || v.bytes() == 0) return -1;
    const intptr_t lo = arenas[rank], hi = lo + arena_sizes[rank];
    return v.ptr >= lo && v.ptr + v.bytes() <= hi ? static_cast<int64_t>(v.ptr - lo) : -1;
  }

  template <typename Args>
  void fill_common(Args& a) const {
    a.buffers = buffers;
    a.buffer_bytes = buffer_bytes;
    a.rank = rank;
    a.num_ranks = num_ranks;
    a.use_tma = use_tma;
    a.status = status;
    a.timeout_ns = timeout_ns;
  }

  void check(const char* what) const {
    UCCL_EP_CHECK_ARG(rank >= 0 && rank < num_ranks && num_ranks <= k::kMaxRanks, what, ": rank=", rank,
                      " num_ranks=", num_ranks, " (at most ", k::kMaxRanks, ")");
    check_buffers(buffers, num_ranks, buffer_bytes, what);
    check_status_of(status, what);
  }

  // Zero-copy dispatch: every output that holds bytes lies inside this rank's arena.
  void check_in_arena(std::initializer_list<const TensorView*> outs) const {
    UCCL_EP_CHECK_ARG(!arenas.empty(), "intranode_dispatch: zero_copy=True but this context has no receive arenas");
    const intptr_t lo = arenas[rank], hi = lo + arena_sizes[rank];
    for (const TensorView* v : outs) {
      if (v->none || v->bytes() == 0) continue;
      UCCL_EP_CHECK_ARG(v->ptr >= lo && v->ptr + v->bytes() <= hi, "intranode_dispatch: a zero-copy output [",
                        v->ptr, ", +", v->bytes(), ") lies outside this rank's receive arena [", lo, ", +",
                        arena_sizes[rank], ")");
    }
  }
};

// The views notify reads and writes: the counts in, the info (rank prefix matrix | rows per
// local expert) out, the positions (none for a cached dispatch) and the ids to scan (none: no ids).
struct NotifyViews {
  TensorView per_rank, per_expert, info, in_rank, send_pos, idx;
};

// The views of a dispatch's launch: its inputs, the handle's send_pos and info, its outputs
// (`out_rows` rows each; recv_src none for a cached dispatch, which keeps the handle's).
struct DispatchViews {
  TensorView x, scales, idx, weights, in_rank, info, send_pos;
  TensorView recv_x, recv_scales, recv_idx, recv_w, recv_src;
  int64_t out_rows = 0;
};

// The attribute `name` of `obj` (a new reference; raises what Python raised).
py::object field(py::handle obj, PyObject* name);

// x, x_scales, topk_idx, topk_weights and is_token_in_rank of `v`, read already, checked: FP8
// scales and top-k come with their outputs or not at all.
void expect_inputs(const Context& c, DispatchViews* v);

// num_tokens_per_rank and num_tokens_per_expert (none without local experts) of `v`, read
// already, checked.
void expect_counts(const Context& c, const DispatchLaunch& l, const NotifyViews* v);

// intranode_dispatch_begin on views read and checked by expect_inputs and expect_counts
// (`handle_send_pos`: a cached dispatch's, else none): the RecvReservation, or None (the
// step-by-step path).
py::object begin_checked(const Context& c, const DispatchLaunch& l, const DispatchRows& r, intptr_t stream,
                         intptr_t use_stream, py::handle arena, DispatchViews& v, NotifyViews& n,
                         const TensorView& handle_send_pos);

// The rows of an exact-mode dispatch on `rank` from the host rank prefix matrix (row-major):
// intranode_exact_rows.
DispatchRows exact_rows(const std::vector<int64_t>& pm, int rank, int num_ranks);

// The end of a launch-ahead dispatch (intranode_ahead_finish): `good` when the status word is
// clear, every rank's checks are good and no rank receives more than the bound; then `prefix`,
// `rows`, `most`, `per_expert` (aligned rows per local expert) and `made` ((five outputs),
// (four handle tensors)). Otherwise `state` and `words` of the readback, for the caller to judge.
struct AheadEnd {
  int state = 0;
  std::vector<int64_t> words;
  bool good = false;
  std::vector<int64_t> prefix;
  DispatchRows rows;
  int64_t most = 0;
  py::tuple made;
};
AheadEnd ahead_end(const Context& c, const DispatchLaunch& l, py::handle reservation, int64_t bound);

// The views of a combine: x, its top-k weights (none), the outputs, up to two biases, and the
// dispatch handle's rank prefix matrix and send_pos.
struct CombineViews {
  TensorView x, weights, out, out_w;
  TensorView bias[2];
  int num_bias = 0;
  TensorView prefix, send_pos;
};

// A combine's views (read already) checked against each other and `r` (the dispatch's rows).
void expect_combine(const Context& c, const DispatchRows& r, CombineViews* v);

// What a combine launch returns: kCombinedInPlace when this rank combined in place (peers read
// its x in its arena) or kCombinedByCopyEngine when its rows went back by the copy engine, plus
// kCombineCaptured while `stream` is being captured; the binding
// returns kCombineStatusSet, launching nothing, when the status word is set (the caller raises
// it).
constexpr int kCombinedInPlace = 1, kCombineCaptured = 2, kCombinedByCopyEngine = 4, kCombineStatusSet = -1;

// The pipelined combine kernel on checked views (expect_combine), then the poison fold of its
// outputs (NaN when a wait timed out).
int combine_checked(const Context& c, const CombineLaunch& l, const DispatchRows& r, intptr_t stream,
                    const CombineViews& v);

}  // namespace uccl_ep::bindings::intranode
#endif

// The typed arguments of the intranode call bindings (intranode_calls.cc): what a dispatch's or a
// combine's launches share that its layout and shapes fix (`DispatchLaunch`, `CombineLaunch`,
// built once per layout by the backend and reused), and the row counts of one dispatch
// (`DispatchRows`, from the host rank prefix matrix or a bound known before notify). Named fields
// instead of positional ints: two sizes cannot trade places across the Python/C++ seam, and a
// call takes a handful of arguments, not twenty.
#pragma once

#ifdef UCCL_EP_WITH_GPU
#include <cstdint>

#include "common/errors.h"
#include "kernels/intranode.h"

namespace uccl_ep::bindings {

struct DispatchLaunch {
  int num_sms = 0;
  int experts_per_rank = 0;  // local experts; 0 for a cached dispatch (no per-expert counts)
  int expert_alignment = 1;
  int num_experts = 0;       // the id range notify and a launch-ahead kernel check (0: cached)
  int num_worst_tokens = 0;  // > 0: sync-free, outputs of exactly this many rows
  bool cached = false;       // a cached dispatch: the handle's send_pos and source indices
  int64_t header = 0;        // the call header word every rank must agree on

  bool sync_free() const { return num_worst_tokens > 0; }
  // Notify copies the counts (and every rank's checks) to the host: an exact, uncached call.
  bool readback() const { return !cached && num_worst_tokens == 0; }

  void check() const {
    UCCL_EP_CHECK_ARG(num_sms > 0 && experts_per_rank >= 0 && experts_per_rank <= kernels::kMaxLocalExperts &&
                          expert_alignment >= 1 && num_experts >= 0 && num_worst_tokens >= 0,
                      "DispatchLaunch: num_sms=", num_sms, " experts_per_rank=", experts_per_rank, " (at most ",
                      kernels::kMaxLocalExperts, ") expert_alignment=", expert_alignment, " num_experts=", num_experts,
                      " num_worst_tokens=", num_worst_tokens);
    UCCL_EP_CHECK_ARG(!cached || (experts_per_rank == 0 && num_experts == 0),
                      "DispatchLaunch: a cached dispatch has no experts (experts_per_rank=", experts_per_rank,
                      " num_experts=", num_experts, ")");
  }
};

// The rows of one dispatch (see k::DispatchArgs), and of the combine that returns them.
struct DispatchRows {
  int64_t num_recv = 0;      // rows the call fills: the rows received, or the bound
  int64_t staging_rows = 0;  // the most rows any rank receives: the dispatch's staging
  int64_t own_rows = -1;     // rows this rank keeps for itself; -1: unknown before notify
  int64_t send_rows = -1;    // rows it sends to all ranks; -1: unknown before notify
  int64_t combine_rows = 0;  // the most rows any rank gets back from the others: combine's staging
  // Known before notify (num_worst_tokens, a launch-ahead bound): the outputs exist before
  // notify, which publishes their place with the counts.
  bool bound = false;

  static DispatchRows of_bound(int64_t rows) { return DispatchRows{rows, rows, -1, -1, rows, true}; }

  void check(const char* what) const {
    UCCL_EP_CHECK_ARG(num_recv >= 0 && staging_rows >= 0 && combine_rows >= 0 && own_rows >= -1 && send_rows >= -1 &&
                          num_recv <= INT32_MAX && own_rows <= INT32_MAX,
                      what, ": rows num_recv=", num_recv, " staging_rows=", staging_rows, " own_rows=", own_rows,
                      " send_rows=", send_rows, " combine_rows=", combine_rows);
  }
};

struct CombineLaunch {
  int num_sms = 0;
  int64_t header = 0;  // pack_combine_header's word: weights' columns as top-k, biases as experts

  void check() const { UCCL_EP_CHECK_ARG(num_sms > 0, "CombineLaunch: num_sms=", num_sms, " must be positive"); }
};

}  // namespace uccl_ep::bindings
#endif

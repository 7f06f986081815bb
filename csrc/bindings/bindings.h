// Each subsystem binds itself into the `_C` module from its own file; module.cc calls them.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>

namespace uccl_ep::bindings {

void bind_common(pybind11::module_& m);
void bind_kernels(pybind11::module_& m);
// The intranode backend's per-call entry points (intranode_calls.cc), bound by bind_kernels (of a
// build without GPU kernels: only notify_checks_good).
void bind_intranode_calls(pybind11::module_& m);
// The direct lane of an uncached dispatch in one binding call (intranode_lane.cc), bound by
// bind_kernels of a build with GPU kernels.
void bind_intranode_lane(pybind11::module_& m);
void bind_internode(pybind11::module_& m);
// The internode backend's per-call entry points (internode_calls.cc), bound by bind_internode
// into the `internode` submodule.
void bind_internode_calls(pybind11::module_& m);
void bind_permute(pybind11::module_& m);
void bind_proxy(pybind11::module_& m);
// The receive arena's allocator and output factory (recv_arena.cc).
void bind_recv_arena(pybind11::module_& m);

// Where a receive-arena reservation (`RecvArenaCore.reserve`, outputs whose tensors are made
// after the launches that fill them) puts each output: device addresses (0: absent), rows,
// and the element sizes it was made for (recv_x bytes per row; 0 for an absent output).
// `send_pos`/`info`: the handle's int32 tensors when the block holds them (reserve_outputs
// with aux), else 0; `entry`: the receive entry words {1, arena offsets of the five outputs}.
struct ReservedOutputs {
  intptr_t x = 0, scales = 0, idx = 0, w = 0, src = 0, send_pos = 0, info = 0;
  int64_t rows = 0, row_bytes = 0, num_scales = 0, num_topk = 0, idx_bytes = 0;
  std::array<int64_t, 6> entry{};
};
// `h`'s outputs when it is a reservation (recv_arena.cc), else false.
bool reserved_outputs(pybind11::handle h, ReservedOutputs* out);

// The handle's tensors a block reserved by one launch call also holds (0: none): send_pos
// [tokens, ranks] and info [info] int32.
struct ReserveAux {
  int64_t tokens = 0, ranks = 0, info = 0;
};
// A reservation (`RecvReservation`, with `aux`) of `core` (a `RecvArenaCore`) for `rows` rows,
// its places in `out`; None when it does not fit.
pybind11::object reserve_outputs(pybind11::handle core, int64_t rows, int64_t hidden, int x_code, int x_bits,
                                 int64_t num_scales, int64_t num_topk, int idx_bits, bool with_src,
                                 const ReserveAux& aux, intptr_t stream, intptr_t use_stream, ReservedOutputs* out);
// The tensors of a reservation made by intranode_dispatch_begin, once: ((recv_x, scales, topk_idx,
// weights, src_idx) of its first `rows` rows, RecvReservation.aux(rank)'s four handle tensors).
pybind11::tuple reservation_tensors(pybind11::handle reservation, int64_t rows, int64_t rank);
// Makes RecvReservation.aux(rank)'s tensors now and keeps them for the one call that takes them
// (`aux(rank)` or reservation_tensors): they need no counts, so they are made before a wait.
void reservation_aux_ahead(pybind11::handle reservation, int64_t rank);

}  // namespace uccl_ep::bindings

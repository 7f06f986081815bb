// Each subsystem binds itself into the `_C` module from its own file; module.cc calls them.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace uccl_ep::bindings {

void bind_common(pybind11::module_& m);
void bind_kernels(pybind11::module_& m);
// The intranode backend's per-call entry points (intranode_calls.cc), bound by bind_kernels.
void bind_intranode_calls(pybind11::module_& m);
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
struct ReservedOutputs {
  intptr_t x = 0, scales = 0, idx = 0, w = 0, src = 0;
  int64_t rows = 0, row_bytes = 0, num_scales = 0, num_topk = 0, idx_bytes = 0;
};
// `h`'s outputs when it is a reservation (recv_arena.cc), else false.
bool reserved_outputs(pybind11::handle h, ReservedOutputs* out);

}  // namespace uccl_ep::bindings

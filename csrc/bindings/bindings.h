// Each subsystem binds itself into the `_C` module from its own file; module.cc calls them.
#pragma once

#include <pybind11/pybind11.h>

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

}  // namespace uccl_ep::bindings

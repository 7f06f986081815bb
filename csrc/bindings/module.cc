// The `_C` extension: raw pointers, sizes and stream handles in; no libtorch.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "uccl_ep_megatron core: FIFO channels, CPU proxies, transports and GPU kernels";
  uccl_ep::bindings::bind_common(m);
  uccl_ep::bindings::bind_kernels(m);
  uccl_ep::bindings::bind_internode(m);
  uccl_ep::bindings::bind_permute(m);
  uccl_ep::bindings::bind_proxy(m);
  uccl_ep::bindings::bind_recv_arena(m);
}

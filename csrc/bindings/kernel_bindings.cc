// The intranode kernels in `_C`: raw pointers (int), sizes and stream handles (int) in; IPC
// handles travel as bytes. Without a GPU toolchain only `kernels_built` (False) is bound, so
// the package imports everywhere and backends/kernels.py reports why it is unavailable.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"

#ifdef UCCL_EP_WITH_GPU
#include "kernels/intranode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

void bind_kernels(py::module_& m) {
#ifndef UCCL_EP_WITH_GPU
  m.def("kernels_built", [] { return false; }, "Whether the intranode GPU kernels were compiled into _C.");
#else
  namespace k = uccl_ep::kernels;
  m.def("kernels_built", [] { return true; }, "Whether the intranode GPU kernels were compiled into _C.");
  m.attr("KERNELS_MAX_RANKS") = k::kMaxRanks;
  m.attr("KERNELS_MAX_LOCAL_EXPERTS") = k::kMaxLocalExperts;
  m.attr("KERNELS_DATA_OFFSET") = static_cast<int64_t>(k::kDataOffset);

  m.def("tma_supported", &k::tma_supported, "Whether the current GPU has bulk copies (TMA, sm_90+).");
  m.def("device_alloc_zeroed", &k::device_alloc_zeroed, py::arg("bytes"),
        "cudaMalloc/hipMalloc `bytes` on the current device, zeroed; returns the pointer.");
  m.def("device_free", &k::device_free, py::arg("ptr"));
  m.def("device_copy", &k::device_copy, py::arg("dst"), py::arg("src"), py::arg("bytes"),
        "Synchronous copy of `bytes` between two device allocations.");
  m.def(
      "ipc_get_handle", [](intptr_t ptr) { return py::bytes(k::ipc_get_handle(ptr)); }, py::arg("ptr"),
      "IPC handle (bytes) of an allocation from device_alloc_zeroed.");
  m.def(
      "ipc_open_handle", [](py::bytes h) { return k::ipc_open_handle(std::string(h)); }, py::arg("handle"),
      "Maps a peer's allocation into this process; returns the local pointer.");
  m.def("ipc_close_handle", &k::ipc_close_handle, py::arg("ptr"));
  m.def("host_status_alloc", &k::host_status_alloc, "Mapped pinned host words the kernels report timeouts in.");
  m.def("host_status_free", &k::host_status_free, py::arg("ptr"));
  m.def(
      "host_status_read",
      [](intptr_t ptr) {
        const volatile int64_t* w = reinterpret_cast<const volatile int64_t*>(ptr);
        py::list out;
        for (int i = 0; i < k::kStatusWords; ++i) out.append(static_cast<int64_t>(w[i]));
        return out;
      },
      py::arg("ptr"), "Status words: [set, stalled peer rank, barrier sequence, site code].");

  m.def("get_dispatch_layout", &k::get_dispatch_layout, py::arg("topk_idx"), py::arg("idx_is_64"),
        py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_ranks"), py::arg("num_experts"),
        py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("is_token_in_rank"),
        py::arg("stream"));
  m.def("intranode_notify", &k::intranode_notify, py::arg("buffers"), py::arg("rank"), py::arg("num_ranks"),
        py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"), py::arg("experts_per_rank"),
        py::arg("expert_alignment"), py::arg("seq"), py::arg("rank_prefix_matrix"), py::arg("out_info"),
        py::arg("status"), py::arg("timeout_ns"), py::arg("is_token_in_rank"), py::arg("num_tokens"),
        py::arg("send_pos"), py::arg("stream"));
  m.def("dispatch_staging_bytes", &k::dispatch_staging_bytes, py::arg("rows"), py::arg("row_bytes"),
        py::arg("num_scales"), py::arg("num_topk"), py::arg("idx_size"));
  m.def("combine_staging_bytes", &k::combine_staging_bytes, py::arg("rows"), py::arg("row_bytes"),
        py::arg("num_topk"));

  py::class_<k::DispatchArgs>(m, "IntranodeDispatchArgs")
      .def(py::init<>())
      .def_readwrite("buffers", &k::DispatchArgs::buffers)
      .def_readwrite("rank", &k::DispatchArgs::rank)
      .def_readwrite("num_ranks", &k::DispatchArgs::num_ranks)
      .def_readwrite("num_tokens", &k::DispatchArgs::num_tokens)
      .def_readwrite("experts_per_rank", &k::DispatchArgs::experts_per_rank)
      .def_readwrite("x", &k::DispatchArgs::x)
      .def_readwrite("row_bytes", &k::DispatchArgs::row_bytes)
      .def_readwrite("x_scales", &k::DispatchArgs::x_scales)
      .def_readwrite("num_scales", &k::DispatchArgs::num_scales)
      .def_readwrite("topk_idx", &k::DispatchArgs::topk_idx)
      .def_readwrite("idx_is_64", &k::DispatchArgs::idx_is_64)
      .def_readwrite("topk_weights", &k::DispatchArgs::topk_weights)
      .def_readwrite("num_topk", &k::DispatchArgs::num_topk)
      .def_readwrite("is_token_in_rank", &k::DispatchArgs::is_token_in_rank)
      .def_readwrite("rank_prefix_matrix", &k::DispatchArgs::rank_prefix_matrix)
      .def_readwrite("send_pos", &k::DispatchArgs::send_pos)
      .def_readwrite("cached", &k::DispatchArgs::cached)
      .def_readwrite("recv_x", &k::DispatchArgs::recv_x)
      .def_readwrite("recv_scales", &k::DispatchArgs::recv_scales)
      .def_readwrite("recv_topk_idx", &k::DispatchArgs::recv_topk_idx)
      .def_readwrite("recv_topk_weights", &k::DispatchArgs::recv_topk_weights)
      .def_readwrite("recv_src_idx", &k::DispatchArgs::recv_src_idx)
      .def_readwrite("num_recv", &k::DispatchArgs::num_recv)
      .def_readwrite("num_out_rows", &k::DispatchArgs::num_out_rows)
      .def_readwrite("recv_begin", &k::DispatchArgs::recv_begin)
      .def_readwrite("staging_rows", &k::DispatchArgs::staging_rows)
      .def_readwrite("send_rows", &k::DispatchArgs::send_rows)
      .def_readwrite("buffer_bytes", &k::DispatchArgs::buffer_bytes)
      .def_readwrite("num_sms", &k::DispatchArgs::num_sms)
      .def_readwrite("use_tma", &k::DispatchArgs::use_tma)
      .def_readwrite("seq", &k::DispatchArgs::seq)
      .def_readwrite("status", &k::DispatchArgs::status)
      .def_readwrite("timeout_ns", &k::DispatchArgs::timeout_ns);
  m.def("intranode_dispatch", &k::intranode_dispatch, py::arg("args"), py::arg("stream"));

  py::class_<k::CombineArgs>(m, "IntranodeCombineArgs")
      .def(py::init<>())
      .def_readwrite("buffers", &k::CombineArgs::buffers)
      .def_readwrite("rank", &k::CombineArgs::rank)
      .def_readwrite("num_ranks", &k::CombineArgs::num_ranks)
      .def_readwrite("dtype", &k::CombineArgs::dtype)
      .def_readwrite("hidden", &k::CombineArgs::hidden)
      .def_readwrite("x", &k::CombineArgs::x)
      .def_readwrite("topk_weights", &k::CombineArgs::topk_weights)
      .def_readwrite("num_topk", &k::CombineArgs::num_topk)
      .def_readwrite("num_recv", &k::CombineArgs::num_recv)
      .def_readwrite("rank_prefix", &k::CombineArgs::rank_prefix)
      .def_readwrite("send_pos", &k::CombineArgs::send_pos)
      .def_readwrite("num_tokens", &k::CombineArgs::num_tokens)
      .def_readwrite("bias0", &k::CombineArgs::bias0)
      .def_readwrite("bias1", &k::CombineArgs::bias1)
      .def_readwrite("out", &k::CombineArgs::out)
      .def_readwrite("out_weights", &k::CombineArgs::out_weights)
      .def_readwrite("staging_rows", &k::CombineArgs::staging_rows)
      .def_readwrite("buffer_bytes", &k::CombineArgs::buffer_bytes)
      .def_readwrite("num_sms", &k::CombineArgs::num_sms)
      .def_readwrite("use_tma", &k::CombineArgs::use_tma)
      .def_readwrite("seq_entry", &k::CombineArgs::seq_entry)
      .def_readwrite("seq_done", &k::CombineArgs::seq_done)
      .def_readwrite("status", &k::CombineArgs::status)
      .def_readwrite("timeout_ns", &k::CombineArgs::timeout_ns);
  m.def("intranode_combine_push", &k::intranode_combine_push, py::arg("args"), py::arg("stream"));
  m.def("intranode_combine_reduce", &k::intranode_combine_reduce, py::arg("args"), py::arg("stream"));
#endif
}

}  // namespace uccl_ep::bindings

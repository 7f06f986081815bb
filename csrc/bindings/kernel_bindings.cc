// The intranode kernels in `_C`: raw pointers (int), sizes and stream handles (int) in; IPC
// handles travel as bytes. Without a GPU toolchain only `kernels_built` (False) is bound, so
// the package imports everywhere and backends/intranode/ reports why it is unavailable.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"

#ifdef UCCL_EP_WITH_GPU
#include <cstring>
#include <string>
#include <vector>

#include "common/errors.h"
#include "common/registry.h"
#include "kernels/intranode.h"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

#ifdef UCCL_EP_WITH_GPU
namespace {

namespace k = uccl_ep::kernels;
constexpr uint64_t kStatusBytes = k::kStatusWords * sizeof(int64_t);

// Every raw address a kernel launch gets from Python is checked here, before anything runs on
// the GPU: a bad one must raise, never fault the process or the CUDA context. Buffers and
// status words must be `_C`'s own live allocations of the right size; tensor pointers (torch
// owns them) must be non-null wherever the sizes say the kernels touch them.
void check_buffers(const std::vector<intptr_t>& buffers, int num_ranks, int64_t bytes, const char* what) {
  UCCL_EP_CHECK_ARG(static_cast<int>(buffers.size()) == num_ranks, what, ": got ", buffers.size(),
                    " buffers for ", num_ranks, " ranks");
  UCCL_EP_CHECK_ARG(bytes > 0, what, ": buffer_bytes=", bytes, " must be positive");
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string name = detail::concat(what, ": buffers[", i, "]");
    AllocRegistry::get().check(static_cast<uintptr_t>(buffers[i]), static_cast<uint64_t>(bytes),
                               {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping}, name.c_str());
  }
}

void check_status(intptr_t status, const char* what) {
  AllocRegistry::get().check(static_cast<uintptr_t>(status), kStatusBytes, {AllocKind::kHostStatus}, what);
}

void check_ptr(intptr_t ptr, bool used, const char* what) {
  if (used && ptr == 0) UCCL_EP_THROW(InvalidArgument, what, " is a null pointer but the sizes say it is used");
}

void check_dispatch(const k::DispatchArgs& a) {
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && a.num_recv >= 0 && a.num_out_rows >= 0 && a.num_topk >= 0 &&
                        a.num_scales >= 0 && a.row_bytes > 0,
                    "dispatch sizes must be non-negative (row_bytes positive): num_tokens=", a.num_tokens,
                    " num_recv=", a.num_recv, " num_out_rows=", a.num_out_rows, " num_topk=", a.num_topk,
                    " num_scales=", a.num_scales, " row_bytes=", a.row_bytes);
  check_buffers(a.buffers, a.num_ranks, a.buffer_bytes, "intranode_dispatch");
  check_status(a.status, "intranode_dispatch: status");
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

void check_combine(const k::CombineArgs& a, const char* what) {
  UCCL_EP_CHECK_ARG(a.num_tokens >= 0 && a.num_recv >= 0 && a.num_topk >= 0 && a.hidden > 0,
                    what, ": sizes must be non-negative (hidden positive): num_tokens=", a.num_tokens,
                    " num_recv=", a.num_recv, " num_topk=", a.num_topk, " hidden=", a.hidden);
  check_buffers(a.buffers, a.num_ranks, a.buffer_bytes, what);
  const std::string at = std::string(what) + ": ";
  check_status(a.status, (at + "status").c_str());
  check_ptr(a.x, a.num_recv > 0, (at + "x").c_str());
  check_ptr(a.send_pos, a.num_tokens > 0, (at + "send_pos").c_str());
  check_ptr(a.rank_prefix_matrix, true, (at + "rank_prefix_matrix").c_str());
  check_ptr(a.out, a.num_tokens > 0, (at + "out").c_str());
  check_ptr(a.topk_weights, a.num_recv > 0 && a.num_topk > 0, (at + "topk_weights").c_str());
  check_ptr(a.out_weights, a.num_tokens > 0 && a.num_topk > 0, (at + "out_weights").c_str());
}

}  // namespace
#endif

void bind_kernels(py::module_& m) {
#ifndef UCCL_EP_WITH_GPU
  m.def("kernels_built", [] { return false; }, "Whether the intranode GPU kernels were compiled into _C.");
#else
  m.def("kernels_built", [] { return true; }, "Whether the intranode GPU kernels were compiled into _C.");
  m.attr("KERNELS_MAX_RANKS") = k::kMaxRanks;
  m.attr("KERNELS_MAX_LOCAL_EXPERTS") = k::kMaxLocalExperts;
  m.attr("KERNELS_DATA_OFFSET") = static_cast<int64_t>(k::kDataOffset);
  // Codes of status word 0 (intranode.h), so Python names each failure.
  m.attr("STATUS_TIMEOUT") = k::kStatusTimeout;
  m.attr("STATUS_BAD_EXPERT_ID") = k::kStatusBadExpertId;
  m.attr("STATUS_LAYOUT_MISMATCH") = k::kStatusLayoutMismatch;
  m.attr("STATUS_DISPATCH_OVERFLOW") = k::kStatusDispatchOverflow;
  m.attr("STATUS_COMBINE_OVERFLOW") = k::kStatusCombineOverflow;
  m.attr("STATUS_PEER_ABORT") = k::kStatusPeerAbort;
  m.attr("STATUS_HEADER_MISMATCH") = k::kStatusHeaderMismatch;

  m.def("tma_supported", &k::tma_supported, "Whether the current GPU has bulk copies (TMA, sm_90+).");
  m.def(
      "device_alloc_zeroed",
      [](size_t bytes) {
        const intptr_t p = k::device_alloc_zeroed(bytes);
        try {
          AllocRegistry::get().add(static_cast<uintptr_t>(p), bytes, AllocKind::kDeviceBuffer);
        } catch (...) {
          k::device_free(p);
          throw;
        }
        return p;
      },
      py::arg("bytes"), "cudaMalloc/hipMalloc `bytes` on the current device, zeroed; returns the pointer.");
  m.def(
      "device_free",
      [](intptr_t ptr) {
        AllocRegistry::get().remove(static_cast<uintptr_t>(ptr), AllocKind::kDeviceBuffer, "device_free");
        k::device_free(ptr);
      },
      py::arg("ptr"), "Frees a pointer device_alloc_zeroed returned (anything else raises).");
  m.def(
      "device_copy",
      [](intptr_t dst, intptr_t src, size_t bytes) {
        const auto kinds = {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping};
        AllocRegistry::get().check(static_cast<uintptr_t>(dst), bytes, kinds, "device_copy: dst");
        AllocRegistry::get().check(static_cast<uintptr_t>(src), bytes, kinds, "device_copy: src");
        k::device_copy(dst, src, bytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("bytes"),
      "Synchronous copy of `bytes` between two device allocations of _C (buffers or IPC mappings).");
  m.def(
      "ipc_get_handle",
      [](intptr_t ptr) {
        // The allocation's size travels with the handle, so the mapping is bounds-checked too.
        const uint64_t bytes =
            AllocRegistry::get().size_of(static_cast<uintptr_t>(ptr), AllocKind::kDeviceBuffer, "ipc_get_handle");
        std::string h = k::ipc_get_handle(ptr);
        h.append(reinterpret_cast<const char*>(&bytes), sizeof(bytes));
        return py::bytes(h);
      },
      py::arg("ptr"), "IPC handle (bytes, with the size) of an allocation from device_alloc_zeroed.");
  m.def(
      "ipc_open_handle",
      [](py::bytes blob) {
        std::string h(blob);
        UCCL_EP_CHECK_ARG(h.size() > sizeof(uint64_t), "IPC handle has ", h.size(),
                          " bytes; pass what ipc_get_handle of this build returned");
        uint64_t bytes = 0;
        std::memcpy(&bytes, h.data() + h.size() - sizeof(bytes), sizeof(bytes));
        h.resize(h.size() - sizeof(bytes));
        UCCL_EP_CHECK_ARG(bytes > 0, "IPC handle names an empty allocation");
        const intptr_t p = k::ipc_open_handle(h);
        try {
          AllocRegistry::get().add(static_cast<uintptr_t>(p), bytes, AllocKind::kIpcMapping);
        } catch (...) {
          k::ipc_close_handle(p);
          throw;
        }
        return p;
      },
      py::arg("handle"), "Maps a peer's allocation into this process; returns the local pointer.");
  m.def(
      "ipc_close_handle",
      [](intptr_t ptr) {
        AllocRegistry::get().remove(static_cast<uintptr_t>(ptr), AllocKind::kIpcMapping, "ipc_close_handle");
        k::ipc_close_handle(ptr);
      },
      py::arg("ptr"), "Unmaps a pointer ipc_open_handle returned (anything else raises).");
  m.def(
      "host_status_alloc",
      [] {
        const intptr_t p = k::host_status_alloc();
        AllocRegistry::get().add(static_cast<uintptr_t>(p), kStatusBytes, AllocKind::kHostStatus);
        return p;
      },
      "Mapped pinned host words the kernels report timeouts in.");
  m.def(
      "host_status_free",
      [](intptr_t ptr) {
        AllocRegistry::get().remove(static_cast<uintptr_t>(ptr), AllocKind::kHostStatus, "host_status_free");
        k::host_status_free(ptr);
      },
      py::arg("ptr"));
  m.def(
      "host_status_read",
      [](intptr_t ptr) {
        check_status(ptr, "host_status_read");
        const volatile int64_t* w = reinterpret_cast<const volatile int64_t*>(ptr);
        py::list out;
        for (int i = 0; i < k::kStatusWords; ++i) out.append(static_cast<int64_t>(w[i]));
        return out;
      },
      py::arg("ptr"),
      "Status words: [code, ...]: [STATUS_TIMEOUT, stalled peer rank, barrier sequence, site code], or an "
      "input error of a sync-free dispatch/combine: [code, rank, value, extra] (intranode.h).");

  m.def(
      "post_abort",
      [](const std::vector<intptr_t>& buffers, int rank, uint64_t word, const std::string& reason) {
        UCCL_EP_CHECK_ARG(rank >= 0 && rank < static_cast<int>(buffers.size()), "post_abort: rank=", rank,
                          " is not in [0, ", buffers.size(), ")");
        check_buffers(buffers, static_cast<int>(buffers.size()), static_cast<int64_t>(k::kDataOffset), "post_abort");
        py::gil_scoped_release release;
        k::post_abort(buffers, rank, word, reason);
      },
      py::arg("buffers"), py::arg("rank"), py::arg("word"), py::arg("reason"),
      "Tell every peer that this rank rejected a call: its reason, then the word "
      "{call number << 8 | error class code}; their barrier waits stop at once.");
  m.def(
      "read_abort",
      [](intptr_t own_buffer, int peer) {
        check_buffers({own_buffer}, 1, static_cast<int64_t>(k::kDataOffset), "read_abort");
        auto [word, reason] = k::read_abort(own_buffer, peer);
        return py::make_tuple(word, py::bytes(reason).attr("decode")("utf-8", "replace"));
      },
      py::arg("own_buffer"), py::arg("peer"), "Rank `peer`'s abort record in this rank's buffer: (word, reason).");
  m.def(
      "poison_if_failed",
      [](intptr_t status, const std::vector<intptr_t>& ptrs, const std::vector<int64_t>& bytes,
         const std::vector<uint64_t>& patterns, intptr_t stream) {
        check_status(status, "poison_if_failed: status");
        k::poison_if_failed(status, ptrs, bytes, patterns, stream);
      },
      py::arg("status"), py::arg("ptrs"), py::arg("bytes"), py::arg("patterns"), py::arg("stream"),
      "On the stream: when the status word is set, fill each region with its 8-byte pattern.");
  m.def(
      "get_dispatch_layout",
      [](intptr_t topk_idx, bool idx_is_64, int num_tokens, int num_topk, int num_ranks, int num_experts,
         intptr_t per_rank, intptr_t per_expert, intptr_t in_rank, intptr_t stream) {
        UCCL_EP_CHECK_ARG(num_tokens >= 0 && num_topk >= 0 && num_experts > 0, "get_dispatch_layout: num_tokens=",
                          num_tokens, " num_topk=", num_topk, " num_experts=", num_experts);
        const bool any = num_tokens > 0 && num_topk > 0;
        check_ptr(topk_idx, any, "get_dispatch_layout: topk_idx");
        check_ptr(in_rank, num_tokens > 0, "get_dispatch_layout: is_token_in_rank");
        check_ptr(per_rank, true, "get_dispatch_layout: num_tokens_per_rank");
        check_ptr(per_expert, true, "get_dispatch_layout: num_tokens_per_expert");
        k::get_dispatch_layout(topk_idx, idx_is_64, num_tokens, num_topk, num_ranks, num_experts, per_rank,
                               per_expert, in_rank, stream);
      },
      py::arg("topk_idx"), py::arg("idx_is_64"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_ranks"),
      py::arg("num_experts"), py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"),
      py::arg("is_token_in_rank"), py::arg("stream"));
  m.def(
      "intranode_notify",
      [](const std::vector<intptr_t>& buffers, int rank, int num_ranks, intptr_t per_rank, intptr_t per_expert,
         int experts_per_rank, int expert_alignment, intptr_t prefix, intptr_t out_info,
         intptr_t status, int64_t timeout_ns, intptr_t in_rank, int num_tokens, intptr_t send_pos, intptr_t stream,
         intptr_t topk_idx, bool idx_is_64, int num_topk, intptr_t out_bounds, int num_worst_tokens,
         int num_experts, int64_t header) {
        UCCL_EP_CHECK_ARG(num_tokens >= 0 && experts_per_rank >= 0 && num_worst_tokens >= 0 && num_experts >= 0 &&
                              num_topk >= 0,
                          "intranode_notify: num_tokens=", num_tokens, " experts_per_rank=", experts_per_rank,
                          " num_worst_tokens=", num_worst_tokens, " num_experts=", num_experts,
                          " num_topk=", num_topk);
        check_buffers(buffers, num_ranks, static_cast<int64_t>(k::kDataOffset), "intranode_notify");
        check_status(status, "intranode_notify: status");
        check_ptr(per_rank, true, "intranode_notify: num_tokens_per_rank");
        check_ptr(per_expert, experts_per_rank > 0, "intranode_notify: num_tokens_per_expert");
        check_ptr(prefix, true, "intranode_notify: rank_prefix_matrix");
        check_ptr(out_info, true, "intranode_notify: out_info");
        check_ptr(in_rank, send_pos != 0 && num_tokens > 0, "intranode_notify: is_token_in_rank");
        k::intranode_notify(buffers, rank, num_ranks, per_rank, per_expert, experts_per_rank, expert_alignment,
                            prefix, out_info, status, timeout_ns, in_rank, num_tokens, send_pos, stream, topk_idx,
                            idx_is_64, num_topk, out_bounds, num_worst_tokens, num_experts, header);
      },
      py::arg("buffers"), py::arg("rank"), py::arg("num_ranks"), py::arg("num_tokens_per_rank"),
      py::arg("num_tokens_per_expert"), py::arg("experts_per_rank"), py::arg("expert_alignment"),
      py::arg("rank_prefix_matrix"), py::arg("out_info"), py::arg("status"), py::arg("timeout_ns"),
      py::arg("is_token_in_rank"), py::arg("num_tokens"), py::arg("send_pos"), py::arg("stream"),
      py::arg("topk_idx") = 0, py::arg("idx_is_64") = true, py::arg("num_topk") = 0, py::arg("out_bounds") = 0,
      py::arg("num_worst_tokens") = 0, py::arg("num_experts") = 0, py::arg("header") = 0);
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
      .def_readwrite("own_rows", &k::DispatchArgs::own_rows)
      .def_readwrite("staging_rows", &k::DispatchArgs::staging_rows)
      .def_readwrite("send_rows", &k::DispatchArgs::send_rows)
      .def_readwrite("buffer_bytes", &k::DispatchArgs::buffer_bytes)
      .def_readwrite("num_sms", &k::DispatchArgs::num_sms)
      .def_readwrite("use_tma", &k::DispatchArgs::use_tma)
      .def_readwrite("status", &k::DispatchArgs::status)
      .def_readwrite("timeout_ns", &k::DispatchArgs::timeout_ns);
  m.def(
      "intranode_dispatch",
      [](const k::DispatchArgs& a, intptr_t stream) {
        check_dispatch(a);
        k::intranode_dispatch(a, stream);
      },
      py::arg("args"), py::arg("stream"));

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
      .def_readwrite("rank_prefix_matrix", &k::CombineArgs::rank_prefix_matrix)
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
      .def_readwrite("status", &k::CombineArgs::status)
      .def_readwrite("timeout_ns", &k::CombineArgs::timeout_ns)
      .def_readwrite("header", &k::CombineArgs::header);
  m.def(
      "intranode_combine_push",
      [](const k::CombineArgs& a, intptr_t stream) {
        check_combine(a, "intranode_combine_push");
        k::intranode_combine_push(a, stream);
      },
      py::arg("args"), py::arg("stream"));
  m.def(
      "intranode_combine_reduce",
      [](const k::CombineArgs& a, intptr_t stream) {
        check_combine(a, "intranode_combine_reduce");
        k::intranode_combine_reduce(a, stream);
      },
      py::arg("args"), py::arg("stream"));
#endif
}

}  // namespace uccl_ep::bindings

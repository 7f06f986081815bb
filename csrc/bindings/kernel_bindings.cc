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

#include "bindings/pointer_checks.h"
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
  // Peer abort records (kAbortOffset): their kinds and word, which Python packs and reads too.
  m.attr("ABORT_REJECTED") = k::kAbortRejected;
  m.attr("ABORT_TIMED_OUT") = k::kAbortTimedOut;
  m.attr("ABORT_HOST_GAVE_UP") = k::kAbortHostGaveUp;
  m.attr("ABORT_PEER_EXITED") = k::kAbortPeerExited;
  m.def("abort_word", &k::abort_word, py::arg("kind"), py::arg("code"), py::arg("site"), py::arg("peer"),
        py::arg("seq"), "An abort record's word: {seq:32 | peer waited for:8 | site:8 | kind:8 | code:8}.");

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
      "host_status_record",
      [](intptr_t ptr, const std::vector<int64_t>& words) {
        check_status(ptr, "host_status_record");
        k::host_status_record(ptr, words);
      },
      py::arg("ptr"), py::arg("words"),
      "Records a failure [code, a, b, extra] from the host as a kernel would (first one wins): every "
      "later kernel of the Buffer skips its data movement.");
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
      "post_abort_as",
      [](intptr_t own_buffer, int peer, uint64_t word, const std::string& reason) {
        check_buffers({own_buffer}, 1, static_cast<int64_t>(k::kDataOffset), "post_abort_as");
        py::gil_scoped_release release;
        k::post_abort_as(own_buffer, peer, word, reason);
      },
      py::arg("own_buffer"), py::arg("peer"), py::arg("word"), py::arg("reason"),
      "Write rank `peer`'s abort record into this rank's own buffer (its process exited): this "
      "rank's waits for it stop at once.");
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
  m.def("dispatch_staging_bytes", &k::dispatch_staging_bytes, py::arg("rows"), py::arg("row_bytes"),
        py::arg("num_scales"), py::arg("num_topk"), py::arg("idx_size"));
  m.def("combine_staging_bytes", &k::combine_staging_bytes, py::arg("rows"), py::arg("row_bytes"),
        py::arg("num_topk"));
  m.def("combine_push_blocks", &k::combine_push_blocks, py::arg("push_rows"), py::arg("reduce_rows"),
        py::arg("blocks"),
        "Blocks of a combine grid that push rows back (the rest reduce): the kernel's own split.");
#endif
  bind_intranode_calls(m);
#ifdef UCCL_EP_WITH_GPU
  bind_intranode_lane(m);
#endif
}

}  // namespace uccl_ep::bindings

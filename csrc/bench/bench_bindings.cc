// The `uccl_ep_megatron.bench._bench_C` extension: the FIFO test and benchmark kernels, kept out
// of the production `_C`. Channels come from `_C` (`_C.FifoChannel` objects): pybind11 shares
// registered types between extensions, so this module only reads their device handles.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bench/fifo_bench.h"
#include "bench/nvlink_bench.h"
#include "fifo/fifo.h"

namespace py = pybind11;

namespace uccl_ep::bindings {
namespace {

std::vector<FifoDeviceHandle> handles_of(const std::vector<FifoChannel*>& chans) {
  std::vector<FifoDeviceHandle> h;
  for (auto* c : chans) h.push_back(c->device_handle());
  return h;
}

void bind_bench(py::module_& m) {
  m.def(
      "fifo_launch_traffic",
      [](const std::vector<FifoChannel*>& chans, uint32_t blocks, uint32_t warps_per_block, uint32_t msgs,
         uint32_t len, uint32_t rank, uint32_t peer, uintptr_t region, int device, uintptr_t stream) {
        gpu::launch_traffic_kernel(handles_of(chans), blocks, warps_per_block, msgs, len, rank, peer,
                                   reinterpret_cast<void*>(region), device, stream);
      },
      py::arg("channels"), py::arg("blocks"), py::arg("warps_per_block"), py::arg("msgs"), py::arg("length"),
      py::arg("rank"), py::arg("peer"), py::arg("region_ptr"), py::arg("device"), py::arg("stream"),
      "Launch the GPU test's traffic kernel (see csrc/fifo/fifo_gpu.h).");
  m.def(
      "fifo_bench",
      [](int device, uint32_t channels, uint32_t threads, uint32_t blocks, uint32_t warps_per_block,
         uint32_t cmds_per_warp, uint32_t capacity, uint32_t latency_iters, uint64_t timeout_ms,
         uint32_t poll_backoff_ns) {
        gpu::FifoBenchResult r;
        {
          // Release the GIL only around the bench: the dict below is built with it held again
          // (creating Python objects without the GIL segfaulted the device run, rc 139).
          py::gil_scoped_release nogil;
          r = gpu::run_fifo_bench(device, channels, threads, blocks, warps_per_block, cmds_per_warp, capacity,
                                  latency_iters, timeout_ms, poll_backoff_ns);
        }
        py::dict d;
        d["commands"] = r.commands;
        d["seconds"] = r.seconds;
        d["kernel_seconds"] = r.kernel_seconds;
        d["order_errors"] = r.order_errors;
        d["latency_ns"] = r.latency_ns;
        d["push_ns"] = r.push_ns;
        d["host_read_ns"] = r.host_read_ns;
        d["push_to_poll_max_ns"] = r.push_to_poll_max_ns;
        d["clock_read_ns"] = r.clock_read_ns;
        return d;
      },
      py::arg("device"), py::arg("channels"), py::arg("threads"), py::arg("blocks"), py::arg("warps_per_block"),
      py::arg("cmds_per_warp"), py::arg("capacity"), py::arg("latency_iters"), py::arg("timeout_ms"),
      py::arg("poll_backoff_ns") = 0,
      "GPU->CPU command rate and push->pop latency of the FIFO (releases the GIL while it runs).");
  m.def(
      "nvlink_bench",
      [](const std::vector<int>& devices, const std::string& mode, int sms, int rows, int64_t row_bytes, int fanout,
         int iters) {
        gpu::NvlinkBenchResult r;
        {
          py::gil_scoped_release nogil;
          r = gpu::run_nvlink_bench(devices, mode, sms, rows, row_bytes, fanout, iters);
        }
        py::dict d;
        d["seconds"] = r.seconds;
        d["bytes_per_device"] = r.bytes_per_device;
        return d;
      },
      py::arg("devices"), py::arg("mode"), py::arg("sms"), py::arg("rows"), py::arg("row_bytes"), py::arg("fanout"),
      py::arg("iters"),
      "Seconds per all-to-all round of row copies between `devices` (ldst, tma or ce; see nvlink_bench.h).");
}

}  // namespace
}  // namespace uccl_ep::bindings

PYBIND11_MODULE(_bench_C, m) {
  m.doc() = "uccl_ep_megatron benchmark kernels (FIFO traffic and command-rate benches)";
  // The channel type and the exception translation live in _C: import it first.
  py::module_::import("uccl_ep_megatron._C");
  uccl_ep::bindings::bind_bench(m);
}

// The NVLink copy floor (defined in nvlink_bench.cu; GPU builds, `_bench_C` only): how fast the
// row copies the intranode kernels are built from move bytes between GPUs in the all-to-all
// pattern of a dispatch, next to the copy engines.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace uccl_ep::gpu {

struct NvlinkBenchResult {
  std::vector<double> seconds;  // per device: its events' span over the timed rounds / rounds
  int64_t bytes_per_device = 0;  // bytes each device writes into its peers per round
};

// One process drives every device in `devices` (peer access enabled between them). Each device
// holds `rows` source rows of `row_bytes`; a round sends every row to `fanout` peers (row t to
// peers rank+1+(t+j) mod, j < fanout), all devices at once, and times it with events on
// each device:
//   "ldst": the dispatch's warp row copy (16-byte loads once, stores to each destination),
//   "tma":  the dispatch's bulk-copy pipeline (shared-memory stage, bulk stores to each peer),
//   "ce":   copy engines, one stream per (device, peer), a cudaMemcpyPeerAsync per peer slot
//           (fanout rows per peer are contiguous there; same bytes).
// `sms` blocks of 512 threads for the kernels. After a warm-up round, `iters` rounds go back to
// back on every device, so the launch skew between devices counts once, not once per round.
NvlinkBenchResult run_nvlink_bench(const std::vector<int>& devices, const std::string& mode, int sms, int rows,
                                   int64_t row_bytes, int fanout, int iters);

}  // namespace uccl_ep::gpu

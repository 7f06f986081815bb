// FIFO test and benchmark kernels (defined in fifo_bench.cu; GPU builds, `_bench_C` only).
#pragma once

#include <cstdint>
#include <vector>

#include "fifo/fifo.h"
#include "fifo/fifo_gpu.h"

namespace uccl_ep::gpu {

// Kernel: warps_per_block * blocks warps; lane 0 of warp w pushes cmds_per_warp Writes into
// channel w % num_channels, encoding (producer w, sequence i) in (dst_rank, length) so the consumer
// can check exactly-once, per-producer order. Returns after launch (async on `stream`).
void launch_push_kernel(const std::vector<FifoDeviceHandle>& handles, uint32_t blocks, uint32_t warps_per_block,
                        uint32_t cmds_per_warp, int device, uintptr_t stream);

// The proxy traffic of the GPU test: warp w of `rank` fills its slice of the send area with a
// pattern, then pushes Write+atomic(+1 on counter rank*channels + channel) of `len` bytes into
// `peer`'s receive area, msgs times; then Drain(all) and a Barrier on its channel, and waits for
// both. Region layout: send area [0, S), receive area [S, 2S), S = warps*msgs*len, slice (w, k) at
// (w*msgs + k)*len. Failed waits are recorded in the channels' error records.
void launch_traffic_kernel(const std::vector<FifoDeviceHandle>& handles, uint32_t blocks, uint32_t warps_per_block,
                           uint32_t msgs, uint32_t len, uint32_t rank, uint32_t peer, void* region, int device,
                           uintptr_t stream);

struct FifoBenchResult {
  uint64_t commands = 0;
  double seconds = 0;        // first launch to last pop, host clock
  double kernel_seconds = 0;  // GPU events around the kernel
  uint64_t order_errors = 0;  // commands out of per-producer order or lost
  std::vector<uint64_t> latency_ns;  // push -> completion visible to the pushing thread
  std::vector<uint64_t> push_ns;       // until fifo_push returned (atomic, fence, slot store issued)
  std::vector<uint64_t> host_read_ns;  // one GPU read of the host-resident head (the return leg's floor)
  // One-way push -> poll on the host clock alone. Before each push the GPU reads a host word that
  // the consumer rewrites with its clock while it polls; the consumer stamps the poll that finds
  // the command. The value was written before the read sampled it, and the push began after the
  // read returned, so poll - value is an upper bound of push -> poll (by the read's return leg);
  // minus the read's round trip (clock_read_ns, GPU clock) it is a lower bound.
  std::vector<uint64_t> push_to_poll_max_ns;
  std::vector<uint64_t> clock_read_ns;
};

// Throughput: `threads` CPU consumers (channel c served by thread c % threads, pinned to the GPU's
// NUMA node) drain the push kernel's commands; a channel found empty (or drained below a full
// batch) is not polled again for poll_backoff_ns (0: at once). Latency: one thread pushes and
// waits for each pop.
FifoBenchResult run_fifo_bench(int device, uint32_t channels, uint32_t threads, uint32_t blocks,
                               uint32_t warps_per_block, uint32_t cmds_per_warp, uint32_t capacity,
                               uint32_t latency_iters, uint64_t timeout_ms, uint32_t poll_backoff_ns = 0);

}  // namespace uccl_ep::gpu

// Host-callable GPU side of the FIFO (defined in fifo_gpu.cu; only in GPU builds): channels whose
// producers are kernels, mapped host memory for software-atomic counters, device queries. The
// test/benchmark kernels are declared in csrc/bench/fifo_bench.h.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fifo/fifo.h"

namespace uccl_ep::gpu {

// Slots and control block in pinned host memory mapped into every device (portable), tail and
// head cache in `device` memory.
std::unique_ptr<FifoChannel> create_fifo(uint32_t channel, uint32_t capacity, uint64_t timeout_ms, int device);

// Pinned, zeroed host memory mapped into every device; `dev` is the pointer kernels use.
struct MappedHost {
  void* host = nullptr;
  void* dev = nullptr;
  size_t bytes = 0;
};
MappedHost alloc_mapped(size_t bytes);
void free_mapped(void* host);

std::string pci_bus_id(int device);
int device_count();

}  // namespace uccl_ep::gpu

// Host-callable GPU side of the FIFO (only in GPU builds): channels whose producers are kernels,
// mapped host memory for software-atomic counters, device queries. The test and benchmark kernels
// that drive these channels live apart, in csrc/bench/fifo_bench.cu (the `_bench_C` extension).
#include <cstring>

#include "common/gpu.h"
#include "fifo/fifo_gpu.h"

#if defined(UCCL_EP_DEVICE_HIP)
#define fifo_host_alloc_portable hipHostMallocPortable
#else
#define fifo_host_alloc_portable cudaHostAllocPortable
#endif

namespace uccl_ep::gpu {

std::unique_ptr<FifoChannel> create_fifo(uint32_t channel, uint32_t capacity, uint64_t timeout_ms, int device) {
  UCCL_EP_CHECK_ARG(capacity >= 2 && (capacity & (capacity - 1)) == 0, "FIFO capacity=", capacity,
                    " must be a power of two");
  GPU_CHECK(gpuSetDevice(device));
  MappedHost host = alloc_mapped(FifoChannel::host_bytes(capacity));
  unsigned long long* dev = nullptr;
  // tail and head cache on separate 128-byte lines: producers hammer tail with atomics.
  GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&dev), 256));
  GPU_CHECK(gpuMemsetAsync(dev, 0, 256, 0));
  GPU_CHECK(gpuDeviceSynchronize());
  FifoChannel::Memory mem;
  mem.block_host = static_cast<FifoHostBlock*>(host.host);
  mem.block_dev = static_cast<FifoHostBlock*>(host.dev);
  mem.slots_host = reinterpret_cast<uint64_t*>(static_cast<char*>(host.host) + sizeof(FifoHostBlock));
  mem.slots_dev = reinterpret_cast<uint64_t*>(static_cast<char*>(host.dev) + sizeof(FifoHostBlock));
  mem.tail_dev = dev;
  mem.head_cache_dev = dev + 16;
  mem.host_producer = false;
  void* h = host.host;
  mem.release = [h, dev, device] {
    (void)gpuSetDevice(device);
    (void)gpuFree(dev);
    (void)gpuFreeHost(h);
  };
  return std::make_unique<FifoChannel>(channel, capacity, timeout_ms, std::move(mem));
}

MappedHost alloc_mapped(size_t bytes) {
  MappedHost m;
  m.bytes = bytes;
  GPU_CHECK(gpuHostAlloc(&m.host, bytes, gpuHostAllocMapped | fifo_host_alloc_portable));
  std::memset(m.host, 0, bytes);
  GPU_CHECK(gpuHostGetDevicePointer(&m.dev, m.host, 0));
  return m;
}

void free_mapped(void* host) {
  if (host) GPU_CHECK(gpuFreeHost(host));
}

std::string pci_bus_id(int device) {
  char buf[64] = {};
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipDeviceGetPCIBusId(buf, sizeof(buf), device));
#else
  GPU_CHECK(cudaDeviceGetPCIBusId(buf, sizeof(buf), device));
#endif
  return buf;
}

int device_count() {
  int n = 0;
  if (gpuGetDeviceCount(&n) != gpuSuccess) return 0;
  return n;
}

}  // namespace uccl_ep::gpu

// GPU operations the host-only transports need, supplied by the GPU library (transport_gpu.cu)
// through function pointers, so the core compiles and its tests link without a GPU toolchain.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace uccl_ep {

struct GpuHooks {
  // Opaque bytes that let another process map the allocation containing `ptr` (ptr may be an
  // interior pointer; the bytes carry the offset).
  std::string (*ipc_handle)(void* ptr, int device) = nullptr;
  // Maps a handle from ipc_handle in this process; returns the pointer equal to the exporter's ptr.
  void* (*ipc_open)(const std::string& handle, int device) = nullptr;
  void (*ipc_close)(void* ptr, int device) = nullptr;
  // Copy queue of one proxy endpoint: a stream on `device` and a ring of `depth` events, created
  // up front (connect time, before kernels run) and used by one thread only. Nothing in it ever
  // waits for the GPU: a proxy thread blocked inside a CUDA wait cannot time out or report, and
  // a copy that cannot run while a kernel spins on that same proxy would hang both silently.
  void* (*copy_queue_create)(int device, uint32_t depth) = nullptr;
  // Waits for the queue's copies (teardown only) and frees it.
  void (*copy_queue_destroy)(void* queue) = nullptr;
  // Enqueues dst <- src (any host/device pointers); returns the copy's ticket (1, 2, ...). The
  // caller keeps fewer than `depth` copies in flight (submitted - completed).
  uint64_t (*copy_submit)(void* queue, void* dst, const void* src, size_t bytes) = nullptr;
  // Enqueues n copies dst[i] <- src[i] as one submission (cudaMemcpyBatchAsync where the runtime
  // has it); returns one ticket for all of them. Null: the caller submits copies one at a time.
  uint64_t (*copy_submit_batch)(void* queue, void* const* dst, const void* const* src, const size_t* bytes,
                                size_t n) = nullptr;
  // Tickets completed so far, in submission order (every ticket <= the value landed); polls the
  // events, never blocks.
  uint64_t (*copy_completed)(void* queue) = nullptr;
  // Lets `device`'s copies write `peer_device` memory directly (NVLink / PCIe P2P). Without it a
  // copy between two devices of one process is staged through host memory by the driver, which
  // is slower and involves the peer's context. False when the pair cannot do P2P.
  bool (*enable_peer_access)(int device, int peer_device) = nullptr;
  // A DMA-BUF file descriptor for [ptr, ptr+bytes) (verbs registration without peer-memory), or -1.
  int (*dmabuf_fd)(void* ptr, size_t bytes, size_t* offset) = nullptr;
  // Base and size of the device allocation holding `ptr` (with `device` current); false when ptr
  // is not device memory of this process. Lets the bindings bounds-check a region they did not
  // allocate (e.g. a torch tensor) before a transport writes into it.
  bool (*address_range)(const void* ptr, int device, uintptr_t* base, size_t* bytes) = nullptr;
};

// The hooks of the GPU library when it was built, else nullptr. Defined in transport_gpu.cu;
// host-only code reaches it through the bindings, never by linking.
const GpuHooks* gpu_hooks();

}  // namespace uccl_ep

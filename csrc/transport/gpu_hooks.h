// GPU operations the host-only transports need, supplied by the GPU library (transport_gpu.cu)
// through function pointers, so the core compiles and its tests link without a GPU toolchain.
#pragma once

#include <cstddef>
#include <string>

namespace uccl_ep {

struct GpuHooks {
  // Opaque bytes that let another process map the allocation containing `ptr` (ptr may be an
  // interior pointer; the bytes carry the offset).
  std::string (*ipc_handle)(void* ptr, int device) = nullptr;
  // Maps a handle from ipc_handle in this process; returns the pointer equal to the exporter's ptr.
  void* (*ipc_open)(const std::string& handle, int device) = nullptr;
  void (*ipc_close)(void* ptr, int device) = nullptr;
  // Copies between any host/device pointers; returns after the bytes landed.
  void (*copy)(void* dst, const void* src, size_t bytes, int device) = nullptr;
  // A DMA-BUF file descriptor for [ptr, ptr+bytes) (verbs registration without peer-memory), or -1.
  int (*dmabuf_fd)(void* ptr, size_t bytes, size_t* offset) = nullptr;
};

// The hooks of the GPU library when it was built, else nullptr. Defined in transport_gpu.cu;
// host-only code reaches it through the bindings, never by linking.
const GpuHooks* gpu_hooks();

}  // namespace uccl_ep

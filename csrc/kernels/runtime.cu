// Memory and IPC plumbing of the intranode path: the registered buffer, its IPC handle, the
// peers' mappings and the mapped host status words.
#include <cstring>

#include "common/gpu.h"
#include "kernels/intranode.h"

namespace uccl_ep::kernels {

intptr_t device_alloc_zeroed(size_t bytes) {
  UCCL_EP_CHECK_ARG(bytes > 0, "buffer size must be positive, got ", bytes);
  void* p = nullptr;
  GPU_CHECK(gpuMalloc(&p, bytes));
  // Barrier flags start at 0 and sequence numbers at 1: a fresh buffer never looks signalled.
  GPU_CHECK(gpuMemsetAsync(p, 0, bytes, 0));
  GPU_CHECK(gpuDeviceSynchronize());
  return reinterpret_cast<intptr_t>(p);
}

void device_free(intptr_t ptr) {
  if (ptr) GPU_CHECK(gpuFree(reinterpret_cast<void*>(ptr)));
}

void device_copy(intptr_t dst, intptr_t src, size_t bytes) {
  if (bytes == 0) return;
  GPU_CHECK(gpuMemcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), bytes, gpuMemcpyDefault));
}

std::string ipc_get_handle(intptr_t ptr) {
  gpuIpcMemHandle_t h;
  GPU_CHECK(gpuIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

intptr_t ipc_open_handle(const std::string& handle) {
  UCCL_EP_CHECK_ARG(handle.size() == sizeof(gpuIpcMemHandle_t), "IPC handle has ", handle.size(),
                    " bytes, expected ", sizeof(gpuIpcMemHandle_t), " (from ipc_get_handle of this build)");
  gpuIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  GPU_CHECK(gpuIpcOpenMemHandle(&p, h, gpuIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<intptr_t>(p);
}

void ipc_close_handle(intptr_t ptr) {
  if (ptr) GPU_CHECK(gpuIpcCloseMemHandle(reinterpret_cast<void*>(ptr)));
}

intptr_t host_status_alloc() {
  void* p = nullptr;
  GPU_CHECK(gpuHostAlloc(&p, kStatusWords * sizeof(int64_t), gpuHostAllocMapped));
  std::memset(p, 0, kStatusWords * sizeof(int64_t));
  return reinterpret_cast<intptr_t>(p);
}

void host_status_free(intptr_t ptr) {
  if (ptr) GPU_CHECK(gpuFreeHost(reinterpret_cast<void*>(ptr)));
}

}  // namespace uccl_ep::kernels

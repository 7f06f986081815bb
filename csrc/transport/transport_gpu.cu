// GpuHooks for the host-only transports: IPC handles of (interior) device pointers, copies on a
// per-thread stream, DMA-BUF export for verbs registration.
#include <cstring>
#include <map>
#include <mutex>

#include "common/gpu.h"
#include "transport/gpu_hooks.h"

#if !defined(UCCL_EP_DEVICE_HIP)
#include <cuda.h>
#endif

namespace uccl_ep {
namespace {

#if !defined(UCCL_EP_DEVICE_HIP)
// Driver entry points through the runtime, so `_C` needs no link against libcuda.
template <typename Fn>
Fn driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  GPU_CHECK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || !fn) UCCL_EP_THROW(Unsupported, "CUDA driver lacks ", name);
  return reinterpret_cast<Fn>(fn);
}
#endif

// Base of the allocation holding ptr: IPC handles name allocations, not interior pointers.
char* allocation_base(void* ptr, size_t* size) {
#if defined(UCCL_EP_DEVICE_HIP)
  void* base = nullptr;
  GPU_CHECK(hipMemGetAddressRange(&base, size, ptr));
  return static_cast<char*>(base);
#else
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn get_range = driver_fn<Fn>("cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t sz = 0;
  if (get_range(&base, &sz, reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) {
    UCCL_EP_THROW(InvalidArgument, "pointer ", ptr, " is not device memory of this process (cuMemGetAddressRange)");
  }
  if (size) *size = sz;
  return reinterpret_cast<char*>(base);
#endif
}

std::mutex g_mu;
std::map<void*, void*> g_open_base;  // pointer returned by ipc_open -> mapped base

std::string hook_ipc_handle(void* ptr, int device) {
  GPU_CHECK(gpuSetDevice(device));
  char* base = allocation_base(ptr, nullptr);
  gpuIpcMemHandle_t h;
  GPU_CHECK(gpuIpcGetMemHandle(&h, base));
  uint64_t offset = static_cast<uint64_t>(static_cast<char*>(ptr) - base);
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  out.append(reinterpret_cast<const char*>(&offset), sizeof(offset));
  return out;
}

void* hook_ipc_open(const std::string& handle, int device) {
  UCCL_EP_CHECK_ARG(handle.size() == sizeof(gpuIpcMemHandle_t) + sizeof(uint64_t), "IPC handle of ", handle.size(),
                    " bytes is not from this build");
  gpuIpcMemHandle_t h;
  uint64_t offset;
  std::memcpy(&h, handle.data(), sizeof(h));
  std::memcpy(&offset, handle.data() + sizeof(h), sizeof(offset));
  GPU_CHECK(gpuSetDevice(device));
  void* base = nullptr;
  GPU_CHECK(gpuIpcOpenMemHandle(&base, h, gpuIpcMemLazyEnablePeerAccess));
  void* p = static_cast<char*>(base) + offset;
  std::lock_guard<std::mutex> lock(g_mu);
  g_open_base[p] = base;
  return p;
}

void hook_ipc_close(void* ptr, int /*device*/) {
  void* base = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_open_base.find(ptr);
    if (it == g_open_base.end()) return;
    base = it->second;
    g_open_base.erase(it);
  }
  // Teardown: report nothing if the context is already gone.
  (void)gpuIpcCloseMemHandle(base);
}

void hook_copy(void* dst, const void* src, size_t bytes, int device) {
  // One non-blocking stream per proxy thread: copies never serialize behind the kernels that
  // push the commands (those kernels wait for these copies).
  thread_local std::map<int, gpuStream_t> streams;
  GPU_CHECK(gpuSetDevice(device));
  gpuStream_t& s = streams[device];
  if (!s) {
#if defined(UCCL_EP_DEVICE_HIP)
    GPU_CHECK(hipStreamCreateWithFlags(&s, hipStreamNonBlocking));
#else
    GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
#endif
  }
  GPU_CHECK(gpuMemcpyAsync(dst, src, bytes, gpuMemcpyDefault, s));
  GPU_CHECK(gpuStreamSynchronize(s));
}

int hook_dmabuf_fd(void* ptr, size_t bytes, size_t* offset) {
#if defined(UCCL_EP_DEVICE_HIP)
  (void)ptr;
  (void)bytes;
  (void)offset;
  return -1;
#else
  using Fn = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);
  static Fn get_handle = driver_fn<Fn>("cuMemGetHandleForAddressRange");
  // DMA-BUF export works on whole pages; register [aligned, aligned + span) at `offset`.
  const uint64_t page = 1ull << 16;
  uint64_t p = reinterpret_cast<uint64_t>(ptr);
  uint64_t aligned = p & ~(page - 1);
  uint64_t span = ((p + bytes - aligned) + page - 1) & ~(page - 1);
  int fd = -1;
  if (get_handle(&fd, static_cast<CUdeviceptr>(aligned), span, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0) !=
      CUDA_SUCCESS) {
    return -1;
  }
  *offset = p - aligned;
  return fd;
#endif
}

const GpuHooks kHooks = [] {
  GpuHooks h;
  h.ipc_handle = hook_ipc_handle;
  h.ipc_open = hook_ipc_open;
  h.ipc_close = hook_ipc_close;
  h.copy = hook_copy;
  h.dmabuf_fd = hook_dmabuf_fd;
  return h;
}();

}  // namespace

const GpuHooks* gpu_hooks() { return &kHooks; }

}  // namespace uccl_ep

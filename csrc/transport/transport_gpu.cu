// GpuHooks for the host-only transports: IPC handles of (interior) device pointers, the ipc NIC's
// copy queues (stream + events, polled, never waited on; batched submissions), P2P enabling,
// DMA-BUF export for verbs.
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/gpu.h"
#include "transport/gpu_hooks.h"

#if !defined(UCCL_EP_DEVICE_HIP)
#include <cuda.h>
#endif

namespace uccl_ep {
namespace {

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

// Makes `device` current and restores the caller's device: connect-time hooks run on the user's
// thread, whose current device (PyTorch's too) must not change under it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (gpuGetDevice(&prev_) != gpuSuccess) prev_ = -1;
    GPU_CHECK(gpuSetDevice(device));
  }
  ~DeviceGuard() {
    if (prev_ >= 0) (void)gpuSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

std::mutex g_mu;
std::map<void*, void*> g_open_base;  // pointer returned by ipc_open -> mapped base

std::string hook_ipc_handle(void* ptr, int device) {
  DeviceGuard guard(device);
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
  DeviceGuard guard(device);
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

// One copy stream of the ipc NIC: its own non-blocking stream (copies never serialize behind the
// kernels that push the commands; those kernels wait for these copies) and a ring of events,
// one per submission in flight. Created and destroyed by the thread that connects the
// transport, used by the NIC thread in between: no locking.
struct CopyQueue {
  int device = -1;
  gpuStream_t stream = nullptr;
  std::vector<gpuEvent_t> events;
  uint64_t submitted = 0;
  uint64_t completed = 0;
};

void* hook_copy_queue_create(int device, uint32_t depth) {
  UCCL_EP_CHECK_ARG(depth >= 1, "copy queue depth must be >= 1");
  DeviceGuard guard(device);
  auto q = std::make_unique<CopyQueue>();
  q->device = device;
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipStreamCreateWithFlags(&q->stream, hipStreamNonBlocking));
#else
  GPU_CHECK(cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking));
#endif
  q->events.resize(depth, nullptr);
  for (auto& e : q->events) {
#if defined(UCCL_EP_DEVICE_HIP)
    GPU_CHECK(hipEventCreateWithFlags(&e, hipEventDisableTiming));
#else
    GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
#endif
  }
  return q.release();
}

void hook_copy_queue_destroy(void* queue) {
  std::unique_ptr<CopyQueue> q(static_cast<CopyQueue*>(queue));
  if (!q) return;
  // Teardown: report nothing if the context is already gone.
  int prev = -1;
  if (gpuGetDevice(&prev) != gpuSuccess) prev = -1;
  (void)gpuSetDevice(q->device);
  (void)gpuStreamSynchronize(q->stream);
  for (auto& e : q->events) {
#if defined(UCCL_EP_DEVICE_HIP)
    (void)hipEventDestroy(e);
#else
    (void)cudaEventDestroy(e);
#endif
  }
#if defined(UCCL_EP_DEVICE_HIP)
  (void)hipStreamDestroy(q->stream);
#else
  (void)cudaStreamDestroy(q->stream);
#endif
  if (prev >= 0) (void)gpuSetDevice(prev);
}

uint64_t hook_copy_submit(void* queue, void* dst, const void* src, size_t bytes) {
  auto* q = static_cast<CopyQueue*>(queue);
  UCCL_EP_CHECK_ARG(q->submitted - q->completed < q->events.size(), "copy queue of device ", q->device, " has ",
                    q->events.size(), " copies in flight already");
  GPU_CHECK(gpuSetDevice(q->device));
  GPU_CHECK(gpuMemcpyAsync(dst, src, bytes, gpuMemcpyDefault, q->stream));
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipEventRecord(q->events[q->submitted % q->events.size()], q->stream));
#else
  GPU_CHECK(cudaEventRecord(q->events[q->submitted % q->events.size()], q->stream));
#endif
  return ++q->submitted;
}

uint64_t hook_copy_submit_batch(void* queue, void* const* dst, const void* const* src, const size_t* bytes,
                                size_t n) {
  auto* q = static_cast<CopyQueue*>(queue);
  UCCL_EP_CHECK_ARG(n >= 1 && q->submitted - q->completed < q->events.size(), "copy queue of device ", q->device,
                    ": batch of ", n, " copies with ", q->submitted - q->completed, " of ", q->events.size(),
                    " submissions in flight");
  GPU_CHECK(gpuSetDevice(q->device));
#if !defined(UCCL_EP_DEVICE_HIP) && CUDART_VERSION >= 12080
  if (n > 1) {
    // One API call for the whole batch; the driver may spread it over several copy engines.
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
    GPU_CHECK(cudaMemcpyBatchAsync(dst, src, bytes, n, &attr, &attr_idx, 1, q->stream));
#else
    size_t fail_idx = 0;
    GPU_CHECK(cudaMemcpyBatchAsync(const_cast<void**>(dst), const_cast<void**>(src), const_cast<size_t*>(bytes), n,
                                   &attr, &attr_idx, 1, &fail_idx, q->stream));
#endif
  } else {
    GPU_CHECK(gpuMemcpyAsync(dst[0], src[0], bytes[0], gpuMemcpyDefault, q->stream));
  }
#else
  for (size_t i = 0; i < n; ++i) GPU_CHECK(gpuMemcpyAsync(dst[i], src[i], bytes[i], gpuMemcpyDefault, q->stream));
#endif
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipEventRecord(q->events[q->submitted % q->events.size()], q->stream));
#else
  GPU_CHECK(cudaEventRecord(q->events[q->submitted % q->events.size()], q->stream));
#endif
  return ++q->submitted;
}

uint64_t hook_copy_completed(void* queue) {
  auto* q = static_cast<CopyQueue*>(queue);
  // One stream: events complete in submission order, so the first pending one bounds the rest.
  while (q->completed < q->submitted) {
#if defined(UCCL_EP_DEVICE_HIP)
    hipError_t r = hipEventQuery(q->events[q->completed % q->events.size()]);
    if (r == hipErrorNotReady) break;
#else
    cudaError_t r = cudaEventQuery(q->events[q->completed % q->events.size()]);
    if (r == cudaErrorNotReady) break;
#endif
    GPU_CHECK(r);
    ++q->completed;
  }
  return q->completed;
}

bool hook_enable_peer_access(int device, int peer_device) {
  if (device == peer_device) return true;
  int can = 0;
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipDeviceCanAccessPeer(&can, device, peer_device));
#else
  GPU_CHECK(cudaDeviceCanAccessPeer(&can, device, peer_device));
#endif
  if (!can) return false;
  DeviceGuard guard(device);
#if defined(UCCL_EP_DEVICE_HIP)
  hipError_t r = hipDeviceEnablePeerAccess(peer_device, 0);
  if (r == hipErrorPeerAccessAlreadyEnabled) {
    (void)hipGetLastError();  // PyTorch (or an earlier transport) enabled it: fine
    return true;
  }
#else
  cudaError_t r = cudaDeviceEnablePeerAccess(peer_device, 0);
  if (r == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();  // PyTorch (or an earlier transport) enabled it: fine
    return true;
  }
#endif
  GPU_CHECK(r);
  return true;
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

bool hook_address_range(const void* ptr, int device, uintptr_t* base, size_t* bytes) {
  DeviceGuard guard(device);
  size_t size = 0;
  try {
    *base = reinterpret_cast<uintptr_t>(allocation_base(const_cast<void*>(ptr), &size));
  } catch (const Error&) {
    (void)gpuGetLastError();  // a failed query leaves nothing behind for the next runtime call
    return false;
  }
  *bytes = size;
  return size > 0;
}

const GpuHooks kHooks = [] {
  GpuHooks h;
  h.ipc_handle = hook_ipc_handle;
  h.ipc_open = hook_ipc_open;
  h.ipc_close = hook_ipc_close;
  h.copy_queue_create = hook_copy_queue_create;
  h.copy_queue_destroy = hook_copy_queue_destroy;
  h.copy_submit = hook_copy_submit;
  h.copy_submit_batch = hook_copy_submit_batch;
  h.copy_completed = hook_copy_completed;
  h.enable_peer_access = hook_enable_peer_access;
  h.dmabuf_fd = hook_dmabuf_fd;
  h.address_range = hook_address_range;
  return h;
}();

}  // namespace

const GpuHooks* gpu_hooks() { return &kHooks; }

}  // namespace uccl_ep

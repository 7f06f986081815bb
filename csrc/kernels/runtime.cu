// Memory and IPC plumbing of the intranode path: the registered buffer, its IPC handle, the
// peers' mappings and the mapped host status words.
#include <cstring>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "common/gpu.h"
#include "kernels/common.cuh"

#if !defined(UCCL_EP_DEVICE_HIP)
#include <cuda.h>
#endif

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

namespace {
// Runs `f` with `device` current, then restores the previous device.
template <typename F>
auto on_device(int device, F&& f) {
  int prev = 0;
  GPU_CHECK(gpuGetDevice(&prev));
  if (prev != device) GPU_CHECK(gpuSetDevice(device));
  struct Restore {
    int prev, device;
    ~Restore() {
      if (prev != device) (void)gpuSetDevice(prev);
    }
  } restore{prev, device};
  return f();
}
}  // namespace

intptr_t event_create(int device) {
  return on_device(device, [] {
    gpuEvent_t e = nullptr;
    GPU_CHECK(gpuEventCreateWithFlags(&e, gpuEventDisableTiming));
    return reinterpret_cast<intptr_t>(e);
  });
}

void event_destroy(intptr_t event) {
  if (event) GPU_CHECK(gpuEventDestroy(reinterpret_cast<gpuEvent_t>(event)));
}

void event_record(intptr_t event, intptr_t stream) {
  GPU_CHECK(gpuEventRecord(reinterpret_cast<gpuEvent_t>(event), reinterpret_cast<gpuStream_t>(stream)));
}

bool event_done(intptr_t event) {
  const gpuError_t err = gpuEventQuery(reinterpret_cast<gpuEvent_t>(event));
  if (err == gpuErrorNotReady) {
    (void)gpuGetLastError();  // not an error: clear it
    return false;
  }
  GPU_CHECK(err);
  return true;
}

void stream_wait_event(intptr_t stream, intptr_t event) {
  GPU_CHECK(gpuStreamWaitEvent(reinterpret_cast<gpuStream_t>(stream), reinterpret_cast<gpuEvent_t>(event), 0));
}

void copy_on_stream(intptr_t dst, intptr_t src, int64_t bytes, intptr_t stream) {
  if (bytes <= 0) return;
  GPU_CHECK(gpuMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), static_cast<size_t>(bytes),
                           gpuMemcpyDefault, reinterpret_cast<gpuStream_t>(stream)));
}

#if !defined(UCCL_EP_DEVICE_HIP)
namespace {
void driver_check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) UCCL_EP_THROW(GpuError, what, " failed: CUresult ", static_cast<int>(r));
}
}  // namespace
#endif

void stream_wait_at_least(intptr_t stream, intptr_t addr, uint64_t value) {
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipStreamWaitValue64(reinterpret_cast<hipStream_t>(stream), reinterpret_cast<void*>(addr), value,
                                 hipStreamWaitValueGte, ~0ull));
#else
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const Fn wait = driver_fn<Fn>("cuStreamWaitValue64");
  driver_check(
      wait(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(addr), value, CU_STREAM_WAIT_VALUE_GEQ),
      "cuStreamWaitValue64");
#endif
}

void stream_write_word(intptr_t stream, intptr_t addr, uint64_t value) {
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipStreamWriteValue64(reinterpret_cast<hipStream_t>(stream), reinterpret_cast<void*>(addr), value, 0));
#else
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  static const Fn write = driver_fn<Fn>("cuStreamWriteValue64");
  driver_check(write(reinterpret_cast<CUstream>(stream), static_cast<CUdeviceptr>(addr), value,
                     CU_STREAM_WRITE_VALUE_DEFAULT),
               "cuStreamWriteValue64");
#endif
}

uint64_t next_ce_value() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1) + 1;
}

bool stream_capturing(intptr_t stream) {
  gpuStreamCaptureStatus st = gpuStreamCaptureStatusNone;
  GPU_CHECK(gpuStreamIsCapturing(reinterpret_cast<gpuStream_t>(stream), &st));
  return st != gpuStreamCaptureStatusNone;
}

void device_free_on(int device, intptr_t ptr) {
  on_device(device, [ptr] {
    device_free(ptr);
    return 0;
  });
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

namespace {
// Abort records travel on a private non-blocking stream: the caller's stream may be ordered
// behind work that waits for the very peers being told to stop. Error path only, so a stream
// per call is fine.
struct PrivateStream {
  gpuStream_t s{};
  PrivateStream() { GPU_CHECK(gpuStreamCreateWithFlags(&s, gpuStreamNonBlocking)); }
  ~PrivateStream() { (void)gpuStreamDestroy(s); }
  PrivateStream(const PrivateStream&) = delete;
  PrivateStream& operator=(const PrivateStream&) = delete;
};

// Writes rank `slot`'s abort record into the control region at `base`: the reason first, then
// the word that announces it, each waited for on `s`.
void write_abort(uint8_t* base, int slot, uint64_t word, const std::string& text, gpuStream_t s) {
  GPU_CHECK(gpuMemcpyAsync(base + kAbortReasonOffset + kAbortReasonBytes * slot, text.data(), text.size(),
                           gpuMemcpyHostToDevice, s));
  GPU_CHECK(gpuStreamSynchronize(s));  // the reason lands before the word that announces it
  GPU_CHECK(gpuMemcpyAsync(base + kAbortOffset + 8ull * slot, &word, sizeof(word), gpuMemcpyHostToDevice, s));
  GPU_CHECK(gpuStreamSynchronize(s));
}

std::string abort_text(const std::string& reason) {
  std::string text = reason.substr(0, kAbortReasonBytes - 1);
  text.resize(kAbortReasonBytes, '\0');
  return text;
}
}  // namespace

void post_abort(const std::vector<intptr_t>& buffers, int rank, uint64_t word, const std::string& reason) {
  UCCL_EP_CHECK_ARG(word != 0, "post_abort: the abort word must be non-zero");
  const std::string text = abort_text(reason);
  PrivateStream ps;
  for (size_t r = 0; r < buffers.size(); ++r) {
    if (static_cast<int>(r) == rank || buffers[r] == 0) continue;
    write_abort(reinterpret_cast<uint8_t*>(buffers[r]), rank, word, text, ps.s);
  }
}

void post_abort_as(intptr_t own_buffer, int peer, uint64_t word, const std::string& reason) {
  UCCL_EP_CHECK_ARG(word != 0, "post_abort_as: the abort word must be non-zero");
  UCCL_EP_CHECK_ARG(peer >= 0 && peer < kMaxRanks, "post_abort_as: peer ", peer, " is not in [0, ", kMaxRanks, ")");
  PrivateStream ps;
  write_abort(reinterpret_cast<uint8_t*>(own_buffer), peer, word, abort_text(reason), ps.s);
}

std::pair<uint64_t, std::string> read_abort(intptr_t own_buffer, int peer) {
  UCCL_EP_CHECK_ARG(peer >= 0 && peer < kMaxRanks, "read_abort: peer ", peer, " is not in [0, ", kMaxRanks, ")");
  auto* base = reinterpret_cast<const uint8_t*>(own_buffer);
  uint64_t word = 0;
  std::string text(kAbortReasonBytes, '\0');
  PrivateStream ps;
  gpuStream_t s = ps.s;
  GPU_CHECK(gpuMemcpyAsync(&word, base + kAbortOffset + 8ull * peer, sizeof(word), gpuMemcpyDeviceToHost, s));
  GPU_CHECK(gpuMemcpyAsync(text.data(), base + kAbortReasonOffset + kAbortReasonBytes * peer, text.size(),
                           gpuMemcpyDeviceToHost, s));
  GPU_CHECK(gpuStreamSynchronize(s));
  text.resize(text.find('\0') == std::string::npos ? text.size() : text.find('\0'));
  return {word, text};
}

intptr_t host_status_alloc() {
  void* flag = nullptr;
  GPU_CHECK(gpuMalloc(&flag, sizeof(int64_t)));
  const int64_t zero = 0;
  GPU_CHECK(gpuMemcpy(flag, &zero, sizeof(zero), gpuMemcpyHostToDevice));
  void* p = nullptr;
  const gpuError_t err = gpuHostAlloc(&p, kHostBlockWords * sizeof(int64_t), gpuHostAllocMapped);
  if (err != gpuSuccess) {
    (void)gpuFree(flag);
    GPU_CHECK(err);
  }
  auto* w = static_cast<int64_t*>(p);
  std::memset(w, 0, kHostBlockWords * sizeof(int64_t));
  w[kStatusFlagWord] = reinterpret_cast<int64_t>(flag);
  return reinterpret_cast<intptr_t>(p);
}

void host_status_free(intptr_t ptr) {
  if (!ptr) return;
  GPU_CHECK(gpuFree(reinterpret_cast<void*>(reinterpret_cast<int64_t*>(ptr)[kStatusFlagWord])));
  GPU_CHECK(gpuFreeHost(reinterpret_cast<void*>(ptr)));
}

void host_status_record(intptr_t ptr, const std::vector<int64_t>& words) {
  UCCL_EP_CHECK_ARG(words.size() == static_cast<size_t>(kStatusWords) && words[0] != 0, "host_status_record: ",
                    words.size(), " words (expected ", kStatusWords, ", the first a non-zero code)");
  const StatusRef s = status_ref(ptr);
  volatile int64_t* st = s.host;
  if (st[0] != 0) return;
  for (int i = 1; i < kStatusWords; ++i) st[i] = words[i];
  st[0] = words[0];
  const int64_t code = words[0];
  GPU_CHECK(gpuMemcpy(s.flag, &code, sizeof(code), gpuMemcpyHostToDevice));
}

int host_readback_wait(intptr_t ptr, int64_t timeout_ns) {
  const volatile int64_t* ready = reinterpret_cast<const volatile int64_t*>(ptr) + kReadbackWord;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(timeout_ns);
  for (uint32_t i = 0;; ++i) {
    const int64_t v = *ready;
    if (v != 0) return v > 0 ? 1 : -1;
    if ((i & 255u) == 255u && std::chrono::steady_clock::now() > deadline) return 0;
  }
}

namespace {

constexpr int kPoisonThreads = 256;

__global__ void __launch_bounds__(kPoisonThreads) poison_kernel(StatusRef status, PoisonRegions r) {
  __shared__ int s_set;
  if (threadIdx.x == 0) s_set = status_set(status) ? 1 : 0;
  __syncthreads();
  if (!s_set) return;
  fill_poison(r, static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
              static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace

void PoisonRegions::add(intptr_t p, int64_t n, uint64_t pat) {
  if (n == 0) return;
  UCCL_EP_CHECK_ARG(count < kMaxPoisonRegions, "poison regions: more than ", kMaxPoisonRegions);
  UCCL_EP_CHECK_ARG(n > 0 && p != 0 && p % 8 == 0, "poison region ", count, " at ", p, " of ", n,
                    " bytes must be non-null, 8-byte aligned and non-negative");
  ptr[count] = p;
  bytes[count] = n;
  pattern[count] = pat;
  ++count;
}

void poison_if_failed(intptr_t status, const std::vector<intptr_t>& ptrs, const std::vector<int64_t>& bytes,
                      const std::vector<uint64_t>& patterns, intptr_t stream) {
  UCCL_EP_CHECK_ARG(ptrs.size() == bytes.size() && ptrs.size() == patterns.size(), "poison_if_failed: ",
                    ptrs.size(), " pointers, ", bytes.size(), " sizes and ", patterns.size(),
                    " patterns must be as many");
  PoisonRegions r;
  int64_t total = 0;
  for (size_t i = 0; i < ptrs.size(); ++i) {
    r.add(ptrs[i], bytes[i], patterns[i]);
    total += bytes[i];
  }
  if (r.count == 0) return;
  // Few blocks: on the common path (status clear) each only reads the device flag and exits.
  const int64_t per_block = static_cast<int64_t>(kPoisonThreads) * 8 * 16;
  const int blocks = static_cast<int>(std::min<int64_t>(64, std::max<int64_t>(1, (total + per_block - 1) / per_block)));
  poison_kernel<<<blocks, kPoisonThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(status_ref(status), r);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

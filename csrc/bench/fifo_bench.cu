// FIFO test and benchmark kernels (tests/gpu/test_fifo_gpu.py, `uccl-ep-megatron bench fifo`):
// built into the `uccl_ep_megatron.bench._bench_C` extension, never into the production `_C`.
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

// First: under HIP the runtime header defines what the FIFO headers' device code uses.
#include "common/gpu.h"

#include "bench/fifo_bench.h"
#include "fifo/fifo_device.cuh"
#include "fifo/fifo_gpu.h"
#include "proxy/proxy.h"

#if defined(UCCL_EP_DEVICE_HIP)
#define fifo_event_create hipEventCreate
#define fifo_event_record hipEventRecord
#define fifo_event_elapsed hipEventElapsedTime
#define fifo_event_destroy hipEventDestroy
#define fifo_host_alloc_portable hipHostMallocPortable
// Sub-wave of 32 lanes: order the lanes' payload writes before lane 0's push, and broadcast.
#define FIFO_SYNCWARP()                \
  do {                                 \
    __threadfence_block();             \
    __builtin_amdgcn_wave_barrier();   \
  } while (0)
#define FIFO_SHFL0(v) __shfl((v), 0, 32)
#else
#define FIFO_SYNCWARP() __syncwarp()
#define FIFO_SHFL0(v) __shfl_sync(0xffffffffu, (v), 0)
#define fifo_event_create cudaEventCreate
#define fifo_event_record cudaEventRecord
#define fifo_event_elapsed cudaEventElapsedTime
#define fifo_event_destroy cudaEventDestroy
#define fifo_host_alloc_portable cudaHostAllocPortable
#endif

namespace uccl_ep::gpu {
namespace {

// Producer granularity is one lane per 32 threads on both vendors (a wave64 then pushes from two
// lanes, each with its own sequence).
constexpr int kWarp = 32;

// The channels' handles as a kernel parameter (2 KiB at most). Passing them by value leaves
// nothing behind the kernel in its stream: a stream-ordered free of an uploaded array is an
// operation that waits for the kernel, and the kernels here wait for the proxies, whose ipc
// copies must never queue behind such an operation.
constexpr uint32_t kMaxKernelChannels = 32;
struct HandleArray {
  FifoDeviceHandle h[kMaxKernelChannels];
};

HandleArray handle_array(const std::vector<FifoDeviceHandle>& handles) {
  UCCL_EP_CHECK_ARG(!handles.empty() && handles.size() <= kMaxKernelChannels, "the FIFO test/bench kernels take 1 to ",
                    kMaxKernelChannels, " channels, got ", handles.size());
  HandleArray a{};
  for (size_t i = 0; i < handles.size(); ++i) a.h[i] = handles[i];
  return a;
}

__global__ void push_kernel(const HandleArray handles, uint32_t num_channels, uint32_t cmds_per_warp) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  if (threadIdx.x % kWarp != 0) return;
  const FifoDeviceHandle h = handles.h[warp % num_channels];
  for (uint32_t i = 0; i < cmds_per_warp; ++i) {
    if (fifo_push(h, make_write(warp, 0, 0, i)) == kFifoPushFailed) return;
  }
}

// Stops the thread until the load that produced v returned (a load only blocks at its first use).
__device__ __forceinline__ void consume_u64(uint64_t v) {
#if defined(UCCL_EP_DEVICE_HIP)
  if (v == kFifoPushFailed) __builtin_trap();
#else
  asm volatile("{\n .reg .pred p;\n setp.eq.u64 p, %0, -1;\n @p trap;\n}" ::"l"(v) : "memory");
#endif
}

// Per iteration i: out_ns[i] push -> completion seen (GPU clock); out_ns[iters + i] until fifo_push
// returned (the system-scope release store was issued); out_ns[2 * iters + i] the consumer's clock
// read from host memory just before the push (host clock); out_ns[3 * iters + i] that read's round
// trip (GPU clock). The clock value was sampled in host memory before the push began and at most
// one read round trip before it: see FifoBenchResult::push_to_poll_max_ns.
__global__ void latency_kernel(FifoDeviceHandle h, const uint64_t* host_clock, uint32_t iters, uint64_t* out_ns) {
  for (uint32_t i = 0; i < iters; ++i) {
    const uint64_t r0 = fifo_now_ns();
    const uint64_t clock = fifo_load_head(host_clock);  // a system-scope load of a host word
    consume_u64(clock);
    const uint64_t t0 = fifo_now_ns();
    uint64_t idx = fifo_push(h, make_write(0, 0, 0, i));
    uint64_t t1 = fifo_now_ns();
    if (idx == kFifoPushFailed || !fifo_wait_completion(h, idx)) return;
    out_ns[i] = fifo_now_ns() - t0;
    out_ns[iters + i] = t1 - t0;
    out_ns[2 * iters + i] = clock;
    out_ns[3 * iters + i] = t0 - r0;
  }
}

// Time of one GPU read of the host-resident head (nothing changes it meanwhile): the floor of the
// completion leg of latency_kernel's round trip, reported next to it.
__global__ void host_read_kernel(FifoDeviceHandle h, uint32_t iters, uint64_t* out_ns) {
  for (uint32_t i = 0; i < iters; ++i) {
    uint64_t t0 = fifo_now_ns();
    consume_u64(fifo_load_head(h.head));
    out_ns[i] = fifo_now_ns() - t0;
  }
}

__device__ __forceinline__ uint8_t traffic_pattern(uint32_t rank, uint32_t warp, uint32_t k, uint32_t i) {
  return static_cast<uint8_t>(rank * 131u + warp * 71u + k * 13u + i * 7u + 1u);
}

__global__ void traffic_kernel(const HandleArray handles, uint32_t num_channels, uint32_t msgs, uint32_t len,
                               uint32_t rank, uint32_t peer, uint8_t* region, uint64_t area) {
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const uint32_t lane = threadIdx.x % kWarp;
  const uint32_t ch = warp % num_channels;
  const FifoDeviceHandle h = handles.h[ch];
  bool ok = true;
  for (uint32_t k = 0; k < msgs && ok; ++k) {
    const uint64_t off = (uint64_t{warp} * msgs + k) * len;
    for (uint32_t i = lane; i < len; i += kWarp) region[off + i] = traffic_pattern(rank, warp, k, i);
    // The payload written by all lanes must be visible before lane 0 publishes the command.
    FIFO_SYNCWARP();
    if (lane == 0) {
      ok = fifo_push(h, make_write_atomic(peer, off, area + off, len, rank * num_channels + ch, 1)) != kFifoPushFailed;
    }
    ok = FIFO_SHFL0(ok);
  }
  if (lane == 0 && ok) {
    uint64_t d = fifo_push(h, make_drain_all());
    if (d != kFifoPushFailed && fifo_wait_completion(h, d)) {
      uint64_t b = fifo_push(h, make_barrier(false));
      if (b != kFifoPushFailed) fifo_wait_completion(h, b);
    }
  }
}

// Commands a bench consumer takes from a channel per visit (the proxy's ProxyOptions::batch).
constexpr uint32_t kBatch = 32;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("pause" ::: "memory");
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// `cpus` is looked up once by the calling thread (numa_cpus_of_pci / pci_bus_id may throw, and an
// exception escaping a std::thread terminates the process). Pinning is best effort.
void pin_to_cpus(const std::vector<int>& cpus) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) {
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  }
  (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Joins the bench's consumer threads on every exit path: a joinable std::thread destroyed while
// an exception unwinds calls std::terminate (the whole Python process would abort).
class ConsumerGroup {
 public:
  ConsumerGroup(std::atomic<bool>& stop, std::vector<std::unique_ptr<FifoChannel>>& fifos, gpuStream_t stream)
      : stop_(stop), fifos_(fifos), stream_(stream) {}
  ~ConsumerGroup() {
    if (threads_.empty()) return;  // joined: the normal path
    stop_ = true;
    for (auto& f : fifos_) f->set_abort(true);  // producers stuck on a full ring give up
    join();
    // The channels are freed next: let a launched kernel see the abort and finish first.
    (void)gpuStreamSynchronize(stream_);
  }
  template <typename F>
  void spawn(F&& f) {
    threads_.emplace_back(std::forward<F>(f));
  }
  void join() {
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

 private:
  std::atomic<bool>& stop_;
  std::vector<std::unique_ptr<FifoChannel>>& fifos_;
  gpuStream_t stream_;
  std::vector<std::thread> threads_;
};

}  // namespace

void launch_push_kernel(const std::vector<FifoDeviceHandle>& handles, uint32_t blocks, uint32_t warps_per_block,
                        uint32_t cmds_per_warp, int device, uintptr_t stream) {
  UCCL_EP_CHECK_ARG(!handles.empty() && blocks > 0 && warps_per_block > 0 && warps_per_block <= 32,
                    "push kernel: channels=", handles.size(), " blocks=", blocks, " warps_per_block=", warps_per_block);
  UCCL_EP_CHECK_ARG(uint64_t{blocks} * warps_per_block <= cmd_limits::kMaxRanks, "push kernel encodes the warp in ",
                    "dst_rank: at most ", cmd_limits::kMaxRanks, " warps");
  const HandleArray a = handle_array(handles);
  GPU_CHECK(gpuSetDevice(device));
  push_kernel<<<blocks, warps_per_block * kWarp, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      a, static_cast<uint32_t>(handles.size()), cmds_per_warp);
  GPU_CHECK(gpuGetLastError());
}

void launch_traffic_kernel(const std::vector<FifoDeviceHandle>& handles, uint32_t blocks, uint32_t warps_per_block,
                           uint32_t msgs, uint32_t len, uint32_t rank, uint32_t peer, void* region, int device,
                           uintptr_t stream) {
  UCCL_EP_CHECK_ARG(!handles.empty() && blocks > 0 && warps_per_block > 0 && warps_per_block <= 32 && msgs > 0,
                    "traffic kernel: channels=", handles.size(), " blocks=", blocks, " warps=", warps_per_block,
                    " msgs=", msgs);
  UCCL_EP_CHECK_ARG(len > 0 && len % 16 == 0, "traffic kernel: len=", len, " must be a positive multiple of 16");
  const HandleArray a = handle_array(handles);
  GPU_CHECK(gpuSetDevice(device));
  const uint64_t area = uint64_t{blocks} * warps_per_block * msgs * len;
  traffic_kernel<<<blocks, warps_per_block * kWarp, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      a, static_cast<uint32_t>(handles.size()), msgs, len, rank, peer, static_cast<uint8_t*>(region), area);
  GPU_CHECK(gpuGetLastError());
}

FifoBenchResult run_fifo_bench(int device, uint32_t channels, uint32_t threads, uint32_t blocks,
                               uint32_t warps_per_block, uint32_t cmds_per_warp, uint32_t capacity,
                               uint32_t latency_iters, uint64_t timeout_ms, uint32_t poll_backoff_ns) {
  UCCL_EP_CHECK_ARG(channels >= 1 && threads >= 1 && threads <= channels, "bench fifo: channels=", channels,
                    " threads=", threads, " (need 1 <= threads <= channels)");
  GPU_CHECK(gpuSetDevice(device));
  const std::vector<int> numa_cpus = numa_cpus_of_pci(pci_bus_id(device));
  std::vector<std::unique_ptr<FifoChannel>> fifos;
  std::vector<FifoDeviceHandle> handles;
  for (uint32_t c = 0; c < channels; ++c) {
    fifos.push_back(create_fifo(c, capacity, timeout_ms, device));
    handles.push_back(fifos.back()->device_handle());
  }
  const uint32_t warps = blocks * warps_per_block;
  FifoBenchResult res;
  res.commands = uint64_t{warps} * cmds_per_warp;

  gpuStream_t s;
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipStreamCreateWithFlags(&s, hipStreamNonBlocking));
#else
  GPU_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
#endif
  std::atomic<uint64_t> errors{0};
  std::atomic<bool> timed_out{false};
  std::atomic<bool> stop{false};  // set when the host side fails: consumers leave at once
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  // Consumer t drains channels c % threads == t and checks per-producer order.
  auto consume = [&](uint32_t t, uint64_t expect) {
    pin_to_cpus(numa_cpus);
    std::vector<uint32_t> next(warps, 0);
    // Per channel: no poll before this time (poll_backoff_ns after the channel was found empty).
    // Every read of the line the GPU is still writing makes its next write to that line snoop
    // this core: a consumer that sits at the write frontier slows the GPU's whole posted-write
    // stream. The flag measures how much backing off from the frontier is worth.
    using BenchClock = std::chrono::steady_clock;
    std::vector<BenchClock::time_point> not_before(channels);
    const auto backoff = std::chrono::nanoseconds(poll_backoff_ns);
    uint64_t got = 0;
    uint32_t spins = 0;
    TransferCmd cmd;
    while (got < expect && !stop.load(std::memory_order_relaxed)) {
      bool any = false;
      const auto now = poll_backoff_ns ? BenchClock::now() : BenchClock::time_point{};
      for (uint32_t c = t; c < channels; c += threads) {
        FifoChannel& f = *fifos[c];
        if (poll_backoff_ns && now < not_before[c]) continue;
        // As the proxy does: up to kBatch commands per visit, head published once per visit.
        uint32_t n = 0;
        for (; n < kBatch && f.poll(&cmd); ++n) {
          uint32_t w = cmd.dst_rank();
          if (w >= warps || w % channels != c || cmd.length() != next[w]) {
            errors.fetch_add(1);
          } else {
            ++next[w];
          }
          f.advance();
          ++got;
          any = true;
        }
        f.publish();
        if (poll_backoff_ns && n < kBatch) not_before[c] = now + backoff;
      }
      // Nothing anywhere: do not re-read the lines the GPU is writing right away.
      if (!any) cpu_relax();
      if (!any && (++spins & 0xFFFF) == 0 && std::chrono::steady_clock::now() > deadline) {
        timed_out = true;
        return;
      }
    }
  };

  // ---- throughput ----
  std::vector<uint64_t> per_thread(threads, 0);
  for (uint32_t w = 0; w < warps; ++w) per_thread[(w % channels) % threads] += cmds_per_warp;
  gpuEvent_t e0, e1;
  GPU_CHECK(fifo_event_create(&e0));
  GPU_CHECK(fifo_event_create(&e1));
  std::chrono::steady_clock::time_point t0, t1;
  {
    ConsumerGroup consumers(stop, fifos, s);
    for (uint32_t t = 0; t < threads; ++t) consumers.spawn([&consume, t, n = per_thread[t]] { consume(t, n); });
    t0 = std::chrono::steady_clock::now();
    GPU_CHECK(fifo_event_record(e0, s));
    launch_push_kernel(handles, blocks, warps_per_block, cmds_per_warp, device, reinterpret_cast<uintptr_t>(s));
    GPU_CHECK(fifo_event_record(e1, s));
    consumers.join();
    t1 = std::chrono::steady_clock::now();
  }
  if (timed_out) {
    for (auto& f : fifos) f->set_abort(true);
    (void)gpuStreamSynchronize(s);
    UCCL_EP_THROW(TimeoutError, "bench fifo: consumers did not receive all ", res.commands, " commands within ",
                  timeout_ms, " ms on GPU ", device);
  }
  GPU_CHECK(gpuStreamSynchronize(s));
  for (auto& f : fifos) f->check_error();
  float ms = 0;
  GPU_CHECK(fifo_event_elapsed(&ms, e0, e1));
  res.kernel_seconds = ms / 1e3;
  res.seconds = std::chrono::duration<double>(t1 - t0).count();
  res.order_errors = errors.load();

  // ---- latency: one pushing thread, one consumer, one command in flight ----
  if (latency_iters > 0) {
    uint64_t* d_ns = nullptr;
    const size_t ns_bytes = 4 * size_t{latency_iters} * sizeof(uint64_t);
    GPU_CHECK(gpuMalloc(reinterpret_cast<void**>(&d_ns), ns_bytes));
    GPU_CHECK(gpuMemsetAsync(d_ns, 0, ns_bytes, s));
    // The consumer's clock, on its own line in mapped host memory: rewritten on every empty poll.
    MappedHost clock_word = alloc_mapped(128);
    std::unique_ptr<void, void (*)(void*)> clock_owner(clock_word.host, [](void* p) { (void)gpuFreeHost(p); });
    auto* clock_host = static_cast<uint64_t*>(clock_word.host);
    const auto host_now_ns = [] {
      return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now().time_since_epoch())
                                       .count());
    };
    __atomic_store_n(clock_host, host_now_ns(), __ATOMIC_RELEASE);
    std::vector<uint64_t> poll_ns(latency_iters, 0);
    {
      ConsumerGroup consumer(stop, fifos, s);
      // Fresh channel 0 state: the consumer continues from its current head.
      consumer.spawn([&] {
        pin_to_cpus(numa_cpus);
        FifoChannel& f = *fifos[0];
        TransferCmd cmd;
        uint64_t got = 0;
        uint32_t spins = 0;
        while (got < latency_iters && !stop.load(std::memory_order_relaxed)) {
          if (f.poll(&cmd)) {
            poll_ns[got] = host_now_ns();
            f.pop();
            ++got;
          } else {
            __atomic_store_n(clock_host, host_now_ns(), __ATOMIC_RELAXED);
            if ((++spins & 0xFFFF) == 0 && std::chrono::steady_clock::now() > deadline) {
              timed_out = true;
              return;
            }
          }
        }
      });
      latency_kernel<<<1, 1, 0, s>>>(handles[0], static_cast<const uint64_t*>(clock_word.dev), latency_iters, d_ns);
      GPU_CHECK(gpuGetLastError());
      consumer.join();
    }
    if (timed_out) {
      fifos[0]->set_abort(true);
      (void)gpuStreamSynchronize(s);
      UCCL_EP_THROW(TimeoutError, "bench fifo latency: no pop of the ping within ", timeout_ms, " ms on GPU ", device);
    }
    GPU_CHECK(gpuStreamSynchronize(s));
    fifos[0]->check_error();
    res.latency_ns.resize(latency_iters);
    GPU_CHECK(gpuMemcpy(res.latency_ns.data(), d_ns, latency_iters * sizeof(uint64_t), gpuMemcpyDeviceToHost));
    res.push_ns.resize(latency_iters);
    GPU_CHECK(gpuMemcpy(res.push_ns.data(), d_ns + latency_iters, latency_iters * sizeof(uint64_t),
                        gpuMemcpyDeviceToHost));
    std::vector<uint64_t> clock_at_push(latency_iters);
    GPU_CHECK(gpuMemcpy(clock_at_push.data(), d_ns + 2 * latency_iters, latency_iters * sizeof(uint64_t),
                        gpuMemcpyDeviceToHost));
    res.clock_read_ns.resize(latency_iters);
    GPU_CHECK(gpuMemcpy(res.clock_read_ns.data(), d_ns + 3 * latency_iters, latency_iters * sizeof(uint64_t),
                        gpuMemcpyDeviceToHost));
    res.push_to_poll_max_ns.resize(latency_iters);
    for (uint32_t i = 0; i < latency_iters; ++i) {
      // Both on the host clock; the value was written before the push began, so this is >= 0.
      if (poll_ns[i] < clock_at_push[i]) {
        UCCL_EP_THROW(Error, "bench fifo: sample ", i, " was polled at ", poll_ns[i],
                      " ns, before the clock value ", clock_at_push[i], " ns its push read");
      }
      res.push_to_poll_max_ns[i] = poll_ns[i] - clock_at_push[i];
    }
    host_read_kernel<<<1, 1, 0, s>>>(handles[0], latency_iters, d_ns);
    GPU_CHECK(gpuGetLastError());
    GPU_CHECK(gpuStreamSynchronize(s));
    res.host_read_ns.resize(latency_iters);
    GPU_CHECK(gpuMemcpy(res.host_read_ns.data(), d_ns, latency_iters * sizeof(uint64_t), gpuMemcpyDeviceToHost));
    GPU_CHECK(gpuFree(d_ns));
  }
  GPU_CHECK(fifo_event_destroy(e0));
  GPU_CHECK(fifo_event_destroy(e1));
#if defined(UCCL_EP_DEVICE_HIP)
  GPU_CHECK(hipStreamDestroy(s));
#else
  GPU_CHECK(cudaStreamDestroy(s));
#endif
  return res;
}

}  // namespace uccl_ep::gpu

// Device-side shim for the intranode kernels: one source for CUDA (sm_80/sm_90) and HIP
// (gfx90a/gfx942, wave64). Memory-ordering helpers use PTX on NVIDIA (explicit .sys scope,
// which is what peers reading over NVLink need) and the clang __hip_atomic builtins on AMD.
#pragma once

#include <cstdint>

#include "common/gpu.h"

#if defined(UCCL_EP_DEVICE_HIP)
#define UCCL_EP_WARP_SIZE 64
using lane_mask_t = unsigned long long;
#else
#define UCCL_EP_WARP_SIZE 32
using lane_mask_t = unsigned int;
#endif

// A kernel parameter read in place (its address may be taken without a local copy).
#if defined(UCCL_EP_DEVICE_HIP)
#define UCCL_EP_GRID_CONSTANT
#else
#define UCCL_EP_GRID_CONSTANT __grid_constant__
#endif

namespace uccl_ep::dev {

constexpr int kWarpSize = UCCL_EP_WARP_SIZE;

// Ballot of the whole warp/wavefront; every lane must participate.
__device__ __forceinline__ lane_mask_t warp_ballot(bool pred) {
#if defined(UCCL_EP_DEVICE_HIP)
  return __ballot(pred);
#else
  return __ballot_sync(0xffffffffu, pred);
#endif
}

__device__ __forceinline__ int popc_mask(lane_mask_t m) {
#if defined(UCCL_EP_DEVICE_HIP)
  return __popcll(m);
#else
  return __popc(m);
#endif
}

// Bits of lanes below the calling lane.
__device__ __forceinline__ lane_mask_t lanemask_lt() {
  const int lane = threadIdx.x % kWarpSize;
#if defined(UCCL_EP_DEVICE_HIP)
  return lane == 0 ? 0ull : (~0ull >> (64 - lane));
#else
  return (1u << lane) - 1u;
#endif
}

__device__ __forceinline__ void warp_sync() {
#if defined(UCCL_EP_DEVICE_HIP)
  // Wavefronts execute in lockstep; the barrier only orders LDS traffic, which we don't rely on.
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// Lane `src`'s value of v, in every lane; every lane must participate.
__device__ __forceinline__ int warp_shfl(int v, int src) {
#if defined(UCCL_EP_DEVICE_HIP)
  return __shfl(v, src);
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}

// The value of lane (this lane ^ mask), for 64-bit values; every lane must participate.
__device__ __forceinline__ long long warp_shfl_xor(long long v, int mask) {
#if defined(UCCL_EP_DEVICE_HIP)
  return __shfl_xor(v, mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

// The sum of v over the warp, in every lane; every lane must participate.
__device__ __forceinline__ int warp_sum(int v) {
#if defined(UCCL_EP_DEVICE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_add_sync(0xffffffffu, v);
#else
  for (int m = kWarpSize / 2; m > 0; m >>= 1) v += static_cast<int>(warp_shfl_xor(v, m));
  return v;
#endif
}

// (lo, hi) over the warp, in every lane: the least lo and the greatest hi; every lane must
// participate.
__device__ __forceinline__ void warp_min_max(int64_t& lo, int64_t& hi) {
  for (int m = kWarpSize / 2; m > 0; m >>= 1) {
    const int64_t olo = warp_shfl_xor(lo, m), ohi = warp_shfl_xor(hi, m);
    lo = olo < lo ? olo : lo;
    hi = ohi > hi ? ohi : hi;
  }
}

// Nanoseconds from a clock that ticks the same on every SM (for timeouts only).
__device__ __forceinline__ uint64_t global_timer_ns() {
#if defined(UCCL_EP_DEVICE_HIP)
#if defined(__HIP_DEVICE_COMPILE__)
  // s_memrealtime ticks at a constant 100 MHz on gfx9 (CDNA), whatever the shader clock.
  return __builtin_amdgcn_s_memrealtime() * 10ull;
#else
  return 0;
#endif
#else
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// Orders this thread's earlier stores (to local or peer memory) before its later ones, as
// seen by every agent of the system (peer GPUs read our writes over NVLink/xGMI).
__device__ __forceinline__ void fence_system() { __threadfence_system(); }

// Release store and acquire load of a 64-bit flag. kSystem: ordered for every agent of the
// system (peer GPUs over NVLink/xGMI, the host); otherwise among the blocks of this GPU only
// (a word written and read on this GPU), which is cheaper.
template <bool kSystem>
__device__ __forceinline__ void st_release(uint64_t* p, uint64_t v) {
#if defined(UCCL_EP_DEVICE_HIP)
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, kSystem ? __HIP_MEMORY_SCOPE_SYSTEM : __HIP_MEMORY_SCOPE_AGENT);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if constexpr (kSystem)
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  else
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#else
  if constexpr (kSystem)
    __threadfence_system();
  else
    __threadfence();
  *reinterpret_cast<volatile uint64_t*>(p) = v;
#endif
}

template <bool kSystem>
__device__ __forceinline__ uint64_t ld_acquire(const uint64_t* p) {
#if defined(UCCL_EP_DEVICE_HIP)
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, kSystem ? __HIP_MEMORY_SCOPE_SYSTEM : __HIP_MEMORY_SCOPE_AGENT);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  uint64_t v;
  if constexpr (kSystem)
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
#else
  uint64_t v = *reinterpret_cast<const volatile uint64_t*>(p);
  if constexpr (kSystem)
    __threadfence_system();
  else
    __threadfence();
  return v;
#endif
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) { st_release<true>(p, v); }
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) { return ld_acquire<true>(p); }
__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) { st_release<false>(p, v); }
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) { return ld_acquire<false>(p); }

// Streaming 16-byte load of data read exactly once (keeps L1 clean for metadata).
template <typename T>
__device__ __forceinline__ T ld_stream(const T* p) {
#if defined(UCCL_EP_DEVICE_CUDA) && defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 16) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return *reinterpret_cast<T*>(&v);
  } else {
    return __ldg(p);
  }
#else
  return *p;
#endif
}

// Load that bypasses L1 (cached in L2 only): for data peers write while this kernel runs,
// where a line fetched for a neighbouring row must not serve a later, not-yet-landed row.
template <typename T>
__device__ __forceinline__ T ld_cg(const T* p) {
#if defined(UCCL_EP_DEVICE_CUDA) && defined(__CUDA_ARCH__)
  return __ldcg(p);
#else
  // AMD: not yet exercised on hardware; a plain load (vL1D is write-through). Revisit with a
  // glc load when the HIP path runs on MI300X.
  return *p;
#endif
}

// 16 bytes through ld_cg: vector rows another agent (proxy DMA, NIC, peer GPU) writes while
// the kernel runs.
__device__ __forceinline__ int4 ld_cg16(const void* p) { return ld_cg(reinterpret_cast<const int4*>(p)); }

// Pause between two polls of memory another agent writes (frees issue slots for the block's
// other warps and eases the PCIe/NVLink traffic of the poll).
__device__ __forceinline__ void spin_pause() {
#if defined(UCCL_EP_DEVICE_HIP)
  __builtin_amdgcn_s_sleep(2);
#elif defined(__CUDA_ARCH__)
  __nanosleep(128);
#endif
}

// Pause between two polls of host memory (software-atomic counters the proxy updates): short
// while the wait is young, longer as it ages. Every waiting block polls over PCIe; at a fixed
// 128 ns two dozen blocks issue ~10^8 reads/s and crowd the PCIe path that the copies' command
// fetches, the FIFO pushes and the counters share, which stalled internode calls as a whole
// (the time did not fall with more channels, docs/performance.md).
__device__ __forceinline__ void poll_pause(uint64_t waited_ns) {
#if defined(UCCL_EP_DEVICE_HIP)
  if (waited_ns < 2000) {
    __builtin_amdgcn_s_sleep(2);
  } else {
    __builtin_amdgcn_s_sleep(16);
  }
#elif defined(__CUDA_ARCH__)
  __nanosleep(waited_ns < 2000 ? 128u : waited_ns < 20000 ? 512u : 1024u);
#endif
}

// Plain store; peer pointers are IPC mappings, so this is an NVLink/xGMI write when remote.
template <typename T>
__device__ __forceinline__ void st_plain(T* p, const T& v) {
  *p = v;
}

}  // namespace uccl_ep::dev

// ---- Hopper bulk copies (TMA, cp.async.bulk): a row goes global -> shared -> peer global
// without occupying threads; lane 0 of a warp drives it. Only on sm_90+ device code; elsewhere
// the callers take the ld/st path and these are never reached.
#if defined(UCCL_EP_DEVICE_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define UCCL_EP_HAS_TMA 1
#else
#define UCCL_EP_HAS_TMA 0
#endif

namespace uccl_ep::dev {

#if UCCL_EP_HAS_TMA
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(phase)
      : "memory");
}
__device__ __forceinline__ void tma_load(void* smem, const void* gsrc, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem)),
               "l"(gsrc), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void tma_store(void* gdst, const void* smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst), "r"(smem_addr(smem)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// All but the newest `kPending` groups have finished reading their shared-memory source.
template <int kPending>
__device__ __forceinline__ void tma_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// Every committed group has completed (its writes are performed).
__device__ __forceinline__ void tma_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
// Orders this thread's generic-proxy accesses of global memory with its bulk copies (async
// proxy), both ways: before a bulk load of rows a peer published (seen through an acquire) and
// after bulk stores that a release store will publish.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.global;" ::: "memory"); }
#endif

}  // namespace uccl_ep::dev

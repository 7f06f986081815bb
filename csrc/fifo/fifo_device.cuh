// Device side of the FIFO channel (see fifo.h for placement): push, check_completion and a
// bounded wait. Include from .cu files only.
//
// Contract for callers: commands one thread pushes into one channel are executed in push order.
// If other lanes of the warp wrote the payload a command refers to, __syncwarp() (or a block
// barrier) before the push; the push's system-scope release then publishes the payload too.
#pragma once

#include "common/gpu.h"
#include "fifo/fifo.h"
#include "fifo/transfer_cmd.h"
#include "kernels/device.cuh"

namespace uccl_ep {

// Deadlines of the FIFO waits: the device shim's clock (the same on every SM).
__device__ __forceinline__ uint64_t fifo_now_ns() { return dev::global_timer_ns(); }

// Reads the consumer's head from host memory. Acquire at system scope: once we see head > i, the
// proxy's reads of slot i are done (it stored head with release), so reusing the slot is safe.
__device__ __forceinline__ uint64_t fifo_load_head(const uint64_t* head) { return dev::ld_acquire_sys(head); }

// One 16-byte store of the command. Release at system scope orders every earlier write of this
// thread (e.g. the payload in GPU memory the NIC will read) before the command is visible to the
// CPU. Both halves carry the phase bit, so a CPU that sees only one half waits for the other.
__device__ __forceinline__ void fifo_store_slot(uint64_t* slot, uint64_t lo, uint64_t hi) {
#if defined(UCCL_EP_DEVICE_HIP)
  __threadfence_system();
  __hip_atomic_store(slot + 1, hi, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
  __hip_atomic_store(slot, lo, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
#else
  asm volatile("st.release.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(slot), "l"(lo), "l"(hi) : "memory");
#endif
}

__device__ __forceinline__ void fifo_record_error(const FifoDeviceHandle& h, uint32_t code, uint64_t index) {
  // First failure wins; the host raises it (FifoChannel::check_error) naming channel and index.
  // Claim, fill, then publish the code, so the host never pairs the code with a stale index.
  unsigned int* code_word = reinterpret_cast<unsigned int*>(&h.error->code);
  if (atomicCAS(code_word, 0u, kFifoErrorPending) == 0u) {
    h.error->channel = h.channel;
    h.error->index = index;
    __threadfence_system();
    atomicExch(code_word, code);
    __threadfence_system();
  }
}

// Waiting producers back off briefly so hundreds of stalled warps do not flood PCIe with reads
// of the head while the proxy is draining the ring.
__device__ __forceinline__ void fifo_backoff() {
#if defined(UCCL_EP_DEVICE_HIP)
  __builtin_amdgcn_s_sleep(1);
#else
  __nanosleep(64);
#endif
}

// Refreshes the cached head from host memory (one PCIe read) and returns it.
__device__ __forceinline__ uint64_t fifo_refresh_head(const FifoDeviceHandle& h) {
  uint64_t head = fifo_load_head(h.head);
  atomicMax(h.head_cache, static_cast<unsigned long long>(head));
  return head;
}

// Enqueues `cmd`; returns its FIFO index, or kFifoPushFailed after timeout_ns (error recorded) or
// when the host aborted. Called by one thread; many threads may push into the same channel. A
// failed push leaves its reserved index unwritten (a hole, fifo.h): the proxy then fails with an
// error naming it and aborts the channel's other producers, so the caller must treat the channel
// as dead (the kernels record a status and give up).
__device__ __forceinline__ uint64_t fifo_push(const FifoDeviceHandle& h, const TransferCmd& cmd) {
  const uint64_t idx = atomicAdd(h.tail, 1ull);
  // Common case: the device-resident cached head proves there is room; no PCIe round trip.
  uint64_t head = *reinterpret_cast<volatile unsigned long long*>(h.head_cache);
  if (idx - head >= h.capacity) {
    const uint64_t start = fifo_now_ns();
    for (uint32_t spin = 0;; ++spin) {
      // A full ring has up to (warps on the channel) waiters: each re-reads the host head over
      // PCIe only every 8th round and otherwise the device-resident cache, which any waiter's
      // read refreshes. That cuts the PCIe reads of the head line, which the consumer's stores
      // also need, ~8x. Abort (a PCIe read) and the clock are checked every 16th round.
      if ((spin & 7u) == 0) {
        head = fifo_load_head(h.head);
        atomicMax(h.head_cache, static_cast<unsigned long long>(head));
      } else {
        head = *reinterpret_cast<volatile unsigned long long*>(h.head_cache);
      }
      if (idx - head < h.capacity) break;
      if ((spin & 15u) == 15u) {
        if (*reinterpret_cast<const volatile uint32_t*>(h.abort)) {
          fifo_record_error(h, kFifoPushAborted, idx);
          return kFifoPushFailed;
        }
        if (fifo_now_ns() - start > h.timeout_ns) {
          fifo_record_error(h, kFifoPushTimeout, idx);
          return kFifoPushFailed;
        }
      }
      fifo_backoff();
    }
  }
  const uint64_t phase = ((idx / h.capacity) & 1u) ^ 1u;
  TransferCmd c = cmd.with_phase(static_cast<uint32_t>(phase));
  fifo_store_slot(h.slots + 2 * (idx & (h.capacity - 1)), c.lo, c.hi);
  return idx;
}

// True once the proxy popped `idx` (a Write was posted, a Drain/Barrier completed).
__device__ __forceinline__ bool fifo_check_completion(const FifoDeviceHandle& h, uint64_t idx) {
  if (*reinterpret_cast<volatile unsigned long long*>(h.head_cache) > idx) return true;
  return fifo_refresh_head(h) > idx;
}

// Blocks until `idx` completed; false after timeout_ns (error recorded) or when the host aborted.
// The loop is the return leg of every GPU->proxy->GPU round trip, so it does one PCIe read per
// round (head: fresher than head_cache, which never exceeds it) and nothing else on the common
// path: abort (a second PCIe read) and the clock are checked every 64th round, head_cache is
// updated once, on success, for the producers' room checks.
__device__ __forceinline__ bool fifo_wait_completion(const FifoDeviceHandle& h, uint64_t idx) {
  if (*reinterpret_cast<volatile unsigned long long*>(h.head_cache) > idx) return true;
  const uint64_t start = fifo_now_ns();
  for (uint32_t spin = 1;; ++spin) {
    const uint64_t head = fifo_load_head(h.head);
    if (head > idx) {
      atomicMax(h.head_cache, static_cast<unsigned long long>(head));
      return true;
    }
    if ((spin & 63u) == 0) {
      if (*reinterpret_cast<const volatile uint32_t*>(h.abort)) {
        fifo_record_error(h, kFifoAborted, idx);
        return false;
      }
      if (fifo_now_ns() - start > h.timeout_ns) {
        fifo_record_error(h, kFifoCompletionTimeout, idx);
        return false;
      }
    }
  }
}

}  // namespace uccl_ep

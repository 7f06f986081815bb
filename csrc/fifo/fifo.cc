#include "fifo/fifo.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "common/errors.h"

namespace uccl_ep {
namespace {

bool is_pow2(uint32_t x) { return x != 0 && (x & (x - 1)) == 0; }

// The phase a slot carries in lap `index / capacity`. Lap 0 writes 1 so that zeroed memory reads
// as stale.
inline uint64_t expected_phase(uint64_t index, uint32_t capacity) { return ((index / capacity) & 1u) ^ 1u; }

using Clock = std::chrono::steady_clock;

}  // namespace

size_t FifoChannel::host_bytes(uint32_t capacity) {
  return sizeof(FifoHostBlock) + static_cast<size_t>(capacity) * sizeof(TransferCmd);
}

FifoChannel::FifoChannel(uint32_t channel, uint32_t capacity, uint64_t timeout_ms, Memory mem)
    : channel_(channel), capacity_(capacity), timeout_ms_(timeout_ms), mem_(std::move(mem)) {
  UCCL_EP_CHECK_ARG(is_pow2(capacity), "FIFO capacity=", capacity, " must be a power of two (e.g. 1024)");
  UCCL_EP_CHECK_ARG(timeout_ms > 0, "FIFO timeout_ms=", timeout_ms, " must be positive");
  UCCL_EP_CHECK_ARG(mem_.block_host && mem_.block_dev && mem_.slots_host && mem_.slots_dev && mem_.tail_dev &&
                        mem_.head_cache_dev,
                    "FIFO channel ", channel, " was given incomplete memory");
}

FifoChannel::~FifoChannel() {
  if (mem_.release) mem_.release();
}

std::unique_ptr<FifoChannel> FifoChannel::create_host(uint32_t channel, uint32_t capacity, uint64_t timeout_ms) {
  UCCL_EP_CHECK_ARG(is_pow2(capacity), "FIFO capacity=", capacity, " must be a power of two (e.g. 1024)");
  size_t bytes = host_bytes(capacity);
  void* raw = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!raw) throw std::bad_alloc();
  std::memset(raw, 0, bytes);
  auto* block = new (raw) FifoHostBlock();
  Memory mem;
  mem.block_host = mem.block_dev = block;
  mem.slots_host = mem.slots_dev = reinterpret_cast<uint64_t*>(static_cast<char*>(raw) + sizeof(FifoHostBlock));
  mem.tail_dev = &block->host_tail;
  mem.head_cache_dev = &block->host_head_cache;
  mem.host_producer = true;
  mem.release = [raw] { std::free(raw); };
  return std::make_unique<FifoChannel>(channel, capacity, timeout_ms, std::move(mem));
}

FifoDeviceHandle FifoChannel::device_handle() const {
  FifoDeviceHandle h{};
  h.slots = mem_.slots_dev;
  h.tail = mem_.tail_dev;
  h.head_cache = mem_.head_cache_dev;
  h.head = &mem_.block_dev->head;
  h.error = &mem_.block_dev->error;
  h.abort = &mem_.block_dev->abort;
  h.capacity = capacity_;
  h.channel = channel_;
  h.timeout_ns = timeout_ms_ * 1000000ull;
  return h;
}

bool FifoChannel::poll(TransferCmd* out) const {
  const uint64_t* slot = mem_.slots_host + 2 * (head_ & (capacity_ - 1));
  const uint64_t phase = expected_phase(head_, capacity_);
  // Acquire on lo orders the hi load after it (CPU producers store hi, then lo with release).
  // A GPU writes both halves in one 16-byte store whose halves may still become visible
  // separately over PCIe, so each half's own phase bit is checked.
  uint64_t lo = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
  if ((lo & 1u) != phase) return false;
  uint64_t hi = __atomic_load_n(slot + 1, __ATOMIC_ACQUIRE);
  if ((hi & 1u) != phase) return false;
  out->lo = lo & ~uint64_t{1};
  out->hi = hi & ~uint64_t{1};
  return true;
}

void FifoChannel::pop() {
  ++head_;
  publish();
}

void FifoChannel::publish() {
  if (published_ == head_) return;
  published_ = head_;
  // Release: the producer that reuses these slots must not see them free before our reads of them.
  __atomic_store_n(&mem_.block_host->head, head_, __ATOMIC_RELEASE);
}

uint64_t FifoChannel::published_head() const { return __atomic_load_n(&mem_.block_host->head, __ATOMIC_ACQUIRE); }

uint64_t FifoChannel::push(const TransferCmd& cmd) {
  if (!mem_.host_producer) {
    UCCL_EP_THROW(Unsupported, "FIFO channel ", channel_,
                  " lives in GPU memory; push from a kernel (fifo_device.cuh), not from the CPU");
  }
  // Refuse before reserving an index: a reservation that is never written would be a new hole.
  if (fifo_error_is_hole(__atomic_load_n(&mem_.block_host->error.code, __ATOMIC_ACQUIRE))) {
    UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel_, " is unusable: index ",
                  __atomic_load_n(&mem_.block_host->error.index, __ATOMIC_ACQUIRE),
                  " was reserved by a push that gave up, so nothing pushed after it can be consumed; "
                  "stop the proxy and create a new channel (a new Buffer)");
  }
  if (__atomic_load_n(&mem_.block_host->abort, __ATOMIC_ACQUIRE)) {
    UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel_,
                  ": push refused because the proxy aborted (see the proxy's error); nothing was reserved");
  }
  const uint64_t idx = __atomic_fetch_add(mem_.tail_dev, 1ull, __ATOMIC_RELAXED);
  unsigned long long cached = __atomic_load_n(mem_.head_cache_dev, __ATOMIC_RELAXED);
  if (idx - cached >= capacity_) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
    uint32_t spins = 0;
    for (;;) {
      uint64_t h = __atomic_load_n(&mem_.block_host->head, __ATOMIC_ACQUIRE);
      // Monotonic max: another producer may have cached a newer head already.
      unsigned long long c = __atomic_load_n(mem_.head_cache_dev, __ATOMIC_RELAXED);
      while (c < h && !__atomic_compare_exchange_n(mem_.head_cache_dev, &c, h, true, __ATOMIC_RELAXED,
                                                    __ATOMIC_RELAXED)) {
      }
      if (idx - h < capacity_) break;
      if (__atomic_load_n(&mem_.block_host->abort, __ATOMIC_ACQUIRE)) {
        fail_push(kFifoPushAborted, idx, "was abandoned because the proxy aborted (see the proxy's error)");
      }
      if ((++spins & 1023u) == 0) {
        if (Clock::now() > deadline) {
          fail_push(kFifoPushTimeout, idx,
                    detail::concat("waited ", timeout_ms_, " ms for the proxy to pop index ", idx - capacity_,
                                   " (head=", h, "); is the proxy running and consuming this channel?"));
        }
        std::this_thread::yield();
      }
    }
  }
  const uint64_t phase = expected_phase(idx, capacity_);
  TransferCmd c = cmd.with_phase(static_cast<uint32_t>(phase));
  uint64_t* slot = mem_.slots_host + 2 * (idx & (capacity_ - 1));
  __atomic_store_n(slot + 1, c.hi, __ATOMIC_RELAXED);
  __atomic_store_n(slot, c.lo, __ATOMIC_RELEASE);
  return idx;
}

void FifoChannel::fail_push(uint32_t code, uint64_t idx, const std::string& why) {
  FifoErrorRecord& rec = mem_.block_host->error;
  uint32_t expected = kFifoOk;
  if (__atomic_compare_exchange_n(&rec.code, &expected, kFifoErrorPending, false, __ATOMIC_ACQ_REL,
                                  __ATOMIC_ACQUIRE)) {
    __atomic_store_n(&rec.channel, channel_, __ATOMIC_RELAXED);
    __atomic_store_n(&rec.index, idx, __ATOMIC_RELAXED);
    __atomic_store_n(&rec.code, code, __ATOMIC_RELEASE);
  }
  UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel_, ": push of index ", idx, " ", why, ". The index stays ",
                "reserved and is never written, so nothing pushed after it can be consumed: the channel is ",
                "unusable now (stop the proxy and create a new channel, i.e. a new Buffer)");
}

void FifoChannel::check_hole() {
  const FifoErrorRecord& rec = mem_.block_host->error;
  const uint32_t code = __atomic_load_n(&rec.code, __ATOMIC_ACQUIRE);
  if (!fifo_error_is_hole(code)) return;
  const uint64_t index = __atomic_load_n(&rec.index, __ATOMIC_RELAXED);
  if (index != head_) return;
  TransferCmd cmd;
  if (poll(&cmd)) return;
  publish();
  UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel_, ": the producer that reserved index ", index, " gave up (",
                code == kFifoPushTimeout ? "its push timed out waiting for room" : "the proxy had aborted",
                ") without writing it; the consumer cannot go past it, so the channel is unusable (create a new "
                "Buffer)");
}

bool FifoChannel::check_completion(uint64_t index) const {
  return __atomic_load_n(&mem_.block_host->head, __ATOMIC_ACQUIRE) > index;
}

void FifoChannel::wait_completion(uint64_t index) const {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms_);
  uint32_t spins = 0;
  while (!check_completion(index)) {
    if (__atomic_load_n(&mem_.block_host->abort, __ATOMIC_ACQUIRE)) {
      UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel_, ": wait for index ", index,
                    " abandoned because the proxy aborted (see the proxy's error)");
    }
    if ((++spins & 1023u) == 0) {
      if (Clock::now() > deadline) {
        UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel_, ": index ", index, " not completed after ",
                      timeout_ms_, " ms (head=", published_head(), ")");
      }
      std::this_thread::yield();
    }
  }
}

void FifoChannel::set_abort(bool abort) {
  __atomic_store_n(&mem_.block_host->abort, abort ? 1u : 0u, __ATOMIC_RELEASE);
}

void FifoChannel::check_error() const {
  const FifoErrorRecord& r = mem_.block_host->error;
  const uint32_t code = __atomic_load_n(&r.code, __ATOMIC_ACQUIRE);
  if (code == kFifoOk || code == kFifoErrorPending) return;
  const uint32_t channel = __atomic_load_n(&r.channel, __ATOMIC_RELAXED);
  const uint64_t index = __atomic_load_n(&r.index, __ATOMIC_RELAXED);
  const char* what = code == kFifoPushTimeout         ? "a push waited too long for free space at index "
                     : code == kFifoCompletionTimeout ? "a completion wait timed out at index "
                     : code == kFifoPushAborted       ? "a push gave up (proxy aborted) at index "
                                                      : "a producer gave up (proxy aborted) at index ";
  UCCL_EP_THROW(TimeoutError, "FIFO channel ", channel, ": ", what, index, " (timeout ", timeout_ms_,
                " ms; the proxy thread owning this channel stalled or stopped)",
                fifo_error_is_hole(code) ? "; that index was never written, so the channel is unusable now" : "");
}

}  // namespace uccl_ep

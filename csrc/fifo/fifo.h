// FIFO channel: a lock-free ring of TransferCmds from GPU threads (producers) to one CPU proxy
// thread (consumer), paper §3.1.
//
// Placement (each piece lives where its frequent reader is):
//   - slots and `head` (the consumer's pop count) live in host memory, pinned and mapped into the
//     GPU when a GPU produces: the CPU polls slots without crossing PCIe;
//   - `tail` (the reservation counter) and `head_cache` (the last head a producer saw) live in
//     device memory: a push reads the cached head and crosses PCIe to re-read `head` only when the
//     cached value says the ring is full.
// Producers reserve an index with an atomic add on `tail`, so many warps may push into one channel;
// commands of one channel are consumed strictly in index order, which is the ordering guarantee a
// kernel gets when it pushes a sequence from one thread. `capacity` is the kMaxInflight of the paper:
// a full ring stalls the pushing thread, so the proxy paces the GPU by consuming slower.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "fifo/transfer_cmd.h"

namespace uccl_ep {

// A failure a producer recorded (a kernel cannot throw): the host raises it on its next call.
struct FifoErrorRecord {
  uint32_t code;     // FifoErrorCode
  uint32_t channel;  // channel that stalled
  uint64_t index;    // FIFO index that was waited on
};
enum FifoErrorCode : uint32_t {
  kFifoOk = 0,
  kFifoPushTimeout = 1,       // a push reserved `index` and gave up waiting for room: a hole
  kFifoCompletionTimeout = 2,
  kFifoAborted = 3,           // a completion wait gave up because the host aborted
  kFifoPushAborted = 4,       // a push reserved `index` and gave up because the host aborted: a hole
};
// A producer that gave up after reserving its index never writes that slot, and the consumer
// takes slots strictly in order: nothing pushed after the hole can ever be consumed. Such a
// channel is unusable for good; both sides raise that instead of waiting.
// The first failing producer claims the record with this code, writes channel and index, then
// stores its real code: readers never see a code with a stale index.
constexpr uint32_t kFifoErrorPending = 0xFFFFFFFFu;
inline bool fifo_error_is_hole(uint32_t code) { return code == kFifoPushTimeout || code == kFifoPushAborted; }

// Host-resident control block, one per channel, followed by the slots (64-byte aligned).
struct FifoHostBlock {
  alignas(64) uint64_t head;  // written by the consumer only
  alignas(64) uint32_t abort;  // set by the host to make waiting producers give up
  alignas(64) FifoErrorRecord error;
  // Used only when CPU threads produce (create_host): then nothing lives in device memory.
  alignas(64) unsigned long long host_tail;
  alignas(64) unsigned long long host_head_cache;
};

// Plain data handed to kernels (and to host producers). Pointers are as seen by the producer.
struct FifoDeviceHandle {
  uint64_t* slots;                 // 2 * capacity words
  unsigned long long* tail;        // reservation counter (device memory)
  unsigned long long* head_cache;  // producers' cached copy of head (device memory)
  const uint64_t* head;            // consumer's pop count (host memory)
  FifoErrorRecord* error;          // first producer-side failure (host memory)
  const uint32_t* abort;           // non-zero: stop waiting (host memory)
  uint32_t capacity;               // power of two
  uint32_t channel;
  uint64_t timeout_ns;             // bound of every producer wait
};

constexpr uint64_t kFifoPushFailed = ~uint64_t{0};

class FifoChannel {
 public:
  // Memory the channel uses; `release` frees it when the channel is destroyed.
  struct Memory {
    FifoHostBlock* block_host = nullptr;  // CPU view of the control block
    FifoHostBlock* block_dev = nullptr;   // producer view of the same block
    uint64_t* slots_host = nullptr;
    uint64_t* slots_dev = nullptr;
    unsigned long long* tail_dev = nullptr;
    unsigned long long* head_cache_dev = nullptr;
    bool host_producer = false;  // producer view == CPU view: CPU threads may push
    std::function<void()> release;
  };

  FifoChannel(uint32_t channel, uint32_t capacity, uint64_t timeout_ms, Memory mem);
  ~FifoChannel();
  FifoChannel(const FifoChannel&) = delete;
  FifoChannel& operator=(const FifoChannel&) = delete;

  // A channel whose producers are CPU threads (tests, CPU-only proxies); all memory is host memory.
  static std::unique_ptr<FifoChannel> create_host(uint32_t channel, uint32_t capacity, uint64_t timeout_ms);
  // Bytes of host memory a channel of `capacity` slots needs (control block + slots).
  static size_t host_bytes(uint32_t capacity);

  uint32_t channel() const { return channel_; }
  uint32_t capacity() const { return capacity_; }
  uint64_t timeout_ms() const { return timeout_ms_; }
  FifoDeviceHandle device_handle() const;

  // ---- consumer side (exactly one thread) ----
  // Reads the command at head without dequeuing it; false when the producer has not written it.
  bool poll(TransferCmd* out) const;
  // Dequeues the command at head; producers waiting on this index (back-pressure, completion)
  // see it after this store.
  void pop();
  // Throws TimeoutError when the slot at head belongs to a producer that gave up after
  // reserving it (see fifo_error_is_hole): the consumer would wait for it forever. Publishes the
  // commands consumed before it first, so their producers see them completed.
  void check_hole();
  // pop() in two halves, for consumers that take several commands per visit: advance() dequeues
  // privately, publish() makes every advance so far visible with one store. Each store of head
  // pulls its cache line away from the GPU's PCIe reads of it (producers waiting for room or
  // completion), so a busy consumer publishes once per batch, not once per command.
  void advance() { ++head_; }
  void publish();
  uint64_t head() const { return head_; }

  // ---- producer side, CPU threads (only channels from create_host) ----
  // Returns the command's FIFO index; throws TimeoutError naming channel and index when the ring
  // stays full for timeout_ms or the proxy aborted. A push that gives up after reserving its
  // index records the hole, and every later push fails at once without reserving anything.
  uint64_t push(const TransferCmd& cmd);
  // True once the command at `index` was popped.
  bool check_completion(uint64_t index) const;
  // Blocks until `index` was popped; TimeoutError names channel and index.
  void wait_completion(uint64_t index) const;

  // ---- failure propagation ----
  // Make producers stuck in a wait give up (the proxy failed or is stopping).
  void set_abort(bool abort);
  // Raise the first failure a producer recorded (TimeoutError naming channel and index).
  void check_error() const;
  // Producer-visible pop count, for tests and stats.
  uint64_t published_head() const;

 private:
  uint32_t channel_;
  uint32_t capacity_;
  uint64_t timeout_ms_;
  [[noreturn]] void fail_push(uint32_t code, uint64_t idx, const std::string& why);
  Memory mem_;
  // The consumer's private copies, on their own cache line: each channel object is a separate
  // heap allocation, and neighbouring channels usually belong to other proxy threads.
  alignas(64) uint64_t head_ = 0;  // consumer's private copy of head
  uint64_t published_ = 0;         // last head stored for producers
};

}  // namespace uccl_ep

// Internals of the ipc transport shared by ipc_transport.cc (setup, endpoints) and ipc_nic.cc
// (the NIC thread). Nothing outside csrc/transport/ipc_* includes this header.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <queue>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "transport/ipc_transport.h"

namespace uccl_ep {
namespace ipc {

using Clock = std::chrono::steady_clock;
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// Single-producer single-consumer ring in process memory. The producer writes slots and makes
// them visible with publish() (one release store for a batch: the doorbell); the consumer reads
// what was published and frees slots with consume().
template <typename T>
class SpscRing {
 public:
  explicit SpscRing(uint32_t capacity) : slots_(capacity), mask_(capacity - 1) {}
  uint32_t capacity() const { return static_cast<uint32_t>(slots_.size()); }

  // Producer side.
  bool try_push(const T& v) {
    if (tail_ - head_seen_ >= slots_.size()) {
      head_seen_ = head_.load(std::memory_order_acquire);
      if (tail_ - head_seen_ >= slots_.size()) return false;
    }
    slots_[tail_ & mask_] = v;
    ++tail_;
    return true;
  }
  void publish() {
    if (published_.load(std::memory_order_relaxed) != tail_) published_.store(tail_, std::memory_order_release);
  }
  bool unpublished() const { return published_.load(std::memory_order_relaxed) != tail_; }

  // Consumer side.
  uint64_t available() {
    tail_seen_ = published_.load(std::memory_order_acquire);
    return tail_seen_ - head_local_;
  }
  const T& peek(uint64_t i) const { return slots_[(head_local_ + i) & mask_]; }
  void consume(uint64_t n) {
    head_local_ += n;
    head_.store(head_local_, std::memory_order_release);
  }

 private:
  std::vector<T> slots_;
  uint64_t mask_;
  alignas(64) uint64_t tail_ = 0;  // producer's
  uint64_t head_seen_ = 0;
  alignas(64) std::atomic<uint64_t> published_{0};
  alignas(64) std::atomic<uint64_t> head_{0};
  alignas(64) uint64_t head_local_ = 0;  // consumer's
  uint64_t tail_seen_ = 0;
};

// One posted write (a send-queue entry). length 0: an immediate-only message.
struct WorkRequest {
  uint32_t peer, channel;
  uint64_t src_offset, dst_offset;
  uint32_t length, imm;
  uint64_t wr_id;
  int64_t posted_ns;
};

// The shared-memory inbox segment of a rank: a header, then one ring of immediates per (proxy
// thread, source rank). Each ring has one producer (the source rank's NIC thread) and one
// consumer (this rank's proxy thread).
struct InboxHeader {
  alignas(64) std::atomic<uint32_t> dead;  // dead_peer fault: this rank's NIC stopped answering
};
struct InboxEntry {
  uint32_t imm, channel, bytes, reserved;
};
struct RingHeader {
  alignas(64) uint64_t head;  // consumer
  alignas(64) uint64_t tail;  // producer
};

inline size_t ring_bytes(uint32_t capacity) { return sizeof(RingHeader) + size_t{capacity} * sizeof(InboxEntry); }
inline size_t inbox_bytes(uint32_t capacity, uint32_t threads, uint32_t world) {
  return sizeof(InboxHeader) + ring_bytes(capacity) * threads * world;
}
inline InboxHeader* inbox_header(void* segment) { return static_cast<InboxHeader*>(segment); }
inline RingHeader* ring_at(void* segment, uint32_t thread, uint32_t src, uint32_t world, uint32_t capacity) {
  return reinterpret_cast<RingHeader*>(static_cast<char*>(segment) + sizeof(InboxHeader) +
                                       (size_t{thread} * world + src) * ring_bytes(capacity));
}
inline InboxEntry* ring_entries(RingHeader* r) { return reinterpret_cast<InboxEntry*>(r + 1); }

// A send completion (status kWcSuccess) the NIC hands to a proxy thread.
struct SendDone {
  uint32_t peer, channel, imm, bytes;
  uint64_t wr_id;
};

}  // namespace ipc

struct IpcTransport::Peer {
  void* inbox = nullptr;  // the peer's inbox segment, mapped here
  std::unique_ptr<SharedMemory> inbox_map;
  char* region = nullptr;
  uint64_t region_bytes = 0;
  bool region_gpu = false;
  bool ipc_opened = false;
  int gpu_device = -1;
  std::unique_ptr<SharedMemory> region_map;
};

// A proxy thread's side: its send queue (it produces, the NIC consumes), its completion queue
// (the NIC produces, it consumes), its inbox rings, and the first error the NIC reported for it.
class IpcTransport::IpcEndpoint : public Endpoint {
 public:
  IpcEndpoint(IpcTransport& t, uint32_t thread, uint32_t queue_capacity);
  void post_write(uint32_t peer, uint32_t channel, uint64_t src_offset, uint64_t dst_offset, uint32_t length,
                  uint32_t imm, uint64_t wr_id) override;
  void flush() override { sq.publish(); }
  int poll(Completion* out, int max) override;

  // Set by the NIC thread; poll() throws it (TransportError) on the proxy thread.
  void fail(const std::string& message);

  ipc::SpscRing<ipc::WorkRequest> sq;
  ipc::SpscRing<ipc::SendDone> cq;

 private:
  IpcTransport& t_;
  uint32_t thread_;
  uint32_t next_src_ = 0;
  std::atomic<bool> failed_{false};
  std::mutex error_mu_;
  std::string error_;
};


// The virtual NIC of one rank (ipc_nic.cc), created by connect() after the peers are mapped.
// Its thread ("uenic<rank>") takes work requests from every endpoint's send queue, times them on
// the wire, hands their bytes to the DMA side and delivers immediates and completions once the
// bytes landed and the modelled arrival passed. Where bytes move between GPUs a second thread
// ("uenicd<rank>", the NIC's DMA engines) gathers the copies, submits them in batches on the copy
// streams and publishes, per device, how far they landed: the copy API's cost no longer delays
// the wire's bookkeeping.
class IpcTransport::Nic {
 public:
  explicit Nic(IpcTransport& t);
  ~Nic();  // stops the threads (they finish nothing further), then frees the copy streams
  Nic(const Nic&) = delete;
  Nic& operator=(const Nic&) = delete;
  void start();
  IpcNicStats stats() const;

 private:
  struct Flight {
    ipc::WorkRequest wr;
    uint32_t thread = 0;
    int64_t arrive_ns = 0;   // earliest time the receiver may see it
    int32_t copy_slot = -1;  // device slot of its bytes' copy; -1: nothing to wait for
    uint64_t copy_seq = 0;   // its copy's number in that slot (landed once landed_ reaches it)
    int status = kWcSuccess;
    std::string why;         // a failed flight: what the model says happened
  };
  struct CopyJob {           // the NIC thread's hand-off to the DMA thread
    void* dst;
    const void* src;
    uint64_t bytes;
    uint64_t seq;            // per device slot, from 1, in hand-off order
    uint32_t slot, peer, thread, channel;  // the slot; the flight's QP and channel (for a stall)
  };
  struct Pending {           // a copy submission not yet seen complete
    uint64_t ticket;
    int64_t submit_ns;
    CopyJob first;           // a job it carries (named by a stall)
  };
  struct CopyQueue {
    void* handle = nullptr;
    int device = -1;
    uint64_t submitted = 0, completed = 0;
    std::deque<Pending> pending;
  };
  struct Batch {             // copies gathered for one device, not yet submitted
    std::vector<void*> dst;
    std::vector<const void*> src;
    std::vector<size_t> bytes;
    std::vector<CopyJob> first;             // the first job of each entry
    std::vector<uint64_t> last_seq;         // the last job of each entry
    size_t next = 0;                        // entries before this one were submitted
  };
  struct Submitted {         // a device slot's submissions in order: landed up to the first undone
    uint64_t last_seq;
    size_t stream;
    uint64_t ticket;
  };
  struct Ack {
    ipc::SendDone done;
    int64_t due_ns;
  };

  void run();
  bool pass(int64_t now);
  bool pickup(int64_t now);
  void admit(uint32_t thread, const ipc::WorkRequest& wr, int64_t now);
  void fault_check(Flight& f, int64_t now);
  void move_bytes(uint32_t id);
  void add_copy(uint32_t id);
  bool hand_off();
  bool deliver(int64_t now);
  bool deliver_one(uint32_t id, int64_t now);
  bool copy_done(const Flight& f) const;
  bool flush_acks(int64_t now);
  void fail(uint32_t id);
  void fail_all(const std::string& message);
  uint32_t alloc_flight();
  void release(uint32_t id);
  size_t device_slot(int device) const;
  int copy_device(uint32_t peer) const;
  bool in_place() const;  // IpcOptions::bytes_in_place
  // The DMA thread's.
  void dma_run();
  bool dma_take();
  void dma_add(const CopyJob& job);
  bool dma_submit();
  bool dma_submit_device(size_t d);
  bool dma_poll();
  uint64_t dma_completed(const CopyQueue& q);  // the queue's completed ticket (one GPU call)
  void dma_check_stalls(int64_t now);
  void check_dma_call(int64_t now);  // the NIC thread's watch over a DMA thread stuck in a GPU call

  IpcTransport& t_;
  const uint32_t world_, threads_;
  const double ns_per_byte_;  // 0: unthrottled
  const int64_t latency_ns_;
  std::mt19937_64 rng_;
  std::vector<int> devices_;                 // devices copies are issued on
  // NIC thread: flights and their queues.
  std::vector<Flight> pool_;
  std::vector<uint32_t> free_;
  std::vector<std::deque<uint32_t>> qp_;     // RC: [thread * world + peer], post order
  std::priority_queue<std::pair<int64_t, uint32_t>, std::vector<std::pair<int64_t, uint32_t>>,
                      std::greater<std::pair<int64_t, uint32_t>>> srd_;  // SRD: by arrival
  std::vector<uint32_t> landing_;            // SRD: arrived, bytes moving, then delivered
  std::vector<uint32_t> failed_;             // flights that complete with an error
  std::vector<std::deque<Ack>> acks_;        // [thread], due times non-decreasing
  std::vector<uint64_t> qp_posted_;          // writes posted per QP (fault counters)
  std::vector<int64_t> qp_failed_ns_;        // QP in the error state: when its failure completes
  std::vector<uint64_t> job_seq_;            // [device slot]: copies handed off
  std::deque<CopyJob> overflow_;             // handed off while the job ring was full
  uint64_t posted_total_ = 0;
  int64_t egress_free_ns_ = 0;
  uint64_t inflight_ = 0;                    // flights not yet delivered or failed
  // Between the two threads.
  ipc::SpscRing<CopyJob> jobs_;
  std::unique_ptr<std::atomic<uint64_t>[]> landed_;  // [device slot]: jobs 1..landed_ landed
  // DMA thread: batches and copy streams.
  std::vector<std::vector<CopyQueue>> queues_;  // [device slot][stream]
  std::vector<size_t> next_stream_;
  std::vector<Batch> open_;                  // [device slot]
  std::vector<std::deque<Submitted>> order_;  // [device slot]
  std::vector<uint64_t> taken_seq_;          // [device slot]: jobs taken from the ring
  // When the DMA thread entered the GPU library call it is in (ns; 0: in none), and the entry the
  // NIC thread last reported (check_dma_call).
  std::atomic<int64_t> gpu_call_since_{0};
  int64_t gpu_call_reported_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_, dma_thread_;
  std::atomic<bool> has_cpu_clock_{false}, has_dma_clock_{false};
  clockid_t cpu_clock_{}, dma_clock_{};
  std::atomic<uint64_t> writes_{0}, bytes_{0}, copies_{0}, batches_{0}, delivered_{0}, wire_busy_ns_{0};
  std::atomic<uint64_t> gaps_short_{0}, idle_short_ns_{0}, gaps_long_{0}, idle_long_ns_{0}, queue_ns_{0},
      lag_ns_{0}, late_ns_{0}, busy_passes_{0}, dma_passes_{0};
  std::atomic<uint64_t> step_ns_[5] = {};  // IpcNicStats::step_ns
};

}  // namespace uccl_ep

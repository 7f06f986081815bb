// The virtual NIC of the ipc transport (the model is described in ipc_transport.h). One thread per
// rank runs pass() in a loop: take new work requests, hand their bytes' copies to the DMA thread,
// deliver what arrived, hand out due completions. Where bytes move between GPUs a second thread
// (the DMA engines) gathers the copies, submits them in batches on the copy streams and polls
// them. Neither waits for the GPU: a copy that does not finish becomes an error naming it, after
// copy_timeout_ms.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "common/log.h"
#include "transport/ipc_internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UCCL_EP_NIC_RELAX() _mm_pause()
#else
#define UCCL_EP_NIC_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace uccl_ep {
namespace {

constexpr uint32_t kMaxPickup = 1024;           // work requests taken per pass, over all queues
constexpr size_t kMaxBatch = 512;               // copies per submission
constexpr uint64_t kMaxCoalesce = 16ull << 20;  // bytes one coalesced copy may reach
constexpr int64_t kIdleSpinNs = 20'000'000;     // spin this long with nothing to do, then nap
constexpr uint64_t kPacketBytes = 4096;         // MTU of the modelled wire
constexpr uint64_t kHeaderBytes = 64;           // per-packet headers and framing (RoCEv2/SRD order)
constexpr int64_t kLongGapNs = 50'000;          // an idle wire this long: between calls, not within one
constexpr uint32_t kJobRing = 1u << 14;         // copies in flight from the NIC thread to the DMA thread

// The DMA thread inside a GPU library call (submit or poll a copy stream) for its lifetime: the
// NIC thread names a call that does not return (check_dma_call).
class InGpuCall {
 public:
  explicit InGpuCall(std::atomic<int64_t>& since) : since_(since) {
    since_.store(ipc::now_ns(), std::memory_order_release);
  }
  ~InGpuCall() { since_.store(0, std::memory_order_release); }
  InGpuCall(const InGpuCall&) = delete;
  InGpuCall& operator=(const InGpuCall&) = delete;

 private:
  std::atomic<int64_t>& since_;
};

uint64_t wire_bytes(uint32_t length) {
  const uint64_t packets = length == 0 ? 1 : (length + kPacketBytes - 1) / kPacketBytes;
  return length + packets * kHeaderBytes;
}

void bump(std::atomic<uint64_t>& c, uint64_t v = 1) {
  c.store(c.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
}

// Names the calling thread `name` and finds its CPU clock (for the model's CPU time).
void name_thread(const std::string& name, clockid_t& clock, std::atomic<bool>& has_clock) {
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  if (pthread_getcpuclockid(pthread_self(), &clock) == 0) has_clock.store(true, std::memory_order_release);
}

// Runs pass(now) until `stop`; pass returns whether work is in flight. The thread spins while
// it is and for kIdleSpinNs after; then (no calls in flight) it gives the core back, napping
// 50 us per round: the next call pays one wake-up.
template <typename Pass>
void serve(const std::atomic<bool>& stop, Pass pass) {
  int64_t idle_since = ipc::now_ns();
  while (!stop.load(std::memory_order_relaxed)) {
    const int64_t now = ipc::now_ns();
    if (pass(now)) {
      idle_since = now;
      UCCL_EP_NIC_RELAX();
    } else if (now - idle_since < kIdleSpinNs) {
      UCCL_EP_NIC_RELAX();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace

IpcTransport::Nic::Nic(IpcTransport& t)
    : t_(t),
      world_(t.setup_.world_size),
      threads_(t.setup_.num_threads),
      ns_per_byte_(t.options_.link_gbps > 0 ? 1.0 / t.options_.link_gbps : 0.0),
      latency_ns_(static_cast<int64_t>(t.options_.latency_us * 1000.0)),
      rng_(t.options_.seed * 0x9E3779B97F4A7C15ull + t.setup_.rank * 7919u + 1),
      qp_(size_t{t.setup_.num_threads} * t.setup_.world_size),
      acks_(t.setup_.num_threads),
      qp_posted_(size_t{t.setup_.num_threads} * t.setup_.world_size, 0),
      qp_failed_ns_(size_t{t.setup_.num_threads} * t.setup_.world_size, 0),
      jobs_(kJobRing) {
  // Copy streams, made here on the connecting thread before any kernel runs. None when the
  // kernels store GPU bytes in place: then this NIC makes no CUDA call at all.
  for (uint32_t p = 0; p < world_ && !in_place(); ++p) {
    const int dev = copy_device(p);
    if (dev < 0 || std::find(devices_.begin(), devices_.end(), dev) != devices_.end()) continue;
    devices_.push_back(dev);
  }
  landed_ = std::make_unique<std::atomic<uint64_t>[]>(devices_.size());
  for (size_t d = 0; d < devices_.size(); ++d) landed_[d].store(0, std::memory_order_relaxed);
  for (int dev : devices_) {
    queues_.emplace_back();
    for (uint32_t s = 0; s < t.options_.copy_streams; ++s) {
      CopyQueue q;
      q.device = dev;
      q.handle = t.options_.gpu->copy_queue_create(dev, t.options_.copy_queue_depth);
      queues_.back().push_back(std::move(q));
    }
    next_stream_.push_back(0);
    open_.emplace_back();
    order_.emplace_back();
    taken_seq_.push_back(0);
    job_seq_.push_back(0);
  }
}

IpcTransport::Nic::~Nic() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  if (dma_thread_.joinable()) dma_thread_.join();
  for (auto& per_dev : queues_) {
    for (auto& q : per_dev) t_.options_.gpu->copy_queue_destroy(q.handle);
  }
}

void IpcTransport::Nic::start() {
  thread_ = std::thread([this] { run(); });
  if (!devices_.empty()) dma_thread_ = std::thread([this] { dma_run(); });
}

IpcNicStats IpcTransport::Nic::stats() const {
  IpcNicStats s;
  s.writes = writes_.load(std::memory_order_relaxed);
  s.bytes = bytes_.load(std::memory_order_relaxed);
  s.copies = copies_.load(std::memory_order_relaxed);
  s.batches = batches_.load(std::memory_order_relaxed);
  s.delivered = delivered_.load(std::memory_order_relaxed);
  s.wire_busy_ns = wire_busy_ns_.load(std::memory_order_relaxed);
  s.wire_gaps_short = gaps_short_.load(std::memory_order_relaxed);
  s.wire_idle_short_ns = idle_short_ns_.load(std::memory_order_relaxed);
  s.wire_gaps_long = gaps_long_.load(std::memory_order_relaxed);
  s.wire_idle_long_ns = idle_long_ns_.load(std::memory_order_relaxed);
  s.wire_queue_ns = queue_ns_.load(std::memory_order_relaxed);
  s.nic_lag_ns = lag_ns_.load(std::memory_order_relaxed);
  s.late_ns = late_ns_.load(std::memory_order_relaxed);
  s.busy_passes = busy_passes_.load(std::memory_order_relaxed);
  s.dma_passes = dma_passes_.load(std::memory_order_relaxed);
  for (int i = 0; i < 5; ++i) s.step_ns[i] = step_ns_[i].load(std::memory_order_relaxed);
  timespec ts{};
  if (has_cpu_clock_.load(std::memory_order_acquire) && clock_gettime(cpu_clock_, &ts) == 0)
    s.cpu_seconds += ts.tv_sec + ts.tv_nsec * 1e-9;
  if (has_dma_clock_.load(std::memory_order_acquire) && clock_gettime(dma_clock_, &ts) == 0)
    s.cpu_seconds += ts.tv_sec + ts.tv_nsec * 1e-9;
  return s;
}

int IpcTransport::Nic::copy_device(uint32_t peer) const {
  const Peer& p = *t_.peers_[peer];
  if (t_.setup_.region.gpu_device >= 0) return t_.setup_.region.gpu_device;
  return p.region_gpu ? p.gpu_device : -1;
}

bool IpcTransport::Nic::in_place() const { return t_.options_.bytes_in_place; }

size_t IpcTransport::Nic::device_slot(int device) const {
  return static_cast<size_t>(std::find(devices_.begin(), devices_.end(), device) - devices_.begin());
}

void IpcTransport::Nic::run() {
  name_thread("uenic" + std::to_string(t_.setup_.rank), cpu_clock_, has_cpu_clock_);
  try {
    serve(stop_, [this](int64_t now) { return pass(now) || inflight_ > 0; });
  } catch (const std::exception& e) {
    fail_all(detail::concat("ipc rank ", t_.setup_.rank, " NIC thread failed: ", e.what()));
  }
}

bool IpcTransport::Nic::pass(int64_t now) {
  // Each step's time, summed over the passes that moved anything (the thread's own cost).
  int64_t t[4];
  t[0] = now;
  bool moved = pickup(now);
  moved |= hand_off();
  t[1] = ipc::now_ns();
  moved |= deliver(now);
  t[2] = ipc::now_ns();
  moved |= flush_acks(now);
  t[3] = ipc::now_ns();
  check_dma_call(t[3]);
  if (moved) {
    bump(busy_passes_);
    bump(step_ns_[0], static_cast<uint64_t>(t[1] - t[0]));
    bump(step_ns_[3], static_cast<uint64_t>(t[2] - t[1]));
    bump(step_ns_[4], static_cast<uint64_t>(t[3] - t[2]));
  }
  return moved;
}

uint32_t IpcTransport::Nic::alloc_flight() {
  if (!free_.empty()) {
    const uint32_t id = free_.back();
    free_.pop_back();
    pool_[id] = Flight{};
    return id;
  }
  pool_.emplace_back();
  return static_cast<uint32_t>(pool_.size() - 1);
}

void IpcTransport::Nic::release(uint32_t id) {
  free_.push_back(id);
  --inflight_;
}

bool IpcTransport::Nic::pickup(int64_t now) {
  uint32_t taken = 0;
  for (uint32_t th = 0; th < threads_ && taken < kMaxPickup; ++th) {
    auto& sq = t_.endpoints_[th]->sq;
    const uint64_t n = std::min<uint64_t>(sq.available(), kMaxPickup - taken);
    for (uint64_t i = 0; i < n; ++i) admit(th, sq.peek(i), now);
    sq.consume(n);
    taken += static_cast<uint32_t>(n);
  }
  return taken > 0;
}

// Times one work request on the wire, starts its copy and queues it for delivery.
void IpcTransport::Nic::admit(uint32_t thread, const ipc::WorkRequest& wr, int64_t now) {
  const uint32_t id = alloc_flight();
  ++inflight_;
  Flight& f = pool_[id];
  f.wr = wr;
  f.thread = thread;
  // The wire takes a message from its post (the doorbell), as a NIC's hardware does within a
  // microsecond, not from when this thread got to it: the thread's lag (nic_lag_ns) is the
  // model's own cost, not the wire's. Its bytes still move from here, and it is delivered only
  // once they landed (late_ns counts deliveries the model's mechanics held past their arrival).
  const int64_t start = wr.posted_ns;
  int64_t wire_end = start;
  if (ns_per_byte_ > 0) {
    const int64_t begin = std::max(start, egress_free_ns_);
    const auto busy = static_cast<int64_t>(static_cast<double>(wire_bytes(wr.length)) * ns_per_byte_);
    if (egress_free_ns_ > 0 && start > egress_free_ns_) {  // the wire sat idle until this post
      const int64_t gap = start - egress_free_ns_;
      bump(gap < kLongGapNs ? gaps_short_ : gaps_long_);
      bump(gap < kLongGapNs ? idle_short_ns_ : idle_long_ns_, static_cast<uint64_t>(gap));
    }
    bump(queue_ns_, static_cast<uint64_t>(begin - wr.posted_ns));
    bump(lag_ns_, static_cast<uint64_t>(std::max<int64_t>(0, now - wr.posted_ns)));
    egress_free_ns_ = begin + busy;
    wire_end = egress_free_ns_;
    bump(wire_busy_ns_, static_cast<uint64_t>(busy));
  }
  f.arrive_ns = wire_end + latency_ns_;
  if (t_.options_.reorder) {
    f.arrive_ns += static_cast<int64_t>(rng_() % (uint64_t{t_.options_.max_delay_us} + 1)) * 1000;
  }
  bump(writes_);
  bump(bytes_, wr.length);
  fault_check(f, now);
  if (f.status != kWcSuccess) {
    failed_.push_back(id);
    return;
  }
  if (t_.options_.reorder) {
    srd_.push({f.arrive_ns, id});  // SRD: its bytes land at its (randomly delayed) arrival
    return;
  }
  // RC: the bytes may move at once; the receiver learns of them only in post order, later.
  move_bytes(id);
  qp_[size_t{thread} * world_ + wr.peer].push_back(id);
}

// Moves a flight's bytes: memcpy for host regions (the NIC thread is the DMA engine), else a
// copy in its device's open batch, or nothing where the kernels stored them in place.
void IpcTransport::Nic::move_bytes(uint32_t id) {
  const Flight& f = pool_[id];
  if (f.wr.length == 0) return;
  if (copy_device(f.wr.peer) >= 0) {
    if (!in_place()) add_copy(id);
    return;
  }
  const char* src = static_cast<const char*>(t_.setup_.region.base) + f.wr.src_offset;
  std::memcpy(t_.peers_[f.wr.peer]->region + f.wr.dst_offset, src, f.wr.length);
  bump(copies_);
}

// Injected faults (ipc_fault.h): sets the flight's status and when its error completion is due.
void IpcTransport::Nic::fault_check(Flight& f, int64_t now) {
  const uint32_t me = t_.setup_.rank;
  const size_t qp = size_t{f.thread} * world_ + f.wr.peer;
  ++qp_posted_[qp];
  ++posted_total_;
  if (qp_failed_ns_[qp] != 0) {
    // In the error state: flushed, completing after the completion that failed the QP.
    f.status = kWcWrFlushErr;
    f.why = "its QP is in the error state after an earlier failed completion";
    f.arrive_ns = std::max(now, qp_failed_ns_[qp] + 1);
    return;
  }
  for (const IpcFault& x : t_.options_.faults) {
    const int64_t detect = static_cast<int64_t>(x.detect_ms) * 1'000'000;
    if (x.kind == IpcFault::kRetryExceeded && x.rank == me && (x.qp < 0 || x.qp == static_cast<int32_t>(f.thread)) &&
        (x.peer < 0 || x.peer == static_cast<int32_t>(f.wr.peer)) && qp_posted_[qp] > x.after) {
      f.status = kWcRetryExcErr;
      f.why = detail::concat("injected by UCCL_EP_IPC_FAULT (retry_exceeded after ", x.after, " writes on this QP)");
      f.arrive_ns = now + detect;
      qp_failed_ns_[qp] = f.arrive_ns;
      return;
    }
    if (x.kind != IpcFault::kDeadPeer) continue;
    auto* hdr = ipc::inbox_header(x.rank == me ? t_.inbox_->data() : t_.peers_[x.rank]->inbox);
    if (x.rank == me && posted_total_ > x.after) hdr->dead.store(1, std::memory_order_release);
    const bool dead = hdr->dead.load(std::memory_order_acquire) != 0;
    if (dead && (x.rank == me || x.rank == f.wr.peer)) {
      f.status = kWcRetryExcErr;
      f.why = x.rank == me ? detail::concat("this rank's NIC stopped answering (UCCL_EP_IPC_FAULT dead_peer after ",
                                            x.after, " writes)")
                           : detail::concat("rank ", x.rank, " stopped answering (UCCL_EP_IPC_FAULT dead_peer)");
      f.arrive_ns = f.wr.posted_ns + detect;
      return;
    }
  }
}

// Hands a flight's copy to the DMA thread; the flight is delivered once landed_ reaches its number.
void IpcTransport::Nic::add_copy(uint32_t id) {
  Flight& f = pool_[id];
  const size_t d = device_slot(copy_device(f.wr.peer));
  f.copy_slot = static_cast<int32_t>(d);
  f.copy_seq = ++job_seq_[d];
  const CopyJob job{t_.peers_[f.wr.peer]->region + f.wr.dst_offset,
                    static_cast<const char*>(t_.setup_.region.base) + f.wr.src_offset,
                    f.wr.length,
                    f.copy_seq,
                    static_cast<uint32_t>(d),
                    f.wr.peer,
                    f.thread,
                    f.wr.channel};
  if (!overflow_.empty() || !jobs_.try_push(job)) overflow_.push_back(job);
}

// Publishes the copies handed off this pass (and any the full ring held back).
bool IpcTransport::Nic::hand_off() {
  bool moved = false;
  while (!overflow_.empty() && jobs_.try_push(overflow_.front())) {
    overflow_.pop_front();
    moved = true;
  }
  if (jobs_.unpublished()) {
    jobs_.publish();
    moved = true;
  }
  return moved;
}

bool IpcTransport::Nic::copy_done(const Flight& f) const {
  if (f.copy_slot < 0) return true;
  return landed_[static_cast<size_t>(f.copy_slot)].load(std::memory_order_acquire) >= f.copy_seq;
}

// ---- the DMA thread ----------------------------------------------------------------------------

void IpcTransport::Nic::dma_run() {
  name_thread("uenicd" + std::to_string(t_.setup_.rank), dma_clock_, has_dma_clock_);
  try {
    serve(stop_, [this](int64_t t0) {
      bool moved = dma_take();
      moved |= dma_submit();
      const int64_t t1 = ipc::now_ns();
      moved |= dma_poll();
      const int64_t t2 = ipc::now_ns();
      dma_check_stalls(t2);
      bool outstanding = false;
      for (size_t d = 0; d < devices_.size(); ++d)
        outstanding |= landed_[d].load(std::memory_order_relaxed) != taken_seq_[d];
      if (moved) {
        bump(dma_passes_);
        bump(step_ns_[1], static_cast<uint64_t>(t1 - t0));
        bump(step_ns_[2], static_cast<uint64_t>(t2 - t1));
      }
      return moved || outstanding;
    });
  } catch (const std::exception& e) {
    fail_all(detail::concat("ipc rank ", t_.setup_.rank, " NIC DMA thread failed: ", e.what()));
  }
}

// Takes the copies the NIC thread handed off into the open batches.
bool IpcTransport::Nic::dma_take() {
  const uint64_t n = jobs_.available();
  for (uint64_t i = 0; i < n; ++i) dma_add(jobs_.peek(i));
  if (n > 0) jobs_.consume(n);
  return n > 0;
}

// Adds a copy to its device's open batch, extending the previous copy when it goes to the same
// peer and source and destination both continue it (consecutive chunks of a ring stream).
void IpcTransport::Nic::dma_add(const CopyJob& job) {
  Batch& b = open_[job.slot];
  taken_seq_[job.slot] = job.seq;
  // Only the newest unsubmitted entry may grow: entries stay in job order, which is what lets a
  // submission's last job stand for all of its jobs (dma_poll).
  const size_t last = b.dst.size() - 1;
  if (b.dst.size() > b.next && b.first[last].peer == job.peer &&
      static_cast<char*>(b.dst[last]) + b.bytes[last] == job.dst &&
      static_cast<const char*>(b.src[last]) + b.bytes[last] == job.src && b.bytes[last] + job.bytes <= kMaxCoalesce) {
    b.bytes[last] += job.bytes;
    b.last_seq[last] = job.seq;
    return;
  }
  b.dst.push_back(job.dst);
  b.src.push_back(job.src);
  b.bytes.push_back(job.bytes);
  b.first.push_back(job);
  b.last_seq.push_back(job.seq);
}

bool IpcTransport::Nic::dma_submit() {
  bool moved = false;
  for (size_t d = 0; d < open_.size(); ++d) {
    while (open_[d].next < open_[d].dst.size() && dma_submit_device(d)) moved = true;
  }
  return moved;
}

// Submits the next copies of device slot d's open batch on the first stream with room: all of
// them in one call where the GPU library batches copies, else one. False: every stream is full.
bool IpcTransport::Nic::dma_submit_device(size_t d) {
  Batch& b = open_[d];
  auto& streams = queues_[d];
  const GpuHooks& gpu = *t_.options_.gpu;
  for (size_t k = 0; k < streams.size(); ++k) {
    const size_t s = (next_stream_[d] + k) % streams.size();
    CopyQueue& q = streams[s];
    if (q.submitted - q.completed >= t_.options_.copy_queue_depth) {
      q.completed = dma_completed(q);
      if (q.submitted - q.completed >= t_.options_.copy_queue_depth) continue;
    }
    const size_t n = gpu.copy_submit_batch ? std::min(b.dst.size() - b.next, kMaxBatch) : 1;
    uint64_t ticket = 0;
    {
      InGpuCall in_call(gpu_call_since_);
      ticket = gpu.copy_submit_batch ? gpu.copy_submit_batch(q.handle, b.dst.data() + b.next, b.src.data() + b.next,
                                                             b.bytes.data() + b.next, n)
                                     : gpu.copy_submit(q.handle, b.dst[b.next], b.src[b.next], b.bytes[b.next]);
    }
    q.submitted = ticket;
    const uint64_t last_seq = b.last_seq[b.next + n - 1];
    q.pending.push_back(Pending{ticket, ipc::now_ns(), b.first[b.next]});
    order_[d].push_back(Submitted{last_seq, s, ticket});
    b.next += n;
    bump(copies_, n);
    bump(batches_);
    next_stream_[d] = (s + 1) % streams.size();
    if (b.next == b.dst.size()) {
      b.dst.clear();
      b.src.clear();
      b.bytes.clear();
      b.first.clear();
      b.last_seq.clear();
      b.next = 0;
    }
    return true;
  }
  return false;
}

// Polls the copy streams and publishes, per device slot, the copies landed in submission order.
bool IpcTransport::Nic::dma_poll() {
  bool moved = false;
  for (size_t d = 0; d < queues_.size(); ++d) {
    for (auto& q : queues_[d]) {
      if (q.completed == q.submitted) continue;
      const uint64_t c = dma_completed(q);
      if (c == q.completed) continue;
      q.completed = c;
      while (!q.pending.empty() && q.pending.front().ticket <= c) q.pending.pop_front();
      moved = true;
    }
    auto& order = order_[d];
    uint64_t landed = 0;
    while (!order.empty() && queues_[d][order.front().stream].completed >= order.front().ticket) {
      landed = order.front().last_seq;
      order.pop_front();
    }
    if (landed != 0) landed_[d].store(landed, std::memory_order_release);
  }
  return moved;
}

uint64_t IpcTransport::Nic::dma_completed(const CopyQueue& q) {
  InGpuCall in_call(gpu_call_since_);
  return t_.options_.gpu->copy_completed(q.handle);
}

// A copy submitted copy_timeout_ms ago that has not completed: the GPU never ran it (its
// stream is blocked, e.g. behind work that waits for this proxy, or the device hung).
void IpcTransport::Nic::dma_check_stalls(int64_t now) {
  const int64_t limit = static_cast<int64_t>(t_.options_.copy_timeout_ms) * 1'000'000;
  for (auto& per_dev : queues_) {
    for (auto& q : per_dev) {
      if (q.pending.empty() || now - q.pending.front().submit_ns <= limit) continue;
      const CopyJob& j = q.pending.front().first;
      t_.endpoints_[j.thread]->fail(detail::concat(
          "ipc rank ", t_.setup_.rank, " thread ", j.thread, ": GPU copy of ", j.bytes, " bytes to rank ", j.peer,
          " (channel ", j.channel, ") has not completed after ", (now - q.pending.front().submit_ns) / 1'000'000,
          " ms; the GPU never ran it (its copy stream is blocked, e.g. behind work that waits for this proxy, or the "
          "device hung)"));
      q.pending.front().submit_ns = now;  // reported once per timeout
    }
  }
}

// A DMA thread that entered a GPU library call copy_timeout_ms ago and is still inside it: the
// copies cannot move, and no stall of a submitted copy will ever be seen. The way to get here: a
// CUDA call of another thread of this process that waits for every running kernel while holding
// the context (cudaFree, cudaFreeHost, cudaHostUnregister, a library loading kernels such as
// cuBLAS on a new GEMM shape, a lazily loaded kernel's first launch; measured on H200), made
// while a kernel waits for these copies: the copies wait for the call, the call for the kernel,
// the kernel for the copies. A NIC moves bytes without the CUDA API; copy delivery does not (store
// delivery makes no CUDA call). The NIC thread, which never calls into the GPU library, names
// such a call once.
void IpcTransport::Nic::check_dma_call(int64_t now) {
  const int64_t since = gpu_call_since_.load(std::memory_order_acquire);
  if (since == 0 || since == gpu_call_reported_) return;
  const int64_t waited = now - since;
  if (waited <= static_cast<int64_t>(t_.options_.copy_timeout_ms) * 1'000'000) return;
  gpu_call_reported_ = since;
  fail_all(detail::concat(
      "ipc rank ", t_.setup_.rank, ": the NIC model's DMA thread has been inside a GPU copy-stream call (submit or "
      "poll) for ", waited / 1'000'000,
      " ms, so no copy can move. Another thread of this process is making a CUDA call that waits for the running "
      "kernels (cudaFree, cudaFreeHost, a library loading kernels such as cuBLAS on a new GEMM shape, a lazily "
      "loaded kernel's first launch) while a kernel waits for these copies; the ipc NIC model's copy delivery "
      "needs the CUDA API to move bytes (a NIC does not). Use UCCL_EP_IPC_DELIVERY=store (the default), which "
      "makes no CUDA call"));
}

// Delivers what arrived: RC in post order per QP, SRD in arrival order. Failed flights complete
// with their error once due.
bool IpcTransport::Nic::deliver(int64_t now) {
  bool moved = false;
  if (!failed_.empty()) {
    // Error completions in the order they fall due (a QP's flushes after the error that failed it).
    std::sort(failed_.begin(), failed_.end(),
              [this](uint32_t a, uint32_t b) { return pool_[a].arrive_ns < pool_[b].arrive_ns; });
    size_t due = 0;
    while (due < failed_.size() && pool_[failed_[due]].arrive_ns <= now) fail(failed_[due++]);
    failed_.erase(failed_.begin(), failed_.begin() + static_cast<ptrdiff_t>(due));
    moved |= due > 0;
  }
  if (t_.options_.reorder) {
    while (!srd_.empty() && srd_.top().first <= now) {
      move_bytes(srd_.top().second);
      landing_.push_back(srd_.top().second);
      srd_.pop();
      moved = true;
    }
    size_t keep = 0;
    for (uint32_t id : landing_) {
      if (copy_done(pool_[id]) && deliver_one(id, now)) {
        moved = true;
      } else {
        landing_[keep++] = id;
      }
    }
    landing_.resize(keep);
    return moved;
  }
  for (auto& q : qp_) {
    while (!q.empty()) {
      const Flight& f = pool_[q.front()];
      if (f.arrive_ns > now || !copy_done(f) || !deliver_one(q.front(), now)) break;
      q.pop_front();
      moved = true;
    }
  }
  return moved;
}

// Hands the immediate to the peer's proxy thread; false when its inbox ring is full (the peer's
// proxy is not draining: receiver-not-ready, retried next pass).
bool IpcTransport::Nic::deliver_one(uint32_t id, int64_t now) {
  Flight& f = pool_[id];
  for (const IpcFault& x : t_.options_.faults) {
    if (x.kind != IpcFault::kDeadPeer || (x.rank != t_.setup_.rank && x.rank != f.wr.peer)) continue;
    const void* seg = x.rank == t_.setup_.rank ? t_.inbox_->data() : t_.peers_[x.rank]->inbox;
    if (ipc::inbox_header(const_cast<void*>(seg))->dead.load(std::memory_order_acquire) != 0) {
      f.status = kWcRetryExcErr;
      f.why = detail::concat("rank ", x.rank, " stopped answering (UCCL_EP_IPC_FAULT dead_peer)");
      f.arrive_ns = f.wr.posted_ns + static_cast<int64_t>(x.detect_ms) * 1'000'000;
      failed_.push_back(id);
      return true;
    }
  }
  const uint32_t cap = t_.options_.inbox_capacity;
  ipc::RingHeader* r = ipc::ring_at(t_.peers_[f.wr.peer]->inbox, f.thread, t_.setup_.rank, world_, cap);
  const uint64_t tail = r->tail;
  if (tail - __atomic_load_n(&r->head, __ATOMIC_ACQUIRE) >= cap) return false;
  ipc::ring_entries(r)[tail & (cap - 1)] = ipc::InboxEntry{f.wr.imm, f.wr.channel, f.wr.length, 0};
  __atomic_store_n(&r->tail, tail + 1, __ATOMIC_RELEASE);
  acks_[f.thread].push_back(Ack{ipc::SendDone{f.wr.peer, f.wr.channel, f.wr.imm, f.wr.length, f.wr.wr_id},
                                now + latency_ns_});
  if (now > f.arrive_ns) bump(late_ns_, static_cast<uint64_t>(now - f.arrive_ns));
  bump(delivered_);
  release(id);
  return true;
}

bool IpcTransport::Nic::flush_acks(int64_t now) {
  bool moved = false;
  for (uint32_t th = 0; th < threads_; ++th) {
    auto& q = acks_[th];
    auto& cq = t_.endpoints_[th]->cq;
    while (!q.empty() && q.front().due_ns <= now && cq.try_push(q.front().done)) {
      q.pop_front();
      moved = true;
    }
    cq.publish();
  }
  return moved;
}

void IpcTransport::Nic::fail(uint32_t id) {
  const Flight& f = pool_[id];
  t_.endpoints_[f.thread]->fail(detail::concat(
      "ipc rank ", t_.setup_.rank, ": RDMA write to rank ", f.wr.peer, " on QP (proxy thread ", f.thread,
      " -> rank ", f.wr.peer, ", channel ", f.wr.channel, ") completed with ", wc_status_name(f.status), ": ", f.why));
  release(id);
}

void IpcTransport::Nic::fail_all(const std::string& message) {
  for (auto& ep : t_.endpoints_) ep->fail(message);
}

}  // namespace uccl_ep

#include "transport/ipc_transport.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>

#include "common/errors.h"
#include "common/log.h"
#include "transport/kv.h"

namespace uccl_ep {
namespace {

struct InboxEntry {
  uint32_t imm;
  uint32_t channel;
  uint32_t bytes;
  uint32_t reserved;
};

struct RingHeader {
  alignas(64) uint64_t head;  // consumer (receiving proxy thread)
  alignas(64) uint64_t tail;  // producer (sending proxy thread of one peer)
};

size_t ring_bytes(uint32_t capacity) { return sizeof(RingHeader) + size_t{capacity} * sizeof(InboxEntry); }

// Ring (thread, src) of a rank's inbox segment.
RingHeader* ring_at(void* segment, uint32_t thread, uint32_t src, uint32_t world, uint32_t capacity) {
  return reinterpret_cast<RingHeader*>(static_cast<char*>(segment) + (size_t{thread} * world + src) * ring_bytes(capacity));
}
InboxEntry* ring_entries(RingHeader* r) { return reinterpret_cast<InboxEntry*>(r + 1); }

using Clock = std::chrono::steady_clock;

}  // namespace

SharedHostRegion::SharedHostRegion(uint64_t bytes) : shm_(SharedMemory::unique_name("region"), bytes, true) {}

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

class IpcTransport::IpcEndpoint : public Endpoint {
 public:
  IpcEndpoint(IpcTransport& t, uint32_t thread)
      : t_(t), thread_(thread), rng_(t.options_.seed * 0x9E3779B97F4A7C15ull + t.setup_.rank * 7919u + thread) {}

  ~IpcEndpoint() override {
    for (auto& kv : queues_) t_.options_.gpu->copy_queue_destroy(kv.second.handle);
  }

  // Connect time (before any kernel runs): one copy queue per device this endpoint copies with.
  void add_copy_queue(int device) {
    if (queues_.count(device)) return;
    queues_[device].handle = t_.options_.gpu->copy_queue_create(device, t_.options_.copy_queue_depth);
  }

  void post_write(uint32_t peer, uint32_t channel, uint64_t src_offset, uint64_t dst_offset, uint32_t length,
                  uint32_t imm, uint64_t wr_id) override {
    UCCL_EP_CHECK_ARG(peer < t_.peers_.size(), "ipc post_write to rank ", peer, " of ", t_.peers_.size());
    auto now = Clock::now();
    // Injector: every write gets its own random latency in [0, max_delay_us]; differing latencies
    // are what reorders a stream (as packet spraying does on SRD).
    auto due = t_.options_.reorder ? now + std::chrono::microseconds(rng_() % (t_.options_.max_delay_us + 1ull)) : now;
    held_.push_back(Op{peer, channel, src_offset, dst_offset, length, imm, wr_id, due});
    progress();
  }

  int poll(Completion* out, int max) override {
    progress();
    int n = 0;
    while (n < max && !done_.empty()) {
      out[n++] = done_.front();
      done_.pop_front();
    }
    const uint32_t world = t_.setup_.world_size;
    const uint32_t cap = t_.options_.inbox_capacity;
    for (uint32_t k = 0; k < world && n < max; ++k) {
      uint32_t src = (next_src_ + k) % world;
      RingHeader* r = ring_at(t_.inbox_->data(), thread_, src, world, cap);
      uint64_t head = r->head;
      uint64_t tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
      while (head < tail && n < max) {
        const InboxEntry& e = ring_entries(r)[head & (cap - 1)];
        out[n++] = Completion{Completion::kRecv, src, e.channel, e.imm, e.bytes, 0};
        ++head;
      }
      __atomic_store_n(&r->head, head, __ATOMIC_RELEASE);
    }
    next_src_ = (next_src_ + 1) % world;
    return n;
  }

 private:
  struct Op {
    uint32_t peer, channel;
    uint64_t src_offset, dst_offset;
    uint32_t length, imm;
    uint64_t wr_id;
    Clock::time_point due;  // earliest execution time
  };

  struct Queue {
    void* handle = nullptr;
    uint64_t submitted = 0;
    uint64_t completed = 0;
  };

  // An executed op whose immediate is not published yet: its GPU copy may still be in flight.
  struct Pending {
    Op op;
    Queue* queue;     // null: nothing to wait for (host copy done, or no payload)
    uint64_t ticket;  // the copy's ticket in `queue`
    Clock::time_point since;
  };

  // Executes held writes: all, in order, without the injector; with it, every write whose random
  // latency elapsed (earliest first), and the earliest ones early when more than max_held wait.
  // Then publishes, in execution order, the immediates of the executed writes whose bytes landed.
  void progress() {
    if (!t_.options_.reorder) {
      size_t i = 0;
      while (i < held_.size() && execute(held_[i])) ++i;
      held_.erase(held_.begin(), held_.begin() + static_cast<ptrdiff_t>(i));
    } else {
      const auto now = Clock::now();
      while (!held_.empty()) {
        size_t first = 0;
        for (size_t i = 1; i < held_.size(); ++i) {
          if (held_[i].due < held_[first].due) first = i;
        }
        if (held_[first].due > now && held_.size() <= t_.options_.max_held) break;
        if (!execute(held_[first])) break;
        held_[first] = held_.back();
        held_.pop_back();
      }
    }
    publish();
  }

  Queue* queue_for(const Peer& p) {
    const int dev = t_.setup_.region.gpu_device >= 0 ? t_.setup_.region.gpu_device : p.gpu_device;
    auto it = queues_.find(dev);
    if (it == queues_.end()) {
      UCCL_EP_THROW(TransportError, "ipc rank ", t_.setup_.rank, " thread ", thread_, ": no copy queue for GPU ", dev,
                    " (the transport was connected without it)");
    }
    return &it->second;
  }

  // Starts the op's copy (GPU copies are only enqueued) and queues the op for publication. False:
  // try again later (the copy queue is full).
  bool execute(const Op& op) {
    Peer& p = *t_.peers_[op.peer];
    Pending pend{op, nullptr, 0, Clock::now()};
    if (op.length > 0) {
      char* dst = p.region + op.dst_offset;
      const char* src = static_cast<const char*>(t_.setup_.region.base) + op.src_offset;
      if (p.region_gpu || t_.setup_.region.gpu_device >= 0) {
        Queue* q = queue_for(p);
        if (q->submitted - q->completed >= t_.options_.copy_queue_depth) {
          q->completed = t_.options_.gpu->copy_completed(q->handle);
          if (q->submitted - q->completed >= t_.options_.copy_queue_depth) return false;
        }
        q->submitted = t_.options_.gpu->copy_submit(q->handle, dst, src, op.length);
        pend.queue = q;
        pend.ticket = q->submitted;
      } else {
        std::memcpy(dst, src, op.length);
      }
    }
    pending_.push_back(pend);
    return true;
  }

  // Publishes the immediate (release) once the op's bytes landed, then completes locally: a
  // receiver that sees the immediate sees the bytes, and a sender completion implies the peer can
  // see the immediate. In execution order, so an ordered (injector-off) transport stays ordered.
  void publish() {
    const uint32_t world = t_.setup_.world_size;
    const uint32_t cap = t_.options_.inbox_capacity;
    while (!pending_.empty()) {
      Pending& f = pending_.front();
      if (f.queue && f.ticket > f.queue->completed) {
        f.queue->completed = t_.options_.gpu->copy_completed(f.queue->handle);
        if (f.ticket > f.queue->completed) {
          check_stall(f);
          return;
        }
      }
      Peer& p = *t_.peers_[f.op.peer];
      RingHeader* r = ring_at(p.inbox, thread_, t_.setup_.rank, world, cap);
      uint64_t tail = r->tail;
      if (tail - __atomic_load_n(&r->head, __ATOMIC_ACQUIRE) >= cap) return;  // peer not draining
      ring_entries(r)[tail & (cap - 1)] = InboxEntry{f.op.imm, f.op.channel, f.op.length, 0};
      __atomic_store_n(&r->tail, tail + 1, __ATOMIC_RELEASE);
      done_.push_back(Completion{Completion::kSend, f.op.peer, f.op.channel, f.op.imm, f.op.length, f.op.wr_id});
      pending_.pop_front();
    }
  }

  // A GPU copy that does not finish is reported here, naming what it copies, rather than left to
  // the proxy's generic "the transport stopped completing" (the proxy thread stays responsive).
  void check_stall(const Pending& f) const {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - f.since).count();
    if (static_cast<uint64_t>(waited) <= t_.options_.copy_timeout_ms) return;
    UCCL_EP_THROW(TransportError, "ipc rank ", t_.setup_.rank, " thread ", thread_, ": GPU copy of ", f.op.length,
                  " bytes to rank ", f.op.peer, " (channel ", f.op.channel, ") has not completed after ", waited,
                  " ms; the GPU never ran it (its copy stream is blocked, e.g. behind work that waits for this ",
                  "proxy, or the device hung)");
  }

  IpcTransport& t_;
  uint32_t thread_;
  std::mt19937_64 rng_;
  std::vector<Op> held_;
  std::deque<Pending> pending_;
  std::deque<Completion> done_;
  std::map<int, Queue> queues_;
  uint32_t next_src_ = 0;
};

IpcTransport::IpcTransport(const TransportSetup& setup, const IpcOptions& options,
                           const std::string& shared_region_name)
    : setup_(setup), options_(options), shared_region_name_(shared_region_name) {
  UCCL_EP_CHECK_ARG(setup.world_size >= 1 && setup.rank < setup.world_size, "rank=", setup.rank,
                    " world_size=", setup.world_size);
  UCCL_EP_CHECK_ARG(setup.num_threads >= 1, "num_threads=", setup.num_threads, " must be >= 1");
  UCCL_EP_CHECK_ARG(options.inbox_capacity >= 2 && (options.inbox_capacity & (options.inbox_capacity - 1)) == 0,
                    "ipc inbox_capacity=", options.inbox_capacity, " must be a power of two >= 2");
  UCCL_EP_CHECK_ARG(setup.region.base != nullptr && setup.region.bytes > 0, "ipc transport needs a region");
  UCCL_EP_CHECK_ARG(options.copy_queue_depth >= 1 && options.copy_timeout_ms > 0, "ipc copy_queue_depth=",
                    options.copy_queue_depth, " and copy_timeout_ms=", options.copy_timeout_ms, " must be positive");
  UCCL_EP_CHECK_ARG(setup.region.gpu_device < 0 || options.gpu != nullptr,
                    "the region is GPU memory (device ", setup.region.gpu_device,
                    ") but this build has no GPU support; rebuild with nvcc/hipcc");
  inbox_ = std::make_unique<SharedMemory>(SharedMemory::unique_name("inbox"),
                                          ring_bytes(options.inbox_capacity) * setup.num_threads * setup.world_size,
                                          true);
}

IpcTransport::~IpcTransport() {
  endpoints_.clear();
  for (auto& p : peers_) {
    if (p && p->ipc_opened && options_.gpu) options_.gpu->ipc_close(p->region, setup_.region.gpu_device);
  }
}

std::string IpcTransport::local_info() const {
  std::map<std::string, std::string> f;
  f["transport"] = "ipc";
  f["pid"] = std::to_string(::getpid());
  f["world"] = std::to_string(setup_.world_size);
  f["threads"] = std::to_string(setup_.num_threads);
  f["inbox_cap"] = std::to_string(options_.inbox_capacity);
  f["inbox"] = kv::hex(inbox_->name());
  f["inbox_ptr"] = std::to_string(reinterpret_cast<uint64_t>(inbox_->data()));
  f["ptr"] = std::to_string(reinterpret_cast<uint64_t>(setup_.region.base));
  f["bytes"] = std::to_string(setup_.region.bytes);
  f["gpu"] = std::to_string(setup_.region.gpu_device + 1);
  f["shm"] = kv::hex(shared_region_name_);
  f["handle"] = setup_.region.gpu_device >= 0
                    ? kv::hex(options_.gpu->ipc_handle(setup_.region.base, setup_.region.gpu_device))
                    : "";
  return kv::encode(f);
}

void IpcTransport::connect(const std::vector<std::string>& infos) {
  UCCL_EP_CHECK_ARG(infos.size() == setup_.world_size, "ipc connect got ", infos.size(), " infos for world_size ",
                    setup_.world_size);
  UCCL_EP_CHECK_ARG(peers_.empty(), "ipc transport of rank ", setup_.rank, " is already connected");
  const uint64_t my_pid = static_cast<uint64_t>(::getpid());
  for (uint32_t r = 0; r < infos.size(); ++r) {
    const std::string origin = "rank " + std::to_string(r);
    auto f = kv::decode(infos[r]);
    UCCL_EP_CHECK_ARG(kv::get(f, "transport", origin) == "ipc", origin, " uses transport '",
                      kv::get(f, "transport", origin), "'; set UCCL_EP_TRANSPORT identically on all ranks");
    UCCL_EP_CHECK_ARG(kv::get_u64(f, "world", origin) == setup_.world_size &&
                          kv::get_u64(f, "threads", origin) == setup_.num_threads &&
                          kv::get_u64(f, "inbox_cap", origin) == options_.inbox_capacity,
                      origin, " disagrees on world size / proxy threads / inbox capacity; ",
                      "set UCCL_EP_NUM_PROXY_THREADS identically on all ranks");
    auto p = std::make_unique<Peer>();
    const bool same_process = kv::get_u64(f, "pid", origin) == my_pid;
    if (r == setup_.rank) {
      p->inbox = inbox_->data();
    } else if (same_process) {
      // One mapping per segment and process: atomics on two aliases of one page would be the same
      // memory to the CPU but not to ThreadSanitizer.
      p->inbox = reinterpret_cast<void*>(kv::get_u64(f, "inbox_ptr", origin));
    } else {
      p->inbox_map = std::make_unique<SharedMemory>(kv::unhex(kv::get(f, "inbox", origin)), inbox_->bytes(), false);
      p->inbox = p->inbox_map->data();
    }
    p->region_bytes = kv::get_u64(f, "bytes", origin);
    p->gpu_device = static_cast<int>(kv::get_u64(f, "gpu", origin)) - 1;
    p->region_gpu = p->gpu_device >= 0;
    if (same_process) {
      p->region = reinterpret_cast<char*>(kv::get_u64(f, "ptr", origin));
    } else if (p->region_gpu) {
      UCCL_EP_CHECK_ARG(options_.gpu != nullptr, origin, " registered GPU memory but this build has no GPU support");
      p->region = static_cast<char*>(
          options_.gpu->ipc_open(kv::unhex(kv::get(f, "handle", origin)), std::max(setup_.region.gpu_device, 0)));
      p->ipc_opened = true;
    } else {
      std::string shm_name = kv::unhex(kv::get(f, "shm", origin));
      if (shm_name.empty()) {
        UCCL_EP_THROW(InvalidArgument, origin, " is another process and its host region is private memory; ",
                      "allocate host regions with SharedHostRegion for multi-process ipc");
      }
      p->region_map = std::make_unique<SharedMemory>(shm_name, p->region_bytes, false);
      p->region = static_cast<char*>(p->region_map->data());
    }
    peers_.push_back(std::move(p));
  }
  for (uint32_t t = 0; t < setup_.num_threads; ++t) endpoints_.push_back(std::make_unique<IpcEndpoint>(*this, t));
  // GPU copies: the devices they are issued on (the local GPU; or each GPU peer's when the local
  // region is host memory), and direct P2P to same-process GPU peers (IPC-opened peers enabled it
  // lazily). Everything is set up here, before any kernel runs and not from the proxy threads.
  std::vector<int> devices;
  for (uint32_t r = 0; r < peers_.size(); ++r) {
    const Peer& p = *peers_[r];
    if (!p.region_gpu && setup_.region.gpu_device < 0) continue;
    devices.push_back(setup_.region.gpu_device >= 0 ? setup_.region.gpu_device : p.gpu_device);
    if (options_.peer_access && setup_.region.gpu_device >= 0 && p.region_gpu && !p.ipc_opened &&
        p.gpu_device != setup_.region.gpu_device &&
        !options_.gpu->enable_peer_access(setup_.region.gpu_device, p.gpu_device)) {
      UCCL_EP_LOG(kWarn, "ipc rank ", setup_.rank, ": GPU ", setup_.region.gpu_device, " cannot access GPU ",
                  p.gpu_device, " (rank ", r, ") peer-to-peer; copies are staged through host memory");
    }
  }
  UCCL_EP_CHECK_ARG(devices.empty() || options_.gpu != nullptr, "ipc rank ", setup_.rank,
                    " must copy to GPU memory but this build has no GPU support; rebuild with nvcc/hipcc");
  for (int dev : devices) {
    for (auto& ep : endpoints_) ep->add_copy_queue(dev);
  }
}

Endpoint& IpcTransport::endpoint(uint32_t thread) {
  if (endpoints_.empty()) UCCL_EP_THROW(InvalidArgument, "ipc transport of rank ", setup_.rank, " is not connected");
  UCCL_EP_CHECK_ARG(thread < endpoints_.size(), "proxy thread ", thread, " of ", endpoints_.size());
  return *endpoints_[thread];
}

uint64_t IpcTransport::peer_region_bytes(uint32_t peer) const {
  UCCL_EP_CHECK_ARG(peer < peers_.size(), "rank ", peer, " is not a connected peer (world ", peers_.size(), ")");
  return peers_[peer]->region_bytes;
}

}  // namespace uccl_ep

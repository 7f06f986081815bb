#include "transport/ipc_transport.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>

#include "common/errors.h"
#include "common/log.h"
#include "transport/ipc_internal.h"
#include "transport/kv.h"

namespace uccl_ep {

using ipc::InboxEntry;
using ipc::RingHeader;

SharedHostRegion::SharedHostRegion(uint64_t bytes) : shm_(SharedMemory::unique_name("region"), bytes, true) {}

IpcTransport::IpcEndpoint::IpcEndpoint(IpcTransport& t, uint32_t thread, uint32_t queue_capacity)
    : sq(queue_capacity), cq(queue_capacity), t_(t), thread_(thread) {}

void IpcTransport::IpcEndpoint::fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(error_mu_);
  if (failed_.load(std::memory_order_relaxed)) return;
  error_ = message;
  failed_.store(true, std::memory_order_release);
}

// Only puts the request into the send queue, as ibv_post_send does; flush() (or the next poll)
// makes it visible to the NIC thread. A full queue (more posted than the proxy's windows allow)
// waits for the NIC, bounded.
void IpcTransport::IpcEndpoint::post_write(uint32_t peer, uint32_t channel, uint64_t src_offset, uint64_t dst_offset,
                                           uint32_t length, uint32_t imm, uint64_t wr_id) {
  UCCL_EP_CHECK_ARG(peer < t_.peers_.size(), "ipc post_write to rank ", peer, " of ", t_.peers_.size());
  const ipc::WorkRequest wr{peer, channel, src_offset, dst_offset, length, imm, wr_id, ipc::now_ns()};
  if (sq.try_push(wr)) return;
  sq.publish();
  const auto deadline = ipc::Clock::now() + std::chrono::milliseconds(t_.options_.copy_timeout_ms);
  while (!sq.try_push(wr)) {
    if (failed_.load(std::memory_order_acquire) || ipc::Clock::now() > deadline) {
      UCCL_EP_THROW(TransportError, "ipc rank ", t_.setup_.rank, " thread ", thread_, ": the send queue (",
                    sq.capacity(), " work requests) stayed full for ", t_.options_.copy_timeout_ms,
                    " ms; the NIC thread stopped taking requests");
    }
    std::this_thread::yield();
  }
}

int IpcTransport::IpcEndpoint::poll(Completion* out, int max) {
  if (failed_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(error_mu_);
    UCCL_EP_THROW(TransportError, error_);
  }
  sq.publish();
  int n = 0;
  const uint64_t done = std::min<uint64_t>(cq.available(), static_cast<uint64_t>(max));
  for (uint64_t i = 0; i < done; ++i) {
    const ipc::SendDone& d = cq.peek(i);
    out[n++] = Completion{Completion::kSend, d.peer, d.channel, d.imm, d.bytes, d.wr_id};
  }
  cq.consume(done);
  const uint32_t world = t_.setup_.world_size;
  const uint32_t cap = t_.options_.inbox_capacity;
  for (uint32_t k = 0; k < world && n < max; ++k) {
    uint32_t src = (next_src_ + k) % world;
    RingHeader* r = ipc::ring_at(t_.inbox_->data(), thread_, src, world, cap);
    uint64_t head = r->head;
    uint64_t tail = __atomic_load_n(&r->tail, __ATOMIC_ACQUIRE);
    while (head < tail && n < max) {
      const InboxEntry& e = ipc::ring_entries(r)[head & (cap - 1)];
      out[n++] = Completion{Completion::kRecv, src, e.channel, e.imm, e.bytes, 0};
      ++head;
    }
    __atomic_store_n(&r->head, head, __ATOMIC_RELEASE);
  }
  next_src_ = (next_src_ + 1) % world;
  return n;
}

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
  UCCL_EP_CHECK_ARG(options.link_gbps >= 0 && options.latency_us >= 0, "ipc link_gbps=", options.link_gbps,
                    " and latency_us=", options.latency_us,
                    " must be >= 0 (UCCL_EP_IPC_LINK_GBPS, UCCL_EP_IPC_LATENCY_US; 0 = unthrottled / none)");
  UCCL_EP_CHECK_ARG(options.copy_streams >= 1 && options.copy_streams <= 64, "ipc copy_streams=",
                    options.copy_streams, " must be in [1, 64] (UCCL_EP_IPC_COPY_STREAMS)");
  for (const IpcFault& f : options.faults) {
    UCCL_EP_CHECK_ARG(f.rank < setup.world_size && f.qp < static_cast<int32_t>(setup.num_threads) &&
                          f.peer < static_cast<int32_t>(setup.world_size),
                      "UCCL_EP_IPC_FAULT names rank ", f.rank, " qp ", f.qp, " peer ", f.peer, " but the world has ",
                      setup.world_size, " ranks and ", setup.num_threads, " proxy threads");
  }
  inbox_ = std::make_unique<SharedMemory>(
      SharedMemory::unique_name("inbox"),
      ipc::inbox_bytes(options.inbox_capacity, setup.num_threads, setup.world_size), true);
}

IpcTransport::~IpcTransport() {
  nic_.reset();  // the NIC thread uses the endpoints and the peers' mappings
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
  f["in_place"] = options_.bytes_in_place ? "1" : "0";
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
    UCCL_EP_CHECK_ARG((kv::get(f, "in_place", origin) == "1") == options_.bytes_in_place, origin,
                      " moves write bytes differently from rank ", setup_.rank, " (",
                      options_.bytes_in_place ? "copies" : "stores in place", " vs ",
                      options_.bytes_in_place ? "stores in place" : "copies",
                      "); set UCCL_EP_IPC_DELIVERY identically on all ranks");
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
  // Send and completion queues: more than a proxy thread's stream windows ever hold (a full
  // queue makes post_write wait for the NIC, bounded).
  constexpr uint32_t kQueueCapacity = 8192;
  for (uint32_t t = 0; t < setup_.num_threads; ++t) {
    endpoints_.push_back(std::make_unique<IpcEndpoint>(*this, t, kQueueCapacity));
  }
  // GPU copies need the GPU library, and direct P2P to same-process GPU peers (IPC-opened peers
  // enabled it lazily). Everything is set up here, before any kernel runs: the NIC's copy
  // streams too (Nic's constructor), not from its thread.
  bool gpu_copies = false;
  for (uint32_t r = 0; r < peers_.size(); ++r) {
    const Peer& p = *peers_[r];
    if (!p.region_gpu && setup_.region.gpu_device < 0) continue;
    gpu_copies = true;
    if (options_.peer_access && setup_.region.gpu_device >= 0 && p.region_gpu && !p.ipc_opened &&
        p.gpu_device != setup_.region.gpu_device &&
        !options_.gpu->enable_peer_access(setup_.region.gpu_device, p.gpu_device)) {
      UCCL_EP_CHECK_ARG(!options_.bytes_in_place, "ipc rank ", setup_.rank, ": GPU ", setup_.region.gpu_device,
                        " cannot access GPU ", p.gpu_device, " (rank ", r, ") peer-to-peer, so its kernels cannot ",
                        "store ring bytes there; set UCCL_EP_IPC_DELIVERY=copy");
      UCCL_EP_LOG(kWarn, "ipc rank ", setup_.rank, ": GPU ", setup_.region.gpu_device, " cannot access GPU ",
                  p.gpu_device, " (rank ", r, ") peer-to-peer; copies are staged through host memory");
    }
  }
  UCCL_EP_CHECK_ARG(!gpu_copies || options_.gpu != nullptr, "ipc rank ", setup_.rank,
                    " must copy to GPU memory but this build has no GPU support; rebuild with nvcc/hipcc");
  nic_ = std::make_unique<Nic>(*this);
  nic_->start();
}

Endpoint& IpcTransport::endpoint(uint32_t thread) {
  if (endpoints_.empty()) UCCL_EP_THROW(InvalidArgument, "ipc transport of rank ", setup_.rank, " is not connected");
  UCCL_EP_CHECK_ARG(thread < endpoints_.size(), "proxy thread ", thread, " of ", endpoints_.size());
  return *endpoints_[thread];
}

IpcNicStats IpcTransport::nic_stats() const { return nic_ ? nic_->stats() : IpcNicStats{}; }

uintptr_t IpcTransport::peer_region(uint32_t peer) const {
  UCCL_EP_CHECK_ARG(peer < peers_.size(), "rank ", peer, " is not a connected peer (world ", peers_.size(),
                    "); connect the ipc transport first");
  return reinterpret_cast<uintptr_t>(peers_[peer]->region);
}

uint64_t IpcTransport::peer_region_bytes(uint32_t peer) const {
  UCCL_EP_CHECK_ARG(peer < peers_.size(), "rank ", peer, " is not a connected peer (world ", peers_.size(), ")");
  return peers_[peer]->region_bytes;
}

}  // namespace uccl_ep

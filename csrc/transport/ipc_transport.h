// The single-host transport: no NIC. A proxy executes a write as a copy into the peer's mapped
// region (GPU regions: enqueued on the endpoint's own stream and polled through events, never
// waited on), then hands the immediate to the peer proxy through a shared-memory inbox. It lets the
// whole internode path run on one machine by splitting its GPUs into virtual nodes.
//
// Reorder/delay injector (seeded): instead of executing a posted write at once, the endpoint
// gives it a random latency in [0, max_delay_us] and executes it when that elapsed, so data and
// immediates of one stream land out of order, as on EFA SRD.
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "transport/gpu_hooks.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace uccl_ep {

struct IpcOptions {
  uint32_t inbox_capacity = 4096;  // immediates per (peer, thread) inbox ring; power of two
  bool reorder = false;            // enable the injector
  uint64_t seed = 0;               // injector seed (combined with rank and thread)
  uint32_t max_delay_us = 50;      // largest injected latency of a write
  uint32_t max_held = 256;         // more held writes than this: execute the earliest at once
  uint32_t copy_queue_depth = 256;  // GPU copies in flight per proxy thread (and device)
  uint64_t copy_timeout_ms = 30000;  // a GPU copy pending longer: TransportError (keep < proxy timeout)
  bool peer_access = true;          // enable P2P to same-process GPU peers (UCCL_EP_IPC_PEER_ACCESS)
  const GpuHooks* gpu = nullptr;   // required when the region is GPU memory
};

// Host memory in a named shared-memory segment, so an ipc peer in another process can map it.
class SharedHostRegion {
 public:
  explicit SharedHostRegion(uint64_t bytes);
  void* data() const { return shm_.data(); }
  uint64_t bytes() const { return shm_.bytes(); }
  const std::string& name() const { return shm_.name(); }

 private:
  SharedMemory shm_;
};

class IpcTransport : public Transport {
 public:
  // `shared_region_name`: when the host region is a SharedHostRegion, its name (peers in other
  // processes map it); empty: peers must live in this process.
  IpcTransport(const TransportSetup& setup, const IpcOptions& options, const std::string& shared_region_name = "");
  ~IpcTransport() override;

  std::string name() const override { return options_.reorder ? "ipc+reorder" : "ipc"; }
  bool ordered() const override { return !options_.reorder; }
  std::string local_info() const override;
  void connect(const std::vector<std::string>& infos) override;
  Endpoint& endpoint(uint32_t thread) override;
  uint64_t peer_region_bytes(uint32_t peer) const override;

  struct Peer;
  class IpcEndpoint;

 private:
  TransportSetup setup_;
  IpcOptions options_;
  std::string shared_region_name_;
  std::unique_ptr<SharedMemory> inbox_;  // this rank's inboxes: [thread][src rank] rings
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::unique_ptr<IpcEndpoint>> endpoints_;
};

}  // namespace uccl_ep

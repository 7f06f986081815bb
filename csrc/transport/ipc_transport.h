// The single-host transport and NIC model: no NIC, the same semantics as the verbs transport.
//
// Each rank has one virtual NIC, a thread of its own ("uenic<rank>"). A proxy thread's
// post_write only puts a work request into its send queue (flush() rings the doorbell for all
// posted since the last one) and returns, as ibv_post_send does. The NIC thread takes work
// requests from every send queue, puts them on its egress wire (line rate and latency, below),
// moves their bytes with the GPU's copy engines (batched, several copy streams, contiguous
// writes to one peer coalesced) or memcpy for host regions, and once a write's bytes landed AND
// its modelled arrival time passed, hands its immediate to the peer's proxy through a
// shared-memory inbox; the sender's completion follows one latency later (the ack). Proxies poll
// completions; nothing in a proxy thread waits for the GPU. With bytes_in_place (store
// delivery) the kernels stored a GPU write's bytes at its destination before posting it, and
// the NIC moves none: it makes no CUDA call, which copies would (see check_dma_call).
//
// Model (per virtual NIC):
// - line rate B (UCCL_EP_IPC_LINK_GBPS, GB/s; 0 = as fast as the copies go): egress is one
//   serial wire; a message occupies it for (length + 64 bytes per 4096-byte packet) / B;
// - latency L (UCCL_EP_IPC_LATENCY_US): a write arrives L after its last byte left; its send
//   completion comes L after that;
// - RC (default): a QP (proxy thread x peer) delivers in post order. SRD (the reorder injector,
//   UCCL_EP_IPC_REORDER): each message gets an extra random delay in [0, max_delay_us] and
//   messages are delivered in arrival order, not post order;
// - faults (UCCL_EP_IPC_FAULT, ipc_fault.h): completion errors and dead peers; a failed
//   completion makes the proxy thread's poll() throw TransportError naming rank, QP and status.
// Not modelled: incast at a receiver's ingress, PCIe between NIC and GPU, packet loss.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "transport/gpu_hooks.h"
#include "transport/ipc_fault.h"
#include "transport/shm.h"
#include "transport/transport.h"

namespace uccl_ep {

struct IpcOptions {
  uint32_t inbox_capacity = 4096;  // immediates per (peer, thread) inbox ring; power of two
  bool reorder = false;            // SRD: unordered delivery after random delays
  uint64_t seed = 0;               // injector seed (combined with rank)
  uint32_t max_delay_us = 50;      // largest injected extra delay of a message
  double link_gbps = 0;            // egress line rate, GB/s (1e9 bytes/s); 0 = unthrottled
  double latency_us = 0;           // one-way latency of the virtual wire
  std::vector<IpcFault> faults;    // injected faults (every rank gets the same list)
  uint32_t copy_queue_depth = 256;  // GPU copy batches in flight per copy stream
  uint32_t copy_streams = 4;        // copy streams per GPU the NIC spreads batches over
  uint64_t copy_timeout_ms = 30000;  // a GPU copy pending longer: TransportError (keep < proxy timeout)
  bool peer_access = true;          // enable P2P to same-process GPU peers (UCCL_EP_IPC_PEER_ACCESS)
  // GPU regions: every write's bytes are at their destination before it is posted (the
  // internode kernels store ring slots into the receiver's region over NVLink;
  // UCCL_EP_IPC_DELIVERY=store). The NIC then times each write and delivers it as usual but
  // copies nothing, so it makes no CUDA call at all once connected.
  bool bytes_in_place = false;
  const GpuHooks* gpu = nullptr;   // required when the region is GPU memory
};

// What the NIC model did; its thread's CPU time is reported apart from the proxies'.
struct IpcNicStats {
  uint64_t writes = 0;         // messages put on the wire (writes and immediate-only messages)
  uint64_t bytes = 0;          // payload bytes
  uint64_t copies = 0;         // copy-engine copies after coalescing
  uint64_t batches = 0;        // copy submissions (one API call each)
  uint64_t delivered = 0;      // immediates handed to peers
  uint64_t wire_busy_ns = 0;   // time the egress wire was occupied (line-rate model only)
  // Line-rate model only: the egress wire idle between two messages, split by the gap's length
  // (short gaps: the posts did not keep up within a call; long ones: between calls), and per
  // message the time it waited for the wire behind earlier ones and the time from its post
  // until the NIC thread took it (the model's own lag).
  uint64_t wire_gaps_short = 0, wire_idle_short_ns = 0;  // gaps under 50 us
  uint64_t wire_gaps_long = 0, wire_idle_long_ns = 0;    // gaps of 50 us or more
  uint64_t wire_queue_ns = 0;  // summed over messages: wire start - post
  uint64_t nic_lag_ns = 0;     // summed over messages: pickup - post
  uint64_t late_ns = 0;        // summed over deliveries: delivery - modelled arrival (copies, lag)
  // The passes that moved anything of the NIC thread (taking work requests and handing their
  // copies off, delivering, handing out completions) and of its DMA thread (submitting copies,
  // polling them), and their time per step: take, submit, poll, deliver, complete.
  uint64_t busy_passes = 0, dma_passes = 0;
  uint64_t step_ns[5] = {0, 0, 0, 0, 0};
  double cpu_seconds = 0;      // CPU time of the NIC thread and its DMA thread
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
  // Maps every peer, creates the copy streams and starts the NIC thread.
  void connect(const std::vector<std::string>& infos) override;
  Endpoint& endpoint(uint32_t thread) override;
  uint64_t peer_region_bytes(uint32_t peer) const override;
  // Where `peer`'s region is mapped in this process (this rank's own for peer == rank); the
  // kernels store into it when bytes_in_place. Needs connect().
  uintptr_t peer_region(uint32_t peer) const;
  IpcNicStats nic_stats() const;

  struct Peer;
  class IpcEndpoint;
  class Nic;

 private:
  TransportSetup setup_;
  IpcOptions options_;
  std::string shared_region_name_;
  std::unique_ptr<SharedMemory> inbox_;  // this rank's inboxes: header, then [thread][src rank] rings
  std::vector<std::unique_ptr<Peer>> peers_;
  std::vector<std::unique_ptr<IpcEndpoint>> endpoints_;
  std::unique_ptr<Nic> nic_;
};

}  // namespace uccl_ep

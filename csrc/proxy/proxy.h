// The CPU proxy of one GPU (paper §3.2): N threads, each owning channels c with c % N == thread
// and its transport endpoint (thread i talks to thread i of every peer). A thread polls its
// channels' FIFOs, validates each command against the symmetric regions (commands carry offsets),
// posts it through the transport with a sequence-numbered immediate, and on the receive side
// applies software atomics and barrier arrivals in per-stream order (§3.3, §4.1).
//
// Threads never throw across threads: the first failure is recorded, every channel's producers
// are told to give up (FIFO abort flag), and check() re-raises it on the next host call.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fifo/fifo.h"
#include "proxy/imm.h"
#include "transport/transport.h"

namespace uccl_ep {

// Where the delivery order of a stream is enforced.
enum class Ordering {
  kReceiver,  // the receiver buffers control messages until earlier messages landed (default)
  kSender,    // the sender posts a control message only after earlier writes completed (+1 RTT)
  kNone,      // apply on arrival: correct only on ordered transports (RC), for comparison
};
Ordering parse_ordering(const std::string& s);
const char* ordering_name(Ordering o);

struct ProxyOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t ranks_per_node = 1;  // same-rail peers: equal rank % ranks_per_node
  uint32_t num_threads = 4;
  uint64_t timeout_ms = 100000;  // bound of every wait (peer acks, drains, barriers)
  Ordering ordering = Ordering::kReceiver;
  uint32_t max_inflight_per_stream = imm::kSeqWindow;  // <= kSeqWindow; UCCL_IB_MAX_INFLIGHT_NORMAL
  uint64_t max_inflight_bytes_per_stream = 0;          // 0: no cap; UCCL_IB_MAX_INFLIGHT_BYTES
  uint32_t batch = 32;                                 // commands taken from a channel per visit
  std::vector<int> cpus;                               // pin threads here (GPU's NUMA node); empty: no pin
  uint32_t idle_us = 200;                              // idle this long, then nap between polls; 0: spin
  uint64_t stop_timeout_ms = 5000;                     // bound of stop()'s wait for each thread to exit
};

struct ProxyStats {
  uint64_t commands = 0;         // popped commands
  uint64_t writes_posted = 0;
  uint64_t bytes_posted = 0;
  uint64_t atomics_posted = 0;
  uint64_t barriers = 0;
  uint64_t drains = 0;
  uint64_t writes_received = 0;
  uint64_t atomics_applied = 0;
  uint64_t held_out_of_order = 0;  // control/ write messages that arrived ahead of their turn
};

class Proxy {
 public:
  // channels[i]->channel() must equal i; every rank uses the same number of channels.
  // counters: the local software-atomic targets (host memory a GPU may poll), num_counters <=
  // cmd_limits::kNumAtomicCounters; may be null when num_counters is 0.
  Proxy(const ProxyOptions& options, std::vector<FifoChannel*> channels, Transport* transport, int64_t* counters,
        uint32_t num_counters);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  void start();
  // Stops and joins the threads, waiting at most `timeout_ms` (0: options().stop_timeout_ms) for
  // them to leave their loop. A thread still inside a transport call then (e.g. a CUDA call that
  // waits for kernels which wait for this proxy) makes stop() throw TimeoutError naming it; the
  // proxy keeps that thread and everything it uses, running() stays true, and stop() may be
  // called again once the call returned. The channels, transport and counters must outlive the
  // threads. A failure the threads recorded is not raised here (call check()).
  void stop(uint64_t timeout_ms = 0);
  bool running() const { return running_; }
  // Proxy threads of every Proxy in this process that have not exited yet (threads a destructor
  // had to leave behind included).
  static uint32_t live_threads();
  // Re-raises the first failure of a proxy thread (same exception class, message names the rank,
  // channel and peer). Also the watchdog: a thread that has not finished a pass of its loop for
  // timeout_ms (blocked inside a transport call, e.g. a CUDA call that waits for kernels which
  // wait for this proxy) becomes a TimeoutError naming it, and the producers are released.
  void check();
  ProxyStats stats() const;
  const ProxyOptions& options() const { return options_; }

  struct ThreadStats;
  // What the threads use. Shared with them, so a thread that ~Proxy had to leave behind (stuck
  // in a transport call past the stop bound) never touches freed proxy memory.
  struct State;

 private:
  ProxyOptions options_;
  std::shared_ptr<State> st_;
  bool running_ = false;
  std::vector<std::thread> threads_;
  // Watchdog state of check(): each thread's pass count when it last changed, and since when.
  std::mutex watch_mu_;
  std::vector<uint64_t> watch_passes_;
  std::vector<std::chrono::steady_clock::time_point> watch_since_;
};

// CPUs of the NUMA node a PCI device (e.g. "0000:3b:00.0") sits on; empty when unknown.
std::vector<int> numa_cpus_of_pci(const std::string& pci_bus_id, const std::string& sysfs_root = "/sys");
// Parses a Linux cpulist ("0-3,8,10-11"); throws InvalidArgument on malformed input.
std::vector<int> parse_cpulist(const std::string& s);

}  // namespace uccl_ep

// One proxy thread's state and loop body (Worker), shared by the files that implement it:
// worker_commands.cc turns FIFO commands into transport posts (validation, stream windows,
// ordering modes, drains, barriers); worker_completions.cc handles what the transport completes
// (send acknowledgements, receive-side ordering, software atomics, lost-message detection).
// proxy.cc owns the threads that run a Worker each. Internal to the proxy: nothing outside
// csrc/proxy/ includes this header.
#pragma once

#include <atomic>
#include <bitset>
#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "fifo/fifo.h"
#include "proxy/imm.h"
#include "proxy/proxy.h"
#include "proxy/reorder.h"
#include "transport/transport.h"

namespace uccl_ep {

struct Proxy::ThreadStats {
  std::atomic<uint64_t> commands{0}, writes_posted{0}, bytes_posted{0}, atomics_posted{0}, barriers{0}, drains{0},
      writes_received{0}, atomics_applied{0}, held_out_of_order{0};
  // Passes of the thread's loop (its heartbeat for the watchdog in check()); own cache line, as
  // check() reads it from another thread while the proxy thread bumps it every pass.
  alignas(64) std::atomic<uint64_t> passes{0};
};

namespace proxy_detail {

using Clock = std::chrono::steady_clock;

inline void bump(std::atomic<uint64_t>& c, uint64_t v = 1) {
  // Single writer: a relaxed load+store is enough and cheaper than a locked add.
  c.store(c.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
}

// Per-destination send state of one channel (one stream).
// The window bounds the *span* of un-acknowledged sequence numbers (oldest un-acked .. next), not
// their count: that is what lets the receiver order 7-bit sequence numbers (imm.h).
struct StreamTx {
  uint64_t next_seq = 0;    // unwrapped sequence number of the next message
  uint64_t acked_upto = 0;  // every message below this one completed
  std::bitset<imm::kSeqMod> unacked;
  uint32_t inflight = 0;
  uint32_t inflight_writes = 0;
  uint64_t inflight_bytes = 0;

  void on_ack(uint64_t seq) {
    unacked.reset(seq % imm::kSeqMod);
    while (acked_upto < next_seq && !unacked.test(acked_upto % imm::kSeqMod)) ++acked_upto;
  }
};

struct ChannelState {
  FifoChannel* fifo = nullptr;
  uint32_t id = 0;
  bool busy = false;  // a command was polled and is not yet popped
  TransferCmd cmd{};
  uint64_t idx = 0;
  int stage = 0;
  bool blocked = false;
  Clock::time_point blocked_since;
  uint64_t barrier_epoch = 0;
  std::multiset<uint64_t> outstanding;  // FIFO indices of posted, uncompleted messages
  std::vector<StreamTx> tx;             // by destination rank
};

struct RecvStream {
  StreamReorder reorder;
  uint64_t barriers = 0;
  Clock::time_point gap_since;  // when the current gap (held messages, expected one missing) opened
};

struct OutEntry {
  uint32_t local_channel;
  uint32_t peer;
  uint64_t seq;
  uint64_t fifo_idx;
  uint32_t bytes;
  bool is_write;
};

enum class Step { kDone, kAdvanced, kBlocked };

// Everything one proxy thread touches; no other thread reads it.
class Worker {
 public:
  Worker(const ProxyOptions& o, uint32_t thread, const std::vector<FifoChannel*>& channels, Transport& transport,
         int64_t* counters, uint32_t num_counters, Proxy::ThreadStats& stats);

  // One pass over completions and channels; true when anything moved.
  bool run_once();

 private:
  static constexpr int kMaxComps = 64;

  // Commands (worker_commands.cc).
  bool service(ChannelState& ch);
  std::string why_blocked(const ChannelState& ch) const;
  const std::vector<uint32_t>& barrier_peers(const TransferCmd& c) const;
  bool has_room(const StreamTx& t, uint32_t msgs, uint64_t bytes) const;
  void post(ChannelState& ch, uint32_t peer, uint64_t src, uint64_t dst, uint32_t len, uint32_t imm_value,
            bool is_write);
  void check_write(const ChannelState& ch, const TransferCmd& c) const;
  void check_atomic(const ChannelState& ch, const TransferCmd& c) const;
  Step step(ChannelState& ch);
  Step step_write(ChannelState& ch, const TransferCmd& c);
  Step step_atomic(ChannelState& ch, const TransferCmd& c);
  Step post_sender_side_atomic(ChannelState& ch, const TransferCmd& c);
  Step step_drain(ChannelState& ch, const TransferCmd& c);
  Step step_barrier(ChannelState& ch, const TransferCmd& c);

  // Completions (worker_completions.cc).
  void on_send_done(const Completion& comp);
  void on_receive(const Completion& comp);
  void check_gaps() const;
  void apply_one(RecvStream& rs, uint32_t peer, uint32_t channel, uint32_t v);

  const ProxyOptions& o_;
  uint32_t thread_;
  Endpoint& ep_;
  int64_t* counters_;
  uint32_t num_counters_;
  Proxy::ThreadStats& stats_;
  std::chrono::milliseconds timeout_;
  std::vector<ChannelState> chans_;
  std::vector<int> local_of_;
  std::vector<std::vector<RecvStream>> rx_;
  std::vector<OutEntry> table_;
  std::vector<uint32_t> free_;
  std::vector<uint64_t> peer_bytes_;
  uint64_t local_bytes_;
  std::vector<uint32_t> same_rail_, all_peers_;
  uint32_t idle_passes_ = 0;
  Completion comps_[kMaxComps];
};

}  // namespace proxy_detail
}  // namespace uccl_ep

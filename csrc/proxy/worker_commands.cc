// The command side of a proxy thread: polls its channels' FIFOs, validates each command against
// the registered regions, and posts it in its stream within the window and ordering mode.
#include "common/errors.h"
#include "fifo/cmd_builder.h"
#include "proxy/text_util.h"
#include "proxy/worker.h"

namespace uccl_ep {
namespace proxy_detail {

Worker::Worker(const ProxyOptions& o, uint32_t thread, const std::vector<FifoChannel*>& channels,
               Transport& transport, int64_t* counters, uint32_t num_counters, Proxy::ThreadStats& stats)
    : o_(o), thread_(thread), ep_(transport.endpoint(thread)), counters_(counters), num_counters_(num_counters),
      stats_(stats), timeout_(std::chrono::milliseconds(o.timeout_ms)) {
  local_of_.assign(channels.size(), -1);
  for (uint32_t c = thread; c < channels.size(); c += o.num_threads) {
    local_of_[c] = static_cast<int>(chans_.size());
    ChannelState s;
    s.fifo = channels[c];
    s.id = c;
    s.tx.resize(o.world_size);
    chans_.push_back(std::move(s));
  }
  rx_.resize(o.world_size);
  for (auto& v : rx_) v.resize(chans_.size());
  local_bytes_ = 0;
  peer_bytes_.resize(o.world_size);
  for (uint32_t r = 0; r < o.world_size; ++r) peer_bytes_[r] = transport.peer_region_bytes(r);
  local_bytes_ = peer_bytes_[o.rank];
  // Barrier sets include this rank: its barrier message to itself is ordered after its own
  // writes to itself, so a completed barrier fences those too.
  for (uint32_t r = 0; r < o.world_size; ++r) {
    if (o.ranks_per_node == 0 || r % o.ranks_per_node == o.rank % o.ranks_per_node) same_rail_.push_back(r);
    all_peers_.push_back(r);
  }
}

// One pass over completions and channels; true when anything moved.
bool Worker::run_once() {
  bool progress = false;
  int n = ep_.poll(comps_, kMaxComps);
  for (int i = 0; i < n; ++i) {
    if (comps_[i].kind == Completion::kSend) {
      on_send_done(comps_[i]);
    } else {
      on_receive(comps_[i]);
    }
  }
  progress = n > 0;
  for (auto& ch : chans_) {
    progress |= service(ch);
    // One store of head per visit (up to `batch` commands), not per command: see advance().
    ch.fifo->publish();
  }
  ep_.flush();  // one doorbell for every write this pass posted
  if (!progress && (++idle_passes_ & 1023u) == 0) check_gaps();
  return progress;
}

bool Worker::service(ChannelState& ch) {
  bool progress = false;
  for (uint32_t budget = o_.batch; budget > 0; --budget) {
    if (!ch.busy) {
      if (!ch.fifo->poll(&ch.cmd)) {
        ch.fifo->check_hole();  // a producer that gave up would stall this channel for good
        return progress;
      }
      ch.busy = true;
      ch.idx = ch.fifo->head();
      ch.stage = 0;
      ch.blocked = false;
    }
    Step s = step(ch);
    if (s == Step::kDone) {
      ch.fifo->advance();
      ch.busy = false;
      bump(stats_.commands);
      progress = true;
      continue;
    }
    if (s == Step::kAdvanced) {
      progress = true;
      ch.blocked = false;
    }
    // Blocked: remember since when, and give up after the timeout naming what we wait for.
    if (s == Step::kBlocked) {
      auto now = Clock::now();
      if (!ch.blocked) {
        ch.blocked = true;
        ch.blocked_since = now;
      } else if (now - ch.blocked_since > timeout_) {
        UCCL_EP_THROW(TimeoutError, "proxy rank ", o_.rank, " channel ", ch.id, ": ", describe_cmd(ch.cmd),
                      " at FIFO index ", ch.idx, " made no progress for ", o_.timeout_ms, " ms: ", why_blocked(ch));
      }
    }
    return progress;
  }
  return progress;
}

std::string Worker::why_blocked(const ChannelState& ch) const {
  const TransferCmd& c = ch.cmd;
  if (c.type() == CmdType::kBarrier && ch.stage == 1) {
    std::string missing;
    for (uint32_t p : barrier_peers(c)) {
      if (rx_[p][local_of_[ch.id]].barriers < ch.barrier_epoch) {
        missing += detail::concat(missing.empty() ? "" : ",", p);
      }
    }
    return detail::concat("barrier epoch ", ch.barrier_epoch, " still waits for rank(s) ", missing,
                          " (dead, or not pushing a Barrier on channel ", ch.id, ")");
  }
  if (c.type() == CmdType::kDrain) {
    return detail::concat(ch.outstanding.size(), " posted messages not completed, oldest FIFO index ",
                          ch.outstanding.empty() ? 0 : *ch.outstanding.begin(),
                          "; the transport stopped completing (peer dead or link down)");
  }
  // Waiting for acknowledgements of a stream.
  for (uint32_t r = 0; r < o_.world_size; ++r) {
    const StreamTx& t = ch.tx[r];
    if (t.next_seq - t.acked_upto >= o_.max_inflight_per_stream ||
        (c.type() != CmdType::kBarrier && r == c.dst_rank() && t.inflight > 0)) {
      return detail::concat("rank ", r, " has not acknowledged ", t.inflight,
                            " in-flight messages (peer dead, or its proxy stopped draining)");
    }
  }
  return "waiting for in-flight messages to complete";
}

const std::vector<uint32_t>& Worker::barrier_peers(const TransferCmd& c) const {
  return c.barrier_same_rail() ? same_rail_ : all_peers_;
}

bool Worker::has_room(const StreamTx& t, uint32_t msgs, uint64_t bytes) const {
  if (t.next_seq + msgs - t.acked_upto > o_.max_inflight_per_stream) return false;
  if (o_.max_inflight_bytes_per_stream && t.inflight > 0 && t.inflight_bytes + bytes > o_.max_inflight_bytes_per_stream)
    return false;
  return true;
}

void Worker::post(ChannelState& ch, uint32_t peer, uint64_t src, uint64_t dst, uint32_t len, uint32_t imm_value,
                  bool is_write) {
  uint32_t id;
  if (!free_.empty()) {
    id = free_.back();
    free_.pop_back();
  } else {
    id = static_cast<uint32_t>(table_.size());
    table_.push_back({});
  }
  StreamTx& t = ch.tx[peer];
  table_[id] = OutEntry{static_cast<uint32_t>(local_of_[ch.id]), peer, t.next_seq, ch.idx, len, is_write};
  t.unacked.set(t.next_seq % imm::kSeqMod);
  ++t.inflight;
  t.inflight_bytes += len;
  if (is_write) ++t.inflight_writes;
  ++t.next_seq;
  ch.outstanding.insert(ch.idx);
  ep_.post_write(peer, ch.id, src, dst, len, imm_value, id);
}

void Worker::check_write(const ChannelState& ch, const TransferCmd& c) const {
  const uint64_t len = c.length();
  if (c.src_offset() + len > local_bytes_ || c.dst_offset() + len > peer_bytes_[c.dst_rank()]) {
    UCCL_EP_THROW(InvalidArgument, "proxy rank ", o_.rank, " channel ", ch.id, " FIFO index ", ch.idx, ": ",
                  describe_cmd(c), " is outside the registered regions (local ", local_bytes_, " bytes, rank ",
                  c.dst_rank(), " ", peer_bytes_[c.dst_rank()], " bytes)");
  }
}

void Worker::check_atomic(const ChannelState& ch, const TransferCmd& c) const {
  if (c.atomic_index() >= num_counters_) {
    UCCL_EP_THROW(InvalidArgument, "proxy rank ", o_.rank, " channel ", ch.id, " FIFO index ", ch.idx, ": ",
                  describe_cmd(c), " targets counter ", c.atomic_index(), " but only ", num_counters_,
                  " counters are registered");
  }
}

Step Worker::step(ChannelState& ch) {
  const TransferCmd& c = ch.cmd;
  const CmdType type = c.type();
  if ((type == CmdType::kWrite || type == CmdType::kAtomic) && c.dst_rank() >= o_.world_size) {
    UCCL_EP_THROW(InvalidArgument, "proxy rank ", o_.rank, " channel ", ch.id, " FIFO index ", ch.idx, ": ",
                  describe_cmd(c), " names rank ", c.dst_rank(), " but the world has ", o_.world_size, " ranks");
  }
  switch (type) {
    case CmdType::kWrite:
      return step_write(ch, c);
    case CmdType::kAtomic:
      return step_atomic(ch, c);
    case CmdType::kDrain:
      return step_drain(ch, c);
    case CmdType::kBarrier:
      return step_barrier(ch, c);
    default:
      UCCL_EP_THROW(InvalidArgument, "proxy rank ", o_.rank, " channel ", ch.id, " FIFO index ", ch.idx,
                    ": invalid command type ", static_cast<uint32_t>(type), " (lo=", text::hex64(c.lo), ")");
  }
}

// A piggy-backed atomic is posted as a second message right after the write (stage 1), in the
// same stream, so a per-stream cap of one message (Thor-2 / Pollara presets) still works.
Step Worker::step_write(ChannelState& ch, const TransferCmd& c) {
  const uint32_t peer = c.dst_rank();
  StreamTx& t = ch.tx[peer];
  bool posted = false;
  if (ch.stage == 0) {
    check_write(ch, c);
    if (c.has_atomic()) check_atomic(ch, c);
    if (!has_room(t, 1, c.length())) return Step::kBlocked;
    post(ch, peer, c.src_offset(), c.dst_offset(), c.length(), imm::write(t.next_seq), true);
    bump(stats_.writes_posted);
    bump(stats_.bytes_posted, c.length());
    if (!c.has_atomic()) return Step::kDone;
    ch.stage = 1;
    posted = true;
  }
  if (o_.ordering == Ordering::kSender) return post_sender_side_atomic(ch, c);
  if (!has_room(t, 1, 0)) return posted ? Step::kAdvanced : Step::kBlocked;
  post(ch, peer, 0, 0, 0, imm::atomic(t.next_seq, c.atomic_index(), c.atomic_value()), false);
  bump(stats_.atomics_posted);
  return Step::kDone;
}

Step Worker::step_atomic(ChannelState& ch, const TransferCmd& c) {
  check_atomic(ch, c);
  if (o_.ordering == Ordering::kSender) return post_sender_side_atomic(ch, c);
  StreamTx& t = ch.tx[c.dst_rank()];
  if (!has_room(t, 1, 0)) return Step::kBlocked;
  post(ch, c.dst_rank(), 0, 0, 0, imm::atomic(t.next_seq, c.atomic_index(), c.atomic_value()), false);
  bump(stats_.atomics_posted);
  return Step::kDone;
}

// Sender-side ordering: the atomic leaves only once every earlier write of the stream completed.
Step Worker::post_sender_side_atomic(ChannelState& ch, const TransferCmd& c) {
  StreamTx& t = ch.tx[c.dst_rank()];
  if (t.inflight_writes > 0 || !has_room(t, 1, 0)) return Step::kBlocked;
  post(ch, c.dst_rank(), 0, 0, 0, imm::atomic(t.next_seq, c.atomic_index(), c.atomic_value()), false);
  bump(stats_.atomics_posted);
  return Step::kDone;
}

Step Worker::step_drain(ChannelState& ch, const TransferCmd& c) {
  const uint64_t target = c.drain_all() ? ch.idx : drain_target(ch.idx, c.drain_index_low32());
  if (ch.outstanding.empty() || *ch.outstanding.begin() > target) {
    bump(stats_.drains);
    return Step::kDone;
  }
  return Step::kBlocked;
}

Step Worker::step_barrier(ChannelState& ch, const TransferCmd& c) {
  const auto& peers = barrier_peers(c);
  if (ch.stage == 0) {
    for (uint32_t p : peers) {
      const StreamTx& t = ch.tx[p];
      if (!has_room(t, 1, 0)) return Step::kBlocked;
      // Sender-side ordering: the barrier also fences the stream's earlier writes.
      if (o_.ordering == Ordering::kSender && t.inflight_writes > 0) return Step::kBlocked;
    }
    ++ch.barrier_epoch;
    for (uint32_t p : peers) post(ch, p, 0, 0, 0, imm::barrier(ch.tx[p].next_seq, c.barrier_same_rail()), false);
    ch.stage = 1;
  }
  const int local = local_of_[ch.id];
  for (uint32_t p : peers) {
    if (rx_[p][local].barriers < ch.barrier_epoch) return ch.stage == 1 ? Step::kBlocked : Step::kAdvanced;
  }
  bump(stats_.barriers);
  return Step::kDone;
}

}  // namespace proxy_detail
}  // namespace uccl_ep

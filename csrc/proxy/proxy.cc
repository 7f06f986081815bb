#include "proxy/proxy.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <bitset>
#include <chrono>
#include <condition_variable>
#include <set>

#include "common/errors.h"
#include "common/log.h"
#include "fifo/cmd_builder.h"
#include "proxy/reorder.h"
#include "proxy/text_util.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define UCCL_EP_CPU_RELAX() _mm_pause()
#else
#define UCCL_EP_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace uccl_ep {

Ordering parse_ordering(const std::string& s) {
  if (s == "receiver") return Ordering::kReceiver;
  if (s == "sender") return Ordering::kSender;
  if (s == "none") return Ordering::kNone;
  UCCL_EP_THROW(InvalidArgument, "ordering='", s, "' is unknown; use receiver, sender or none");
}

const char* ordering_name(Ordering o) {
  switch (o) {
    case Ordering::kReceiver:
      return "receiver";
    case Ordering::kSender:
      return "sender";
    default:
      return "none";
  }
}

struct Proxy::ThreadStats {
  std::atomic<uint64_t> commands{0}, writes_posted{0}, bytes_posted{0}, atomics_posted{0}, barriers{0}, drains{0},
      writes_received{0}, atomics_applied{0}, held_out_of_order{0};
  // Passes of the thread's loop (its heartbeat for the watchdog in check()); own cache line, as
  // check() reads it from another thread while the proxy thread bumps it every pass.
  alignas(64) std::atomic<uint64_t> passes{0};
};

namespace {

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
         int64_t* counters, uint32_t num_counters, Proxy::ThreadStats& stats)
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
  bool run_once() {
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
    if (!progress && (++idle_passes_ & 1023u) == 0) check_gaps();
    return progress;
  }

 private:
  static constexpr int kMaxComps = 64;

  bool service(ChannelState& ch) {
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

  std::string why_blocked(const ChannelState& ch) const {
    const TransferCmd& c = ch.cmd;
    if (c.type() == CmdType::kBarrier && ch.stage == 1) {
      std::string missing;
      for (uint32_t p : barrier_peers(c)) {
        if (rx_[p][local_of_[ch.id]].barriers < ch.barrier_epoch) missing += detail::concat(missing.empty() ? "" : ",", p);
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

  const std::vector<uint32_t>& barrier_peers(const TransferCmd& c) const {
    return c.barrier_same_rail() ? same_rail_ : all_peers_;
  }

  bool has_room(const StreamTx& t, uint32_t msgs, uint64_t bytes) const {
    if (t.next_seq + msgs - t.acked_upto > o_.max_inflight_per_stream) return false;
    if (o_.max_inflight_bytes_per_stream && t.inflight > 0 && t.inflight_bytes + bytes > o_.max_inflight_bytes_per_stream)
      return false;
    return true;
  }

  void post(ChannelState& ch, uint32_t peer, uint64_t src, uint64_t dst, uint32_t len, uint32_t imm_value,
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

  void check_write(const ChannelState& ch, const TransferCmd& c) const {
    const uint64_t len = c.length();
    if (c.src_offset() + len > local_bytes_ || c.dst_offset() + len > peer_bytes_[c.dst_rank()]) {
      UCCL_EP_THROW(InvalidArgument, "proxy rank ", o_.rank, " channel ", ch.id, " FIFO index ", ch.idx, ": ",
                    describe_cmd(c), " is outside the registered regions (local ", local_bytes_, " bytes, rank ",
                    c.dst_rank(), " ", peer_bytes_[c.dst_rank()], " bytes)");
    }
  }

  void check_atomic(const ChannelState& ch, const TransferCmd& c) const {
    if (c.atomic_index() >= num_counters_) {
      UCCL_EP_THROW(InvalidArgument, "proxy rank ", o_.rank, " channel ", ch.id, " FIFO index ", ch.idx, ": ",
                    describe_cmd(c), " targets counter ", c.atomic_index(), " but only ", num_counters_,
                    " counters are registered");
    }
  }

  Step step(ChannelState& ch) {
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
  Step step_write(ChannelState& ch, const TransferCmd& c) {
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

  Step step_atomic(ChannelState& ch, const TransferCmd& c) {
    check_atomic(ch, c);
    if (o_.ordering == Ordering::kSender) return post_sender_side_atomic(ch, c);
    StreamTx& t = ch.tx[c.dst_rank()];
    if (!has_room(t, 1, 0)) return Step::kBlocked;
    post(ch, c.dst_rank(), 0, 0, 0, imm::atomic(t.next_seq, c.atomic_index(), c.atomic_value()), false);
    bump(stats_.atomics_posted);
    return Step::kDone;
  }

  // Sender-side ordering: the atomic leaves only once every earlier write of the stream completed.
  Step post_sender_side_atomic(ChannelState& ch, const TransferCmd& c) {
    StreamTx& t = ch.tx[c.dst_rank()];
    if (t.inflight_writes > 0 || !has_room(t, 1, 0)) return Step::kBlocked;
    post(ch, c.dst_rank(), 0, 0, 0, imm::atomic(t.next_seq, c.atomic_index(), c.atomic_value()), false);
    bump(stats_.atomics_posted);
    return Step::kDone;
  }

  Step step_drain(ChannelState& ch, const TransferCmd& c) {
    const uint64_t target = c.drain_all() ? ch.idx : drain_target(ch.idx, c.drain_index_low32());
    if (ch.outstanding.empty() || *ch.outstanding.begin() > target) {
      bump(stats_.drains);
      return Step::kDone;
    }
    return Step::kBlocked;
  }

  Step step_barrier(ChannelState& ch, const TransferCmd& c) {
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

  void on_send_done(const Completion& comp) {
    if (comp.wr_id >= table_.size()) {
      UCCL_EP_THROW(TransportError, "proxy rank ", o_.rank, " thread ", thread_, ": completion for unknown work id ",
                    comp.wr_id, " from rank ", comp.peer);
    }
    const OutEntry e = table_[comp.wr_id];
    ChannelState& ch = chans_[e.local_channel];
    auto it = ch.outstanding.find(e.fifo_idx);
    if (it != ch.outstanding.end()) ch.outstanding.erase(it);
    StreamTx& t = ch.tx[e.peer];
    --t.inflight;
    t.on_ack(e.seq);
    t.inflight_bytes -= e.bytes;
    if (e.is_write) --t.inflight_writes;
    free_.push_back(static_cast<uint32_t>(comp.wr_id));
  }

  void on_receive(const Completion& comp) {
    if (comp.channel >= local_of_.size() || local_of_[comp.channel] < 0 || comp.peer >= o_.world_size) {
      UCCL_EP_THROW(TransportError, "proxy rank ", o_.rank, " thread ", thread_, ": message from rank ", comp.peer,
                    " for channel ", comp.channel, ", which this thread does not serve; all ranks must use the same ",
                    "number of channels and UCCL_EP_NUM_PROXY_THREADS");
    }
    RecvStream& rs = rx_[comp.peer][local_of_[comp.channel]];
    auto apply = [&](uint32_t v) { apply_one(rs, comp.peer, comp.channel, v); };
    if (o_.ordering == Ordering::kReceiver) {
      const uint32_t held_before = rs.reorder.num_held();
      const uint32_t expected_before = rs.reorder.expected();
      rs.reorder.deliver(comp.imm, apply, comp.peer, comp.channel);
      if (rs.reorder.num_held() > held_before) bump(stats_.held_out_of_order);
      // A gap (re)opens when messages wait and the expected one has not just arrived.
      if (rs.reorder.num_held() > 0 && (held_before == 0 || rs.reorder.expected() != expected_before)) {
        rs.gap_since = Clock::now();
      }
    } else {
      apply(comp.imm);
    }
  }

  // A stream whose expected message has not arrived for the timeout while later ones wait: the
  // message was lost or its sender died mid-stream. Checked only when idle, every 1024 passes.
  void check_gaps() const {
    const auto now = Clock::now();
    for (uint32_t p = 0; p < rx_.size(); ++p) {
      for (size_t l = 0; l < rx_[p].size(); ++l) {
        const RecvStream& rs = rx_[p][l];
        if (rs.reorder.num_held() > 0 && now - rs.gap_since > timeout_) {
          UCCL_EP_THROW(TimeoutError, "proxy rank ", o_.rank, ": stream from rank ", p, " channel ", chans_[l].id,
                        " has waited ", o_.timeout_ms, " ms for sequence ", rs.reorder.expected(), " (mod 128) while ",
                        rs.reorder.num_held(), " later messages are held; a message was lost or rank ", p,
                        " stopped mid-stream");
        }
      }
    }
  }

  void apply_one(RecvStream& rs, uint32_t peer, uint32_t channel, uint32_t v) {
    switch (imm::kind(v)) {
      case ImmKind::kWrite:
        bump(stats_.writes_received);
        break;
      case ImmKind::kAtomic: {
        uint32_t idx = imm::atomic_index(v);
        if (idx >= num_counters_) {
          UCCL_EP_THROW(TransportError, "proxy rank ", o_.rank, ": atomic from rank ", peer, " channel ", channel,
                        " targets counter ", idx, " of ", num_counters_);
        }
        // Several threads may add to one counter; the GPU polls it, so seq_cst publishes the add.
        __atomic_fetch_add(&counters_[idx], static_cast<int64_t>(imm::atomic_value(v)), __ATOMIC_SEQ_CST);
        bump(stats_.atomics_applied);
        break;
      }
      case ImmKind::kBarrier:
        ++rs.barriers;
        break;
      default:
        UCCL_EP_THROW(TransportError, "proxy rank ", o_.rank, ": unknown immediate ", text::hex64(v),
                      " from rank ", peer, " channel ", channel);
    }
  }

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

}  // namespace

struct Proxy::State {
  ProxyOptions options;
  std::vector<FifoChannel*> channels;
  Transport* transport;
  int64_t* counters;
  uint32_t num_counters;
  std::atomic<bool> stop{false};
  std::vector<std::unique_ptr<ThreadStats>> stats;
  std::mutex error_mu;
  std::exception_ptr error;
  // Which threads have left thread_main; stop() waits on `exit_cv` for them, bounded.
  std::mutex exit_mu;
  std::condition_variable exit_cv;
  std::vector<bool> exited;

  void record_failure(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(error_mu);
      if (!error) error = e;
    }
    // Producers blocked on this proxy must not hang: make their waits give up.
    for (auto* ch : channels) ch->set_abort(true);
    stop = true;
  }
};

namespace {

std::atomic<uint32_t> g_live_threads{0};

std::string thread_name(uint32_t rank, uint32_t thread) {
  return ("ueproxy" + std::to_string(rank) + "t" + std::to_string(thread)).substr(0, 15);
}

void thread_main(const std::shared_ptr<Proxy::State>& st, uint32_t thread) {
  const ProxyOptions& o = st->options;
  std::string name = thread_name(o.rank, thread);
  pthread_setname_np(pthread_self(), name.c_str());
  if (!o.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : o.cpus) CPU_SET(c, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof(set), &set) != 0) {
      UCCL_EP_LOG(kWarn, "proxy thread ", name, ": could not pin to the GPU's NUMA CPUs; running unpinned");
    }
  }
  try {
    Worker w(o, thread, st->channels, *st->transport, st->counters, st->num_counters, *st->stats[thread]);
    uint32_t idle = 0;
    std::atomic<uint64_t>& passes = st->stats[thread]->passes;
    while (!st->stop.load(std::memory_order_relaxed)) {
      const bool moved = w.run_once();
      passes.store(passes.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      if (moved) {
        idle = 0;
      } else if (++idle < 64) {
        UCCL_EP_CPU_RELAX();
      } else {
        // Long idle: let co-located threads (other proxies, the trainer) run.
        std::this_thread::yield();
      }
    }
  } catch (...) {
    st->record_failure(std::current_exception());
  }
  {
    std::lock_guard<std::mutex> lock(st->exit_mu);
    st->exited[thread] = true;
  }
  st->exit_cv.notify_all();
  g_live_threads.fetch_sub(1);
}

}  // namespace

Proxy::Proxy(const ProxyOptions& options, std::vector<FifoChannel*> channels, Transport* transport,
             int64_t* counters, uint32_t num_counters)
    : options_(options), st_(std::make_shared<State>()) {
  st_->options = options;
  st_->channels = std::move(channels);
  st_->transport = transport;
  st_->counters = counters;
  st_->num_counters = num_counters;
  const auto& chans = st_->channels;
  UCCL_EP_CHECK_ARG(transport != nullptr, "proxy needs a transport");
  UCCL_EP_CHECK_ARG(options.world_size >= 1 && options.world_size <= cmd_limits::kMaxRanks &&
                        options.rank < options.world_size,
                    "rank=", options.rank, " world_size=", options.world_size);
  UCCL_EP_CHECK_ARG(options.num_threads >= 1 && options.num_threads <= 64, "num_threads=", options.num_threads,
                    " must be in [1, 64] (UCCL_EP_NUM_PROXY_THREADS)");
  UCCL_EP_CHECK_ARG(options.max_inflight_per_stream >= 1 && options.max_inflight_per_stream <= imm::kSeqWindow,
                    "max_inflight_per_stream=", options.max_inflight_per_stream, " must be in [1, ", imm::kSeqWindow,
                    "] (7-bit sequence numbers)");
  UCCL_EP_CHECK_ARG(options.timeout_ms > 0, "timeout_ms must be positive");
  UCCL_EP_CHECK_ARG(options.stop_timeout_ms > 0, "stop_timeout_ms must be positive");
  UCCL_EP_CHECK_ARG(options.batch >= 1, "batch must be >= 1");
  UCCL_EP_CHECK_ARG(num_counters <= cmd_limits::kNumAtomicCounters && (counters != nullptr || num_counters == 0),
                    "num_counters=", num_counters, " must be <= ", cmd_limits::kNumAtomicCounters,
                    " with a counters array");
  UCCL_EP_CHECK_ARG(!chans.empty(), "proxy needs at least one FIFO channel");
  for (size_t i = 0; i < chans.size(); ++i) {
    UCCL_EP_CHECK_ARG(chans[i] != nullptr && chans[i]->channel() == i, "channels[", i, "] must be channel ", i);
  }
  if (options.ordering == Ordering::kNone && !transport->ordered()) {
    UCCL_EP_LOG(kWarn, "proxy rank ", options.rank, ": ordering=none on unordered transport '", transport->name(),
                "': atomics may overtake writes");
  }
}

Proxy::~Proxy() {
  try {
    stop();
  } catch (const TimeoutError& e) {
    // The stuck threads keep the shared state alive; nothing of this object is used by them.
    UCCL_EP_LOG(kError, e.what(), "; the destructor leaves them behind (detached)");
    for (auto& th : threads_) {
      if (th.joinable()) th.detach();
    }
  }
}

uint32_t Proxy::live_threads() { return g_live_threads.load(); }

void Proxy::start() {
  UCCL_EP_CHECK_ARG(!running_, "proxy of rank ", options_.rank,
                    " is already running (or still stopping: a thread did not leave a transport call)");
  st_->stop = false;
  st_->stats.clear();
  for (uint32_t t = 0; t < options_.num_threads; ++t) st_->stats.push_back(std::make_unique<ThreadStats>());
  st_->exited.assign(options_.num_threads, false);
  for (auto* ch : st_->channels) ch->set_abort(false);
  {
    std::lock_guard<std::mutex> lock(watch_mu_);
    watch_passes_.assign(options_.num_threads, 0);
    watch_since_.assign(options_.num_threads, std::chrono::steady_clock::now());
  }
  running_ = true;
  for (uint32_t t = 0; t < options_.num_threads; ++t) {
    g_live_threads.fetch_add(1);
    std::shared_ptr<State> st = st_;
    threads_.emplace_back([st, t] { thread_main(st, t); });
  }
}

void Proxy::stop(uint64_t timeout_ms) {
  if (!running_) return;
  st_->stop = true;
  const uint64_t bound = timeout_ms ? timeout_ms : options_.stop_timeout_ms;
  std::vector<uint32_t> stuck;
  {
    std::unique_lock<std::mutex> lock(st_->exit_mu);
    st_->exit_cv.wait_for(lock, std::chrono::milliseconds(bound), [&] {
      return std::all_of(st_->exited.begin(), st_->exited.end(), [](bool e) { return e; });
    });
    for (uint32_t t = 0; t < threads_.size(); ++t) {
      if (!st_->exited[t]) stuck.push_back(t);
    }
  }
  // A thread that left its loop is joined now (it returns at once), a stuck one stays joinable.
  for (uint32_t t = 0; t < threads_.size(); ++t) {
    if (threads_[t].joinable() && std::find(stuck.begin(), stuck.end(), t) == stuck.end()) threads_[t].join();
  }
  if (stuck.empty()) {
    threads_.clear();
    running_ = false;
    return;
  }
  std::string who;
  for (uint32_t t : stuck) {
    who += detail::concat(who.empty() ? "" : ", ", "thread ", t, " (", thread_name(options_.rank, t), ", ",
                          st_->stats[t]->passes.load(std::memory_order_relaxed), " passes done)");
  }
  UCCL_EP_THROW(TimeoutError, "proxy rank ", options_.rank, ": ", who, " did not stop within ", bound,
                " ms: blocked inside a call into transport '", st_->transport->name(),
                "' (e.g. a CUDA call that waits for kernels which wait for this proxy). The proxy keeps the "
                "thread(s) and what they use; call stop() again once the call returned, or end the process");
}

void Proxy::check() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(st_->error_mu);
    e = st_->error;
  }
  if (e) std::rethrow_exception(e);
  if (!running_ || st_->stop.load()) return;
  // Watchdog: a proxy thread blocked inside a call cannot time out by itself.
  std::lock_guard<std::mutex> lock(watch_mu_);
  const auto now = std::chrono::steady_clock::now();
  for (uint32_t t = 0; t < st_->stats.size() && t < watch_passes_.size(); ++t) {
    const uint64_t passes = st_->stats[t]->passes.load(std::memory_order_relaxed);
    if (passes != watch_passes_[t]) {
      watch_passes_[t] = passes;
      watch_since_[t] = now;
      continue;
    }
    const auto stuck_ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - watch_since_[t]).count();
    if (static_cast<uint64_t>(stuck_ms) <= options_.timeout_ms) continue;
    try {
      UCCL_EP_THROW(TimeoutError, "proxy rank ", options_.rank, " thread ", t, " (ueproxy", options_.rank, "t", t,
                    ") has not come back from a call into transport '", st_->transport->name(), "' for ", stuck_ms,
                    " ms (after ", passes, " passes): it is blocked, e.g. in a CUDA call that waits for kernels ",
                    "which wait for this proxy; its channels (c % ", options_.num_threads, " == ", t,
                    ") stopped moving");
    } catch (...) {
      st_->record_failure(std::current_exception());
      throw;
    }
  }
}

ProxyStats Proxy::stats() const {
  ProxyStats s;
  for (const auto& t : st_->stats) {
    s.commands += t->commands.load(std::memory_order_relaxed);
    s.writes_posted += t->writes_posted.load(std::memory_order_relaxed);
    s.bytes_posted += t->bytes_posted.load(std::memory_order_relaxed);
    s.atomics_posted += t->atomics_posted.load(std::memory_order_relaxed);
    s.barriers += t->barriers.load(std::memory_order_relaxed);
    s.drains += t->drains.load(std::memory_order_relaxed);
    s.writes_received += t->writes_received.load(std::memory_order_relaxed);
    s.atomics_applied += t->atomics_applied.load(std::memory_order_relaxed);
    s.held_out_of_order += t->held_out_of_order.load(std::memory_order_relaxed);
  }
  return s;
}

std::vector<int> parse_cpulist(const std::string& s) {
  std::vector<int> out;
  for (const std::string& raw : text::split(s, ',')) {
    std::string part = text::strip(raw);
    if (part.empty()) continue;
    size_t dash = part.find('-');
    int lo = 0, hi = 0;
    bool ok = text::parse_int(part.substr(0, dash), &lo);
    hi = lo;
    if (ok && dash != std::string::npos) ok = text::parse_int(part.substr(dash + 1), &hi);
    if (!ok || lo < 0 || hi < lo) {
      UCCL_EP_THROW(InvalidArgument, "cpulist '", s, "' has a malformed entry '", part, "'");
    }
    for (int c = lo; c <= hi; ++c) out.push_back(c);
  }
  return out;
}

std::vector<int> numa_cpus_of_pci(const std::string& pci_bus_id, const std::string& sysfs_root) {
  std::string id = pci_bus_id;
  for (auto& ch : id) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  // CUDA reports "00000000:3b:00.0"; sysfs uses a 4-digit domain.
  if (id.size() > 12 && id.find(':') == 8) id = id.substr(4);
  int node = -1;
  if (!text::parse_int(text::strip(text::read_first_line(sysfs_root + "/bus/pci/devices/" + id + "/numa_node")),
                       &node) ||
      node < 0) {
    return {};
  }
  std::string list = text::read_first_line(sysfs_root + "/devices/system/node/node" + std::to_string(node) + "/cpulist");
  if (text::strip(list).empty()) return {};
  return parse_cpulist(list);
}

}  // namespace uccl_ep

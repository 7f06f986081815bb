// The completion side of a proxy thread: send acknowledgements free stream window slots; received
// immediates are applied in per-stream order (software atomics, barrier arrivals).
#include "common/errors.h"
#include "proxy/text_util.h"
#include "proxy/worker.h"

namespace uccl_ep {
namespace proxy_detail {

void Worker::on_send_done(const Completion& comp) {
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

void Worker::on_receive(const Completion& comp) {
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
void Worker::check_gaps() const {
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

void Worker::apply_one(RecvStream& rs, uint32_t peer, uint32_t channel, uint32_t v) {
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

}  // namespace proxy_detail
}  // namespace uccl_ep

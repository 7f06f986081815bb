// Receiver-side ordering of one stream (source rank, channel): the "control buffer" of paper §3.3.
//
// Messages may arrive in any order (EFA SRD, the ipc injector). Writes are placed by the NIC on
// arrival; what must not overtake them is the *effect* of later control messages (atomics,
// barriers). So the buffer releases messages strictly in sequence order: a control message is
// applied only after every earlier write and control message of its stream was seen.
#pragma once

#include <array>
#include <cstdint>

#include "common/errors.h"
#include "proxy/imm.h"

namespace uccl_ep {

class StreamReorder {
 public:
  // Feeds one arrived immediate; calls apply(imm) for each message that became in-order, in
  // sequence order. Throws TransportError on a duplicate or a sequence outside the window
  // (a protocol violation: the sender overran kSeqWindow or a message was delivered twice).
  template <typename Apply>
  void deliver(uint32_t v, Apply&& apply, uint32_t src_rank, uint32_t channel) {
    const uint32_t s = imm::seq(v);
    const uint32_t ahead = (s - expected_) & (imm::kSeqMod - 1);
    if (ahead >= imm::kSeqWindow) {
      UCCL_EP_THROW(TransportError, "stream from rank ", src_rank, " channel ", channel, ": sequence ", s,
                    " arrived while expecting ", expected_, " (duplicate or window overrun)");
    }
    if (ahead != 0) {
      if (present_[s]) {
        UCCL_EP_THROW(TransportError, "stream from rank ", src_rank, " channel ", channel, ": sequence ", s,
                      " delivered twice");
      }
      present_[s] = true;
      held_[s] = v;
      ++num_held_;
      return;
    }
    apply(v);
    expected_ = (expected_ + 1) & (imm::kSeqMod - 1);
    while (present_[expected_]) {
      present_[expected_] = false;
      --num_held_;
      apply(held_[expected_]);
      expected_ = (expected_ + 1) & (imm::kSeqMod - 1);
    }
  }

  uint32_t expected() const { return expected_; }
  uint32_t num_held() const { return num_held_; }

 private:
  uint32_t expected_ = 0;
  uint32_t num_held_ = 0;
  std::array<bool, imm::kSeqMod> present_{};
  std::array<uint32_t, imm::kSeqMod> held_{};
};

}  // namespace uccl_ep

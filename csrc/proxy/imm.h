// The 32-bit immediate every proxy-posted RDMA write carries (paper §3.2-3.3, §4.1).
//
// [31:30] kind | [29:23] per-stream sequence number mod 128 | [22:0] payload
//   Write:   payload unused (the bytes already landed when the immediate is seen)
//   Atomic:  [22:11] counter index, [10:0] signed value (a software atomic: the receiving proxy
//            adds the value to its counter array; EFA has no hardware atomics)
//   Barrier: [0] same-rail flag
// A stream is (source rank, channel) -> destination rank. The sender keeps the sequence numbers
// of a stream's un-acknowledged messages within a span of kSeqWindow, so a receiver never holds two messages whose sequence
// numbers are equal mod 128 and can order them with 7 bits. "Un-acknowledged" spans sequence
// numbers: message s is posted only after every message before s - kSeqWindow + 1 completed.
#pragma once

#include <cstdint>

#include "fifo/transfer_cmd.h"

namespace uccl_ep {

enum class ImmKind : uint32_t { kWrite = 0, kAtomic = 1, kBarrier = 2 };

namespace imm {
constexpr uint32_t kSeqBits = 7;
constexpr uint32_t kSeqMod = 1u << kSeqBits;
constexpr uint32_t kSeqWindow = kSeqMod / 2;
static_assert(cmd_limits::kAtomicIndexBits + cmd_limits::kAtomicValueBits == 23, "atomic payload must fit 23 bits");

inline uint32_t pack(ImmKind kind, uint32_t seq, uint32_t payload) {
  return (static_cast<uint32_t>(kind) << 30) | ((seq & (kSeqMod - 1)) << 23) | (payload & 0x7FFFFFu);
}
inline uint32_t write(uint32_t seq) { return pack(ImmKind::kWrite, seq, 0); }
inline uint32_t atomic(uint32_t seq, uint32_t index, int32_t value) {
  return pack(ImmKind::kAtomic, seq, ((index & 0xFFFu) << 11) | (static_cast<uint32_t>(value) & 0x7FFu));
}
inline uint32_t barrier(uint32_t seq, bool same_rail) { return pack(ImmKind::kBarrier, seq, same_rail ? 1u : 0u); }

inline ImmKind kind(uint32_t v) { return static_cast<ImmKind>(v >> 30); }
inline uint32_t seq(uint32_t v) { return (v >> 23) & (kSeqMod - 1); }
inline uint32_t atomic_index(uint32_t v) { return (v >> 11) & 0xFFFu; }
inline int32_t atomic_value(uint32_t v) {
  int32_t x = static_cast<int32_t>(v & 0x7FFu);
  return (x ^ 0x400) - 0x400;
}
inline bool barrier_same_rail(uint32_t v) { return v & 1u; }
}  // namespace imm

}  // namespace uccl_ep

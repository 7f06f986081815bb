// TransferCmd: the 16-byte command a GPU thread (or a CPU stand-in) pushes into a FIFO channel.
//
// One 128-bit store writes a whole command (paper §3.1: 16 bytes fit one GPU instruction). Both
// 64-bit halves carry the slot's phase bit in bit 0, so the consumer accepts a slot only when both
// halves belong to the current lap: a torn or stale slot is never read as a command.
//
// lo: [0] phase | [1:3] type | [4] flag | [5:16] dst_rank | [17:40] length (bytes)
//     | [41:52] atomic counter index | [53:63] atomic value (signed)
// hi: [0] phase | [1:31] src offset / 16 | [32:63] dst offset / 16
//
// flag: Write -> carries a piggy-backed atomic; Drain -> drain everything (ignore the index);
//       Barrier -> same-rail peers only.
// Drain keeps the low 32 bits of "drain up to FIFO index" in the dst-offset field.
// Offsets are into the symmetric registered region and must be 16-byte aligned; the atomic
// index/value ranges equal what the 32-bit RDMA immediate can carry (proxy/imm.h).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define UCCL_EP_HD __host__ __device__ __forceinline__
#else
#define UCCL_EP_HD inline
#endif

namespace uccl_ep {

enum class CmdType : uint32_t { kInvalid = 0, kWrite = 1, kAtomic = 2, kDrain = 3, kBarrier = 4 };

namespace cmd_limits {
constexpr uint32_t kRankBits = 12;
constexpr uint32_t kLengthBits = 24;
constexpr uint32_t kAtomicIndexBits = 12;
constexpr uint32_t kAtomicValueBits = 11;
constexpr uint32_t kSrcOffsetBits = 31;  // in 16-byte units
constexpr uint32_t kDstOffsetBits = 32;  // in 16-byte units
constexpr uint32_t kOffsetAlign = 16;
constexpr uint32_t kMaxRanks = 1u << kRankBits;
constexpr uint32_t kMaxLength = (1u << kLengthBits) - 1;
constexpr uint32_t kNumAtomicCounters = 1u << kAtomicIndexBits;
constexpr int32_t kMinAtomicValue = -(1 << (kAtomicValueBits - 1));
constexpr int32_t kMaxAtomicValue = (1 << (kAtomicValueBits - 1)) - 1;
constexpr uint64_t kMaxSrcOffset = ((uint64_t{1} << kSrcOffsetBits) - 1) * kOffsetAlign;
constexpr uint64_t kMaxDstOffset = ((uint64_t{1} << kDstOffsetBits) - 1) * kOffsetAlign;
}  // namespace cmd_limits

struct alignas(16) TransferCmd {
  uint64_t lo;
  uint64_t hi;

  UCCL_EP_HD CmdType type() const { return static_cast<CmdType>((lo >> 1) & 0x7u); }
  UCCL_EP_HD bool flag() const { return (lo >> 4) & 1u; }
  UCCL_EP_HD uint32_t dst_rank() const { return static_cast<uint32_t>((lo >> 5) & 0xFFFu); }
  UCCL_EP_HD uint32_t length() const { return static_cast<uint32_t>((lo >> 17) & 0xFFFFFFu); }
  UCCL_EP_HD uint32_t atomic_index() const { return static_cast<uint32_t>((lo >> 41) & 0xFFFu); }
  UCCL_EP_HD int32_t atomic_value() const {
    // Sign-extend the 11-bit field.
    int32_t v = static_cast<int32_t>((lo >> 53) & 0x7FFu);
    return (v ^ 0x400) - 0x400;
  }
  UCCL_EP_HD uint64_t src_offset() const { return ((hi >> 1) & 0x7FFFFFFFull) * cmd_limits::kOffsetAlign; }
  UCCL_EP_HD uint64_t dst_offset() const { return (hi >> 32) * cmd_limits::kOffsetAlign; }
  UCCL_EP_HD bool has_atomic() const { return type() == CmdType::kAtomic || (type() == CmdType::kWrite && flag()); }
  UCCL_EP_HD bool drain_all() const { return flag(); }
  UCCL_EP_HD uint32_t drain_index_low32() const { return static_cast<uint32_t>(hi >> 32); }
  UCCL_EP_HD bool barrier_same_rail() const { return flag(); }
  UCCL_EP_HD uint32_t phase_lo() const { return static_cast<uint32_t>(lo & 1u); }
  UCCL_EP_HD uint32_t phase_hi() const { return static_cast<uint32_t>(hi & 1u); }
  UCCL_EP_HD TransferCmd with_phase(uint32_t phase) const {
    return TransferCmd{(lo & ~uint64_t{1}) | phase, (hi & ~uint64_t{1}) | phase};
  }
};
static_assert(sizeof(TransferCmd) == 16, "TransferCmd must be one 128-bit store");

namespace detail {
UCCL_EP_HD uint64_t pack_lo(CmdType type, bool flag, uint32_t dst_rank, uint32_t length, uint32_t atomic_index,
                            int32_t atomic_value) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(type) & 0x7u) << 1) | (static_cast<uint64_t>(flag) << 4) |
         (static_cast<uint64_t>(dst_rank & 0xFFFu) << 5) | (static_cast<uint64_t>(length & 0xFFFFFFu) << 17) |
         (static_cast<uint64_t>(atomic_index & 0xFFFu) << 41) |
         (static_cast<uint64_t>(static_cast<uint32_t>(atomic_value) & 0x7FFu) << 53);
}
UCCL_EP_HD uint64_t pack_hi(uint64_t src_offset, uint64_t dst_offset) {
  return (((src_offset / cmd_limits::kOffsetAlign) & 0x7FFFFFFFull) << 1) |
         ((dst_offset / cmd_limits::kOffsetAlign) << 32);
}
}  // namespace detail

// Makers: pure bit packing, callable from kernels. Host callers validate with check_cmd_args()
// (transfer_cmd_check.h); the proxy re-checks every decoded command against the registered
// region before posting, so a bad device-side value becomes a reported error, not a wild write.
UCCL_EP_HD TransferCmd make_write(uint32_t dst_rank, uint64_t src_offset, uint64_t dst_offset, uint32_t length) {
  return TransferCmd{detail::pack_lo(CmdType::kWrite, false, dst_rank, length, 0, 0),
                     detail::pack_hi(src_offset, dst_offset)};
}
UCCL_EP_HD TransferCmd make_write_atomic(uint32_t dst_rank, uint64_t src_offset, uint64_t dst_offset,
                                         uint32_t length, uint32_t atomic_index, int32_t atomic_value) {
  return TransferCmd{detail::pack_lo(CmdType::kWrite, true, dst_rank, length, atomic_index, atomic_value),
                     detail::pack_hi(src_offset, dst_offset)};
}
UCCL_EP_HD TransferCmd make_atomic(uint32_t dst_rank, uint32_t atomic_index, int32_t atomic_value) {
  return TransferCmd{detail::pack_lo(CmdType::kAtomic, false, dst_rank, 0, atomic_index, atomic_value), 0};
}
// Completes (is popped) once every write this channel posted up to FIFO index `upto` completed.
UCCL_EP_HD TransferCmd make_drain(uint64_t upto) {
  return TransferCmd{detail::pack_lo(CmdType::kDrain, false, 0, 0, 0, 0), (upto & 0xFFFFFFFFull) << 32};
}
UCCL_EP_HD TransferCmd make_drain_all() {
  return TransferCmd{detail::pack_lo(CmdType::kDrain, true, 0, 0, 0, 0), 0};
}
// Completes once every peer (or every same-rail peer) pushed a Barrier on the same channel.
UCCL_EP_HD TransferCmd make_barrier(bool same_rail) {
  return TransferCmd{detail::pack_lo(CmdType::kBarrier, same_rail, 0, 0, 0, 0), 0};
}

// Rebuilds the full 64-bit FIFO index a Drain refers to from its low 32 bits: the target lies at
// most 2^32 - 1 indices before the Drain itself (`drain_idx`).
UCCL_EP_HD uint64_t drain_target(uint64_t drain_idx, uint32_t low32) {
  return drain_idx - static_cast<uint32_t>(static_cast<uint32_t>(drain_idx) - low32);
}

}  // namespace uccl_ep

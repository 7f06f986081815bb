#include "fifo/cmd_builder.h"

#include "common/errors.h"

namespace uccl_ep {
namespace {

void check_rank(uint32_t dst_rank) {
  UCCL_EP_CHECK_ARG(dst_rank < cmd_limits::kMaxRanks, "dst_rank=", dst_rank, " exceeds the ", cmd_limits::kMaxRanks,
                    " ranks a TransferCmd can address");
}

void check_span(uint64_t src_offset, uint64_t dst_offset, uint32_t length) {
  UCCL_EP_CHECK_ARG(src_offset % cmd_limits::kOffsetAlign == 0 && dst_offset % cmd_limits::kOffsetAlign == 0,
                    "src_offset=", src_offset, " dst_offset=", dst_offset, " must be multiples of ",
                    cmd_limits::kOffsetAlign, " bytes; align buffers inside the registered region");
  UCCL_EP_CHECK_ARG(src_offset <= cmd_limits::kMaxSrcOffset, "src_offset=", src_offset,
                    " exceeds the encodable maximum ", cmd_limits::kMaxSrcOffset);
  UCCL_EP_CHECK_ARG(dst_offset <= cmd_limits::kMaxDstOffset, "dst_offset=", dst_offset,
                    " exceeds the encodable maximum ", cmd_limits::kMaxDstOffset);
  UCCL_EP_CHECK_ARG(length <= cmd_limits::kMaxLength, "length=", length, " exceeds ", cmd_limits::kMaxLength,
                    " bytes per command; split the transfer into several commands");
}

void check_atomic(uint32_t atomic_index, int32_t atomic_value) {
  UCCL_EP_CHECK_ARG(atomic_index < cmd_limits::kNumAtomicCounters, "atomic_index=", atomic_index, " exceeds the ",
                    cmd_limits::kNumAtomicCounters, " counters an immediate can address");
  UCCL_EP_CHECK_ARG(atomic_value >= cmd_limits::kMinAtomicValue && atomic_value <= cmd_limits::kMaxAtomicValue,
                    "atomic_value=", atomic_value, " is outside [", cmd_limits::kMinAtomicValue, ", ",
                    cmd_limits::kMaxAtomicValue, "]; split the increment into several atomics");
}

}  // namespace

TransferCmd build_write(uint32_t dst_rank, uint64_t src_offset, uint64_t dst_offset, uint32_t length) {
  check_rank(dst_rank);
  check_span(src_offset, dst_offset, length);
  return make_write(dst_rank, src_offset, dst_offset, length);
}

TransferCmd build_write_atomic(uint32_t dst_rank, uint64_t src_offset, uint64_t dst_offset, uint32_t length,
                               uint32_t atomic_index, int32_t atomic_value) {
  check_rank(dst_rank);
  check_span(src_offset, dst_offset, length);
  check_atomic(atomic_index, atomic_value);
  return make_write_atomic(dst_rank, src_offset, dst_offset, length, atomic_index, atomic_value);
}

TransferCmd build_atomic(uint32_t dst_rank, uint32_t atomic_index, int32_t atomic_value) {
  check_rank(dst_rank);
  check_atomic(atomic_index, atomic_value);
  return make_atomic(dst_rank, atomic_index, atomic_value);
}

CmdFields decode_cmd(const TransferCmd& cmd) {
  CmdFields f;
  f.type = cmd.type();
  f.dst_rank = cmd.dst_rank();
  f.has_atomic = cmd.has_atomic();
  switch (f.type) {
    case CmdType::kWrite:
      f.src_offset = cmd.src_offset();
      f.dst_offset = cmd.dst_offset();
      f.length = cmd.length();
      break;
    case CmdType::kDrain:
      f.drain_all = cmd.drain_all();
      f.drain_index_low32 = cmd.drain_index_low32();
      break;
    case CmdType::kBarrier:
      f.barrier_same_rail = cmd.barrier_same_rail();
      break;
    default:
      break;
  }
  if (f.has_atomic) {
    f.atomic_index = cmd.atomic_index();
    f.atomic_value = cmd.atomic_value();
  }
  return f;
}

const char* cmd_type_name(CmdType type) {
  switch (type) {
    case CmdType::kWrite:
      return "Write";
    case CmdType::kAtomic:
      return "Atomic";
    case CmdType::kDrain:
      return "Drain";
    case CmdType::kBarrier:
      return "Barrier";
    default:
      return "Invalid";
  }
}

std::string describe_cmd(const TransferCmd& cmd) {
  using std::to_string;
  CmdFields f = decode_cmd(cmd);
  std::string s = std::string(cmd_type_name(f.type)) + "(dst_rank=" + to_string(f.dst_rank);
  if (f.type == CmdType::kWrite) {
    s += ", src_offset=" + to_string(f.src_offset) + ", dst_offset=" + to_string(f.dst_offset) +
         ", length=" + to_string(f.length);
  }
  if (f.has_atomic) s += ", atomic_index=" + to_string(f.atomic_index) + ", atomic_value=" + to_string(f.atomic_value);
  if (f.type == CmdType::kDrain) s += f.drain_all ? std::string(", all") : ", upto_low32=" + to_string(f.drain_index_low32);
  if (f.type == CmdType::kBarrier) s += f.barrier_same_rail ? ", same_rail" : ", all_peers";
  return s + ")";
}

}  // namespace uccl_ep

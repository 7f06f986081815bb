// Validated construction of TransferCmds on the host (Python, CPU producers, tests). Kernels use
// the unchecked makers of transfer_cmd.h; the proxy re-validates every command it executes.
#pragma once

#include <cstdint>
#include <string>

#include "fifo/transfer_cmd.h"

namespace uccl_ep {

// Decoded view, for printing and for Python.
struct CmdFields {
  CmdType type = CmdType::kInvalid;
  uint32_t dst_rank = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint32_t length = 0;
  bool has_atomic = false;
  uint32_t atomic_index = 0;
  int32_t atomic_value = 0;
  bool drain_all = false;
  uint32_t drain_index_low32 = 0;
  bool barrier_same_rail = false;
};

// Throw InvalidArgument naming the offending field and its limit.
TransferCmd build_write(uint32_t dst_rank, uint64_t src_offset, uint64_t dst_offset, uint32_t length);
TransferCmd build_write_atomic(uint32_t dst_rank, uint64_t src_offset, uint64_t dst_offset, uint32_t length,
                               uint32_t atomic_index, int32_t atomic_value);
TransferCmd build_atomic(uint32_t dst_rank, uint32_t atomic_index, int32_t atomic_value);

CmdFields decode_cmd(const TransferCmd& cmd);
const char* cmd_type_name(CmdType type);
std::string describe_cmd(const TransferCmd& cmd);

}  // namespace uccl_ep

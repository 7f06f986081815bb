// Faults the ipc NIC model injects, as real NICs produce them in the field (UCCL_EP_IPC_FAULT):
//
//   retry_exceeded:rank=R,qp=T[,peer=P],after=N[,detect_ms=D]
//       On rank R, the QP of proxy thread T (to peer P, or to every peer) completes its (N+1)-th
//       write with IBV_WC_RETRY_EXC_ERR after D ms (the NIC's retry time) and delivers nothing
//       from then on: the QP is in the error state, later writes would flush.
//   dead_peer:rank=R,after=N[,detect_ms=D]
//       Rank R's NIC stops answering once it has posted N writes: nothing it sends arrives,
//       nothing sent to it is acknowledged. Every write to or from R completes with
//       IBV_WC_RETRY_EXC_ERR D ms after it was posted.
//
// Several faults are separated by ';'. The same string is given to every rank (each NIC acts on
// the faults that concern it). D defaults to 500 ms (RC: ack timeout x retry count).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace uccl_ep {

// ibv_wc_status values the model produces (same numbers as <infiniband/verbs.h>).
constexpr int kWcSuccess = 0;
constexpr int kWcWrFlushErr = 5;
constexpr int kWcRetryExcErr = 12;
const char* wc_status_name(int status);

struct IpcFault {
  enum Kind { kRetryExceeded, kDeadPeer } kind = kRetryExceeded;
  uint32_t rank = 0;
  int32_t qp = -1;    // proxy thread (retry_exceeded); -1: every thread
  int32_t peer = -1;  // destination rank (retry_exceeded); -1: every peer
  uint64_t after = 0;
  uint64_t detect_ms = 500;
};

// Parses a UCCL_EP_IPC_FAULT string ("" = no fault). Throws InvalidArgument naming the bad part.
std::vector<IpcFault> parse_ipc_faults(const std::string& spec);

}  // namespace uccl_ep

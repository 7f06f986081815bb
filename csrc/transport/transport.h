// The one interface every proxy transport implements (verbs RC, verbs EFA SRD, ipc).
//
// A transport moves bytes between the symmetric registered regions of ranks and delivers a 32-bit
// immediate with each write, after the write's bytes landed. It owns one Endpoint per proxy thread;
// thread i of every rank talks only to thread i of the others (paper §3.2), and channel c is
// always served by thread c % num_threads, so a (source rank, channel) stream has one sending and
// one receiving endpoint.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace uccl_ep {

struct Completion {
  enum Kind : uint8_t { kSend = 0, kRecv = 1 };
  Kind kind;
  uint32_t peer;     // kSend: destination rank; kRecv: source rank
  uint32_t channel;  // channel of the stream
  uint32_t imm;      // kRecv: the immediate
  uint32_t bytes;    // kRecv: bytes written by the message
  uint64_t wr_id;    // kSend: the id given to post_write
};

// Used only by its owning proxy thread.
class Endpoint {
 public:
  virtual ~Endpoint() = default;
  // RDMA-write [src_offset, +length) of the local region into [dst_offset, +length) of `peer`'s
  // region and deliver `imm` to peer's endpoint once the bytes landed (length 0: immediate only).
  // Offsets were bounds-checked by the caller. Throws TransportError.
  virtual void post_write(uint32_t peer, uint32_t channel, uint64_t src_offset, uint64_t dst_offset,
                          uint32_t length, uint32_t imm, uint64_t wr_id) = 0;
  // Up to `max` send and receive completions; returns how many. Throws TransportError naming the
  // peer on a failed completion.
  virtual int poll(Completion* out, int max) = 0;
  // Rings the doorbell for everything posted since the last flush (one notification of the NIC
  // per batch of posts, as a chained ibv_post_send). A transport may post at once and ignore it;
  // poll() flushes too.
  virtual void flush() {}
};

// Where the local symmetric region lives.
struct RegionInfo {
  void* base = nullptr;
  uint64_t bytes = 0;
  int gpu_device = -1;  // -1: host memory
};

struct TransportSetup {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t num_threads = 1;
  uint32_t num_channels = 1;
  RegionInfo region;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual std::string name() const = 0;
  // True when each stream is delivered in post order (RC); the receiver then needs no reordering.
  virtual bool ordered() const = 0;
  // What peers need to reach this rank (addresses, QP numbers, handles), exchanged by bootstrap.
  virtual std::string local_info() const = 0;
  // Connects to every rank given all ranks' local_info() (indexed by rank, own entry included).
  virtual void connect(const std::vector<std::string>& infos) = 0;
  virtual Endpoint& endpoint(uint32_t thread) = 0;
  // Size of `peer`'s registered region, known after connect (for bounds checks).
  virtual uint64_t peer_region_bytes(uint32_t peer) const = 0;
};

}  // namespace uccl_ep

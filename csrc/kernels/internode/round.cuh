// The round protocol of the ring roles. Thread 0 of a block decides each round (which streams
// have room or data), all warps then move tokens one warp per token, and thread 0 publishes
// the round with FIFO pushes. Commands of one ring stream always go to the same FIFO channel,
// so the proxy's per-stream sequence numbers order a chunk's write before its tail update even
// on transports that deliver out of order (EFA, ipc with the reorder injector).
#pragma once

#include "kernels/internode/plumbing.cuh"

namespace uccl_ep::internode::detail {

// Round decisions thread 0 broadcasts.
enum RoundState : int { kGo = 0, kWait = 1, kDone = 2, kStop = 3 };

// Thread 0's account of its block's round loop (Common::trace): the time between two marks goes
// to waiting (a round that found nothing to do, its back-off included), planning (a round that
// found work: the counter reads), moving rows (the warps' copies and the barrier after them) or
// pushing commands. Without a trace buffer it reads no clock.
struct RoundTrace {
  bool on;
  uint64_t start = 0, mark = 0, rounds = 0, waits = 0, wait_ns = 0, plan_ns = 0, move_ns = 0, push_ns = 0;

  __device__ explicit RoundTrace(const DevCommon& c) : on(c.trace != nullptr && threadIdx.x == 0) {
    if (on) start = mark = dev::global_timer_ns();
  }
  __device__ uint64_t lap() {
    const uint64_t now = dev::global_timer_ns();
    const uint64_t d = now - mark;
    mark = now;
    return d;
  }
  __device__ void planned(int round) {
    if (!on) return;
    const uint64_t d = lap();
    if (round == kWait) {
      ++waits;
      wait_ns += d;
    } else {
      ++rounds;
      plan_ns += d;
    }
  }
  __device__ void moved() {
    if (on) move_ns += lap();
  }
  __device__ void pushed() {
    if (on) push_ns += lap();
  }
  __device__ void store(const DevCommon& c) const {
    if (!on) return;
    uint64_t* w = c.trace + static_cast<int64_t>(blockIdx.x) * kTraceWords;
    const uint64_t v[kTraceWords] = {start, dev::global_timer_ns(), rounds, waits, wait_ns, plan_ns, move_ns, push_ns};
    for (int i = 0; i < kTraceWords; ++i) w[i] = v[i];
  }
};

// Thread 0's decision for one round of a sending or receiving loop: stop (prev == kStop marks
// thread 0's own push failure; or another block failed), done, go, or wait (backing off; after
// timeout_ns without progress it fails, naming the stalled peer, `want` and `got`, at `site`).
__device__ inline int settle_round(const DevCommon& c, bool all_done, bool any, int prev, int site, int peer,
                                   int64_t want, int ch, int64_t got, uint64_t& last_progress) {
  if (prev == kStop || aborted(c)) return kStop;
  if (all_done) return kDone;
  if (any) {
    last_progress = dev::global_timer_ns();
    return kGo;
  }
  const uint64_t waited = dev::global_timer_ns() - last_progress;
  if (waited > c.timeout_ns) {
    fail(c, site, peer, want, ch, got);
    return kStop;
  }
  dev::poll_pause(waited);
  return kWait;
}

// Every thread of the block gets the decision thread 0 wrote to s_round.
__device__ __forceinline__ int broadcast_round(const int& s_round) {
  __syncthreads();
  const int round = s_round;
  // Nobody reads s_round again until thread 0 rewrote it for the next round.
  __syncthreads();
  return round;
}

// Thread 0 of a sending block: the tokens for each node this round (s_k), at most a chunk and
// the room left in node n's ring (head counter `head_kind`); the own node's rows need no ring.
__device__ inline int plan_send_round(const DevCommon& c, int ch, int head_kind, int site, const int* s_cnt,
                                      const int* s_pos, const int64_t* s_sent, int* s_k, int prev,
                                      uint64_t& last_progress) {
  bool all_done = true, any = false;
  int blocked = -1;
  int64_t want = 0, got = 0;
  for (int n = 0; n < c.N; ++n) {
    s_k[n] = 0;
    const int remaining = s_cnt[n] - s_pos[n];
    if (remaining <= 0) continue;
    all_done = false;
    int k = remaining < c.chunk ? remaining : c.chunk;
    if (n != c.node) {
      const int64_t head = ld_counter(c.counters + counter_index(head_kind, ch, n));
      const int64_t room = c.cap - (s_sent[n] - head);
      if (room < k) {
        if (blocked < 0) blocked = n, want = s_sent[n] + k - c.cap, got = head;
        k = room > 0 ? static_cast<int>(room) : 0;
      }
    }
    s_k[n] = k;
    any |= k > 0;
  }
  return settle_round(c, all_done, any, prev, site, blocked * c.L + c.local, want, ch, got, last_progress);
}

// Which ring counters and sites one sending role uses.
struct SendKinds {
  int head, tail, sent;  // counter kinds (head, tail) and the state kind of the sent position
  int site;              // status site of a stalled wait for ring room
};

// The sending side of a ring role, shared by the dispatch sender and the combine forwarder.
// Stream n of channel `ch` holds count_of(n) items. Each round every warp packs its items with
// pack(n, pos, slot): pos is the item's index in stream n, slot its send-ring slot (nullptr for
// this rank's own node, which has no ring), or with remote regions (Common::remote) the slot of
// the receiver's ring itself. Thread 0 then writes each node's chunk into the receiver's ring
// (with remote regions the write only carries the delivery) and bumps its tail. The ring room
// check is the same either way: a receive slot is free once the receiver's head passed it.
// Returns the last round state (kDone: everything sent).
template <typename CountOf, typename Pack>
__device__ int ring_send(const DevCommon& c, const RingLayout& rl, int ch, const SendKinds& kinds,
                         CountOf count_of, Pack pack) {
  const int tid = threadIdx.x, warp = tid / dev::kWarpSize;
  __shared__ int s_pos[kMaxNodes], s_k[kMaxNodes], s_cnt[kMaxNodes];
  __shared__ int64_t s_sent[kMaxNodes];
  __shared__ int s_round;
  if (tid < c.N) {
    s_pos[tid] = 0;
    s_cnt[tid] = count_of(tid);
    s_sent[tid] = c.state[state_index(kinds.sent, ch, tid)];
  }
  if (tid == 0) s_round = kGo;
  __syncthreads();
  uint64_t last_progress = dev::global_timer_ns();
  RoundTrace tr(c);
  int round = kGo;
  for (;;) {
    if (tid == 0) {
      s_round = plan_send_round(c, ch, kinds.head, kinds.site, s_cnt, s_pos, s_sent, s_k, s_round, last_progress);
      tr.planned(s_round);
    }
    round = broadcast_round(s_round);
    if (round == kDone || round == kStop) break;
    if (round != kGo) continue;
    int total = 0;
    for (int n = 0; n < c.N; ++n) total += s_k[n];
    for (int item = warp; item < total; item += kWarps) {
      int n = 0, i = item;
      while (i >= s_k[n]) i -= s_k[n++];
      uint8_t* slot = nullptr;
      if (n != c.node) {
        slot = c.remote[n] != nullptr ? c.remote[n] + ring_slot_offset(rl.recv_offset, rl, ch, c.node, s_sent[n] + i)
                                      : c.region + ring_slot_offset(rl.send_offset, rl, ch, n, s_sent[n] + i);
      }
      pack(n, s_pos[n] + i, slot);
    }
    // The proxy (or NIC) reads the slots once the command is visible, and with remote regions
    // the receiver reads them once the write's delivery bumped its tail: publish them first.
    __threadfence_system();
    __syncthreads();
    if (tid == 0) {
      tr.moved();
      bool ok = true;
      for (int n = 0; n < c.N && ok; ++n) {
        const int k = s_k[n];
        if (k == 0) continue;
        if (n != c.node) {
          ok = push_chunk(c, rl, ch, n, n * c.L + c.local, s_sent[n], k, counter_index(kinds.tail, ch, c.node));
          s_sent[n] += k;
        }
        s_pos[n] += k;
      }
      if (!ok) s_round = kStop;
      tr.pushed();
    }
  }
  __syncthreads();  // thread 0's last updates of the shared positions are visible
  if (tid < c.N) c.state[state_index(kinds.sent, ch, tid)] = s_sent[tid];
  tr.store(c);
  return round;
}

}  // namespace uccl_ep::internode::detail

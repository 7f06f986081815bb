// Pure layout arithmetic of the internode (HT) path, shared by the kernels (device), the host
// launchers and the CPU tests: channel token ranges, ring-slot layouts, symmetric-region
// offsets, software-atomic counter indices and how a chunk that wraps a ring becomes commands.
//
// Everything here is plain integer math with no GPU dependency, so tests/cpp can check it on a
// machine without a GPU and the device code cannot drift from what the host validated.
#pragma once

#include <cstdint>

#include "fifo/transfer_cmd.h"

namespace uccl_ep::internode {

constexpr int kMaxChannels = 32;  // Config.num_sms / 2 <= 32
constexpr int kMaxNodes = 16;
constexpr int kMaxLocal = 8;   // ranks per node (NVLink peers)
constexpr int kMaxTopk = 32;
// Words per block of a launch's trace (Common::trace): kernel entry and exit (global timer ns),
// go rounds, wait rounds, then ns spent waiting, planning, moving rows and pushing commands,
// all as thread 0 of the block saw them (bench internode --trace).
constexpr int kTraceWords = 8;
constexpr int kMaxRanks = kMaxNodes * kMaxLocal;

// Placement of a call's node-local rows (the control area of every NVLink buffer, before its
// staging). At the start of its dispatch or combine kernel each rank tells every node peer
// where its rows of that call lie: a dispatch's outputs, or a combine's input (x and weights),
// in its receive arena, where the peers write or read them in place, or nowhere the peers can
// reach (kind 0), when the peers use its NVLink staging as before. flags: uint64 [kMaxLocal
// source] = the call's placement sequence, stored with release after the words; words: int64
// [kMaxLocal source][kPlaceWords] = {kind (1 arena, 0 staged), then byte offsets in the
// source's arena (-1: none) of recv_x, scales, top-k ids, weights, source indices (dispatch)
// or of x, weights (combine)}. Calls of a node are separated by node barriers, so one slot per
// source suffices: a peer writes the next call's words only after every rank passed the last
// call's closing barrier, which follows its reads.
constexpr int kPlaceWords = 8;
constexpr int kPlaceArena = 1;
constexpr int64_t kPlaceFlagsOffset = 1024;
constexpr int64_t kPlaceWordsOffset = kPlaceFlagsOffset + 8 * kMaxLocal;
constexpr int64_t kPlaceEnd = kPlaceWordsOffset + 8 * kMaxLocal * kPlaceWords;  // staging starts at or after

// Software-atomic counters (int64 in the proxy's mapped host array), one per (kind, channel,
// node). Named from the point of view of the rank that owns the counter:
//   kDispatchTail[c][m]: tokens of source (m, my local) that landed in my dispatch ring (c, m)
//   kDispatchDone[c][m]: end-of-stream markers of that stream (one per dispatch call)
//   kDispatchHead[c][n]: tokens of my stream (c -> node n) node n's forwarder has consumed
//   kCombineTail[c][n]:  partial sums from node n's forwarder that landed in my combine ring
//   kCombineHead[c][m]:  partials of my stream (c -> source (m, my local)) it has consumed
// All counters only grow (never reset), so no re-arming race exists between calls: each side
// keeps its own cumulative position (kernel state in device memory) and compares.
enum CounterKind : int { kDispatchTail = 0, kDispatchDone = 1, kDispatchHead = 2, kCombineTail = 3, kCombineHead = 4 };
constexpr int kNumCounterKinds = 5;
constexpr int kNumCounters = kNumCounterKinds * kMaxChannels * kMaxNodes;
static_assert(kNumCounters <= static_cast<int>(cmd_limits::kNumAtomicCounters), "counters must fit the atomic index");

UCCL_EP_HD int counter_index(int kind, int channel, int node) { return (kind * kMaxChannels + channel) * kMaxNodes + node; }

// Persistent kernel state (int64, device memory), same (kind, channel, node) indexing, plus
// one abort word the first failing block sets so every other block stops waiting.
// kDispatchCalls[c][m]: end markers of stream (c, source node m) seen so far; a channel's
// forwarder is done when the marker count exceeds it (channels a call leaves idle stay in step).
enum StateKind : int {
  kDispatchSent = 0,
  kDispatchConsumed = 1,
  kCombineSent = 2,
  kCombineConsumed = 3,
  kDispatchCalls = 4
};
constexpr int kNumStateKinds = 5;
constexpr int kStateWords = kNumStateKinds * kMaxChannels * kMaxNodes;
UCCL_EP_HD int state_index(int kind, int channel, int node) { return (kind * kMaxChannels + channel) * kMaxNodes + node; }

// Tokens of a rank are split into contiguous per-channel ranges (DeepEP's task split): channel
// c serves [begin, end). Both the sender and every receiver derive the same split from the
// sender's token count, which is what lets streams carry no token indices for ordering.
struct Range {
  int begin;
  int end;
};
UCCL_EP_HD Range channel_range(int num_tokens, int num_channels, int channel) {
  const int per = (num_tokens + num_channels - 1) / num_channels;
  int b = channel * per;
  b = b < num_tokens ? b : num_tokens;
  int e = b + per;
  e = e < num_tokens ? e : num_tokens;
  return Range{b, e};
}

UCCL_EP_HD int64_t align16(int64_t v) { return (v + 15) / 16 * 16; }

// One dispatch ring slot: a token row plus what the forwarder needs to place it.
//   [x row][fp32 scales][int32 global expert ids K][fp32 weights K][int32 source token]
//   [int32 destination row on each local rank of the destination node, -1 = not there]
struct DispatchSlot {
  int64_t x, scales, gid, weights, src, rows, bytes;
};
UCCL_EP_HD DispatchSlot dispatch_slot(int64_t row_bytes, int num_scales, int num_topk, int ranks_per_node) {
  DispatchSlot s{};
  s.x = 0;
  s.scales = row_bytes;
  s.gid = s.scales + 4ll * num_scales;
  s.weights = s.gid + 4ll * num_topk;
  s.src = s.weights + 4ll * num_topk;
  s.rows = s.src + 4;
  s.bytes = align16(s.rows + 4ll * ranks_per_node);
  return s;
}

// One combine ring slot: a partial sum of the node (in x's dtype), its weights and the source
// token index (a consistency check: the receiver knows which token it expects next).
struct CombineSlot {
  int64_t x, weights, src, bytes;
};
UCCL_EP_HD CombineSlot combine_slot(int64_t row_bytes, int num_topk) {
  CombineSlot s{};
  s.x = 0;
  s.weights = row_bytes;
  s.src = s.weights + 4ll * num_topk;
  s.bytes = align16(s.src + 4);
  return s;
}

// NVLink staging row of the dispatch (rows a local peer forwards to this rank; L > 1 only):
//   [x row][fp32 scales][topk idx K (idx_bytes each)][fp32 weights K][int32 source token]
struct StageSlot {
  int64_t x, scales, idx, weights, src, bytes;
};
UCCL_EP_HD StageSlot stage_slot(int64_t row_bytes, int num_scales, int num_topk, int idx_bytes) {
  StageSlot s{};
  s.x = 0;
  s.scales = row_bytes;
  s.idx = align16(s.scales + 4ll * num_scales);  // int64 ids need 8-byte alignment
  s.weights = align16(s.idx + static_cast<int64_t>(idx_bytes) * num_topk);
  s.src = s.weights + 4ll * num_topk;
  s.bytes = align16(s.src + 4);
  return s;
}

// The registered RDMA region is split in two fixed halves, dispatch first, so traffic of a
// combine can never land in a dispatch ring whatever the shapes of consecutive calls. Inside a
// half: send rings [C][N][cap] then receive rings [C][N][cap], slot_bytes each (16-aligned).
struct RingLayout {
  int64_t half_offset;  // 0 (dispatch) or half size (combine)
  int64_t send_offset;  // of ring (0, 0)
  int64_t recv_offset;
  int64_t slot_bytes;
  int cap;
  int num_nodes;
  int64_t bytes;  // what the half must hold
};
UCCL_EP_HD int64_t region_half_bytes(int64_t region_bytes) { return region_bytes / 2 / 16 * 16; }
UCCL_EP_HD RingLayout ring_layout(bool combine, int64_t region_bytes, int num_channels, int num_nodes, int cap,
                                  int64_t slot_bytes) {
  RingLayout l{};
  l.half_offset = combine ? region_half_bytes(region_bytes) : 0;
  l.slot_bytes = slot_bytes;
  l.cap = cap;
  l.num_nodes = num_nodes;
  const int64_t rings = static_cast<int64_t>(num_channels) * num_nodes * cap * slot_bytes;
  l.send_offset = l.half_offset;
  l.recv_offset = l.half_offset + rings;
  l.bytes = 2 * rings;
  return l;
}
// Byte offset (in the region) of slot `index` (cumulative, taken mod cap) of ring (channel, node).
UCCL_EP_HD int64_t ring_slot_offset(int64_t ring_base, const RingLayout& l, int channel, int node, int64_t index) {
  return ring_base + ((static_cast<int64_t>(channel) * l.num_nodes + node) * l.cap + index % l.cap) * l.slot_bytes;
}

// A chunk of k tokens starting at cumulative index `start` occupies at most two contiguous
// pieces of a ring of `cap` slots; each piece becomes one RDMA write.
struct ChunkPieces {
  int first_slot;
  int n1;  // slots [first_slot, first_slot + n1)
  int n2;  // slots [0, n2) after a wrap
};
UCCL_EP_HD ChunkPieces chunk_pieces(int64_t start, int k, int cap) {
  ChunkPieces p{};
  p.first_slot = static_cast<int>(start % cap);
  const int room = cap - p.first_slot;
  p.n1 = k < room ? k : room;
  p.n2 = k - p.n1;
  return p;
}

// Software atomics carry an 11-bit signed value: a counter increment of `delta` is posted as
// ceil(delta / kMaxAtomicValue) atomics; this is the i-th one's value.
constexpr int kMaxAtomicStep = cmd_limits::kMaxAtomicValue;
UCCL_EP_HD int atomic_steps(int64_t delta) { return static_cast<int>((delta + kMaxAtomicStep - 1) / kMaxAtomicStep); }
UCCL_EP_HD int atomic_step_value(int64_t delta, int i) {
  const int64_t left = delta - static_cast<int64_t>(i) * kMaxAtomicStep;
  return static_cast<int>(left < kMaxAtomicStep ? left : kMaxAtomicStep);
}

}  // namespace uccl_ep::internode

// The internode kernels' layout arithmetic (kernels/internode_layout.h) on the host: channel
// ranges partition the tokens, chunks that wrap a ring become exactly two pieces covering the
// right slots, counter increments split into valid 11-bit software atomics, and the dispatch
// and combine halves of the RDMA region never overlap.
#include <gtest/gtest.h>

#include <set>

#include "kernels/internode_layout.h"

namespace uccl_ep::internode {
namespace {

TEST(InternodeLayout, ChannelRangesPartitionTokens) {
  for (int tokens : {0, 1, 7, 100, 4096, 4097}) {
    for (int channels : {1, 3, 12, 32}) {
      int next = 0;
      for (int c = 0; c < channels; ++c) {
        Range r = channel_range(tokens, channels, c);
        EXPECT_EQ(r.begin, next) << tokens << " tokens, channel " << c;
        EXPECT_LE(r.begin, r.end);
        next = r.end;
      }
      EXPECT_EQ(next, tokens);
    }
  }
}

TEST(InternodeLayout, ChunkPiecesCoverConsecutiveSlots) {
  for (int cap : {1, 5, 8, 256}) {
    int64_t start = 0;
    for (int step = 0; step < 1000; ++step) {
      const int k = 1 + (step * 7) % cap;
      ChunkPieces p = chunk_pieces(start, k, cap);
      ASSERT_EQ(p.n1 + p.n2, k);
      ASSERT_EQ(p.first_slot, start % cap);
      if (p.n2 > 0) ASSERT_EQ(p.first_slot + p.n1, cap);  // wrapped exactly at the end
      ASSERT_LE(p.n2, p.first_slot);                        // never overwrites the first piece
      start += k;
    }
  }
}

TEST(InternodeLayout, AtomicStepsFitTheImmediate) {
  for (int64_t delta : {1, 2, 1022, 1023, 1024, 3000, 100000}) {
    int64_t sum = 0;
    for (int i = 0; i < atomic_steps(delta); ++i) {
      const int v = atomic_step_value(delta, i);
      EXPECT_GE(v, 1);
      EXPECT_LE(v, cmd_limits::kMaxAtomicValue);
      sum += v;
    }
    EXPECT_EQ(sum, delta);
  }
}

TEST(InternodeLayout, CountersAreUniqueAndFitTheImmediate) {
  std::set<int> seen;
  for (int kind = 0; kind < kNumCounterKinds; ++kind)
    for (int c = 0; c < kMaxChannels; ++c)
      for (int n = 0; n < kMaxNodes; ++n) {
        const int i = counter_index(kind, c, n);
        EXPECT_GE(i, 0);
        EXPECT_LT(i, kNumCounters);
        seen.insert(i);
      }
  EXPECT_EQ(static_cast<int>(seen.size()), kNumCounters);
  EXPECT_LE(kNumCounters, static_cast<int>(cmd_limits::kNumAtomicCounters));
  EXPECT_LT(state_index(kNumStateKinds - 1, kMaxChannels - 1, kMaxNodes - 1), kStateWords);
}

TEST(InternodeLayout, RingHalvesAreDisjointAndAligned) {
  const int64_t region = (int64_t{1} << 28) + 80;
  const DispatchSlot ds = dispatch_slot(14336, 56, 8, 8);
  const CombineSlot cs = combine_slot(14336, 8);
  EXPECT_EQ(ds.bytes % 16, 0);
  EXPECT_EQ(cs.bytes % 16, 0);
  RingLayout d = ring_layout(false, region, 12, 2, 64, ds.bytes);
  RingLayout c = ring_layout(true, region, 12, 2, 64, cs.bytes);
  EXPECT_LE(d.send_offset + d.bytes, c.half_offset);
  EXPECT_LE(c.send_offset + c.bytes, region);
  // The last slot of the last ring of each half ends inside that half.
  EXPECT_LE(ring_slot_offset(d.recv_offset, d, 11, 1, 63) + ds.bytes, d.half_offset + d.bytes);
  EXPECT_EQ(ring_slot_offset(d.recv_offset, d, 3, 1, 64 + 5), ring_slot_offset(d.recv_offset, d, 3, 1, 5));
  EXPECT_EQ(ring_slot_offset(c.send_offset, c, 0, 0, 0) % 16, 0);
}

}  // namespace
}  // namespace uccl_ep::internode

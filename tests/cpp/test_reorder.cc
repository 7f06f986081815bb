// Receiver-side ordering under thousands of seeded delivery orders.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "common/errors.h"
#include "proxy/imm.h"
#include "proxy/reorder.h"

namespace uccl_ep {
namespace {

TEST(Imm, PacksAndUnpacks) {
  for (uint32_t seq = 0; seq < 300; ++seq) {
    for (int32_t val : {-1024, -1, 0, 1, 1023}) {
      uint32_t v = imm::atomic(seq, 4095 - seq % 4096, val);
      EXPECT_EQ(imm::kind(v), ImmKind::kAtomic);
      EXPECT_EQ(imm::seq(v), seq % imm::kSeqMod);
      EXPECT_EQ(imm::atomic_index(v), 4095 - seq % 4096);
      EXPECT_EQ(imm::atomic_value(v), val);
    }
    EXPECT_EQ(imm::kind(imm::write(seq)), ImmKind::kWrite);
    EXPECT_EQ(imm::seq(imm::write(seq)), seq % imm::kSeqMod);
    EXPECT_TRUE(imm::barrier_same_rail(imm::barrier(seq, true)));
    EXPECT_EQ(imm::kind(imm::barrier(seq, false)), ImmKind::kBarrier);
  }
}

// A sender that posts message s only when every message before s - window was acknowledged
// (the proxy's rule); the network delivers any in-flight message next, the freedom EFA SRD has.
// Checks: every message is applied exactly once, in sequence order, so no atomic is applied
// before a write that precedes it.
void run_interleaving(uint64_t seed, uint32_t n, uint32_t window) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> kinds(n);
  for (auto& k : kinds) k = rng() % 3;  // 0 write, 1 atomic, 2 barrier
  std::vector<uint32_t> inflight;
  uint32_t next = 0;
  StreamReorder r;
  std::vector<uint32_t> applied;  // message numbers in apply order
  uint64_t unwrapped_expected = 0;
  auto encode = [&](uint32_t i) {
    if (kinds[i] == 0) return imm::write(i);
    if (kinds[i] == 1) return imm::atomic(i, i % 4096, static_cast<int32_t>(i % 1000));
    return imm::barrier(i, i & 1);
  };
  while (applied.size() < n) {
    uint32_t oldest = next;
    for (uint32_t m : inflight) oldest = std::min(oldest, m);
    bool can_post = next < n && next - oldest < window;
    if (can_post && (inflight.empty() || rng() % 2)) {
      inflight.push_back(next++);
      continue;
    }
    size_t pick = rng() % inflight.size();
    uint32_t msg = inflight[pick];
    inflight[pick] = inflight.back();
    inflight.pop_back();
    r.deliver(
        encode(msg),
        [&](uint32_t v) {
          // The message with this sequence number must be the next one of the stream.
          ASSERT_EQ(imm::seq(v), unwrapped_expected % imm::kSeqMod);
          uint32_t num = static_cast<uint32_t>(unwrapped_expected);
          ASSERT_EQ(v, encode(num)) << "seed " << seed;
          applied.push_back(num);
          ++unwrapped_expected;
        },
        0, 0);
  }
  for (uint32_t i = 0; i < n; ++i) ASSERT_EQ(applied[i], i) << "seed " << seed;
  EXPECT_EQ(r.num_held(), 0u);
}

TEST(Reorder, ThousandsOfSeededInterleavings) {
  for (uint64_t seed = 0; seed < 3000; ++seed) {
    SCOPED_TRACE(seed);
    run_interleaving(seed, 200 + seed % 300, 1 + seed % imm::kSeqWindow);
    if (HasFatalFailure()) return;
  }
}

TEST(Reorder, RejectsDuplicateAndWindowOverrun) {
  StreamReorder r;
  auto nop = [](uint32_t) {};
  r.deliver(imm::write(2), nop, 1, 0);
  EXPECT_THROW(r.deliver(imm::write(2), nop, 1, 0), TransportError);
  EXPECT_THROW(r.deliver(imm::write(imm::kSeqWindow + 5), nop, 1, 0), TransportError);
  StreamReorder r2;
  r2.deliver(imm::write(0), nop, 1, 0);
  // Sequence 0 again is now 127 behind: a replay, not a new message.
  EXPECT_THROW(r2.deliver(imm::write(0), nop, 1, 0), TransportError);
}

TEST(Reorder, HoldsControlUntilGapFilled) {
  StreamReorder r;
  std::vector<uint32_t> got;
  auto rec = [&](uint32_t v) { got.push_back(imm::seq(v)); };
  r.deliver(imm::atomic(1, 0, 1), rec, 0, 0);
  r.deliver(imm::atomic(2, 0, 1), rec, 0, 0);
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(r.num_held(), 2u);
  r.deliver(imm::write(0), rec, 0, 0);
  EXPECT_EQ(got, (std::vector<uint32_t>{0, 1, 2}));
}

}  // namespace
}  // namespace uccl_ep

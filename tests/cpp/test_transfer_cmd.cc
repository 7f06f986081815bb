#include <gtest/gtest.h>

#include <random>

#include "common/errors.h"
#include "fifo/cmd_builder.h"
#include "fifo/transfer_cmd.h"

namespace uccl_ep {
namespace {

TEST(TransferCmd, WriteRoundTripsRandomFields) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    uint32_t rank = rng() % cmd_limits::kMaxRanks;
    uint64_t src = (rng() % (cmd_limits::kMaxSrcOffset / 16 + 1)) * 16;
    uint64_t dst = (rng() % (cmd_limits::kMaxDstOffset / 16 + 1)) * 16;
    uint32_t len = rng() % (cmd_limits::kMaxLength + 1);
    uint32_t aidx = rng() % cmd_limits::kNumAtomicCounters;
    int32_t aval = cmd_limits::kMinAtomicValue +
                   static_cast<int32_t>(rng() % (cmd_limits::kMaxAtomicValue - cmd_limits::kMinAtomicValue + 1));
    TransferCmd c = build_write_atomic(rank, src, dst, len, aidx, aval);
    // The phase bits must not disturb any field.
    for (uint32_t phase : {0u, 1u}) {
      TransferCmd p = c.with_phase(phase);
      ASSERT_EQ(p.phase_lo(), phase);
      ASSERT_EQ(p.phase_hi(), phase);
      CmdFields f = decode_cmd(p);
      ASSERT_EQ(f.type, CmdType::kWrite);
      ASSERT_EQ(f.dst_rank, rank);
      ASSERT_EQ(f.src_offset, src);
      ASSERT_EQ(f.dst_offset, dst);
      ASSERT_EQ(f.length, len);
      ASSERT_TRUE(f.has_atomic);
      ASSERT_EQ(f.atomic_index, aidx);
      ASSERT_EQ(f.atomic_value, aval);
    }
  }
}

TEST(TransferCmd, PlainWriteHasNoAtomic) {
  TransferCmd c = build_write(3, 32, 4096, 7168);
  EXPECT_EQ(c.type(), CmdType::kWrite);
  EXPECT_FALSE(c.has_atomic());
  EXPECT_EQ(c.src_offset(), 32u);
  EXPECT_EQ(c.dst_offset(), 4096u);
  EXPECT_EQ(c.length(), 7168u);
}

TEST(TransferCmd, AtomicDrainBarrier) {
  TransferCmd a = build_atomic(4095, 4095, -1024);
  EXPECT_EQ(a.type(), CmdType::kAtomic);
  EXPECT_TRUE(a.has_atomic());
  EXPECT_EQ(a.dst_rank(), 4095u);
  EXPECT_EQ(a.atomic_index(), 4095u);
  EXPECT_EQ(a.atomic_value(), -1024);

  TransferCmd d = make_drain(0x1234567890ull);
  EXPECT_EQ(d.type(), CmdType::kDrain);
  EXPECT_FALSE(d.drain_all());
  EXPECT_EQ(d.drain_index_low32(), 0x34567890u);
  EXPECT_TRUE(make_drain_all().drain_all());

  EXPECT_TRUE(make_barrier(true).barrier_same_rail());
  EXPECT_FALSE(make_barrier(false).barrier_same_rail());
  EXPECT_EQ(make_barrier(false).type(), CmdType::kBarrier);
}

TEST(TransferCmd, DrainTargetReconstructsAcrossWrap) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 10000; ++i) {
    uint64_t target = rng() >> 4;
    uint64_t dist = rng() % 0xFFFFFFFFull;
    uint64_t drain_idx = target + dist;
    EXPECT_EQ(drain_target(drain_idx, static_cast<uint32_t>(target)), target);
  }
}

TEST(TransferCmd, BuildersRejectOutOfRange) {
  EXPECT_THROW(build_write(cmd_limits::kMaxRanks, 0, 0, 16), InvalidArgument);
  EXPECT_THROW(build_write(0, 8, 0, 16), InvalidArgument);  // misaligned
  EXPECT_THROW(build_write(0, 0, 0, cmd_limits::kMaxLength + 1), InvalidArgument);
  EXPECT_THROW(build_write(0, cmd_limits::kMaxSrcOffset + 16, 0, 16), InvalidArgument);
  EXPECT_THROW(build_atomic(0, cmd_limits::kNumAtomicCounters, 1), InvalidArgument);
  EXPECT_THROW(build_atomic(0, 0, cmd_limits::kMaxAtomicValue + 1), InvalidArgument);
  EXPECT_THROW(build_atomic(0, 0, cmd_limits::kMinAtomicValue - 1), InvalidArgument);
  try {
    build_write(0, 0, 0, cmd_limits::kMaxLength + 1);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("length="), std::string::npos);
  }
}

TEST(TransferCmd, DescribeNamesFields) {
  std::string s = describe_cmd(build_write_atomic(2, 16, 32, 48, 5, -3));
  EXPECT_NE(s.find("Write"), std::string::npos);
  EXPECT_NE(s.find("dst_rank=2"), std::string::npos);
  EXPECT_NE(s.find("atomic_value=-3"), std::string::npos);
}

}  // namespace
}  // namespace uccl_ep

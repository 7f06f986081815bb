#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "fifo/cmd_builder.h"
#include "fifo/fifo.h"

namespace uccl_ep {
namespace {

TEST(Fifo, RejectsBadCapacity) {
  EXPECT_THROW(FifoChannel::create_host(0, 1000, 100), InvalidArgument);
  EXPECT_THROW(FifoChannel::create_host(0, 0, 100), InvalidArgument);
}

TEST(Fifo, EmptyPollsFalseAndFifoOrderAcrossWrapAround) {
  auto ch = FifoChannel::create_host(0, 4, 1000);
  TransferCmd c;
  EXPECT_FALSE(ch->poll(&c));
  // 10 laps of a 4-slot ring: every command comes back in order, none stale.
  for (uint32_t i = 0; i < 40; ++i) {
    uint64_t idx = ch->push(build_write(i % 7, 16 * i, 32 * i, i));
    EXPECT_EQ(idx, i);
    ASSERT_TRUE(ch->poll(&c));
    EXPECT_EQ(c.dst_rank(), i % 7);
    EXPECT_EQ(c.src_offset(), 16u * i);
    EXPECT_EQ(c.length(), i);
    EXPECT_FALSE(ch->check_completion(idx));
    ch->pop();
    EXPECT_TRUE(ch->check_completion(idx));
    EXPECT_FALSE(ch->poll(&c)) << "slot read twice at " << i;
  }
}

TEST(Fifo, PollDoesNotDequeue) {
  auto ch = FifoChannel::create_host(0, 8, 1000);
  ch->push(build_atomic(1, 2, 3));
  TransferCmd a, b;
  ASSERT_TRUE(ch->poll(&a));
  ASSERT_TRUE(ch->poll(&b));
  EXPECT_EQ(a.lo, b.lo);
  EXPECT_EQ(ch->head(), 0u);
}

TEST(Fifo, FullRingTimesOutNamingChannelAndIndex) {
  auto ch = FifoChannel::create_host(5, 2, 50);
  ch->push(make_barrier(false));
  ch->push(make_barrier(false));
  try {
    ch->push(make_barrier(false));
    FAIL() << "push into a full ring returned";
  } catch (const TimeoutError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("channel 5"), std::string::npos) << msg;
    EXPECT_NE(msg.find("index 2"), std::string::npos) << msg;
  }
}

TEST(Fifo, WaitCompletionTimesOutAndAbortReleasesWaiters) {
  auto ch = FifoChannel::create_host(3, 4, 50);
  uint64_t idx = ch->push(make_drain_all());
  EXPECT_THROW(ch->wait_completion(idx), TimeoutError);
  auto ch2 = FifoChannel::create_host(4, 4, 100000);
  uint64_t idx2 = ch2->push(make_drain_all());
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ch2->set_abort(true);
  });
  EXPECT_THROW(ch2->wait_completion(idx2), TimeoutError);
  t.join();
}

TEST(Fifo, BackPressureBlocksUntilPop) {
  auto ch = FifoChannel::create_host(0, 4, 5000);
  for (int i = 0; i < 4; ++i) ch->push(make_write(0, 0, 0, i));
  std::atomic<bool> pushed{false};
  std::thread producer([&] {
    ch->push(make_write(0, 0, 0, 99));
    pushed = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(pushed.load()) << "push into a full ring did not wait";
  TransferCmd c;
  ASSERT_TRUE(ch->poll(&c));
  ch->pop();
  producer.join();
  EXPECT_TRUE(pushed.load());
  for (uint32_t want : {1u, 2u, 3u, 99u}) {
    ASSERT_TRUE(ch->poll(&c));
    EXPECT_EQ(c.length(), want);
    ch->pop();
  }
}

// Several producer threads share one channel; the consumer must see every command exactly once,
// and each producer's own commands in its push order.
TEST(Fifo, ConcurrentProducersConsumerExactlyOnceInPerProducerOrder) {
  constexpr int kProducers = 4;
  constexpr uint32_t kPerProducer = 20000;
  auto ch = FifoChannel::create_host(0, 64, 20000);
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      for (uint32_t i = 0; i < kPerProducer; ++i) ch->push(make_write(p, 0, 0, i));
    });
  }
  std::vector<uint32_t> next(kProducers, 0);
  uint64_t total = 0;
  TransferCmd c;
  while (total < kProducers * kPerProducer) {
    if (!ch->poll(&c)) continue;
    ASSERT_EQ(c.type(), CmdType::kWrite);
    uint32_t p = c.dst_rank();
    ASSERT_LT(p, static_cast<uint32_t>(kProducers));
    ASSERT_EQ(c.length(), next[p]) << "producer " << p << " out of order";
    ++next[p];
    ch->pop();
    ++total;
  }
  for (auto& t : producers) t.join();
  EXPECT_FALSE(ch->poll(&c));
  for (int p = 0; p < kProducers; ++p) EXPECT_EQ(next[p], kPerProducer);
}

// A push that gives up after reserving its index leaves a hole the consumer can never pass: the
// channel must say so on both sides at once instead of accepting pushes nobody will consume.
TEST(Fifo, PushFailureAfterReservationMakesTheChannelFailFastOnBothSides) {
  auto ch = FifoChannel::create_host(7, 2, 50);
  ch->push(make_barrier(false));
  ch->push(make_barrier(false));
  EXPECT_THROW(ch->push(make_barrier(false)), TimeoutError);  // index 2 reserved, never written
  const auto t0 = std::chrono::steady_clock::now();
  try {
    ch->push(make_barrier(false));
    FAIL() << "a push after a hole was accepted";
  } catch (const TimeoutError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("channel 7 is unusable: index 2"), std::string::npos) << msg;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(40)) << "it waited for room";
  try {
    ch->check_error();
    FAIL() << "check_error() did not report the failed push";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("never written"), std::string::npos) << e.what();
  }
  // The consumer takes the two real commands, then reports the hole instead of waiting for it.
  TransferCmd c;
  for (int i = 0; i < 2; ++i) {
    EXPECT_NO_THROW(ch->check_hole());
    ASSERT_TRUE(ch->poll(&c));
    ch->pop();
  }
  EXPECT_FALSE(ch->poll(&c));
  try {
    ch->check_hole();
    FAIL() << "the consumer was not told about the hole at its head";
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("reserved index 2 gave up"), std::string::npos) << e.what();
  }
}

TEST(Fifo, AbortRefusesAPushBeforeReservingAnIndex) {
  auto ch = FifoChannel::create_host(1, 4, 60000);
  ch->set_abort(true);
  EXPECT_THROW(ch->push(make_barrier(false)), TimeoutError);
  ch->set_abort(false);
  EXPECT_EQ(ch->push(make_barrier(false)), 0u) << "the refused push reserved an index";
  EXPECT_NO_THROW(ch->check_error());
}

TEST(Fifo, DeviceHandleDescribesHostMemory) {
  auto ch = FifoChannel::create_host(9, 16, 1234);
  FifoDeviceHandle h = ch->device_handle();
  EXPECT_EQ(h.capacity, 16u);
  EXPECT_EQ(h.channel, 9u);
  EXPECT_EQ(h.timeout_ns, 1234ull * 1000000ull);
  EXPECT_NE(h.slots, nullptr);
  EXPECT_NO_THROW(ch->check_error());
  h.error->index = 77;
  h.error->channel = 9;
  __atomic_store_n(&h.error->code, static_cast<uint32_t>(kFifoPushTimeout), __ATOMIC_RELEASE);
  try {
    ch->check_error();
    FAIL();
  } catch (const TimeoutError& e) {
    EXPECT_NE(std::string(e.what()).find("channel 9"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("77"), std::string::npos);
  }
}

}  // namespace
}  // namespace uccl_ep

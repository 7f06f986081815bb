// The registry the bindings check raw addresses against (null, outside, wrong kind, too long).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "common/registry.h"

namespace uccl_ep {
namespace {

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(AllocRegistry, ChecksNullOutsideWrongKindAndRangePastTheEnd) {
  AllocRegistry& r = AllocRegistry::get();
  std::vector<char> mem(4096);
  const auto base = reinterpret_cast<uintptr_t>(mem.data());
  r.add(base, 1024, AllocKind::kHostRegion);
  EXPECT_NO_THROW(r.check(base, 1024, {AllocKind::kHostRegion}, "region"));
  EXPECT_NO_THROW(r.check(base + 1000, 24, {AllocKind::kHostRegion}, "region"));
  EXPECT_NO_THROW(r.check(base + 1023, 0, {AllocKind::kHostRegion}, "region"));
  EXPECT_NE(message_of([&] { r.check(0, 8, {AllocKind::kHostRegion}, "region"); }).find("region is a null pointer"),
            std::string::npos);
  std::string past = message_of([&] { r.check(base + 512, 1024, {AllocKind::kHostRegion}, "region"); });
  EXPECT_NE(past.find("must lie inside one host region"), std::string::npos) << past;
  EXPECT_NE(past.find("at offset 512"), std::string::npos) << past;
  std::string outside = message_of([&] { r.check(base + 2048, 8, {AllocKind::kHostRegion}, "region"); });
  EXPECT_NE(outside.find("lies in no live allocation"), std::string::npos) << outside;
  std::string kind = message_of([&] { r.check(base, 8, {AllocKind::kHostStatus}, "status"); });
  EXPECT_NE(kind.find("must lie inside one status words"), std::string::npos) << kind;
  EXPECT_FALSE(r.contains(base + 1024, 1, {AllocKind::kHostRegion}));
  EXPECT_EQ(r.size_of(base, AllocKind::kHostRegion, "region"), 1024u);
  EXPECT_THROW(r.size_of(base + 8, AllocKind::kHostRegion, "region"), InvalidArgument);
  EXPECT_EQ(r.remove(base, AllocKind::kHostRegion, "free"), 1024u);
  std::string twice = message_of([&] { r.remove(base, AllocKind::kHostRegion, "free"); });
  EXPECT_NE(twice.find("is not the start of a live host region"), std::string::npos) << twice;
  EXPECT_THROW(r.check(base, 8, {AllocKind::kHostRegion}, "region"), InvalidArgument);
}

TEST(AllocRegistry, RejectsOverlapsAndAnInteriorFree) {
  AllocRegistry& r = AllocRegistry::get();
  std::vector<char> mem(4096);
  const auto base = reinterpret_cast<uintptr_t>(mem.data());
  r.add(base + 1024, 1024, AllocKind::kDeviceBuffer);
  EXPECT_THROW(r.add(base + 512, 1024, AllocKind::kDeviceBuffer), InvalidArgument);  // ends inside
  EXPECT_THROW(r.add(base + 1536, 8, AllocKind::kDeviceBuffer), InvalidArgument);    // starts inside
  EXPECT_NO_THROW(r.add(base, 1024, AllocKind::kIpcMapping));                          // touches only
  EXPECT_THROW(r.remove(base + 1032, AllocKind::kDeviceBuffer, "free"), InvalidArgument);
  EXPECT_THROW(r.remove(base, AllocKind::kDeviceBuffer, "free"), InvalidArgument);  // wrong kind
  EXPECT_NO_THROW(r.check(base + 8, 8, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping}, "buffer"));
  // A range may not run from one allocation into the next, even when they touch.
  EXPECT_THROW(r.check(base + 1000, 48, {AllocKind::kDeviceBuffer, AllocKind::kIpcMapping}, "buffer"),
               InvalidArgument);
  r.remove(base, AllocKind::kIpcMapping, "close");
  r.remove(base + 1024, AllocKind::kDeviceBuffer, "free");
}

TEST(AllocRegistry, TheSameRangeTwiceIsCountedNotRejected) {
  AllocRegistry& r = AllocRegistry::get();
  std::vector<char> mem(256);
  const auto base = reinterpret_cast<uintptr_t>(mem.data());
  r.add(base, 256, AllocKind::kIpcMapping);
  r.add(base, 256, AllocKind::kIpcMapping);
  EXPECT_THROW(r.add(base, 128, AllocKind::kIpcMapping), InvalidArgument);
  r.remove(base, AllocKind::kIpcMapping, "close");
  EXPECT_TRUE(r.contains(base, 256, {AllocKind::kIpcMapping}));
  r.remove(base, AllocKind::kIpcMapping, "close");
  EXPECT_FALSE(r.contains(base, 1, {AllocKind::kIpcMapping}));
}

TEST(AllocRegistry, ConcurrentAddCheckRemove) {
  AllocRegistry& r = AllocRegistry::get();
  std::vector<std::vector<char>> mems(4, std::vector<char>(64 * 256));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const auto base = reinterpret_cast<uintptr_t>(mems[t].data());
      for (int i = 0; i < 256; ++i) r.add(base + 64 * i, 64, AllocKind::kHostStatus);
      for (int i = 0; i < 256; ++i) r.check(base + 64 * i + 8, 56, {AllocKind::kHostStatus}, "status");
      for (int i = 0; i < 256; ++i) r.remove(base + 64 * i, AllocKind::kHostStatus, "free");
    });
  }
  for (auto& th : threads) th.join();
  for (auto& m : mems) EXPECT_FALSE(r.contains(reinterpret_cast<uintptr_t>(m.data()), 1, {AllocKind::kHostStatus}));
}

}  // namespace
}  // namespace uccl_ep

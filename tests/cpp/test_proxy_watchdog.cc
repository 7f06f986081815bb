// The proxy's watchdog: a proxy thread blocked inside a transport call (the device failure of
// test_two_gpu_ipc_traffic[8-8-reorder] had every proxy thread inside a CUDA copy while the
// kernels waited for them: no proxy timeout could fire, the kernels gave up after 41 s with
// "the proxy thread owning this channel stalled") is reported by Proxy::check() as a
// TimeoutError naming the thread, and the producers waiting on its channels are released.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "fifo/cmd_builder.h"
#include "fifo/fifo.h"
#include "proxy/proxy.h"
#include "proxy_pair.h"
#include "transport/ipc_transport.h"

namespace uccl_ep {
namespace {

// Wraps an ipc transport; once armed, the first post_write of the endpoint blocks until released
// (a copy call that never returns while the kernels spin).
class BlockingTransport : public Transport {
 public:
  explicit BlockingTransport(std::unique_ptr<IpcTransport> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return "blocking-" + inner_->name(); }
  bool ordered() const override { return inner_->ordered(); }
  std::string local_info() const override { return inner_->local_info(); }
  void connect(const std::vector<std::string>& infos) override { inner_->connect(infos); }
  uint64_t peer_region_bytes(uint32_t peer) const override { return inner_->peer_region_bytes(peer); }
  Endpoint& endpoint(uint32_t thread) override {
    if (!ep_) ep_ = std::make_unique<Ep>(inner_->endpoint(thread), *this);
    return *ep_;
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    released_ = true;
    cv_.notify_all();
  }
  std::atomic<bool> blocked{false};

 private:
  class Ep : public Endpoint {
   public:
    Ep(Endpoint& inner, BlockingTransport& t) : inner_(inner), t_(t) {}
    void post_write(uint32_t peer, uint32_t channel, uint64_t src, uint64_t dst, uint32_t len, uint32_t imm,
                    uint64_t wr_id) override {
      {
        std::unique_lock<std::mutex> lock(t_.mu_);
        t_.blocked = true;
        t_.cv_.wait(lock, [&] { return t_.released_; });
      }
      inner_.post_write(peer, channel, src, dst, len, imm, wr_id);
    }
    int poll(Completion* out, int max) override { return inner_.poll(out, max); }

   private:
    Endpoint& inner_;
    BlockingTransport& t_;
  };
  std::unique_ptr<IpcTransport> inner_;
  std::unique_ptr<Ep> ep_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

// Two proxies over ipc, rank 0's transport blocking (once armed by a write on its channel).
struct BlockingPair : ProxyPair {
  BlockingTransport* blocking;

  BlockingPair(uint64_t timeout_ms, uint64_t stop_timeout_ms)
      : ProxyPair([](std::unique_ptr<IpcTransport> ipc) { return std::make_unique<BlockingTransport>(std::move(ipc)); },
                  timeout_ms, stop_timeout_ms),
        blocking(static_cast<BlockingTransport*>(transports[0].get())) {}

  // Makes rank 0's thread block inside post_write; true once it does.
  bool block_rank0() {
    fifos[0]->push(build_write(1, 0, 0, 64));
    const auto t0 = std::chrono::steady_clock::now();
    while (!blocking->blocked.load() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return blocking->blocked.load();
  }
};

TEST(ProxyWatchdog, ThreadBlockedInTransportIsReportedAndProducersReleased) {
  BlockingPair pair(300, 5000);
  auto& proxies = pair.proxies;
  auto& fifos = pair.fifos;
  BlockingTransport* blocking = pair.blocking;
  // A healthy proxy passes check() for longer than its timeout (the watchdog is quiet).
  const auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(700)) {
    for (auto& p : proxies) EXPECT_NO_THROW(p->check());
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Rank 0's thread now blocks inside post_write; its producer waits on a drain.
  std::atomic<bool> released_with_error{false};
  std::thread producer([&] {
    FifoChannel& f = *fifos[0];
    f.push(build_write(1, 0, 0, 64));
    try {
      f.wait_completion(f.push(make_drain_all()));
    } catch (const TimeoutError&) {
      released_with_error = true;
    }
  });
  std::string msg;
  const auto t1 = std::chrono::steady_clock::now();
  while (msg.empty() && std::chrono::steady_clock::now() - t1 < std::chrono::seconds(10)) {
    try {
      proxies[0]->check();
    } catch (const TimeoutError& e) {
      msg = e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(blocking->blocked.load());
  ASSERT_FALSE(msg.empty()) << "the blocked proxy thread was never reported";
  EXPECT_NE(msg.find("proxy rank 0 thread 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has not come back from a call into transport 'blocking-ipc'"), std::string::npos) << msg;
  // The error sticks, and the producer was released by the abort instead of waiting 60 s.
  EXPECT_THROW(proxies[0]->check(), TimeoutError);
  producer.join();
  EXPECT_TRUE(released_with_error.load());
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t1);
  EXPECT_LT(waited.count(), 5000);
  blocking->release();  // let the thread return so stop() can join it
  for (auto& p : proxies) p->stop();
}

void wait_for_live_threads(uint32_t n) {
  const auto t0 = std::chrono::steady_clock::now();
  while (Proxy::live_threads() > n && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST(ProxyWatchdog, StopIsBoundedAndNamesTheThreadStuckInATransportCall) {
  BlockingPair p(60000, 300);
  ASSERT_TRUE(p.block_rank0());
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg;
  try {
    p.proxies[0]->stop(200);
  } catch (const TimeoutError& e) {
    msg = e.what();
  }
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  ASSERT_FALSE(msg.empty()) << "stop() returned although its thread is stuck";
  EXPECT_GE(waited.count(), 190);
  EXPECT_LT(waited.count(), 3000);
  EXPECT_NE(msg.find("proxy rank 0: thread 0 (ueproxy0t0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did not stop within 200 ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("transport 'blocking-ipc'"), std::string::npos) << msg;
  // Still stopping: the proxy kept its thread, cannot be started again, and can be stopped later.
  EXPECT_TRUE(p.proxies[0]->running());
  EXPECT_THROW(p.proxies[0]->start(), InvalidArgument);
  p.blocking->release();
  EXPECT_NO_THROW(p.proxies[0]->stop(10000));
  EXPECT_FALSE(p.proxies[0]->running());
  p.proxies[1]->stop();
}

TEST(ProxyWatchdog, DestructorLeavesAStuckThreadBehindWithoutWaitingForIt) {
  const uint32_t before = Proxy::live_threads();
  BlockingPair p(60000, 300);
  ASSERT_TRUE(p.block_rank0());
  const auto t0 = std::chrono::steady_clock::now();
  p.proxies[0].reset();  // bounded by stop_timeout_ms, then the thread is detached
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  EXPECT_LT(waited.count(), 3000);
  EXPECT_EQ(Proxy::live_threads(), before + 2);  // rank 0's stuck thread and rank 1's thread
  // The detached thread returns into state the destructor left alive (TSAN/ASAN would object
  // otherwise), then exits; the transport it used is still owned here.
  p.blocking->release();
  p.proxies[1]->stop();
  wait_for_live_threads(before);
  EXPECT_EQ(Proxy::live_threads(), before);
}

// A producer that reserved a FIFO index and gave up leaves a slot the proxy waits for forever:
// the proxy must report it (check() raises naming channel and index) instead of idling.
TEST(ProxyWatchdog, ProxyReportsAHoleLeftByAFailedPush) {
  std::vector<uint8_t> region(4096);
  auto fifo = FifoChannel::create_host(0, 2, 50);
  TransportSetup s;
  s.rank = 0;
  s.world_size = 1;
  s.region = RegionInfo{region.data(), region.size(), -1};
  IpcTransport ipc(s, IpcOptions{});
  ipc.connect({ipc.local_info()});
  fifo->push(build_write(0, 0, 1024, 64));
  fifo->push(build_write(0, 0, 2048, 64));
  EXPECT_THROW(fifo->push(build_write(0, 0, 3072, 64)), TimeoutError);  // nobody consumes yet
  std::vector<int64_t> counters(4, 0);
  ProxyOptions o;
  o.num_threads = 1;
  o.timeout_ms = 60000;
  Proxy proxy(o, {fifo.get()}, &ipc, counters.data(), 4);
  proxy.start();
  std::string msg;
  const auto t0 = std::chrono::steady_clock::now();
  while (msg.empty() && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10)) {
    try {
      proxy.check();
    } catch (const TimeoutError& e) {
      msg = e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ASSERT_FALSE(msg.empty()) << "the proxy waited for the hole without a word";
  EXPECT_NE(msg.find("FIFO channel 0: the producer that reserved index 2 gave up"), std::string::npos) << msg;
  EXPECT_EQ(fifo->published_head(), 2u);  // both real commands were executed first
  proxy.stop();
}

}  // namespace
}  // namespace uccl_ep

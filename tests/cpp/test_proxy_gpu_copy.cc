// The ipc transport's GPU copy path, without a GPU: regions flagged as GPU memory (host memory
// underneath) and fake GpuHooks whose copy queues land the bytes only when a copy "completes",
// after a seeded random delay, or never. This is how the device failure of
// test_two_gpu_ipc_traffic[8-8-reorder] looked from the proxy: a copy the GPU did not run while
// the kernels waited for the proxy. Before copy queues, a proxy thread sat inside the blocking
// copy hook, no timeout fired and nothing named the stall; now the thread stays responsive.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "fifo/cmd_builder.h"
#include "fifo/fifo.h"
#include "proxy/proxy.h"
#include "transport/gpu_hooks.h"
#include "transport/ipc_transport.h"

namespace uccl_ep {
namespace {

using Clock = std::chrono::steady_clock;

// ---- fake GPU: one queue per (endpoint, device), used by one proxy thread at a time ----
struct FakeGpu {
  static std::atomic<uint32_t> max_delay_us;  // copy latency drawn from [0, max_delay_us]
  static std::atomic<bool> stall;             // copies never complete
  static std::atomic<bool> block_submit;      // a submission does not return until cleared
  static std::atomic<int> queues_created, queues_destroyed, peer_enables;
  static std::atomic<uint64_t> seed;
  static std::atomic<uint64_t> batches;  // batched submissions of more than one copy
  static void reset(uint32_t delay_us, bool stalled) {
    max_delay_us = delay_us;
    stall = stalled;
    block_submit = false;
    queues_created = 0;
    queues_destroyed = 0;
    peer_enables = 0;
  }
};
std::atomic<uint32_t> FakeGpu::max_delay_us{0};
std::atomic<bool> FakeGpu::stall{false};
std::atomic<bool> FakeGpu::block_submit{false};
std::atomic<int> FakeGpu::queues_created{0}, FakeGpu::queues_destroyed{0}, FakeGpu::peer_enables{0};
std::atomic<uint64_t> FakeGpu::seed{1};
std::atomic<uint64_t> FakeGpu::batches{0};

struct FakeQueue {
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    Clock::time_point due;
    bool last;  // the last copy of its submission (a batch is one submission)
  };
  uint32_t depth;
  std::mt19937_64 rng;
  std::deque<Copy> inflight;  // in submission order, like one CUDA stream
  uint64_t submitted = 0, completed = 0;
};

void* fake_create(int /*device*/, uint32_t depth) {
  ++FakeGpu::queues_created;
  auto* q = new FakeQueue{depth, std::mt19937_64(FakeGpu::seed.fetch_add(1)), {}, 0, 0};
  return q;
}
void fake_destroy(void* q) {
  ++FakeGpu::queues_destroyed;
  delete static_cast<FakeQueue*>(q);
}
// A submission held inside the library call, as a CUDA call can be held behind another thread's
// device-wide wait.
void fake_held() {
  while (FakeGpu::block_submit) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}
uint64_t fake_submit(void* queue, void* dst, const void* src, size_t bytes) {
  fake_held();
  auto* q = static_cast<FakeQueue*>(queue);
  // The transport must respect the depth it asked for (a real event ring would be overrun).
  if (q->submitted - q->completed >= q->depth) {
    UCCL_EP_THROW(InvalidArgument, "fake copy queue overrun: ", q->submitted - q->completed, " in flight, depth ",
                  q->depth);
  }
  const uint32_t d = FakeGpu::max_delay_us.load();
  q->inflight.push_back(
      {dst, src, bytes, Clock::now() + std::chrono::microseconds(d ? q->rng() % (d + 1) : 0), true});
  return ++q->submitted;
}
// A batch is one submission (one ticket, as one cudaMemcpyBatchAsync and its event): its copies
// land one by one, and the ticket completes with the last of them.
uint64_t fake_submit_batch(void* queue, void* const* dst, const void* const* src, const size_t* bytes, size_t n) {
  fake_held();
  auto* q = static_cast<FakeQueue*>(queue);
  if (n == 0 || q->submitted - q->completed >= q->depth) {
    UCCL_EP_THROW(InvalidArgument, "fake copy queue: batch of ", n, " with ", q->submitted - q->completed,
                  " in flight, depth ", q->depth);
  }
  const uint32_t d = FakeGpu::max_delay_us.load();
  for (size_t i = 0; i < n; ++i) {
    const auto due = Clock::now() + std::chrono::microseconds(d ? q->rng() % (d + 1) : 0);
    q->inflight.push_back({dst[i], src[i], bytes[i], due, i + 1 == n});
  }
  ++FakeGpu::batches;
  return ++q->submitted;
}
uint64_t fake_completed(void* queue) {
  auto* q = static_cast<FakeQueue*>(queue);
  if (FakeGpu::stall) return q->completed;
  const auto now = Clock::now();
  // In order: a copy lands (its bytes appear) only when it and every earlier one are due.
  while (!q->inflight.empty() && q->inflight.front().due <= now) {
    const auto& c = q->inflight.front();
    std::memcpy(c.dst, c.src, c.bytes);
    if (c.last) ++q->completed;
    q->inflight.pop_front();
  }
  return q->completed;
}
bool fake_enable_peer(int device, int peer) {
  EXPECT_NE(device, peer);
  ++FakeGpu::peer_enables;
  return true;
}
std::string fake_handle(void*, int) { return "fake"; }

const GpuHooks* fake_hooks() {
  static const GpuHooks h = [] {
    GpuHooks x;
    x.ipc_handle = fake_handle;
    x.copy_queue_create = fake_create;
    x.copy_queue_destroy = fake_destroy;
    x.copy_submit = fake_submit;
    x.copy_completed = fake_completed;
    x.enable_peer_access = fake_enable_peer;
    return x;
  }();
  return &h;
}
// The same with batched submission, as the CUDA build has it.
const GpuHooks* fake_batch_hooks() {
  static const GpuHooks h = [] {
    GpuHooks x = *fake_hooks();
    x.copy_submit_batch = fake_submit_batch;
    return x;
  }();
  return &h;
}

uint8_t pattern(uint32_t rank, uint32_t warp, uint32_t k, uint32_t i) {
  return static_cast<uint8_t>(rank * 131u + warp * 71u + k * 13u + i * 7u + 1u);
}

struct Shape {
  uint32_t world = 2, channels = 8, threads = 8;
  uint32_t warps = 32, msgs = 16, len = 1024;  // the GPU test: 8 blocks x 4 warps
  bool reorder = true;
  uint64_t seed = 7;
  uint32_t copy_delay_us = 50;
  uint32_t copy_queue_depth = 256;
  uint64_t copy_timeout_ms = 10000;
  uint64_t timeout_ms = 20000;
  Ordering ordering = Ordering::kReceiver;
  bool peer_access = true;
  bool batched = false;  // copies submitted in batches (copy_submit_batch)
  bool in_place = false;  // IpcOptions::bytes_in_place: producers store the bytes themselves
  double latency_us = 0;  // IpcOptions::latency_us
};

// Ranks of one process, "GPU" r each (host memory), connected through the ipc transport.
struct GpuWorld {
  Shape s;
  uint64_t area;
  std::vector<std::vector<uint8_t>> regions;
  std::vector<std::vector<std::unique_ptr<FifoChannel>>> fifos;
  std::vector<std::vector<int64_t>> counters;
  std::vector<std::unique_ptr<IpcTransport>> transports;
  std::vector<std::unique_ptr<Proxy>> proxies;

  explicit GpuWorld(const Shape& shape) : s(shape), area(uint64_t{shape.warps} * shape.msgs * shape.len) {
    regions.resize(s.world);
    fifos.resize(s.world);
    counters.resize(s.world);
    std::vector<std::string> infos;
    for (uint32_t r = 0; r < s.world; ++r) {
      regions[r].assign(2 * area, 0);
      counters[r].assign(s.world * s.channels, 0);
      for (uint32_t c = 0; c < s.channels; ++c)
        fifos[r].push_back(FifoChannel::create_host(c, 1024, 2 * s.timeout_ms + 1000));
      TransportSetup t;
      t.rank = r;
      t.world_size = s.world;
      t.num_threads = s.threads;
      t.num_channels = s.channels;
      t.region = RegionInfo{regions[r].data(), regions[r].size(), static_cast<int>(r)};
      IpcOptions o;
      o.reorder = s.reorder;
      o.seed = s.seed;
      o.copy_queue_depth = s.copy_queue_depth;
      o.copy_timeout_ms = s.copy_timeout_ms;
      o.peer_access = s.peer_access;
      o.bytes_in_place = s.in_place;
      o.latency_us = s.latency_us;
      o.gpu = s.batched ? fake_batch_hooks() : fake_hooks();
      transports.push_back(std::make_unique<IpcTransport>(t, o));
      infos.push_back(transports.back()->local_info());
    }
    for (uint32_t r = 0; r < s.world; ++r) {
      transports[r]->connect(infos);
      ProxyOptions po;
      po.rank = r;
      po.world_size = s.world;
      po.num_threads = s.threads;
      po.timeout_ms = s.timeout_ms;
      po.ordering = s.ordering;
      po.ranks_per_node = 0;
      std::vector<FifoChannel*> chans;
      for (auto& f : fifos[r]) chans.push_back(f.get());
      proxies.push_back(std::make_unique<Proxy>(po, chans, transports[r].get(), counters[r].data(),
                                                static_cast<uint32_t>(counters[r].size())));
    }
  }
  ~GpuWorld() {
    for (auto& p : proxies) p->stop();
  }
  void start() {
    for (auto& p : proxies) p->start();
  }
};

class GpuTestTraffic : public ::testing::TestWithParam<std::tuple<uint32_t, uint32_t, bool>> {};

// The shape of tests/gpu/test_two_gpu_ipc_traffic: warp w of rank r fills its slices, pushes
// msgs Write+atomic(+1 on counter r*channels + w%channels) of len bytes to the peer on channel
// w % channels, then Drain(all) and a Barrier, waiting for each. Copies complete late and out of
// step with the immediates' injector; everything must land exactly, with no timeout.
TEST_P(GpuTestTraffic, LandsExactlyWithDeferredCopies) {
  Shape s;
  std::tie(s.channels, s.threads, s.reorder) = GetParam();
  FakeGpu::reset(s.copy_delay_us, false);
  GpuWorld w(s);
  EXPECT_EQ(FakeGpu::queues_created.load(), static_cast<int>(s.world * IpcOptions{}.copy_streams))
      << "copy streams must be created at connect time (copy_streams per rank's NIC), not by the NIC thread";
  EXPECT_EQ(FakeGpu::peer_enables.load(), static_cast<int>(s.world * (s.world - 1)));
  w.start();
  std::vector<std::thread> warps;
  std::atomic<int> failures{0};
  for (uint32_t r = 0; r < s.world; ++r) {
    const uint32_t peer = 1 - r;
    for (uint32_t wp = 0; wp < s.warps; ++wp) {
      warps.emplace_back([&, r, peer, wp] {
        const uint32_t ch = wp % s.channels;
        FifoChannel& f = *w.fifos[r][ch];
        try {
          for (uint32_t k = 0; k < s.msgs; ++k) {
            const uint64_t off = (uint64_t{wp} * s.msgs + k) * s.len;
            for (uint32_t i = 0; i < s.len; ++i) w.regions[r][off + i] = pattern(r, wp, k, i);
            f.push(build_write_atomic(peer, off, w.area + off, s.len, r * s.channels + ch, 1));
          }
          f.wait_completion(f.push(make_drain_all()));
          f.wait_completion(f.push(make_barrier(false)));
        } catch (const Error& e) {
          ADD_FAILURE() << "rank " << r << " warp " << wp << ": " << e.what();
          failures.fetch_add(1);
        }
      });
    }
  }
  for (auto& t : warps) t.join();
  for (auto& p : w.proxies) p->check();
  ASSERT_EQ(failures.load(), 0);
  for (uint32_t r = 0; r < s.world; ++r) {
    const uint32_t peer = 1 - r;
    uint64_t bad = 0;
    for (uint32_t wp = 0; wp < s.warps; ++wp)
      for (uint32_t k = 0; k < s.msgs; ++k)
        for (uint32_t i = 0; i < s.len; ++i)
          bad += w.regions[r][w.area + (uint64_t{wp} * s.msgs + k) * s.len + i] != pattern(peer, wp, k, i);
    EXPECT_EQ(bad, 0u) << "rank " << r << " received bytes differ from rank " << peer << "'s pattern";
    for (uint32_t c = 0; c < s.channels; ++c) {
      uint32_t warps_on_c = 0;
      for (uint32_t wp = 0; wp < s.warps; ++wp) warps_on_c += wp % s.channels == c;
      EXPECT_EQ(w.counters[r][peer * s.channels + c], int64_t{warps_on_c} * s.msgs) << "rank " << r << " ch " << c;
    }
    ProxyStats st = w.proxies[r]->stats();
    EXPECT_EQ(st.writes_posted, uint64_t{s.warps} * s.msgs);
    EXPECT_EQ(st.barriers, s.warps);
    EXPECT_EQ(st.drains, s.warps);
  }
  if (s.reorder) {
    uint64_t held = 0;
    for (auto& p : w.proxies) held += p->stats().held_out_of_order;
    EXPECT_GT(held, 0u) << "the injector did not reorder anything: the test proves nothing";
  }
  w.proxies.clear();
  w.transports.clear();
  EXPECT_EQ(FakeGpu::queues_destroyed.load(), FakeGpu::queues_created.load());
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuTestTraffic,
                         ::testing::Values(std::make_tuple(8u, 8u, true), std::make_tuple(8u, 8u, false),
                                           std::make_tuple(8u, 4u, true), std::make_tuple(4u, 4u, true),
                                           std::make_tuple(1u, 1u, true)),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ch_" +
                                  std::to_string(std::get<1>(info.param)) + "t_" +
                                  (std::get<2>(info.param) ? "reorder" : "inorder");
                         });

// One producer per (rank, channel), so counter v of a stream means its first v writes landed.
// A checker reads counters while the traffic runs. ordering=none with the injector off relies on
// the transport alone: an immediate published before its deferred copy landed is caught here.
// A queue depth of 2 makes nearly every copy wait for a free slot.
void run_ordered_streams(Shape s, uint32_t msgs) {
  s.warps = s.channels;  // warp c pushes on channel c
  s.msgs = msgs;
  s.len = 256;
  FakeGpu::reset(s.copy_delay_us, false);
  GpuWorld w(s);
  w.start();
  std::atomic<bool> done{false};
  std::atomic<uint64_t> violations{0};
  std::vector<std::thread> checkers;
  for (uint32_t r = 0; r < s.world; ++r) {
    checkers.emplace_back([&, r] {
      const uint32_t peer = 1 - r;
      std::vector<uint32_t> verified(s.channels, 0);
      while (true) {
        const bool last = done.load();
        for (uint32_t c = 0; c < s.channels; ++c) {
          const int64_t v = __atomic_load_n(&w.counters[r][peer * s.channels + c], __ATOMIC_ACQUIRE);
          for (uint32_t k = verified[c]; k < v; ++k) {
            const uint8_t* p = w.regions[r].data() + w.area + (uint64_t{c} * s.msgs + k) * s.len;
            for (uint32_t i = 0; i < s.len; ++i) {
              if (__atomic_load_n(p + i, __ATOMIC_RELAXED) != pattern(peer, c, k, i)) {
                violations.fetch_add(1);
                break;
              }
            }
          }
          verified[c] = std::max<uint32_t>(verified[c], static_cast<uint32_t>(v));
        }
        if (last) return;
        std::this_thread::yield();
      }
    });
  }
  std::vector<std::thread> producers;
  for (uint32_t r = 0; r < s.world; ++r) {
    for (uint32_t c = 0; c < s.channels; ++c) {
      producers.emplace_back([&, r, c] {
        FifoChannel& f = *w.fifos[r][c];
        for (uint32_t k = 0; k < s.msgs; ++k) {
          const uint64_t off = (uint64_t{c} * s.msgs + k) * s.len;
          for (uint32_t i = 0; i < s.len; ++i) w.regions[r][off + i] = pattern(r, c, k, i);
          f.push(build_write_atomic(1 - r, off, w.area + off, s.len, r * s.channels + c, 1));
        }
        f.wait_completion(f.push(make_drain_all()));
      });
    }
  }
  for (auto& t : producers) t.join();
  // A completed drain means the immediates were handed to the peers, not yet applied there.
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  auto all_applied = [&] {
    for (uint32_t r = 0; r < s.world; ++r)
      for (uint32_t c = 0; c < s.channels; ++c)
        if (__atomic_load_n(&w.counters[r][(1 - r) * s.channels + c], __ATOMIC_ACQUIRE) < s.msgs) return false;
    return true;
  };
  while (!all_applied() && Clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  done = true;
  for (auto& t : checkers) t.join();
  for (auto& p : w.proxies) p->check();
  EXPECT_EQ(violations.load(), 0u);
  for (uint32_t r = 0; r < s.world; ++r)
    for (uint32_t c = 0; c < s.channels; ++c) EXPECT_EQ(w.counters[r][(1 - r) * s.channels + c], int64_t{s.msgs});
}

TEST(GpuCopyQueue, InOrderTransportPublishesOnlyLandedCopies) {
  Shape s;
  s.channels = 4;
  s.threads = 2;
  s.reorder = false;
  s.ordering = Ordering::kNone;  // the transport's own ordering is all there is
  s.copy_delay_us = 200;
  s.copy_queue_depth = 2;
  run_ordered_streams(s, 120);
}

TEST(GpuCopyQueue, ReceiverOrderingWithReorderAndDeferredCopies) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    SCOPED_TRACE(seed);
    Shape s;
    s.seed = seed;
    s.channels = 4;
    s.threads = 1 + seed % 4;
    s.copy_delay_us = 100;
    s.copy_queue_depth = seed % 2 ? 3 : 256;
    run_ordered_streams(s, 80);
  }
}

// Batched submissions, several copies per ticket spread over the copy streams: a write's
// immediate is still published only after its bytes landed, under RC and under SRD.
TEST(GpuCopyQueue, BatchedCopiesPublishOnlyLandedCopies) {
  for (bool reorder : {false, true}) {
    SCOPED_TRACE(reorder);
    Shape s;
    s.channels = 4;
    s.threads = 2;
    s.reorder = reorder;
    s.ordering = reorder ? Ordering::kReceiver : Ordering::kNone;
    s.copy_delay_us = 200;
    s.copy_queue_depth = 2;
    s.batched = true;
    const uint64_t before = FakeGpu::batches.load();
    run_ordered_streams(s, 120);
    EXPECT_GT(FakeGpu::batches.load(), before) << "no submission carried more than one copy: the test proves nothing";
  }
}

// One 64-byte write from rank 0 to rank 1 and a drain, on one channel and thread, with a 200 ms
// copy timeout: the drain must be released well before the proxy's own timeout (5 s), and the
// error rank 0's proxy recorded is returned (empty: none).
std::string write_released_with_error(bool batched) {
  Shape s;
  s.channels = 1;
  s.threads = 1;
  s.reorder = false;
  s.copy_timeout_ms = 200;
  s.timeout_ms = 5000;
  s.batched = batched;
  GpuWorld w(s);
  w.start();
  FifoChannel& f = *w.fifos[0][0];
  const auto t0 = Clock::now();
  f.push(build_write(1, 0, w.area, 64));
  EXPECT_THROW(f.wait_completion(f.push(make_drain_all())), TimeoutError);
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  EXPECT_LT(waited, 3000) << "the failure was not reported before the proxy's own timeout";
  std::string msg;
  try {
    w.proxies[0]->check();
  } catch (const TransportError& e) {
    msg = e.what();
  }
  FakeGpu::stall = false;  // let teardown drain
  FakeGpu::block_submit = false;
  return msg;
}

// A copy the GPU never runs: the transport names it within copy_timeout_ms, the proxy records
// the error, and the producer waiting on the drain is released instead of hanging.
TEST(GpuCopyQueue, StalledCopyIsReportedNotHung) {
  FakeGpu::reset(0, true);
  const std::string msg = write_released_with_error(false);
  EXPECT_NE(msg.find("GPU copy of 64 bytes to rank 1 (channel 0) has not completed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ipc rank 0 thread 0"), std::string::npos) << msg;
}

// The DMA thread held inside a copy submission: nothing was submitted, so no copy stalls; the NIC
// thread names the held call within copy_timeout_ms, and the producer is released, not hung.
TEST(GpuCopyQueue, DmaThreadHeldInACopyCallIsReportedNotHung) {
  for (const bool batched : {false, true}) {
    SCOPED_TRACE(batched ? "batched" : "one copy per submission");
    FakeGpu::reset(0, false);
    FakeGpu::block_submit = true;
    const std::string msg = write_released_with_error(batched);
    EXPECT_NE(msg.find("ipc rank 0: the NIC model's DMA thread has been inside a GPU copy-stream call"),
              std::string::npos)
        << msg;
  }
}

// Store delivery (UCCL_EP_IPC_DELIVERY=store): the producers store each write's bytes into the
// peer's region themselves, as the internode kernels do over NVLink, and the NIC only times the
// writes. It makes no GPU call once connected: no copy stream exists, and with every GPU call
// held (what a context-synchronizing call of another thread does to copy delivery) the traffic
// still completes. A write's immediate still arrives no sooner than the modelled latency.
TEST(GpuCopyQueue, StoreDeliveryMakesNoGpuCallAndKeepsTheLatency) {
  Shape s;
  s.channels = 4;
  s.threads = 2;
  s.reorder = false;
  s.in_place = true;
  s.latency_us = 2000;
  FakeGpu::reset(0, false);
  FakeGpu::block_submit = true;  // any copy submission would hang here
  GpuWorld w(s);
  EXPECT_EQ(FakeGpu::queues_created.load(), 0) << "store delivery must not create copy streams";
  w.start();
  const uint32_t len = 4096, writes = 64;
  std::vector<std::thread> producers;
  std::atomic<int64_t> earliest_us{INT64_MAX};
  for (uint32_t r = 0; r < s.world; ++r) {
    producers.emplace_back([&, r] {
      const uint32_t peer = 1 - r;
      FifoChannel& f = *w.fifos[r][r % s.channels];
      try {
        for (uint32_t k = 0; k < writes; ++k) {
          const uint64_t off = uint64_t{k} * len;
          for (uint32_t i = 0; i < len; ++i) w.regions[peer][w.area + off + i] = pattern(r, 0, k, i);
          const auto t0 = Clock::now();
          const int64_t* ctr = &w.counters[peer][r * s.channels + r % s.channels];
          f.push(build_write_atomic(peer, off, w.area + off, len, r * s.channels + r % s.channels, 1));
          if (k == 0) {  // the first write's immediate: never before its latency
            while (__atomic_load_n(ctr, __ATOMIC_ACQUIRE) < 1) std::this_thread::yield();
            const auto us = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
            earliest_us.store(us);
          }
        }
        f.wait_completion(f.push(make_drain_all()));
      } catch (const Error& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : producers) t.join();
  for (auto& p : w.proxies) p->check();
  EXPECT_GE(earliest_us.load(), 2000) << "an immediate arrived before the modelled latency";
  for (uint32_t r = 0; r < s.world; ++r) {
    const uint32_t peer = 1 - r;
    // The receiving proxy applies the last atomic on its own thread: wait for it, bounded.
    const int64_t* ctr = &w.counters[r][peer * s.channels + peer % s.channels];
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (__atomic_load_n(ctr, __ATOMIC_ACQUIRE) < int64_t{writes} && Clock::now() < deadline)
      std::this_thread::yield();
    EXPECT_EQ(__atomic_load_n(ctr, __ATOMIC_ACQUIRE), int64_t{writes});
    const IpcNicStats n = w.transports[r]->nic_stats();
    EXPECT_GE(n.writes, uint64_t{writes}) << "every write is still on the modelled wire";
    EXPECT_EQ(n.bytes, uint64_t{writes} * len) << "every write's bytes are still on the modelled wire";
    EXPECT_EQ(n.copies, 0u);
    EXPECT_EQ(n.batches, 0u);
  }
  FakeGpu::block_submit = false;
}

// Every rank must deliver alike: a copying rank would overwrite what a storing peer put in place.
TEST(GpuCopyQueue, MixedDeliveryIsRejectedAtConnect) {
  FakeGpu::reset(0, false);
  std::vector<std::vector<uint8_t>> regions(2, std::vector<uint8_t>(4096));
  std::vector<std::unique_ptr<IpcTransport>> ts;
  std::vector<std::string> infos;
  for (uint32_t r = 0; r < 2; ++r) {
    TransportSetup t;
    t.rank = r;
    t.world_size = 2;
    t.region = RegionInfo{regions[r].data(), regions[r].size(), static_cast<int>(r)};
    IpcOptions o;
    o.gpu = fake_hooks();
    o.bytes_in_place = r == 1;
    ts.push_back(std::make_unique<IpcTransport>(t, o));
    infos.push_back(ts.back()->local_info());
  }
  try {
    ts[0]->connect(infos);
    ADD_FAILURE() << "connect accepted a peer that stores in place while this rank copies";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("set UCCL_EP_IPC_DELIVERY identically on all ranks"), std::string::npos)
        << e.what();
  }
}

// UCCL_EP_IPC_PEER_ACCESS=0: no P2P enabling (the driver stages copies), everything else alike.
TEST(GpuCopyQueue, PeerAccessCanBeLeftOff) {
  Shape s;
  s.channels = 2;
  s.threads = 2;
  s.peer_access = false;
  FakeGpu::reset(0, false);
  GpuWorld w(s);
  EXPECT_EQ(FakeGpu::peer_enables.load(), 0);
  EXPECT_EQ(FakeGpu::queues_created.load(), static_cast<int>(s.world * IpcOptions{}.copy_streams));
}

TEST(GpuCopyQueue, RejectsBadOptions) {
  std::vector<uint8_t> region(64);
  TransportSetup t;
  t.region = RegionInfo{region.data(), region.size(), 0};
  IpcOptions o;
  o.gpu = fake_hooks();
  o.copy_queue_depth = 0;
  EXPECT_THROW(IpcTransport(t, o), InvalidArgument);
  o.copy_queue_depth = 4;
  o.copy_timeout_ms = 0;
  EXPECT_THROW(IpcTransport(t, o), InvalidArgument);
}

}  // namespace
}  // namespace uccl_ep

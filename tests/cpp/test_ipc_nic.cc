// The ipc transport as a NIC model, at the Endpoint level (no proxy): posts return at once,
// the line rate and latency bound when writes arrive and complete, RC keeps post order, and
// injected faults end in TransportError naming rank, QP and completion status.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "transport/ipc_fault.h"
#include "transport/ipc_transport.h"

namespace uccl_ep {
namespace {

using Clock = std::chrono::steady_clock;

// Two ranks of this process, host regions of `bytes` each, one proxy thread.
struct Pair {
  std::vector<std::vector<uint8_t>> regions;
  std::vector<std::unique_ptr<IpcTransport>> t;

  Pair(uint64_t bytes, const IpcOptions& o, uint32_t threads = 1) {
    std::vector<std::string> infos;
    regions.resize(2);
    for (uint32_t r = 0; r < 2; ++r) {
      regions[r].assign(bytes, 0);
      for (uint64_t i = 0; i < bytes; ++i) regions[r][i] = static_cast<uint8_t>(r * 101 + i * 7 + 1);
      TransportSetup s;
      s.rank = r;
      s.world_size = 2;
      s.num_threads = threads;
      s.num_channels = threads;
      s.region = RegionInfo{regions[r].data(), bytes, -1};
      t.push_back(std::make_unique<IpcTransport>(s, o));
      infos.push_back(t.back()->local_info());
    }
    for (auto& x : t) x->connect(infos);
  }
};

// Polls rank r's endpoint until `sends` send and `recvs` receive completions came, at most 10 s.
struct Counted {
  std::vector<Completion> sends, recvs;
  Clock::time_point last_send, last_recv;
};
void drain(Endpoint& ep, Counted& c, size_t sends, size_t recvs) {
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  Completion out[64];
  while (c.sends.size() < sends || c.recvs.size() < recvs) {
    ASSERT_LT(Clock::now(), deadline) << "completions missing: " << c.sends.size() << "/" << sends << " sends, "
                                      << c.recvs.size() << "/" << recvs << " receives";
    const int n = ep.poll(out, 64);
    for (int i = 0; i < n; ++i) {
      if (out[i].kind == Completion::kSend) {
        c.sends.push_back(out[i]);
        c.last_send = Clock::now();
      } else {
        c.recvs.push_back(out[i]);
        c.last_recv = Clock::now();
      }
    }
  }
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

TEST(IpcNic, LineRateBoundsWhenWritesArriveAndBytesLand) {
  IpcOptions o;
  o.link_gbps = 0.5;  // 0.5 GB/s: 4 MiB need >= 8.4 ms on the wire
  const uint32_t kWrites = 64, kLen = 64 << 10;
  Pair p(2ull * kWrites * kLen, o);
  Endpoint& tx = p.t[0]->endpoint(0);
  const auto t0 = Clock::now();
  for (uint32_t i = 0; i < kWrites; ++i) {
    tx.post_write(1, 0, uint64_t{i} * kLen, uint64_t{kWrites + i} * kLen, kLen, 1000 + i, i);
  }
  tx.flush();
  const double post_s = seconds(Clock::now() - t0);
  Counted rx, sx;
  drain(p.t[1]->endpoint(0), rx, 0, kWrites);
  drain(tx, sx, kWrites, 0);
  const double wire_s = kWrites * (kLen + kLen / 4096 * 64.0) / 0.5e9;
  EXPECT_LT(post_s, wire_s / 4) << "posting must not wait for the wire";
  EXPECT_GE(seconds(rx.last_recv - t0), wire_s * 0.999) << "the last write arrived faster than the line rate";
  // RC: immediates in post order; every byte landed before its immediate was seen.
  for (uint32_t i = 0; i < kWrites; ++i) EXPECT_EQ(rx.recvs[i].imm, 1000 + i);
  EXPECT_EQ(0, std::memcmp(p.regions[1].data() + uint64_t{kWrites} * kLen, p.regions[0].data(), kWrites * kLen));
  const IpcNicStats st = p.t[0]->nic_stats();
  EXPECT_EQ(st.writes, kWrites);
  EXPECT_EQ(st.bytes, uint64_t{kWrites} * kLen);
  EXPECT_GE(st.wire_busy_ns, static_cast<uint64_t>(wire_s * 1e9 * 0.999));
}

TEST(IpcNic, TheWireAccountsForItsIdleGapsAndTheWaitsBehindEarlierWrites) {
  IpcOptions o;
  o.link_gbps = 0.25;  // 64 KiB occupy the wire ~264 us
  const uint32_t kBurst = 8, kLen = 64 << 10;
  Pair p(2ull * (kBurst + 1) * kLen, o);
  Endpoint& tx = p.t[0]->endpoint(0);
  const uint64_t half = uint64_t{kBurst + 1} * kLen;
  for (uint32_t i = 0; i < kBurst; ++i) tx.post_write(1, 0, uint64_t{i} * kLen, half + uint64_t{i} * kLen, kLen, i, i);
  tx.flush();
  std::this_thread::sleep_for(std::chrono::milliseconds(80));  // the wire goes idle
  tx.post_write(1, 0, uint64_t{kBurst} * kLen, half + uint64_t{kBurst} * kLen, kLen, kBurst, kBurst);
  tx.flush();
  Counted rx, sx;
  drain(p.t[1]->endpoint(0), rx, 0, kBurst + 1);
  drain(tx, sx, kBurst + 1, 0);
  const IpcNicStats st = p.t[0]->nic_stats();
  const double busy_ns = (kLen + kLen / 4096 * 64.0) / 0.25;
  // The burst went out back to back (posting takes microseconds, a write ~264 us): the k-th
  // write waited for the k before it, ~28 write times in all; then one idle gap of ~79 ms.
  EXPECT_EQ(st.wire_gaps_short, 0u);
  EXPECT_EQ(st.wire_gaps_long, 1u);
  EXPECT_GE(st.wire_idle_long_ns, static_cast<uint64_t>(70e6));
  EXPECT_LE(st.wire_idle_long_ns, static_cast<uint64_t>(2e9));  // a slow machine oversleeps
  EXPECT_GE(st.wire_queue_ns, static_cast<uint64_t>(busy_ns * kBurst * (kBurst - 1) / 2 * 0.95));
  EXPECT_LE(st.wire_queue_ns, static_cast<uint64_t>(busy_ns * kBurst * (kBurst - 1) / 2 + 20e6));
  // The thread's busy passes took the requests and delivered them (each step timed).
  EXPECT_GT(st.busy_passes, 0u);
  EXPECT_GT(st.step_ns[0] + st.step_ns[3], 0u);
}

TEST(IpcNic, LatencyDelaysArrivalAndTheAckFollowsOneLatencyLater) {
  IpcOptions o;
  o.latency_us = 20000;  // 20 ms: far above scheduling noise
  Pair p(4096, o);
  Endpoint& tx = p.t[0]->endpoint(0);
  const auto t0 = Clock::now();
  tx.post_write(1, 0, 0, 1024, 512, 77, 5);
  tx.flush();
  Counted rx, sx;
  drain(p.t[1]->endpoint(0), rx, 0, 1);
  drain(tx, sx, 1, 0);
  EXPECT_GE(seconds(rx.last_recv - t0), 0.020);
  EXPECT_GE(seconds(sx.last_send - t0), 0.040);
  EXPECT_EQ(sx.sends[0].wr_id, 5u);
  EXPECT_EQ(rx.recvs[0].imm, 77u);
  EXPECT_EQ(rx.recvs[0].bytes, 512u);
}

TEST(IpcNic, RetryExceededFailsTheQpNamingRankQpAndStatus) {
  IpcOptions o;
  o.faults = parse_ipc_faults("retry_exceeded:rank=0,qp=0,after=3,detect_ms=5");
  Pair p(1 << 16, o);
  Endpoint& tx = p.t[0]->endpoint(0);
  for (uint32_t i = 0; i < 6; ++i) tx.post_write(1, 0, i * 64, 8192 + i * 64, 64, i, i);
  tx.flush();
  Counted rx;
  drain(p.t[1]->endpoint(0), rx, 0, 3);
  std::string msg;
  Completion out[16];
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (msg.empty() && Clock::now() < deadline) {
    try {
      tx.poll(out, 16);
    } catch (const TransportError& e) {
      msg = e.what();
    }
  }
  EXPECT_NE(msg.find("ipc rank 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("proxy thread 0 -> rank 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("IBV_WC_RETRY_EXC_ERR"), std::string::npos) << msg;
  // Nothing after the failed write reached the peer.
  EXPECT_EQ(p.t[1]->endpoint(0).poll(out, 16), 0);
  EXPECT_EQ(rx.recvs.size(), 3u);
}

TEST(IpcNic, DeadPeerFailsWritesToAndFromIt) {
  IpcOptions o;
  o.faults = parse_ipc_faults("dead_peer:rank=1,after=0,detect_ms=5");
  Pair p(1 << 16, o);
  auto first_error = [](Endpoint& ep) {
    Completion out[16];
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < deadline) {
      try {
        ep.poll(out, 16);
      } catch (const TransportError& e) {
        return std::string(e.what());
      }
    }
    return std::string("(no error)");
  };
  p.t[1]->endpoint(0).post_write(0, 0, 0, 4096, 64, 1, 1);
  p.t[1]->endpoint(0).flush();
  const std::string own = first_error(p.t[1]->endpoint(0));
  EXPECT_NE(own.find("this rank's NIC stopped answering"), std::string::npos) << own;
  p.t[0]->endpoint(0).post_write(1, 0, 0, 4096, 64, 2, 2);
  p.t[0]->endpoint(0).flush();
  const std::string peer = first_error(p.t[0]->endpoint(0));
  EXPECT_NE(peer.find("rank 1 stopped answering"), std::string::npos) << peer;
  EXPECT_NE(peer.find("IBV_WC_RETRY_EXC_ERR"), std::string::npos) << peer;
}

TEST(IpcNic, FaultSpecsAreCheckedAndNamed) {
  EXPECT_EQ(parse_ipc_faults("").size(), 0u);
  EXPECT_EQ(parse_ipc_faults(" retry_exceeded:rank=1,qp=2,peer=0,after=9 ; dead_peer:rank=0,after=5").size(), 2u);
  const auto f = parse_ipc_faults("retry_exceeded:rank=1,qp=2,after=9,detect_ms=7")[0];
  EXPECT_EQ(f.rank, 1u);
  EXPECT_EQ(f.qp, 2);
  EXPECT_EQ(f.after, 9u);
  EXPECT_EQ(f.detect_ms, 7u);
  for (const char* bad : {"flaky:rank=1,after=2", "dead_peer:rank=1", "dead_peer:after=1", "dead_peer:rank=x,after=1",
                          "dead_peer:rank=1,after=-3", "dead_peer:rank=1,after=2,qp=1", "retry_exceeded:rank"}) {
    EXPECT_THROW(parse_ipc_faults(bad), InvalidArgument) << bad;
  }
  // A fault naming a rank or thread the world does not have is refused when the transport is made.
  std::vector<uint8_t> region(64);
  TransportSetup s;
  s.world_size = 2;
  s.region = RegionInfo{region.data(), region.size(), -1};
  IpcOptions o;
  o.faults = parse_ipc_faults("dead_peer:rank=2,after=0");
  EXPECT_THROW(IpcTransport(s, o), InvalidArgument);
  o.faults.clear();
  o.link_gbps = -1;
  EXPECT_THROW(IpcTransport(s, o), InvalidArgument);
}

}  // namespace
}  // namespace uccl_ep

// Two ranks of one process over the ipc transport, one host FIFO channel and one proxy thread
// each, for tests whose rank 0 transport misbehaves: `wrap0` wraps rank 0's ipc transport (one
// that loses or blocks messages); rank 1's is plain.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fifo/fifo.h"
#include "proxy/proxy.h"
#include "transport/ipc_transport.h"

namespace uccl_ep {

struct ProxyPair {
  using Wrap = std::function<std::unique_ptr<Transport>(std::unique_ptr<IpcTransport>)>;

  std::vector<std::vector<uint8_t>> regions{2, std::vector<uint8_t>(4096)};
  std::vector<std::unique_ptr<FifoChannel>> fifos;
  std::vector<std::unique_ptr<Transport>> transports;
  std::vector<int64_t> counters = std::vector<int64_t>(8, 0);  // 4 per rank
  // Last: destroyed (stopped) first, while what its threads use still exists.
  std::vector<std::unique_ptr<Proxy>> proxies;

  ProxyPair(const Wrap& wrap0, uint64_t timeout_ms, uint64_t stop_timeout_ms = ProxyOptions{}.stop_timeout_ms) {
    std::vector<std::string> infos;
    for (uint32_t r = 0; r < 2; ++r) {
      fifos.push_back(FifoChannel::create_host(0, 64, 60000));
      TransportSetup s;
      s.rank = r;
      s.world_size = 2;
      s.region = RegionInfo{regions[r].data(), regions[r].size(), -1};
      auto ipc = std::make_unique<IpcTransport>(s, IpcOptions{});
      infos.push_back(ipc->local_info());
      transports.push_back(r == 0 ? wrap0(std::move(ipc)) : std::move(ipc));
    }
    for (uint32_t r = 0; r < 2; ++r) {
      transports[r]->connect(infos);
      ProxyOptions o;
      o.rank = r;
      o.world_size = 2;
      o.num_threads = 1;
      o.timeout_ms = timeout_ms;
      o.stop_timeout_ms = stop_timeout_ms;  // what the destructor waits
      proxies.push_back(std::make_unique<Proxy>(o, std::vector<FifoChannel*>{fifos[r].get()}, transports[r].get(),
                                                counters.data() + 4 * r, 4));
      proxies.back()->start();
    }
  }
};

}  // namespace uccl_ep

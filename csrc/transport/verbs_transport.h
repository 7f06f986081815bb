// RDMA transport over libibverbs: RC QPs (ConnectX, Broadcom Thor-2, Pollara) or EFA SRD QPs
// (efadv). One QP per (channel, peer) on each side, so a receive completion's QP names its stream;
// channel c's QPs share the CQ of proxy thread c % num_threads. Every message is an RDMA WRITE
// WITH IMMEDIATE (length 0 for atomics and barriers); SRD delivers them unordered and the proxy's
// receiver ordering restores the per-stream order (EFA has no RDMA atomics either: the immediate
// carries the software atomic).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/gpu_hooks.h"
#include "transport/transport.h"
#include "transport/verbs_config.h"
#include "transport/verbs_lib.h"

namespace uccl_ep {

struct VerbsOptions {
  std::string hca;           // UCCL_EP_IB_HCA: allowed devices ("mlx5_0:1,mlx5_1"); empty: all
  int local_index = 0;       // picks device local_index % (#usable devices): the GPU's local rank
  int gid_index = -1;        // UCCL_IB_GID_INDEX
  int64_t sl = 0;            // UCCL_IB_SL
  int64_t tc = 0;            // UCCL_IB_TC
  bool dmabuf = false;       // UCCL_EP_IB_DMABUF: register GPU memory through DMA-BUF
  std::string flavor;        // "", "rc" or "efa" ("" = EFA when the device is EFA)
  uint32_t send_depth = 256;  // send WRs per QP (>= the proxy's per-stream window)
  uint32_t recv_depth = 256;  // receive WRs per QP
  std::string sysfs_root = "/sys";
  const GpuHooks* gpu = nullptr;  // required for GPU regions
};

struct RdmaPortInfo {
  int port = 0;
  std::string state;       // "ACTIVE", "DOWN", ...
  std::string link_layer;  // "InfiniBand" or "Ethernet"
  int active_mtu = 0;      // bytes
  std::vector<GidEntry> gids;
};

struct RdmaDeviceInfo {
  std::string name;
  bool efa = false;
  std::vector<RdmaPortInfo> ports;
};

// Devices libibverbs sees, with port states and GID tables; throws Unsupported without libibverbs.
std::vector<RdmaDeviceInfo> list_rdma_devices(const std::string& sysfs_root = "/sys");

class VerbsTransport : public Transport {
 public:
  VerbsTransport(const TransportSetup& setup, const VerbsOptions& options);
  ~VerbsTransport() override;

  std::string name() const override;
  bool ordered() const override { return flavor_ == QpFlavor::kRc; }
  std::string local_info() const override;
  void connect(const std::vector<std::string>& infos) override;
  Endpoint& endpoint(uint32_t thread) override;
  uint64_t peer_region_bytes(uint32_t peer) const override;

  const std::string& device_name() const { return device_name_; }

  struct Remote {
    uint64_t addr = 0;
    uint32_t rkey = 0;
    uint64_t bytes = 0;
    ibv_ah* ah = nullptr;                  // SRD
    std::vector<uint32_t> qpn_by_channel;  // the peer's QP dedicated to (channel, this rank)
  };
  class VerbsEndpoint;

 private:
  // The QP parameters of this rank's device and port (the remote side left unset).
  QpParams local_qp_params() const;
  uint32_t key(uint32_t channel, uint32_t peer) const { return channel * setup_.world_size + peer; }
  void post_recvs(uint32_t k, uint32_t n);

  TransportSetup setup_;
  VerbsOptions options_;
  const VerbsLib& lib_;
  QpFlavor flavor_ = QpFlavor::kRc;
  std::string device_name_;
  uint8_t port_ = 1;
  bool roce_ = false;
  int gid_index_ = 0;
  uint8_t gid_[16] = {};
  uint16_t lid_ = 0;
  ibv_mtu mtu_ = IBV_MTU_1024;
  uint8_t sl_ = 0, tc_ = 0;
  ibv_context* ctx_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<ibv_cq*> cqs_;   // by thread
  std::vector<ibv_qp*> qps_;   // by key(channel, peer)
  std::vector<ibv_qp_ex*> qpx_;
  std::unordered_map<uint32_t, uint32_t> key_of_qpn_;
  std::vector<Remote> remotes_;
  std::vector<std::unique_ptr<VerbsEndpoint>> endpoints_;
  bool connected_ = false;
};

}  // namespace uccl_ep

// Verbs transport: the device-free paths (HCA list, GID selection from a fake sysfs tree, QP
// attributes, EFA detection, library loading, failure without devices) always run; the loopback
// test needs an RDMA device with an active port and skips with the reason otherwise.
#include <gtest/gtest.h>

#if __has_include(<infiniband/verbs.h>)
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "proxy/imm.h"
#include "transport/verbs_config.h"
#include "transport/verbs_lib.h"
#include "transport/verbs_transport.h"

namespace uccl_ep {
namespace {

class FakeSysfs {
 public:
  FakeSysfs() {
    char tmpl[] = "/tmp/uccl_ep_sysfs_XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  ~FakeSysfs() { std::system(("rm -rf " + root_).c_str()); }
  const std::string& root() const { return root_; }
  void gid(const std::string& dev, int port, int idx, const std::string& gid, const std::string& type) {
    std::string base = root_ + "/class/infiniband/" + dev + "/ports/" + std::to_string(port);
    std::system(("mkdir -p " + base + "/gids " + base + "/gid_attrs/types").c_str());
    std::ofstream(base + "/gids/" + std::to_string(idx)) << gid << "\n";
    std::ofstream(base + "/gid_attrs/types/" + std::to_string(idx)) << type << "\n";
  }

 private:
  std::string root_;
};

const char* kZero = "0000:0000:0000:0000:0000:0000:0000:0000";
const char* kLinkLocal = "fe80:0000:0000:0000:0a00:27ff:fe00:0001";
const char* kV4Mapped = "0000:0000:0000:0000:0000:ffff:0a00:0001";

TEST(VerbsConfig, ParsesHcaList) {
  auto v = parse_hca_list("mlx5_0:1,mlx5_1,,bnxt_re0:2");
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].name, "mlx5_0");
  EXPECT_EQ(v[0].port, 1);
  EXPECT_EQ(v[1].port, 0);
  EXPECT_EQ(v[2].name, "bnxt_re0");
  EXPECT_TRUE(parse_hca_list("").empty());
  EXPECT_THROW(parse_hca_list("mlx5_0:x"), InvalidArgument);
  EXPECT_THROW(parse_hca_list(":1"), InvalidArgument);
  EXPECT_THROW(parse_hca_list("mlx5_0:0"), InvalidArgument);
}

TEST(VerbsConfig, GidSelectionPrefersRoceV2Ipv4) {
  FakeSysfs fs;
  fs.gid("mlx5_0", 1, 0, kLinkLocal, "IB/RoCE v1");
  fs.gid("mlx5_0", 1, 1, kLinkLocal, "RoCE v2");
  fs.gid("mlx5_0", 1, 2, kV4Mapped, "IB/RoCE v1");
  fs.gid("mlx5_0", 1, 3, kV4Mapped, "RoCE v2");
  fs.gid("mlx5_0", 1, 4, kZero, "");
  auto table = read_gid_table(fs.root(), "mlx5_0", 1);
  ASSERT_EQ(table.size(), 5u);
  EXPECT_EQ(table[3].type, "RoCE v2");
  EXPECT_EQ(select_gid_index(table, -1, "mlx5_0"), 3);
  EXPECT_EQ(select_gid_index(table, 0, "mlx5_0"), 0);
  try {
    select_gid_index(table, 4, "mlx5_0");
    FAIL() << "zero GID accepted";
  } catch (const InvalidArgument& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("UCCL_IB_GID_INDEX=4"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[3]"), std::string::npos) << msg;  // lists the alternatives
  }
  EXPECT_THROW(select_gid_index(table, 9, "mlx5_0"), InvalidArgument);
}

TEST(VerbsConfig, GidSelectionFallbacks) {
  FakeSysfs fs;
  fs.gid("mlx5_1", 1, 0, kLinkLocal, "IB/RoCE v1");
  fs.gid("mlx5_1", 1, 1, kLinkLocal, "RoCE v2");
  EXPECT_EQ(select_gid_index(read_gid_table(fs.root(), "mlx5_1", 1), -1, "mlx5_1"), 1);
  fs.gid("ib0", 1, 0, kLinkLocal, "");
  EXPECT_EQ(select_gid_index(read_gid_table(fs.root(), "ib0", 1), -1, "ib0"), 0);
  fs.gid("down0", 1, 0, kZero, "");
  EXPECT_THROW(select_gid_index(read_gid_table(fs.root(), "down0", 1), -1, "down0"), InvalidArgument);
  EXPECT_TRUE(read_gid_table(fs.root(), "absent", 1).empty());
}

TEST(VerbsConfig, GidStringToBytes) {
  uint8_t raw[16];
  gid_from_string(kV4Mapped, raw);
  EXPECT_EQ(raw[10], 0xff);
  EXPECT_EQ(raw[11], 0xff);
  EXPECT_EQ(raw[12], 0x0a);
  EXPECT_EQ(raw[15], 0x01);
  EXPECT_THROW(gid_from_string("fe80::1", raw), InvalidArgument);
  EXPECT_TRUE(gid_is_zero(kZero));
  EXPECT_FALSE(gid_is_zero(kLinkLocal));
}

TEST(VerbsConfig, RcQpTransitions) {
  QpParams p;
  p.port = 2;
  p.roce = true;
  p.gid_index = 3;
  p.sl = 5;
  p.traffic_class = 106;
  p.remote_qpn = 0x1234;
  p.remote_psn = 77;
  p.psn = 99;
  p.mtu = IBV_MTU_4096;
  p.remote_gid[15] = 9;
  QpTransition init = qp_init_attr(p);
  EXPECT_EQ(init.attr.qp_state, IBV_QPS_INIT);
  EXPECT_EQ(init.attr.port_num, 2);
  EXPECT_TRUE(init.mask & IBV_QP_ACCESS_FLAGS);
  EXPECT_TRUE(init.attr.qp_access_flags & IBV_ACCESS_REMOTE_WRITE);
  EXPECT_FALSE(init.mask & IBV_QP_QKEY);
  QpTransition rtr = qp_rtr_attr(p);
  EXPECT_EQ(rtr.attr.qp_state, IBV_QPS_RTR);
  EXPECT_EQ(rtr.attr.dest_qp_num, 0x1234u);
  EXPECT_EQ(rtr.attr.rq_psn, 77u);
  EXPECT_EQ(rtr.attr.path_mtu, IBV_MTU_4096);
  EXPECT_EQ(rtr.attr.ah_attr.is_global, 1);
  EXPECT_EQ(rtr.attr.ah_attr.grh.sgid_index, 3);
  EXPECT_EQ(rtr.attr.ah_attr.grh.traffic_class, 106);
  EXPECT_EQ(rtr.attr.ah_attr.grh.dgid.raw[15], 9);
  EXPECT_EQ(rtr.attr.ah_attr.sl, 5);
  int want = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
  EXPECT_EQ(rtr.mask, want);
  QpTransition rts = qp_rts_attr(p);
  EXPECT_EQ(rts.attr.qp_state, IBV_QPS_RTS);
  EXPECT_EQ(rts.attr.sq_psn, 99u);
  EXPECT_TRUE(rts.mask & IBV_QP_TIMEOUT);
  // InfiniBand link layer: LID routing, no GRH.
  p.roce = false;
  p.remote_lid = 17;
  QpTransition ib = qp_rtr_attr(p);
  EXPECT_EQ(ib.attr.ah_attr.is_global, 0);
  EXPECT_EQ(ib.attr.ah_attr.dlid, 17);
}

TEST(VerbsConfig, SrdQpTransitions) {
  QpParams p;
  p.flavor = QpFlavor::kEfaSrd;
  p.qkey = 0xabc;
  QpTransition init = qp_init_attr(p);
  EXPECT_TRUE(init.mask & IBV_QP_QKEY);
  EXPECT_FALSE(init.mask & IBV_QP_ACCESS_FLAGS);
  EXPECT_EQ(init.attr.qkey, 0xabcu);
  EXPECT_EQ(qp_rtr_attr(p).mask, IBV_QP_STATE);  // no remote binding for SRD
  QpTransition rts = qp_rts_attr(p);
  EXPECT_EQ(rts.mask, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_RNR_RETRY);
}

TEST(VerbsConfig, SlAndTcRanges) {
  EXPECT_EQ(checked_sl(15), 15);
  EXPECT_THROW(checked_sl(16), InvalidArgument);
  EXPECT_THROW(checked_sl(-1), InvalidArgument);
  EXPECT_EQ(checked_tc(255), 255);
  EXPECT_THROW(checked_tc(256), InvalidArgument);
}

TEST(VerbsConfig, EfaDetection) {
  FakeSysfs fs;
  std::string dev = fs.root() + "/class/infiniband/rdmap16s27/device";
  std::system(("mkdir -p " + dev + " " + fs.root() + "/bus/pci/drivers/efa").c_str());
  ASSERT_EQ(::symlink((fs.root() + "/bus/pci/drivers/efa").c_str(), (dev + "/driver").c_str()), 0);
  EXPECT_TRUE(is_efa_device(fs.root(), "rdmap16s27"));
  EXPECT_TRUE(is_efa_device(fs.root(), "efa_0"));
  EXPECT_FALSE(is_efa_device(fs.root(), "mlx5_0"));
  EXPECT_FALSE(efa_installed(fs.root() + "/opt/amazon/efa"));
}

TEST(VerbsLib, LoadsOrExplains) {
  const VerbsLib& v = VerbsLib::get();
  if (v.loaded) {
    EXPECT_NE(v.get_device_list, nullptr);
    EXPECT_NE(v.wc_status_str, nullptr);
    EXPECT_STREQ(v.wc_status_str(IBV_WC_SUCCESS), "success");
  } else {
    EXPECT_FALSE(v.error.empty());
    EXPECT_THROW(VerbsLib::require(), Unsupported);
  }
}

bool have_active_device() {
  if (!VerbsLib::get().loaded) return false;
  for (const auto& d : list_rdma_devices()) {
    for (const auto& p : d.ports) {
      if (p.state == "ACTIVE") return true;
    }
  }
  return false;
}

TEST(VerbsTransport, WithoutDevicesFailsWithAClearReason) {
  if (have_active_device()) GTEST_SKIP() << "an RDMA device is present; covered by the loopback test";
  std::vector<char> region(4096);
  TransportSetup s;
  s.region = RegionInfo{region.data(), region.size(), -1};
  VerbsOptions o;
  try {
    VerbsTransport t(s, o);
    FAIL() << "constructed without an RDMA device";
  } catch (const Unsupported& e) {
    std::string msg = e.what();
    EXPECT_TRUE(msg.find("RDMA device") != std::string::npos || msg.find("libibverbs") != std::string::npos) << msg;
  }
}

// Two ranks in one process over the same NIC: bytes land and immediates arrive per stream.
TEST(VerbsTransport, LoopbackWriteWithImmediate) {
  if (!have_active_device()) GTEST_SKIP() << "needs an RDMA device with an ACTIVE port (none on this machine)";
  constexpr uint32_t kBytes = 1 << 16;
  std::vector<std::vector<uint8_t>> regions(2, std::vector<uint8_t>(kBytes));
  for (uint32_t i = 0; i < kBytes; ++i) regions[0][i] = static_cast<uint8_t>(i * 7 + 3);
  std::vector<std::unique_ptr<VerbsTransport>> t;
  std::vector<std::string> infos;
  for (uint32_t r = 0; r < 2; ++r) {
    TransportSetup s;
    s.rank = r;
    s.world_size = 2;
    s.num_threads = 1;
    s.num_channels = 2;
    s.region = RegionInfo{regions[r].data(), kBytes, -1};
    t.push_back(std::make_unique<VerbsTransport>(s, VerbsOptions{}));
    infos.push_back(t.back()->local_info());
  }
  for (auto& x : t) x->connect(infos);
  t[0]->endpoint(0).post_write(1, 1, 0, 4096, 8192, imm::atomic(0, 5, 3), 42);
  bool sent = false, received = false;
  Completion c[8];
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!(sent && received) && std::chrono::steady_clock::now() < deadline) {
    for (int n = t[0]->endpoint(0).poll(c, 8), i = 0; i < n; ++i) sent |= c[i].kind == Completion::kSend && c[i].wr_id == 42;
    for (int n = t[1]->endpoint(0).poll(c, 8), i = 0; i < n; ++i) {
      if (c[i].kind == Completion::kRecv) {
        EXPECT_EQ(c[i].peer, 0u);
        EXPECT_EQ(c[i].channel, 1u);
        EXPECT_EQ(imm::atomic_index(c[i].imm), 5u);
        received = true;
      }
    }
  }
  ASSERT_TRUE(sent && received) << "no completion within 10 s on " << t[0]->device_name();
  for (uint32_t i = 0; i < 8192; ++i) ASSERT_EQ(regions[1][4096 + i], regions[0][i]);
}

}  // namespace
}  // namespace uccl_ep

#else
TEST(Verbs, HeadersMissing) { GTEST_SKIP() << "built without infiniband/verbs.h (install libibverbs-dev)"; }
#endif

// Device-free parts of the verbs transport: HCA selection, GID selection from sysfs, QP attribute
// construction for the INIT -> RTR -> RTS transitions, EFA detection. Unit-tested without a NIC.
// Only built when infiniband/verbs.h exists (CMake filters verbs*.cc).
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <string>
#include <vector>

namespace uccl_ep {

struct HcaSpec {
  std::string name;
  int port = 0;  // 0: first active port
};

// "mlx5_0:1,mlx5_1" -> [{mlx5_0, 1}, {mlx5_1, 0}]; empty -> []. Throws InvalidArgument.
std::vector<HcaSpec> parse_hca_list(const std::string& s);

struct GidEntry {
  int index = 0;
  std::string gid;   // "fe80:0000:...:0001" as sysfs prints it
  std::string type;  // "IB/RoCE v1", "RoCE v2" or "" (IB)
};

// The GID table of a port from sysfs (<root>/class/infiniband/<dev>/ports/<port>/gids/<i>).
std::vector<GidEntry> read_gid_table(const std::string& sysfs_root, const std::string& device, int port);

// Which GID index to use: `requested` >= 0 must name a non-zero entry; otherwise the first RoCE v2
// IPv4-mapped GID, then the first RoCE v2 GID, then the first non-zero GID (InfiniBand).
// Throws InvalidArgument naming the device and the available entries.
int select_gid_index(const std::vector<GidEntry>& table, int requested, const std::string& device);

bool gid_is_zero(const std::string& gid);
// 16 raw bytes of a sysfs GID string.
void gid_from_string(const std::string& s, uint8_t out[16]);

enum class QpFlavor { kRc, kEfaSrd };

struct QpParams {
  QpFlavor flavor = QpFlavor::kRc;
  uint8_t port = 1;
  bool roce = true;  // Ethernet link layer: address by GID (global route)
  int gid_index = 0;
  uint8_t sl = 0;
  uint8_t traffic_class = 0;
  ibv_mtu mtu = IBV_MTU_4096;
  uint32_t qkey = 0x11111111;
  uint32_t psn = 0;
  // remote side (RC only)
  uint32_t remote_qpn = 0;
  uint16_t remote_lid = 0;
  uint8_t remote_gid[16] = {};
  uint32_t remote_psn = 0;
};

struct QpTransition {
  ibv_qp_attr attr{};
  int mask = 0;
};

QpTransition qp_init_attr(const QpParams& p);
QpTransition qp_rtr_attr(const QpParams& p);
QpTransition qp_rts_attr(const QpParams& p);

// The UCCL_IB_SL / UCCL_IB_TC values checked against the 4-bit SL and 8-bit TC ranges.
uint8_t checked_sl(int64_t v);
uint8_t checked_tc(int64_t v);

// An EFA device: the driver's sysfs name, or an "efa" name prefix; or /opt/amazon/efa installed.
bool is_efa_device(const std::string& sysfs_root, const std::string& device);
bool efa_installed(const std::string& opt_root = "/opt/amazon/efa");

}  // namespace uccl_ep

#include "transport/verbs_config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstring>

#include "common/errors.h"
#include "proxy/text_util.h"

namespace uccl_ep {
namespace {

std::string read_line(const std::string& path) { return text::strip(text::read_first_line(path)); }

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

std::vector<HcaSpec> parse_hca_list(const std::string& s) {
  std::vector<HcaSpec> out;
  for (const std::string& item : text::split(s, ',')) {
    if (item.empty()) continue;
    HcaSpec h;
    size_t colon = item.find(':');
    h.name = item.substr(0, colon);
    UCCL_EP_CHECK_ARG(!h.name.empty(), "UCCL_EP_IB_HCA entry '", item, "' has no device name (use e.g. mlx5_0:1)");
    if (colon != std::string::npos) {
      char* end = nullptr;
      long port = std::strtol(item.c_str() + colon + 1, &end, 10);
      UCCL_EP_CHECK_ARG(*end == '\0' && end != item.c_str() + colon + 1 && port >= 1 && port <= 255,
                        "UCCL_EP_IB_HCA entry '", item, "' has a bad port; use name or name:port with port >= 1");
      h.port = static_cast<int>(port);
    }
    out.push_back(h);
  }
  return out;
}

bool gid_is_zero(const std::string& gid) {
  for (char c : gid) {
    if (c != '0' && c != ':') return false;
  }
  return true;
}

void gid_from_string(const std::string& s, uint8_t out[16]) {
  std::string hex;
  for (char c : s) {
    if (c != ':') hex.push_back(c);
  }
  UCCL_EP_CHECK_ARG(hex.size() == 32, "GID '", s, "' is not 16 bytes");
  for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
}

std::vector<GidEntry> read_gid_table(const std::string& sysfs_root, const std::string& device, int port) {
  std::vector<GidEntry> out;
  const std::string base = sysfs_root + "/class/infiniband/" + device + "/ports/" + std::to_string(port);
  for (int i = 0; i < 256; ++i) {
    std::string gid = read_line(base + "/gids/" + std::to_string(i));
    if (gid.empty()) {
      if (!exists(base + "/gids/" + std::to_string(i))) break;
      continue;
    }
    GidEntry e;
    e.index = i;
    e.gid = gid;
    e.type = read_line(base + "/gid_attrs/types/" + std::to_string(i));
    out.push_back(e);
  }
  return out;
}

int select_gid_index(const std::vector<GidEntry>& table, int requested, const std::string& device) {
  auto listing = [&] {
    std::string s;
    for (const auto& e : table) {
      if (!gid_is_zero(e.gid)) s += detail::concat(" [", e.index, "] ", e.gid, " ", e.type.empty() ? "IB" : e.type, ";");
    }
    return s.empty() ? std::string(" none") : s;
  };
  if (requested >= 0) {
    for (const auto& e : table) {
      if (e.index == requested && !gid_is_zero(e.gid)) return requested;
    }
    UCCL_EP_THROW(InvalidArgument, "UCCL_IB_GID_INDEX=", requested, " is not a populated GID of ", device,
                  "; available:", listing());
  }
  auto is_v2 = [](const GidEntry& e) { return e.type.find("v2") != std::string::npos; };
  auto ipv4_mapped = [](const GidEntry& e) { return e.gid.rfind("0000:0000:0000:0000:0000:ffff:", 0) == 0; };
  for (const auto& e : table) {
    if (!gid_is_zero(e.gid) && is_v2(e) && ipv4_mapped(e)) return e.index;
  }
  for (const auto& e : table) {
    if (!gid_is_zero(e.gid) && is_v2(e)) return e.index;
  }
  for (const auto& e : table) {
    if (!gid_is_zero(e.gid)) return e.index;
  }
  UCCL_EP_THROW(InvalidArgument, "RDMA device ", device, " has no usable GID; available:", listing(),
                " (is the port up and an IP address assigned?)");
}

QpTransition qp_init_attr(const QpParams& p) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_INIT;
  t.attr.pkey_index = 0;
  t.attr.port_num = p.port;
  t.mask = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
  if (p.flavor == QpFlavor::kEfaSrd) {
    // Datagram-like: a QKey instead of access flags.
    t.attr.qkey = p.qkey;
    t.mask |= IBV_QP_QKEY;
  } else {
    t.attr.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    t.mask |= IBV_QP_ACCESS_FLAGS;
  }
  return t;
}

QpTransition qp_rtr_attr(const QpParams& p) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTR;
  t.mask = IBV_QP_STATE;
  if (p.flavor == QpFlavor::kEfaSrd) return t;  // SRD: no remote binding
  t.attr.path_mtu = p.mtu;
  t.attr.dest_qp_num = p.remote_qpn;
  t.attr.rq_psn = p.remote_psn;
  t.attr.max_dest_rd_atomic = 1;
  t.attr.min_rnr_timer = 12;
  t.attr.ah_attr.port_num = p.port;
  t.attr.ah_attr.sl = p.sl;
  t.attr.ah_attr.dlid = p.remote_lid;
  if (p.roce) {
    t.attr.ah_attr.is_global = 1;
    std::memcpy(t.attr.ah_attr.grh.dgid.raw, p.remote_gid, 16);
    t.attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(p.gid_index);
    t.attr.ah_attr.grh.hop_limit = 255;
    t.attr.ah_attr.grh.traffic_class = p.traffic_class;
  }
  t.mask |= IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
            IBV_QP_MIN_RNR_TIMER;
  return t;
}

QpTransition qp_rts_attr(const QpParams& p) {
  QpTransition t;
  t.attr.qp_state = IBV_QPS_RTS;
  t.attr.sq_psn = p.psn;
  t.mask = IBV_QP_STATE | IBV_QP_SQ_PSN;
  if (p.flavor == QpFlavor::kEfaSrd) {
    // SRD retries in hardware; RNR retry lets a receiver that ran out of receive WRs catch up.
    t.attr.rnr_retry = 7;
    t.mask |= IBV_QP_RNR_RETRY;
    return t;
  }
  t.attr.timeout = 14;
  t.attr.retry_cnt = 7;
  t.attr.rnr_retry = 7;
  t.attr.max_rd_atomic = 1;
  t.mask |= IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
  return t;
}

uint8_t checked_sl(int64_t v) {
  UCCL_EP_CHECK_ARG(v >= 0 && v <= 15, "UCCL_IB_SL=", v, " is outside the InfiniBand service levels 0..15");
  return static_cast<uint8_t>(v);
}

uint8_t checked_tc(int64_t v) {
  UCCL_EP_CHECK_ARG(v >= 0 && v <= 255, "UCCL_IB_TC=", v, " is outside the traffic classes 0..255");
  return static_cast<uint8_t>(v);
}

bool is_efa_device(const std::string& sysfs_root, const std::string& device) {
  if (device.rfind("efa", 0) == 0 || device.rfind("rdmap", 0) == 0) {
    // rdmap* names are also used by EFA; confirm through the driver link when present.
    char buf[PATH_MAX];
    std::string link = sysfs_root + "/class/infiniband/" + device + "/device/driver";
    ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
    if (n <= 0) return device.rfind("efa", 0) == 0;
    buf[n] = '\0';
    std::string drv(buf);
    return drv.size() >= 4 && drv.compare(drv.size() - 4, 4, "/efa") == 0;
  }
  return false;
}

bool efa_installed(const std::string& opt_root) { return exists(opt_root); }

}  // namespace uccl_ep

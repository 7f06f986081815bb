#include "transport/verbs_transport.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>

#include "common/errors.h"
#include "common/log.h"
#include "proxy/imm.h"
#include "transport/kv.h"

namespace uccl_ep {
namespace {

constexpr uint32_t kQkey = 0x11111111;

const char* port_state_name(ibv_port_state s) {
  switch (s) {
    case IBV_PORT_ACTIVE:
      return "ACTIVE";
    case IBV_PORT_DOWN:
      return "DOWN";
    case IBV_PORT_INIT:
      return "INIT";
    case IBV_PORT_ARMED:
      return "ARMED";
    default:
      return "OTHER";
  }
}

int mtu_bytes(ibv_mtu m) { return 128 << (static_cast<int>(m) - 1); }

// Verbs return a positive errno (or -1 with errno set); both become a TransportError with context.
#define VERBS_CHECK(expr, ...)                                                                        \
  do {                                                                                                \
    int rc__ = (expr);                                                                                \
    if (rc__ != 0) {                                                                                  \
      int e__ = rc__ > 0 ? rc__ : errno;                                                              \
      UCCL_EP_THROW(TransportError, #expr, " failed: ", std::strerror(e__), " (", __VA_ARGS__, ")"); \
    }                                                                                                 \
  } while (0)

struct DeviceList {
  const VerbsLib& lib;
  ibv_device** list = nullptr;
  int n = 0;
  explicit DeviceList(const VerbsLib& l) : lib(l) { list = lib.get_device_list(&n); }
  ~DeviceList() {
    if (list) lib.free_device_list(list);
  }
};

// The attributes an SRD (ibv_qp_init_attr_ex) and an RC (ibv_qp_init_attr) QP share: one CQ for
// both directions, the configured depths, one scatter-gather entry per work request.
template <class InitAttr>
void set_queues(InitAttr& a, ibv_cq* cq, const VerbsOptions& options) {
  a.send_cq = cq;
  a.recv_cq = cq;
  a.cap.max_send_wr = options.send_depth;
  a.cap.max_recv_wr = options.recv_depth;
  a.cap.max_send_sge = 1;
  a.cap.max_recv_sge = 1;
}

}  // namespace

std::vector<RdmaDeviceInfo> list_rdma_devices(const std::string& sysfs_root) {
  const VerbsLib& lib = VerbsLib::require();
  std::vector<RdmaDeviceInfo> out;
  DeviceList dl(lib);
  for (int i = 0; i < dl.n; ++i) {
    RdmaDeviceInfo d;
    d.name = lib.get_device_name(dl.list[i]);
    d.efa = is_efa_device(sysfs_root, d.name);
    ibv_context* ctx = lib.open_device(dl.list[i]);
    if (!ctx) {
      out.push_back(d);
      continue;
    }
    ibv_device_attr da{};
    if (lib.query_device(ctx, &da) == 0) {
      for (int p = 1; p <= da.phys_port_cnt; ++p) {
        ibv_port_attr pa{};
        if (lib.query_port(ctx, static_cast<uint8_t>(p), &pa) != 0) continue;
        RdmaPortInfo pi;
        pi.port = p;
        pi.state = port_state_name(pa.state);
        pi.link_layer = pa.link_layer == IBV_LINK_LAYER_ETHERNET ? "Ethernet" : "InfiniBand";
        pi.active_mtu = mtu_bytes(pa.active_mtu);
        pi.gids = read_gid_table(sysfs_root, d.name, p);
        d.ports.push_back(pi);
      }
    }
    lib.close_device(ctx);
    out.push_back(d);
  }
  return out;
}

class VerbsTransport::VerbsEndpoint : public Endpoint {
 public:
  VerbsEndpoint(VerbsTransport& t, uint32_t thread) : t_(t), thread_(thread) {}

  void post_write(uint32_t peer, uint32_t channel, uint64_t src_offset, uint64_t dst_offset, uint32_t length,
                  uint32_t imm, uint64_t wr_id) override {
    const uint32_t k = t_.key(channel, peer);
    const Remote& r = t_.remotes_[peer];
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(t_.setup_.region.base) + src_offset;
    sge.length = length;
    sge.lkey = t_.mr_->lkey;
    if (t_.flavor_ == QpFlavor::kEfaSrd) {
      ibv_qp_ex* qx = t_.qpx_[k];
      ibv_wr_start(qx);
      qx->wr_id = wr_id;
      qx->wr_flags = IBV_SEND_SIGNALED;
      ibv_wr_rdma_write_imm(qx, r.rkey, r.addr + dst_offset, htonl(imm));
      ibv_wr_set_ud_addr(qx, r.ah, r.qpn_by_channel[channel], kQkey);
      if (length > 0) {
        ibv_wr_set_sge(qx, sge.lkey, sge.addr, sge.length);
      } else {
        ibv_wr_set_sge_list(qx, 0, nullptr);
      }
      VERBS_CHECK(ibv_wr_complete(qx), "EFA write to rank ", peer, " channel ", channel, " on ", t_.device_name_,
                  "; send queue full? raise UCCL_EP_IB_SEND_DEPTH");
      return;
    }
    ibv_send_wr wr{};
    ibv_send_wr* bad = nullptr;
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = r.addr + dst_offset;
    wr.wr.rdma.rkey = r.rkey;
    wr.sg_list = length > 0 ? &sge : nullptr;
    wr.num_sge = length > 0 ? 1 : 0;
    VERBS_CHECK(ibv_post_send(t_.qps_[k], &wr, &bad), "RC write to rank ", peer, " channel ", channel, " on ",
                t_.device_name_, "; send queue full? raise UCCL_EP_IB_SEND_DEPTH");
  }

  int poll(Completion* out, int max) override {
    ibv_wc wc[64];
    int n = ibv_poll_cq(t_.cqs_[thread_], std::min(max, 64), wc);
    if (n < 0) UCCL_EP_THROW(TransportError, "ibv_poll_cq on ", t_.device_name_, " failed (", n, ")");
    for (int i = 0; i < n; ++i) {
      auto it = t_.key_of_qpn_.find(wc[i].qp_num);
      if (it == t_.key_of_qpn_.end()) {
        UCCL_EP_THROW(TransportError, "completion for unknown QP ", wc[i].qp_num, " on ", t_.device_name_);
      }
      const uint32_t k = it->second;
      const uint32_t channel = k / t_.setup_.world_size;
      const uint32_t peer = k % t_.setup_.world_size;
      if (wc[i].status != IBV_WC_SUCCESS) {
        UCCL_EP_THROW(TransportError, "RDMA completion error on ", t_.device_name_, " with rank ", peer,
                      " channel ", channel, ": ", t_.lib_.wc_status_str(wc[i].status), " (vendor_err ",
                      wc[i].vendor_err, ", opcode ", wc[i].opcode, "); is rank ", peer, " alive and reachable?");
      }
      if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        out[i] = Completion{Completion::kRecv, peer, channel, ntohl(wc[i].imm_data), wc[i].byte_len, 0};
        t_.post_recvs(k, 1);
      } else {
        out[i] = Completion{Completion::kSend, peer, channel, 0, 0, wc[i].wr_id};
      }
    }
    return n;
  }

 private:
  VerbsTransport& t_;
  uint32_t thread_;
};

VerbsTransport::VerbsTransport(const TransportSetup& setup, const VerbsOptions& options)
    : setup_(setup), options_(options), lib_(VerbsLib::require()) {
  UCCL_EP_CHECK_ARG(setup.region.base && setup.region.bytes > 0, "verbs transport needs a region");
  UCCL_EP_CHECK_ARG(setup.num_threads >= 1 && setup.num_channels >= 1, "num_threads=", setup.num_threads,
                    " num_channels=", setup.num_channels);
  UCCL_EP_CHECK_ARG(options.send_depth >= imm::kSeqWindow, "send_depth=", options.send_depth,
                    " must be >= the per-stream window ", imm::kSeqWindow);
  sl_ = checked_sl(options.sl);
  tc_ = checked_tc(options.tc);
  auto allowed = parse_hca_list(options.hca);

  // Usable devices: allowed by UCCL_EP_IB_HCA and with an active port.
  struct Candidate {
    ibv_device* dev;
    std::string name;
    int port;
  };
  std::vector<Candidate> cands;
  DeviceList dl(lib_);
  if (dl.n <= 0) UCCL_EP_THROW(Unsupported, "no RDMA device found (ibv_get_device_list); use UCCL_EP_TRANSPORT=ipc on one host");
  for (int i = 0; i < dl.n; ++i) {
    std::string nm = lib_.get_device_name(dl.list[i]);
    int want_port = 0;
    if (!allowed.empty()) {
      auto it = std::find_if(allowed.begin(), allowed.end(), [&](const HcaSpec& h) { return h.name == nm; });
      if (it == allowed.end()) continue;
      want_port = it->port;
    }
    ibv_context* c = lib_.open_device(dl.list[i]);
    if (!c) continue;
    ibv_device_attr da{};
    int port = 0;
    if (lib_.query_device(c, &da) == 0) {
      for (int p = 1; p <= da.phys_port_cnt && !port; ++p) {
        if (want_port && p != want_port) continue;
        ibv_port_attr pa{};
        if (lib_.query_port(c, static_cast<uint8_t>(p), &pa) == 0 && pa.state == IBV_PORT_ACTIVE) port = p;
      }
    }
    lib_.close_device(c);
    if (port) cands.push_back({dl.list[i], nm, port});
  }
  if (cands.empty()) {
    UCCL_EP_THROW(Unsupported, "no RDMA device with an ACTIVE port", options.hca.empty() ? "" : " among UCCL_EP_IB_HCA=",
                  options.hca, "; check `uccl-ep-megatron doctor` or use UCCL_EP_TRANSPORT=ipc");
  }
  const Candidate& pick = cands[static_cast<size_t>(options.local_index) % cands.size()];
  device_name_ = pick.name;
  port_ = static_cast<uint8_t>(pick.port);
  ctx_ = lib_.open_device(pick.dev);
  if (!ctx_) UCCL_EP_THROW(TransportError, "ibv_open_device(", device_name_, ") failed: ", std::strerror(errno));

  const bool efa = is_efa_device(options.sysfs_root, device_name_);
  if (options.flavor == "efa" || (options.flavor.empty() && efa)) {
    flavor_ = QpFlavor::kEfaSrd;
  } else {
    UCCL_EP_CHECK_ARG(options.flavor.empty() || options.flavor == "rc", "verbs flavor '", options.flavor,
                      "' is unknown; use rc or efa");
    flavor_ = QpFlavor::kRc;
  }
  if (flavor_ == QpFlavor::kEfaSrd) {
    if (!lib_.efa_loaded) UCCL_EP_THROW(Unsupported, device_name_, " is an EFA device but libefa.so.1 did not load");
    efadv_device_attr ea{};
    VERBS_CHECK(lib_.efadv_query_device(ctx_, &ea, sizeof(ea)), "efadv_query_device on ", device_name_);
    if (!(ea.device_caps & kEfaCapsRdmaWrite)) {
      UCCL_EP_THROW(Unsupported, "EFA device ", device_name_,
                    " does not support RDMA write (needs EFA generation 2+ and a recent driver)");
    }
  }

  ibv_port_attr pa{};
  VERBS_CHECK(lib_.query_port(ctx_, port_, &pa), "query port ", int(port_), " of ", device_name_);
  roce_ = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
  lid_ = pa.lid;
  mtu_ = pa.active_mtu;
  // EFA reports an unspecified link layer but addresses by GID like RoCE.
  if (roce_ || flavor_ == QpFlavor::kEfaSrd) {
    gid_index_ = select_gid_index(read_gid_table(options.sysfs_root, device_name_, port_), options.gid_index,
                                  device_name_);
  } else {
    gid_index_ = options.gid_index >= 0 ? options.gid_index : 0;
  }
  ibv_gid g{};
  VERBS_CHECK(lib_.query_gid(ctx_, port_, gid_index_, &g), "query GID ", gid_index_, " of ", device_name_);
  std::memcpy(gid_, g.raw, 16);

  pd_ = lib_.alloc_pd(ctx_);
  if (!pd_) UCCL_EP_THROW(TransportError, "ibv_alloc_pd on ", device_name_, " failed: ", std::strerror(errno));

  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  void* base = setup.region.base;
  const size_t bytes = setup.region.bytes;
  if (setup.region.gpu_device >= 0 && options.dmabuf) {
    UCCL_EP_CHECK_ARG(options.gpu && options.gpu->dmabuf_fd, "UCCL_EP_IB_DMABUF=1 needs a GPU build");
    if (!lib_.reg_dmabuf_mr) UCCL_EP_THROW(Unsupported, "libibverbs lacks ibv_reg_dmabuf_mr (rdma-core >= 34 needed)");
    size_t offset = 0;
    int fd = options.gpu->dmabuf_fd(base, bytes, &offset);
    if (fd < 0) UCCL_EP_THROW(Unsupported, "the GPU driver cannot export a DMA-BUF for the region; unset UCCL_EP_IB_DMABUF");
    mr_ = lib_.reg_dmabuf_mr(pd_, offset, bytes, reinterpret_cast<uint64_t>(base), fd, access);
  } else {
    // Relaxed ordering helps PCIe throughput to GPU memory; retry without where unsupported.
    mr_ = lib_.reg_mr_iova2(pd_, base, bytes, reinterpret_cast<uint64_t>(base), access | IBV_ACCESS_RELAXED_ORDERING);
    if (!mr_) mr_ = lib_.reg_mr_iova2(pd_, base, bytes, reinterpret_cast<uint64_t>(base), access);
  }
  if (!mr_) {
    UCCL_EP_THROW(TransportError, "registering ", bytes, " bytes at ", base, " on ", device_name_, " failed: ",
                  std::strerror(errno),
                  setup.region.gpu_device >= 0 ? " (GPU memory: load nvidia-peermem, or set UCCL_EP_IB_DMABUF=1)" : "");
  }

  // CQs, one per proxy thread, sized for all its QPs.
  ibv_device_attr da{};
  VERBS_CHECK(lib_.query_device(ctx_, &da), "query device ", device_name_);
  const uint32_t world = setup.world_size;
  for (uint32_t t = 0; t < setup.num_threads; ++t) {
    uint32_t chans = 0;
    for (uint32_t c = t; c < setup.num_channels; c += setup.num_threads) ++chans;
    int cqe = static_cast<int>(std::max<uint64_t>(
        64, std::min<uint64_t>(uint64_t{chans} * world * (options.send_depth + options.recv_depth), da.max_cqe)));
    ibv_cq* cq = lib_.create_cq(ctx_, cqe, nullptr, nullptr, 0);
    if (!cq) UCCL_EP_THROW(TransportError, "ibv_create_cq(", cqe, ") on ", device_name_, " failed: ", std::strerror(errno));
    cqs_.push_back(cq);
  }

  // QPs: one per (channel, peer), brought to INIT (RC) or all the way to RTS (SRD has no peer).
  QpParams qp = local_qp_params();
  qp.qkey = kQkey;
  qps_.assign(uint64_t{setup.num_channels} * world, nullptr);
  qpx_.assign(qps_.size(), nullptr);
  for (uint32_t c = 0; c < setup.num_channels; ++c) {
    for (uint32_t p = 0; p < world; ++p) {
      ibv_cq* cq = cqs_[c % setup.num_threads];
      ibv_qp* q = nullptr;
      if (flavor_ == QpFlavor::kEfaSrd) {
        ibv_qp_init_attr_ex ax{};
        ax.qp_type = IBV_QPT_DRIVER;
        set_queues(ax, cq, options);
        ax.pd = pd_;
        ax.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        ax.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
        efadv_qp_init_attr ea{};
        ea.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
        q = lib_.efadv_create_qp_ex(ctx_, &ax, &ea, sizeof(ea));
      } else {
        ibv_qp_init_attr ia{};
        ia.qp_type = IBV_QPT_RC;
        set_queues(ia, cq, options);
        q = lib_.create_qp(pd_, &ia);
      }
      if (!q) {
        UCCL_EP_THROW(TransportError, "creating QP ", c * world + p + 1, " of ", qps_.size(), " on ", device_name_,
                      " failed: ", std::strerror(errno), " (too many QPs? lower channels or ranks per NIC)");
      }
      const uint32_t k = key(c, p);
      qps_[k] = q;
      key_of_qpn_[q->qp_num] = k;
      QpTransition init = qp_init_attr(qp);
      VERBS_CHECK(lib_.modify_qp(q, &init.attr, init.mask), "QP INIT on ", device_name_);
      if (flavor_ == QpFlavor::kEfaSrd) {
        qpx_[k] = lib_.qp_to_qp_ex(q);
        if (!qpx_[k]) UCCL_EP_THROW(TransportError, "ibv_qp_to_qp_ex on ", device_name_, " failed");
        QpTransition rtr = qp_rtr_attr(qp);
        VERBS_CHECK(lib_.modify_qp(q, &rtr.attr, rtr.mask), "SRD QP RTR on ", device_name_);
        QpTransition rts = qp_rts_attr(qp);
        VERBS_CHECK(lib_.modify_qp(q, &rts.attr, rts.mask), "SRD QP RTS on ", device_name_);
      }
      // Receive WRs for incoming write-with-immediate (RC allows posting in INIT).
      post_recvs(k, options.recv_depth);
    }
  }
}

void VerbsTransport::post_recvs(uint32_t k, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    ibv_recv_wr wr{};
    ibv_recv_wr* bad = nullptr;
    wr.wr_id = k;
    wr.sg_list = nullptr;
    wr.num_sge = 0;
    VERBS_CHECK(ibv_post_recv(qps_[k], &wr, &bad), "posting receive WRs on ", device_name_);
  }
}

VerbsTransport::~VerbsTransport() {
  endpoints_.clear();
  for (auto& r : remotes_) {
    if (r.ah) lib_.destroy_ah(r.ah);
  }
  for (auto* q : qps_) {
    if (q) lib_.destroy_qp(q);
  }
  for (auto* cq : cqs_) lib_.destroy_cq(cq);
  if (mr_) lib_.dereg_mr(mr_);
  if (pd_) lib_.dealloc_pd(pd_);
  if (ctx_) lib_.close_device(ctx_);
}

std::string VerbsTransport::name() const {
  return std::string(flavor_ == QpFlavor::kEfaSrd ? "verbs-efa-srd" : "verbs-rc") + ":" + device_name_;
}

std::string VerbsTransport::local_info() const {
  std::map<std::string, std::string> f;
  f["transport"] = flavor_ == QpFlavor::kEfaSrd ? "verbs-efa" : "verbs-rc";
  f["world"] = std::to_string(setup_.world_size);
  f["channels"] = std::to_string(setup_.num_channels);
  f["gid"] = kv::hex(std::string(reinterpret_cast<const char*>(gid_), 16));
  f["lid"] = std::to_string(lid_);
  f["mtu"] = std::to_string(static_cast<int>(mtu_));
  f["addr"] = std::to_string(reinterpret_cast<uint64_t>(setup_.region.base));
  f["rkey"] = std::to_string(mr_->rkey);
  f["bytes"] = std::to_string(setup_.region.bytes);
  std::string qpns;
  for (auto* q : qps_) qpns += (qpns.empty() ? "" : "_") + std::to_string(q->qp_num);
  f["qpns"] = qpns;
  return kv::encode(f);
}

void VerbsTransport::connect(const std::vector<std::string>& infos) {
  const uint32_t world = setup_.world_size;
  UCCL_EP_CHECK_ARG(infos.size() == world, "verbs connect got ", infos.size(), " infos for world_size ", world);
  UCCL_EP_CHECK_ARG(!connected_, "verbs transport is already connected");
  remotes_.resize(world);
  for (uint32_t r = 0; r < world; ++r) {
    const std::string origin = "rank " + std::to_string(r);
    auto f = kv::decode(infos[r]);
    const std::string mine = flavor_ == QpFlavor::kEfaSrd ? "verbs-efa" : "verbs-rc";
    UCCL_EP_CHECK_ARG(kv::get(f, "transport", origin) == mine, origin, " uses '", kv::get(f, "transport", origin),
                      "' but this rank uses '", mine, "'; all ranks need the same NIC kind / UCCL_EP_TRANSPORT");
    UCCL_EP_CHECK_ARG(kv::get_u64(f, "world", origin) == world &&
                          kv::get_u64(f, "channels", origin) == setup_.num_channels,
                      origin, " disagrees on world size or channel count");
    Remote& rm = remotes_[r];
    rm.addr = kv::get_u64(f, "addr", origin);
    rm.rkey = static_cast<uint32_t>(kv::get_u64(f, "rkey", origin));
    rm.bytes = kv::get_u64(f, "bytes", origin);
    std::vector<uint32_t> qpns;
    std::string list = kv::get(f, "qpns", origin);
    size_t pos = 0;
    while (pos <= list.size()) {
      size_t us = list.find('_', pos);
      std::string tok = list.substr(pos, us == std::string::npos ? std::string::npos : us - pos);
      qpns.push_back(static_cast<uint32_t>(std::stoul(tok)));
      if (us == std::string::npos) break;
      pos = us + 1;
    }
    UCCL_EP_CHECK_ARG(qpns.size() == uint64_t{setup_.num_channels} * world, origin, " sent ", qpns.size(),
                      " QP numbers, expected ", uint64_t{setup_.num_channels} * world);
    // The peer's QP for (channel c, peer = this rank).
    for (uint32_t c = 0; c < setup_.num_channels; ++c) rm.qpn_by_channel.push_back(qpns[c * world + setup_.rank]);
    std::string gid = kv::unhex(kv::get(f, "gid", origin));
    QpParams qp = local_qp_params();
    qp.remote_lid = static_cast<uint16_t>(kv::get_u64(f, "lid", origin));
    std::memcpy(qp.remote_gid, gid.data(), 16);
    qp.mtu = static_cast<ibv_mtu>(std::min<uint64_t>(static_cast<uint64_t>(mtu_), kv::get_u64(f, "mtu", origin)));
    if (flavor_ == QpFlavor::kEfaSrd) {
      ibv_ah_attr ah{};
      ah.port_num = port_;
      ah.is_global = 1;
      std::memcpy(ah.grh.dgid.raw, qp.remote_gid, 16);
      ah.grh.sgid_index = static_cast<uint8_t>(gid_index_);
      rm.ah = lib_.create_ah(pd_, &ah);
      if (!rm.ah) UCCL_EP_THROW(TransportError, "ibv_create_ah to ", origin, " on ", device_name_, " failed: ", std::strerror(errno));
      continue;
    }
    for (uint32_t c = 0; c < setup_.num_channels; ++c) {
      ibv_qp* q = qps_[key(c, r)];
      qp.remote_qpn = rm.qpn_by_channel[c];
      QpTransition rtr = qp_rtr_attr(qp);
      VERBS_CHECK(lib_.modify_qp(q, &rtr.attr, rtr.mask), "RC QP RTR to ", origin, " channel ", c, " on ",
                  device_name_, "; check UCCL_IB_GID_INDEX and that both NICs share a subnet");
      QpTransition rts = qp_rts_attr(qp);
      VERBS_CHECK(lib_.modify_qp(q, &rts.attr, rts.mask), "RC QP RTS to ", origin, " channel ", c, " on ",
                  device_name_);
    }
  }
  for (uint32_t t = 0; t < setup_.num_threads; ++t) endpoints_.push_back(std::make_unique<VerbsEndpoint>(*this, t));
  connected_ = true;
  UCCL_EP_LOG(kInfo, "verbs transport rank ", setup_.rank, ": ", name(), " port ", int(port_), " GID index ",
              gid_index_, " QPs ", qps_.size());
}

Endpoint& VerbsTransport::endpoint(uint32_t thread) {
  if (!connected_) UCCL_EP_THROW(InvalidArgument, "verbs transport is not connected");
  UCCL_EP_CHECK_ARG(thread < endpoints_.size(), "proxy thread ", thread, " of ", endpoints_.size());
  return *endpoints_[thread];
}

uint64_t VerbsTransport::peer_region_bytes(uint32_t peer) const {
  UCCL_EP_CHECK_ARG(peer < remotes_.size(), "rank ", peer, " is not a connected peer");
  return remotes_[peer].bytes;
}

QpParams VerbsTransport::local_qp_params() const {
  QpParams qp;
  qp.flavor = flavor_;
  qp.port = port_;
  qp.roce = roce_;
  qp.gid_index = gid_index_;
  qp.sl = sl_;
  qp.traffic_class = tc_;
  return qp;
}

}  // namespace uccl_ep

// libibverbs (and libefa) loaded with dlopen, so the package imports on hosts without RDMA
// (NCCL's ibvwrap pattern). Inline verbs (post_send, poll_cq, ibv_wr_*) dispatch through the
// context's ops table and need no symbol.
#pragma once

#include <infiniband/efadv.h>
#include <infiniband/verbs.h>

#include <string>

namespace uccl_ep {

struct VerbsLib {
  bool loaded = false;
  std::string error;  // why loading failed
  bool efa_loaded = false;

  ibv_device** (*get_device_list)(int*) = nullptr;
  void (*free_device_list)(ibv_device**) = nullptr;
  const char* (*get_device_name)(ibv_device*) = nullptr;
  ibv_context* (*open_device)(ibv_device*) = nullptr;
  int (*close_device)(ibv_context*) = nullptr;
  int (*query_device)(ibv_context*, ibv_device_attr*) = nullptr;
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*) = nullptr;
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context*) = nullptr;
  int (*dealloc_pd)(ibv_pd*) = nullptr;
  ibv_mr* (*reg_mr_iova2)(ibv_pd*, void*, size_t, uint64_t, unsigned int) = nullptr;
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd*, uint64_t, size_t, uint64_t, int, int) = nullptr;  // optional
  int (*dereg_mr)(ibv_mr*) = nullptr;
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int) = nullptr;
  int (*destroy_cq)(ibv_cq*) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*) = nullptr;
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int) = nullptr;
  int (*destroy_qp)(ibv_qp*) = nullptr;
  ibv_ah* (*create_ah)(ibv_pd*, ibv_ah_attr*) = nullptr;
  int (*destroy_ah)(ibv_ah*) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status) = nullptr;
  ibv_qp_ex* (*qp_to_qp_ex)(ibv_qp*) = nullptr;
  // libefa (optional)
  ibv_qp* (*efadv_create_qp_ex)(ibv_context*, ibv_qp_init_attr_ex*, efadv_qp_init_attr*, uint32_t) = nullptr;
  int (*efadv_query_device)(ibv_context*, efadv_device_attr*, uint32_t) = nullptr;

  // Loads once per process; never throws (check `loaded`).
  static const VerbsLib& get();
  // Throws Unsupported with the loader's reason when libibverbs is unavailable.
  static const VerbsLib& require();
};

// rdma-core >= 45 reports RDMA write support of EFA with this capability bit; older headers (such
// as Debian's) lack the enumerator.
constexpr uint32_t kEfaCapsRdmaWrite = 1u << 3;

}  // namespace uccl_ep

#include "transport/verbs_lib.h"

#include <dlfcn.h>

#include "common/errors.h"

namespace uccl_ep {
namespace {

template <typename T>
bool load(void* handle, const char* name, T& fn, std::string& error, bool required = true) {
  fn = reinterpret_cast<T>(::dlsym(handle, name));
  if (!fn && required && error.empty()) error = std::string("libibverbs lacks ") + name;
  return fn != nullptr;
}

VerbsLib load_all() {
  VerbsLib v;
  void* h = ::dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    const char* e = ::dlerror();
    v.error = std::string("cannot load libibverbs.so.1 (install rdma-core / libibverbs1): ") + (e ? e : "");
    return v;
  }
  load(h, "ibv_get_device_list", v.get_device_list, v.error);
  load(h, "ibv_free_device_list", v.free_device_list, v.error);
  load(h, "ibv_get_device_name", v.get_device_name, v.error);
  load(h, "ibv_open_device", v.open_device, v.error);
  load(h, "ibv_close_device", v.close_device, v.error);
  load(h, "ibv_query_device", v.query_device, v.error);
  load(h, "ibv_query_port", v.query_port, v.error);
  load(h, "ibv_query_gid", v.query_gid, v.error);
  load(h, "ibv_alloc_pd", v.alloc_pd, v.error);
  load(h, "ibv_dealloc_pd", v.dealloc_pd, v.error);
  load(h, "ibv_reg_mr_iova2", v.reg_mr_iova2, v.error);
  load(h, "ibv_reg_dmabuf_mr", v.reg_dmabuf_mr, v.error, /*required=*/false);
  load(h, "ibv_dereg_mr", v.dereg_mr, v.error);
  load(h, "ibv_create_cq", v.create_cq, v.error);
  load(h, "ibv_destroy_cq", v.destroy_cq, v.error);
  load(h, "ibv_create_qp", v.create_qp, v.error);
  load(h, "ibv_modify_qp", v.modify_qp, v.error);
  load(h, "ibv_destroy_qp", v.destroy_qp, v.error);
  load(h, "ibv_create_ah", v.create_ah, v.error);
  load(h, "ibv_destroy_ah", v.destroy_ah, v.error);
  load(h, "ibv_wc_status_str", v.wc_status_str, v.error);
  load(h, "ibv_qp_to_qp_ex", v.qp_to_qp_ex, v.error);
  v.loaded = v.error.empty();
  if (void* e = ::dlopen("libefa.so.1", RTLD_NOW | RTLD_GLOBAL)) {
    std::string efa_err;
    load(e, "efadv_create_qp_ex", v.efadv_create_qp_ex, efa_err);
    load(e, "efadv_query_device", v.efadv_query_device, efa_err);
    v.efa_loaded = efa_err.empty();
  }
  return v;
}

}  // namespace

const VerbsLib& VerbsLib::get() {
  static const VerbsLib lib = load_all();
  return lib;
}

const VerbsLib& VerbsLib::require() {
  const VerbsLib& v = get();
  if (!v.loaded) UCCL_EP_THROW(Unsupported, v.error);
  return v;
}

}  // namespace uccl_ep

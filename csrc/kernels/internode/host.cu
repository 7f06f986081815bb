// Host side of the internode kernels: the status words, the validation of a launch's common
// fields, and the explicit kernel loading (preload_kernels).
#include <cstring>

#include "common/errors.h"
#include "kernels/internode/plumbing.cuh"

#if !defined(UCCL_EP_DEVICE_HIP)
#include <cuda.h>
#endif

namespace uccl_ep::internode {

// The intranode host block: the status words (kStatusWords <= kStatusFlagWord of the internode
// layout), the device flag's address, and a readback region the internode path leaves unused.
static_assert(kStatusWords <= kernels::kStatusFlagWord, "internode status words overlap the flag address");

intptr_t status_alloc() { return kernels::host_status_alloc(); }

void status_free(intptr_t ptr) { kernels::host_status_free(ptr); }

std::vector<int64_t> status_read(intptr_t ptr) {
  const volatile int64_t* w = reinterpret_cast<const volatile int64_t*>(ptr);
  std::vector<int64_t> out(kStatusWords);
  for (int i = 0; i < kStatusWords; ++i) out[i] = w[i];
  return out;
}

namespace detail {

DevCommon make_common(const Common& c) {
  UCCL_EP_CHECK_ARG(c.ranks_per_node >= 1 && c.ranks_per_node <= kMaxLocal && c.num_ranks % c.ranks_per_node == 0,
                    "ranks_per_node=", c.ranks_per_node, " must be in [1, ", kMaxLocal, "] and divide num_ranks=",
                    c.num_ranks);
  const int nodes = c.num_ranks / c.ranks_per_node;
  UCCL_EP_CHECK_ARG(nodes >= 2 && nodes <= kMaxNodes, "internode kernels need 2..", kMaxNodes, " nodes, got ", nodes);
  UCCL_EP_CHECK_ARG(c.num_channels >= 1 && c.num_channels <= kMaxChannels, "num_channels=", c.num_channels,
                    " must be in [1, ", kMaxChannels, "] (Config.num_sms / 2)");
  UCCL_EP_CHECK_ARG(c.num_fifos >= 1 && c.fifo_handles && c.counters && c.state && c.region && c.status,
                    "internode launch without FIFO handles, counters, state, region or status");
  UCCL_EP_CHECK_ARG(static_cast<int>(c.nvl.size()) == c.ranks_per_node, "nvl buffers: ", c.nvl.size(),
                    " for ", c.ranks_per_node, " local ranks");
  UCCL_EP_CHECK_ARG(c.cap >= 1 && c.chunk >= 1 && c.chunk <= c.cap, "ring cap=", c.cap, " chunk=", c.chunk);
  DevCommon d{};
  d.rank = c.rank;
  d.num_ranks = c.num_ranks;
  d.L = c.ranks_per_node;
  d.N = nodes;
  d.node = c.rank / c.ranks_per_node;
  d.local = c.rank % c.ranks_per_node;
  d.C = c.num_channels;
  d.fifos = reinterpret_cast<const FifoDeviceHandle*>(c.fifo_handles);
  d.num_fifos = c.num_fifos;
  d.counters = reinterpret_cast<int64_t*>(c.counters);
  d.state = reinterpret_cast<int64_t*>(c.state);
  d.region = reinterpret_cast<uint8_t*>(c.region);
  for (int j = 0; j < c.ranks_per_node; ++j) d.nvl[j] = reinterpret_cast<uint8_t*>(c.nvl[j]);
  UCCL_EP_CHECK_ARG(c.remote.empty() || static_cast<int>(c.remote.size()) == nodes, "remote regions: ",
                    c.remote.size(), " for ", nodes, " nodes (one per node, or none)");
  for (size_t n = 0; n < c.remote.size(); ++n) {
    UCCL_EP_CHECK_ARG(c.remote[n] != 0, "remote region of node ", n, " is null");
    d.remote[n] = reinterpret_cast<uint8_t*>(c.remote[n]);
  }
  UCCL_EP_CHECK_ARG(c.arenas.empty() || static_cast<int>(c.arenas.size()) == c.ranks_per_node, "arenas: ",
                    c.arenas.size(), " for ", c.ranks_per_node, " local ranks (one per local rank, or none)");
  for (size_t j = 0; j < c.arenas.size(); ++j) d.arena[j] = reinterpret_cast<uint8_t*>(c.arenas[j]);
  d.cap = c.cap;
  d.chunk = c.chunk;
  d.status = kernels::status_ref(c.status);
  d.timeout_ns = static_cast<uint64_t>(c.timeout_ns);
  d.verdict = reinterpret_cast<const int64_t*>(c.verdict);
  d.trace = reinterpret_cast<uint64_t*>(c.trace);
  return d;
}

kernels::Peers peers_of(const DevCommon& d) {
  kernels::Peers b{};
  for (int j = 0; j < d.L; ++j) b.p[j] = d.nvl[j];
  return b;
}

int grid_for(int rows, int warps_per_block) {
  int g = (rows + warps_per_block - 1) / warps_per_block;
  return g < 1 ? 1 : (g > 132 ? 132 : g);
}

void load_kernels(const std::vector<const void*>& kernels) {
#if !defined(UCCL_EP_DEVICE_HIP)
  // cuFuncLoad (driver >= 12.4) loads a function explicitly; through the runtime's entry-point
  // query, so the library needs no link against libcuda. Attribute queries also load it.
  using FuncLoad = CUresult (*)(CUfunction);
  static const FuncLoad func_load = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuFuncLoad", &fn, 12040, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      return static_cast<FuncLoad>(nullptr);
    }
    return reinterpret_cast<FuncLoad>(fn);
  }();
#endif
  for (const void* k : kernels) {
#if defined(UCCL_EP_DEVICE_HIP)
    hipFuncAttributes attr;
    GPU_CHECK(hipFuncGetAttributes(&attr, k));
#else
    cudaFuncAttributes attr;
    GPU_CHECK(cudaFuncGetAttributes(&attr, k));
    if (func_load != nullptr) {
      cudaFunction_t f = nullptr;
      GPU_CHECK(cudaGetFuncBySymbol(&f, k));
      const CUresult r = func_load(reinterpret_cast<CUfunction>(f));
      if (r != CUDA_SUCCESS) {
        UCCL_EP_THROW(GpuError, "cuFuncLoad of an internode kernel failed: CUresult ", static_cast<int>(r));
      }
    }
#endif
  }
}

}  // namespace detail

void preload_kernels() {
  for (const auto& group : {detail::dispatch_kernels(), detail::combine_kernels(), detail::barrier_kernels(),
                             detail::tables_kernels(), detail::checks_kernels()}) {
    detail::load_kernels(group);
  }
}

}  // namespace uccl_ep::internode

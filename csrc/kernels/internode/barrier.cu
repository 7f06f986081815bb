// The node's NVLink steps around the ring kernels: the barrier among a node's ranks, and the
// staging of a combine input outside this rank's arena, where its node peers read it.
#include "common/errors.h"
#include "kernels/internode/plumbing.cuh"

namespace uccl_ep::internode {
namespace detail {
namespace {

struct StageDev {
  const uint8_t* x;
  const float* w;
  int K;
  const int* recv_count;  // rows actually received (the rest of x is padding)
  int64_t row_bytes;
  CombineSlot cs;
  uint8_t* stage;
};

__global__ void __launch_bounds__(kBarrierThreads) combine_stage_kernel(StageDev s) {
  const int lane = threadIdx.x % dev::kWarpSize;
  constexpr int kW = kBarrierThreads / dev::kWarpSize;
  const int gw = blockIdx.x * kW + threadIdx.x / dev::kWarpSize, nw = gridDim.x * kW;
  const int rows = *s.recv_count;
  for (int r = gw; r < rows; r += nw) {
    uint8_t* row = s.stage + static_cast<int64_t>(r) * s.cs.bytes;
    uint8_t* d[1] = {row + s.cs.x};
    warp_copy(d, 1, s.x + static_cast<int64_t>(r) * s.row_bytes, s.row_bytes, lane);
    for (int k = lane; k < s.K; k += dev::kWarpSize)
      reinterpret_cast<float*>(row + s.cs.weights)[k] = s.w[static_cast<int64_t>(r) * s.K + k];
  }
  // The rows are in place for the peers at the kernel boundary: the combine kernel after it
  // publishes this rank's placement (exchange_place) only then.
}

__global__ void __launch_bounds__(kBarrierThreads) node_barrier_kernel(kernels::Peers bufs, int local, int L,
                                                                        uint64_t seq, kernels::StatusRef status,
                                                                        int64_t timeout_ns) {
  kernels::barrier_block(bufs, local, L, seq, true, status, timeout_ns, kSiteNvlBarrier);
}

}  // namespace

std::vector<const void*> barrier_kernels() {
  return {reinterpret_cast<const void*>(combine_stage_kernel), reinterpret_cast<const void*>(node_barrier_kernel)};
}

}  // namespace detail

void node_barrier(const Common& c, uint64_t barrier_seq, intptr_t stream) {
  const detail::DevCommon d = detail::make_common(c);
  detail::node_barrier_kernel<<<1, detail::kBarrierThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      detail::peers_of(d), d.local, d.L, barrier_seq, d.status, c.timeout_ns);
  GPU_CHECK(gpuGetLastError());
}

void combine_stage(const CombineArgs& a, intptr_t stream) {
  const detail::DevCommon d = detail::make_common(a.common);
  if (a.num_recv <= 0) return;
  UCCL_EP_CHECK_ARG(a.recv_count != 0, "combine_stage without its recv_count");
  detail::StageDev sd{};
  sd.x = reinterpret_cast<const uint8_t*>(a.x);
  sd.w = reinterpret_cast<const float*>(a.topk_weights);
  sd.K = a.topk_weights ? a.num_topk : 0;
  sd.recv_count = reinterpret_cast<const int*>(a.recv_count);
  sd.row_bytes = a.row_bytes;
  sd.cs = combine_slot(a.row_bytes, a.num_topk);
  sd.stage = d.nvl[d.local] + a.stage_offset;
  constexpr int kWarpsPerBlock = detail::kBarrierThreads / dev::kWarpSize;
  // The combine kernel after it on the stream tells the node peers the rows are in place.
  detail::combine_stage_kernel<<<detail::grid_for(a.num_recv, kWarpsPerBlock), detail::kBarrierThreads, 0,
                                 reinterpret_cast<gpuStream_t>(stream)>>>(sd);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::internode

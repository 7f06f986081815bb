// Intranode notify's own kernel (the device side is notify.cuh) and its parameters.
#include <cstdint>

#include "kernels/notify.cuh"

namespace uccl_ep::kernels {

namespace {

constexpr int kNotifyThreads = 1024;

__global__ void __launch_bounds__(kNotifyThreads) notify_kernel(NotifyParams q) {
  // notify's own blocks first (notify_blocks), then the scan blocks, which read slices of the
  // checked inputs for block 0.
  const int block = static_cast<int>(blockIdx.x);
  if (block >= notify_blocks(q))
    notify_detail::scan_slices<kNotifyThreads>(q);
  else
    notify_block<kNotifyThreads>(q, block);
}

}  // namespace

NotifyParams notify_params(const NotifyArgs& a) {
  UCCL_EP_CHECK_ARG(a.recv_entry.empty() || a.recv_entry.size() == kRecvEntryArgs, "recv_entry has ",
                    a.recv_entry.size(), " words; expected ", kRecvEntryArgs, " or none");
  UCCL_EP_CHECK_ARG(a.experts_per_rank <= kMaxLocalExperts, "experts_per_rank=", a.experts_per_rank,
                    " exceeds the kernels' limit of ", kMaxLocalExperts, " local experts");
  UCCL_EP_CHECK_ARG(a.expert_alignment >= 1, "expert_alignment=", a.expert_alignment, " must be >= 1");
  NotifyParams q{};
  q.bufs = make_peers(a.buffers, a.num_ranks);
  q.rank = a.rank;
  q.num_ranks = a.num_ranks;
  q.per_rank = reinterpret_cast<const int*>(a.num_tokens_per_rank);
  q.per_expert = reinterpret_cast<const int*>(a.num_tokens_per_expert);
  q.experts_per_rank = a.experts_per_rank;
  q.alignment = a.expert_alignment;
  q.info = reinterpret_cast<int*>(a.out_info);
  q.status = status_ref(a.status);
  q.timeout_ns = a.timeout_ns;
  q.in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
  q.num_tokens = a.num_tokens;
  q.send_pos = reinterpret_cast<int*>(a.send_pos);
  q.topk_idx = reinterpret_cast<const void*>(a.topk_idx);
  q.idx_is_64 = a.idx_is_64;
  q.num_topk = a.num_topk;
  q.readback = reinterpret_cast<int64_t*>(a.readback);
  q.num_worst_tokens = a.num_worst_tokens;
  q.num_experts = a.num_experts;
  q.header = a.header;
  q.entry.on = !a.recv_entry.empty();
  for (size_t i = 0; i < a.recv_entry.size(); ++i) q.entry.w[i] = a.recv_entry[i];
  return q;
}

void intranode_notify(const NotifyArgs& a, intptr_t stream) {
  NotifyParams q = notify_params(a);
  q.scan_blocks = q.scan_claimers = notify_scan_blocks(q);
  notify_kernel<<<notify_blocks(q) + q.scan_blocks, kNotifyThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(q);
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

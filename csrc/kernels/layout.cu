// get_dispatch_layout: per-rank / per-expert token counts and the token->rank mask, one
// thread per token, counts aggregated in shared memory before one global atomic per block.
#include "kernels/common.cuh"

namespace uccl_ep::kernels {
namespace {

constexpr int kLayoutThreads = 256;
// Experts counted in shared memory (32 KB, under the default 48 KB limit); more experts fall
// back to global atomics.
constexpr int kSharedExpertLimit = 8192;

__global__ void __launch_bounds__(kLayoutThreads) layout_kernel(const void* topk_idx, bool idx_is_64, int num_tokens,
                                                                int num_topk, int num_ranks, int num_experts,
                                                                int* per_rank, int* per_expert, bool* in_rank) {
  extern __shared__ int s_counts[];  // [num_ranks] then [num_experts] when shared_experts
  const bool shared_experts = num_experts <= kSharedExpertLimit;
  const int n_shared = num_ranks + (shared_experts ? num_experts : 0);
  for (int i = threadIdx.x; i < n_shared; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();
  int* s_rank = s_counts;
  int* s_expert = s_counts + num_ranks;
  const int experts_per_rank = num_experts / num_ranks;

  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < num_tokens) {
    unsigned mask = 0;
    for (int k = 0; k < num_topk; ++k) {
      const int64_t i = static_cast<int64_t>(t) * num_topk + k;
      const int64_t e = idx_is_64 ? static_cast<const int64_t*>(topk_idx)[i]
                                  : static_cast<int64_t>(static_cast<const int32_t*>(topk_idx)[i]);
      // Ids outside [0, E) count nowhere (the host raises for them at the dispatch's sync).
      if (e < 0 || e >= num_experts) continue;
      atomicAdd(shared_experts ? &s_expert[e] : &per_expert[e], 1);
      mask |= 1u << static_cast<int>(e / experts_per_rank);
    }
    for (int r = 0; r < num_ranks; ++r) {
      const bool in = mask >> r & 1u;
      in_rank[static_cast<int64_t>(t) * num_ranks + r] = in;
      if (in) atomicAdd(&s_rank[r], 1);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_shared; i += blockDim.x) {
    const int v = s_counts[i];
    if (v == 0) continue;
    if (i < num_ranks) {
      atomicAdd(&per_rank[i], v);
    } else {
      atomicAdd(&per_expert[i - num_ranks], v);
    }
  }
}

}  // namespace

void get_dispatch_layout(intptr_t topk_idx, bool idx_is_64, int num_tokens, int num_topk, int num_ranks,
                         int num_experts, intptr_t num_tokens_per_rank, intptr_t num_tokens_per_expert,
                         intptr_t is_token_in_rank, intptr_t stream) {
  UCCL_EP_CHECK_ARG(num_ranks >= 1 && num_ranks <= 32, "num_ranks=", num_ranks, " must be in 1..32");
  UCCL_EP_CHECK_ARG(num_experts % num_ranks == 0, "num_experts=", num_experts, " not divisible by ", num_ranks);
  auto s = reinterpret_cast<gpuStream_t>(stream);
  GPU_CHECK(gpuMemsetAsync(reinterpret_cast<void*>(num_tokens_per_rank), 0, sizeof(int) * num_ranks, s));
  GPU_CHECK(gpuMemsetAsync(reinterpret_cast<void*>(num_tokens_per_expert), 0, sizeof(int) * num_experts, s));
  if (num_tokens == 0) return;
  const int blocks = (num_tokens + kLayoutThreads - 1) / kLayoutThreads;
  const size_t smem = sizeof(int) * (num_ranks + (num_experts <= kSharedExpertLimit ? num_experts : 0));
  layout_kernel<<<blocks, kLayoutThreads, smem, s>>>(
      reinterpret_cast<const void*>(topk_idx), idx_is_64, num_tokens, num_topk, num_ranks, num_experts,
      reinterpret_cast<int*>(num_tokens_per_rank), reinterpret_cast<int*>(num_tokens_per_expert),
      reinterpret_cast<bool*>(is_token_in_rank));
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

// SwiGLU x routing probability in one pass each way (see glu.h). One warp per row; each lane
// moves 8 bf16 values of the gate and the linear half (and of the output) as 16-byte vectors.
#include <initializer_list>

#include "kernels/common.cuh"
#include "kernels/glu.h"

namespace uccl_ep::kernels {
namespace {

using Bf = Elt<0>;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / dev::kWarpSize;
constexpr int kVec = 8;  // bf16 values per 16 bytes
constexpr int64_t kMaxGridBlocks = 65535;

__device__ __forceinline__ float round_bf16(float x) { return Bf::to_f(Bf::from_f(x)); }

// torch's SiLU for bf16: x / (1 + exp(-x)) in float32, rounded to bf16.
__device__ __forceinline__ float silu_bf16(float x) { return round_bf16(x / (1.0f + expf(-x))); }

// The rows this launch computes (the rest are padding); every warp reads the bound itself.
__device__ __forceinline__ int64_t live_rows(const int* bound, int64_t rows) {
  if (bound == nullptr) return rows;
  const int64_t b = *bound;
  return b < 0 ? 0 : (b < rows ? b : rows);
}

__device__ __forceinline__ void unpack(const int4& v, float (&f)[kVec]) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int q = 0; q < kVec / 2; ++q) {
    const float2 p = Bf::to_f2(w[q]);
    f[2 * q] = p.x;
    f[2 * q + 1] = p.y;
  }
}

__device__ __forceinline__ int4 pack(const float (&f)[kVec]) {
  int4 v;
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int q = 0; q < kVec / 2; ++q) w[q] = Bf::from_f2(f[2 * q], f[2 * q + 1]);
  return v;
}

__global__ void __launch_bounds__(kThreads)
    glu_forward_kernel(const uint16_t* __restrict__ h, const float* __restrict__ probs, const int* bound,
                       int64_t rows, int64_t ffn, uint16_t* __restrict__ out) {
  const int lane = threadIdx.x % dev::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t live = live_rows(bound, rows);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / dev::kWarpSize; r < live; r += warps) {
    uint16_t* o = out + r * ffn;
    const float p = probs[r];
    const int4* gate = reinterpret_cast<const int4*>(h + r * 2 * ffn);
    const int4* lin = reinterpret_cast<const int4*>(h + r * 2 * ffn + ffn);
    for (int64_t c = lane; c < ffn / kVec; c += dev::kWarpSize) {
      float g[kVec], l[kVec], y[kVec];
      unpack(gate[c], g);
      unpack(lin[c], l);
#pragma unroll
      for (int e = 0; e < kVec; ++e) y[e] = round_bf16(silu_bf16(g[e]) * l[e]) * p;  // rounded by pack
      reinterpret_cast<int4*>(o)[c] = pack(y);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    glu_backward_kernel(const uint16_t* __restrict__ grad_out, const uint16_t* __restrict__ h,
                        const float* __restrict__ probs, const int* bound, int64_t rows, int64_t ffn,
                        uint16_t* __restrict__ grad_h, float* __restrict__ grad_probs) {
  const int lane = threadIdx.x % dev::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t live = live_rows(bound, rows);
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / dev::kWarpSize; r < live; r += warps) {
    uint16_t* gh = grad_h + r * 2 * ffn;
    const float p = probs[r];
    const int4* gate = reinterpret_cast<const int4*>(h + r * 2 * ffn);
    const int4* lin = reinterpret_cast<const int4*>(h + r * 2 * ffn + ffn);
    const int4* go = reinterpret_cast<const int4*>(grad_out + r * ffn);
    float acc = 0.0f;
    for (int64_t c = lane; c < ffn / kVec; c += dev::kWarpSize) {
      float g[kVec], l[kVec], dy[kVec], dg[kVec], dl[kVec];
      unpack(gate[c], g);
      unpack(lin[c], l);
      unpack(go[c], dy);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        // The torch chain backwards: (m * p) with m = bf16(s * l), s = bf16(silu(g)).
        const float s = silu_bf16(g[e]);
        acc += dy[e] * round_bf16(s * l[e]);
        const float dm = round_bf16(dy[e] * p);
        dl[e] = dm * s;                          // rounded by pack
        const float ds = round_bf16(dm * l[e]);
        const float sig = 1.0f / (1.0f + expf(-g[e]));
        dg[e] = ds * sig * (1.0f + g[e] * (1.0f - sig));  // SiLU's derivative, as torch's
      }
      reinterpret_cast<int4*>(gh)[c] = pack(dg);
      reinterpret_cast<int4*>(gh + ffn)[c] = pack(dl);
    }
    for (int m = dev::kWarpSize / 2; m > 0; m >>= 1)
      acc += __int_as_float(static_cast<int>(dev::warp_shfl_xor(static_cast<long long>(__float_as_int(acc)), m)));
    if (lane == 0) grad_probs[r] = acc;
  }
}

int grid_for(int64_t rows) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

void check(int64_t rows, int64_t ffn, std::initializer_list<intptr_t> ptrs, const char* what) {
  UCCL_EP_CHECK_ARG(rows >= 0 && ffn > 0 && ffn % kVec == 0, what, ": rows=", rows, " ffn=", ffn,
                    " (ffn must be a positive multiple of ", kVec, ")");
  for (const intptr_t p : ptrs) UCCL_EP_CHECK_ARG(p % 16 == 0, what, ": every row tensor must be 16-byte aligned");
}

}  // namespace

void glu_probs_forward(intptr_t h, intptr_t probs, intptr_t bound, int64_t rows, int64_t ffn, intptr_t out,
                       intptr_t stream) {
  check(rows, ffn, {h, out}, "glu_probs_forward");
  if (rows == 0) return;
  glu_forward_kernel<<<grid_for(rows), kThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      reinterpret_cast<const uint16_t*>(h), reinterpret_cast<const float*>(probs), reinterpret_cast<const int*>(bound),
      rows, ffn, reinterpret_cast<uint16_t*>(out));
  GPU_CHECK(gpuGetLastError());
}

void glu_probs_backward(intptr_t grad_out, intptr_t h, intptr_t probs, intptr_t bound, int64_t rows, int64_t ffn,
                        intptr_t grad_h, intptr_t grad_probs, intptr_t stream) {
  check(rows, ffn, {grad_out, h, grad_h}, "glu_probs_backward");
  if (rows == 0) return;
  glu_backward_kernel<<<grid_for(rows), kThreads, 0, reinterpret_cast<gpuStream_t>(stream)>>>(
      reinterpret_cast<const uint16_t*>(grad_out), reinterpret_cast<const uint16_t*>(h),
      reinterpret_cast<const float*>(probs), reinterpret_cast<const int*>(bound), rows, ffn,
      reinterpret_cast<uint16_t*>(grad_h), reinterpret_cast<float*>(grad_probs));
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

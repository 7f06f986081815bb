// FP8 rows with per-128-channel scales (see fp8.h). One warp per 128-channel block: each lane
// holds 128 / warp-size consecutive elements (loaded one at a time: any input alignment), the
// warp reduces the block's max |x|, and each lane writes its codes as one word.
#include "kernels/common.cuh"
#include "kernels/fp8.h"
#include "kernels/fp8_bits.h"

namespace uccl_ep::kernels {
namespace {

constexpr int kBlock = 128;  // channels per scale
constexpr int kThreads = 256;
constexpr int kPerLane = kBlock / dev::kWarpSize;  // 4 (warp of 32) or 2 (wavefront of 64)
static_assert(kBlock % dev::kWarpSize == 0 && kPerLane <= 4, "a lane's codes fill at most one word");
constexpr int64_t kMaxGridBlocks = 65535;

template <int kDtype>
using Raw = typename Elt<kDtype>::raw;

// The word of a lane's kPerLane codes (code 0 in the low byte).
using CodeWord = std::conditional_t<kPerLane == 4, uint32_t, uint16_t>;

__device__ __forceinline__ float warp_max_nan(float v) {
  // max that keeps a NaN (as torch's amax does), over the warp's lanes.
  for (int m = dev::kWarpSize / 2; m > 0; m >>= 1) {
    const float o = __int_as_float(static_cast<int>(dev::warp_shfl_xor(static_cast<long long>(__float_as_int(v)), m)));
    v = (o != o || o > v) ? o : v;
  }
  return v;
}

int grid_for(int64_t units) {
  const int64_t warps = kThreads / dev::kWarpSize;
  int64_t blocks = (units + warps - 1) / warps;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

template <int kDtype>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const Raw<kDtype>* __restrict__ x, int64_t units, CodeWord* __restrict__ out,
                    float* __restrict__ scales) {
  const int lane = threadIdx.x % dev::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / dev::kWarpSize);
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x / dev::kWarpSize) + threadIdx.x / dev::kWarpSize;
       u < units; u += warps) {
    // Unit u is the u-th 128-channel block of the row-major tensor.
    const Raw<kDtype>* src = x + u * kBlock + lane * kPerLane;
    float v[kPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) {
      v[e] = Elt<kDtype>::to_f(src[e]);
      const float a = fabsf(v[e]);
      amax = (a != a || a > amax) ? a : amax;
    }
    amax = warp_max_nan(amax);
    if (amax < 1e-4f) amax = 1e-4f;  // a NaN stays
    // As the reference: 448 * (1 / amax) and amax * fl(1 / 448), each product and the
    // reciprocal rounded once (IEEE division: the build never uses fast math).
    const float inv = __fmul_rn(1.0f / amax, 448.0f);
    CodeWord word = 0;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      word |= static_cast<CodeWord>(static_cast<CodeWord>(fp8::e4m3_from_float(__fmul_rn(v[e], inv))) << (8 * e));
    out[u * dev::kWarpSize + lane] = word;
    if (lane == 0) scales[u] = __fmul_rn(amax, 1.0f / 448.0f);
  }
}

template <int kDtype>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const CodeWord* __restrict__ x, const float* __restrict__ scales, int64_t units,
                      Raw<kDtype>* __restrict__ out) {
  const int lane = threadIdx.x % dev::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / dev::kWarpSize);
  for (int64_t u = blockIdx.x * static_cast<int64_t>(blockDim.x / dev::kWarpSize) + threadIdx.x / dev::kWarpSize;
       u < units; u += warps) {
    const float scale = scales[u];
    const CodeWord word = x[u * dev::kWarpSize + lane];
    Raw<kDtype>* dst = out + u * kBlock + lane * kPerLane;
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      dst[e] = Elt<kDtype>::from_f(__fmul_rn(fp8::e4m3_to_float(static_cast<uint8_t>(word >> (8 * e))), scale));
  }
}

void check(int dtype, int64_t rows, int64_t hidden, intptr_t codes, const char* what) {
  UCCL_EP_CHECK_ARG(rows >= 0 && hidden > 0 && hidden % kBlock == 0, what, ": rows=", rows, " hidden=", hidden,
                    " (hidden must be a positive multiple of ", kBlock, ")");
  UCCL_EP_CHECK_ARG(dtype >= 0 && dtype <= 2, what, ": dtype code ", dtype, " must be 0 (bf16), 1 (fp16) or 2 (fp32)");
  UCCL_EP_CHECK_ARG(codes % sizeof(CodeWord) == 0, what, ": the E4M3 rows must be ", sizeof(CodeWord),
                    "-byte aligned");
}

template <typename Launch>
void by_dtype(int dtype, Launch&& launch) {
  if (dtype == 0) {
    launch(std::integral_constant<int, 0>{});
  } else if (dtype == 1) {
    launch(std::integral_constant<int, 1>{});
  } else {
    launch(std::integral_constant<int, 2>{});
  }
}

}  // namespace

void quantize_fp8(intptr_t x, int dtype, int64_t rows, int64_t hidden, intptr_t out, intptr_t scales,
                  intptr_t stream) {
  check(dtype, rows, hidden, out, "quantize_fp8");
  const int64_t units = rows * (hidden / kBlock);
  if (units == 0) return;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  by_dtype(dtype, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    quantize_kernel<kD><<<grid_for(units), kThreads, 0, s>>>(reinterpret_cast<const Raw<kD>*>(x), units,
                                                             reinterpret_cast<CodeWord*>(out),
                                                             reinterpret_cast<float*>(scales));
  });
  GPU_CHECK(gpuGetLastError());
}

void dequantize_fp8(intptr_t x, intptr_t scales, int64_t rows, int64_t hidden, int dtype, intptr_t out,
                    intptr_t stream) {
  check(dtype, rows, hidden, x, "dequantize_fp8");
  const int64_t units = rows * (hidden / kBlock);
  if (units == 0) return;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  by_dtype(dtype, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    dequantize_kernel<kD><<<grid_for(units), kThreads, 0, s>>>(reinterpret_cast<const CodeWord*>(x),
                                                               reinterpret_cast<const float*>(scales), units,
                                                               reinterpret_cast<Raw<kD>*>(out));
  });
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

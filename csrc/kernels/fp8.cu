// FP8 rows with per-128-channel scales (see fp8.h). Sixteen lanes per 128-channel block, eight
// consecutive elements each: a warp takes warp-size / 16 blocks at a time, each lane loads its
// elements as 16-byte vectors where the rows are aligned (one at a time where not), the block's
// lanes reduce its max |x|, and each lane writes its eight codes as one 8-byte word.
#include "kernels/common.cuh"
#include "kernels/fp8.h"
#include "kernels/fp8_bits.h"

namespace uccl_ep::kernels {
namespace {

constexpr int kBlock = 128;  // channels per scale
constexpr int kThreads = 256;
constexpr int kPerLane = 8;
constexpr int kGroup = kBlock / kPerLane;            // lanes per 128-channel block
constexpr int kUnits = dev::kWarpSize / kGroup;      // blocks per warp at a time: 2 (warp of 32) or 4
static_assert(dev::kWarpSize % kGroup == 0, "a warp holds whole 128-channel blocks");
constexpr int64_t kMaxGridBlocks = 65535;

template <int kDtype>
using Raw = typename Elt<kDtype>::raw;

// kPerLane elements of one row, moved as 16-byte vectors (kVec) or one element at a time.
template <typename T, bool kVec>
__device__ __forceinline__ void load_lane(const T* src, T (&v)[kPerLane]) {
  if constexpr (kVec) {
    constexpr int kVecs = static_cast<int>(sizeof(T)) * kPerLane / 16;
    int4 w[kVecs];
#pragma unroll
    for (int i = 0; i < kVecs; ++i) w[i] = reinterpret_cast<const int4*>(src)[i];
    memcpy(v, w, sizeof(v));
  } else {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) v[e] = src[e];
  }
}

template <typename T, bool kVec>
__device__ __forceinline__ void store_lane(T* dst, const T (&v)[kPerLane]) {
  if constexpr (kVec) {
    constexpr int kVecs = static_cast<int>(sizeof(T)) * kPerLane / 16;
    int4 w[kVecs];
    memcpy(w, v, sizeof(v));
#pragma unroll
    for (int i = 0; i < kVecs; ++i) reinterpret_cast<int4*>(dst)[i] = w[i];
  } else {
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) dst[e] = v[e];
  }
}

// max |x| that keeps a NaN (as torch's amax does), over the kGroup lanes of one block.
__device__ __forceinline__ float group_max_nan(float v) {
  for (int m = kGroup / 2; m > 0; m >>= 1) {
    const float o = __int_as_float(static_cast<int>(dev::warp_shfl_xor(static_cast<long long>(__float_as_int(v)), m)));
    v = (o != o || o > v) ? o : v;
  }
  return v;
}

int grid_for(int64_t units) {
  const int64_t per_block = kThreads / dev::kWarpSize * kUnits;
  int64_t blocks = (units + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

// Unit u is the u-th 128-channel block of the row-major tensor. A warp takes kUnits units at a
// time, from `first_unit()` in steps of `unit_stride()`: lane l the unit first + l / kGroup,
// elements (l % kGroup) * kPerLane onwards. The loop's bounds are the warp's (the shuffles need
// every lane); lanes past the last unit store nothing.
__device__ __forceinline__ int64_t first_unit() {
  return (blockIdx.x * static_cast<int64_t>(blockDim.x / dev::kWarpSize) + threadIdx.x / dev::kWarpSize) * kUnits;
}

__device__ __forceinline__ int64_t unit_stride() {
  return static_cast<int64_t>(gridDim.x) * (blockDim.x / dev::kWarpSize) * kUnits;
}

// The 8 codes of a lane as one word (code 0 in the low byte), stored as 8 bytes or two 4-byte words.
template <bool kVec>
__device__ __forceinline__ void store_codes(uint32_t* out, uint32_t lo, uint32_t hi) {
  if constexpr (kVec) {
    *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
  } else {
    out[0] = lo;
    out[1] = hi;
  }
}

template <int kDtype, bool kVec>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const Raw<kDtype>* __restrict__ x, int64_t units, uint32_t* __restrict__ out,
                    float* __restrict__ scales) {
  const int lane = threadIdx.x % dev::kWarpSize, part = lane % kGroup;
  for (int64_t first = first_unit(); first < units; first += unit_stride()) {
    const int64_t u = first + lane / kGroup;
    const bool live = u < units;
    Raw<kDtype> raw[kPerLane];
    float v[kPerLane];
    float amax = 0.0f;
    if (live) {
      load_lane<Raw<kDtype>, kVec>(x + u * kBlock + part * kPerLane, raw);
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) {
        v[e] = Elt<kDtype>::to_f(raw[e]);
        const float a = fabsf(v[e]);
        amax = (a != a || a > amax) ? a : amax;
      }
    }
    amax = group_max_nan(amax);
    if (!live) continue;
    if (amax < 1e-4f) amax = 1e-4f;  // a NaN stays
    // As the reference: 448 * (1 / amax) and amax * fl(1 / 448), each product and the
    // reciprocal rounded once (IEEE division: the build never uses fast math).
    const float inv = __fmul_rn(1.0f / amax, 448.0f);
    uint32_t word[2] = {0, 0};
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      word[e / 4] |= static_cast<uint32_t>(fp8::e4m3_from_float(__fmul_rn(v[e], inv))) << (8 * (e % 4));
    store_codes<kVec>(out + (u * kBlock + part * kPerLane) / 4, word[0], word[1]);
    if (part == 0) scales[u] = __fmul_rn(amax, 1.0f / 448.0f);
  }
}

template <int kDtype, bool kVec>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint32_t* __restrict__ x, const float* __restrict__ scales, int64_t units,
                      const int* bound, int64_t row_units, Raw<kDtype>* __restrict__ out) {
  const int lane = threadIdx.x % dev::kWarpSize, part = lane % kGroup;
  if (bound != nullptr) {  // rows at or past *bound (padding of a sync-free dispatch) stay unwritten
    const int64_t b = *bound;
    const int64_t live = (b < 0 ? 0 : b) * row_units;
    units = live < units ? live : units;
  }
  for (int64_t first = first_unit(); first < units; first += unit_stride()) {
    const int64_t u = first + lane / kGroup;
    if (u >= units) continue;
    const float scale = scales[u];
    const uint32_t* src = x + (u * kBlock + part * kPerLane) / 4;
    uint32_t word[2];
    if constexpr (kVec) {
      const uint2 w = *reinterpret_cast<const uint2*>(src);
      word[0] = w.x;
      word[1] = w.y;
    } else {
      word[0] = src[0];
      word[1] = src[1];
    }
    Raw<kDtype> v[kPerLane];
#pragma unroll
    for (int e = 0; e < kPerLane; ++e)
      v[e] = Elt<kDtype>::from_f(
          __fmul_rn(fp8::e4m3_to_float(static_cast<uint8_t>(word[e / 4] >> (8 * (e % 4)))), scale));
    store_lane<Raw<kDtype>, kVec>(out + u * kBlock + part * kPerLane, v);
  }
}

void check(int dtype, int64_t rows, int64_t hidden, intptr_t codes, const char* what) {
  UCCL_EP_CHECK_ARG(rows >= 0 && hidden > 0 && hidden % kBlock == 0, what, ": rows=", rows, " hidden=", hidden,
                    " (hidden must be a positive multiple of ", kBlock, ")");
  UCCL_EP_CHECK_ARG(dtype >= 0 && dtype <= 2, what, ": dtype code ", dtype, " must be 0 (bf16), 1 (fp16) or 2 (fp32)");
  UCCL_EP_CHECK_ARG(codes % 4 == 0, what, ": the E4M3 rows must be 4-byte aligned");
}

// Vectors where the rows allow them: 16-byte aligned elements, 8-byte aligned codes (each
// row of codes starts at a multiple of 128 bytes from the first).
bool vector_rows(intptr_t elts, intptr_t codes) { return elts % 16 == 0 && codes % 8 == 0; }

template <typename Launch>
void by_dtype(int dtype, bool vec, Launch&& launch) {
  auto with_vec = [&](auto d) {
    if (vec) {
      launch(d, std::true_type{});
    } else {
      launch(d, std::false_type{});
    }
  };
  if (dtype == 0) {
    with_vec(std::integral_constant<int, 0>{});
  } else if (dtype == 1) {
    with_vec(std::integral_constant<int, 1>{});
  } else {
    with_vec(std::integral_constant<int, 2>{});
  }
}

}  // namespace

void quantize_fp8(intptr_t x, int dtype, int64_t rows, int64_t hidden, intptr_t out, intptr_t scales,
                  intptr_t stream) {
  check(dtype, rows, hidden, out, "quantize_fp8");
  const int64_t units = rows * (hidden / kBlock);
  if (units == 0) return;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  by_dtype(dtype, vector_rows(x, out), [&](auto d, auto v) {
    constexpr int kD = decltype(d)::value;
    constexpr bool kV = decltype(v)::value;
    quantize_kernel<kD, kV><<<grid_for(units), kThreads, 0, s>>>(reinterpret_cast<const Raw<kD>*>(x), units,
                                                                 reinterpret_cast<uint32_t*>(out),
                                                                 reinterpret_cast<float*>(scales));
  });
  GPU_CHECK(gpuGetLastError());
}

void dequantize_fp8(intptr_t x, intptr_t scales, int64_t rows, int64_t hidden, int dtype, intptr_t bound,
                    intptr_t out, intptr_t stream) {
  check(dtype, rows, hidden, x, "dequantize_fp8");
  const int64_t units = rows * (hidden / kBlock);
  if (units == 0) return;
  auto s = reinterpret_cast<gpuStream_t>(stream);
  by_dtype(dtype, vector_rows(out, x), [&](auto d, auto v) {
    constexpr int kD = decltype(d)::value;
    constexpr bool kV = decltype(v)::value;
    dequantize_kernel<kD, kV><<<grid_for(units), kThreads, 0, s>>>(
        reinterpret_cast<const uint32_t*>(x), reinterpret_cast<const float*>(scales), units,
        reinterpret_cast<const int*>(bound), hidden / kBlock, reinterpret_cast<Raw<kD>*>(out));
  });
  GPU_CHECK(gpuGetLastError());
}

}  // namespace uccl_ep::kernels

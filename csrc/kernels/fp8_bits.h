// FP8 E4M3 ("fn": no infinities; 0x7F / 0xFF are the NaNs; largest finite 448) to and from
// float32 on raw bits, on the host and the device, rounding as torch's float8_e4m3fn casts do
// (torch 2.13): once, to nearest even, from the float32 value; a value past 448 (an infinity
// too) saturates to +-448, a NaN stays NaN with its sign. (Vendor conversion intrinsics are not
// used: some round through fp16 first, which differs at ties.) tests/cpp/test_fp8_bits.cc checks
// both directions against a nearest-value search.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define UCCL_EP_FP8_HD __host__ __device__ __forceinline__
#else
#define UCCL_EP_FP8_HD inline
#endif

namespace uccl_ep::fp8 {

UCCL_EP_FP8_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

UCCL_EP_FP8_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// The E4M3 code nearest to f (ties to the even code).
UCCL_EP_FP8_HD uint8_t e4m3_from_float(float f) {
  const uint32_t bits = float_bits(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  uint32_t mag = bits & 0x7fffffffu;
  uint32_t code;
  if (mag > 0x7f800000u) {  // NaN
    code = 0x7fu;
  } else if (mag >= 0x43e80000u) {  // |f| >= 464 (inf too): 464 ties to 448 (even), above saturates
    code = 0x7eu;
  } else if (mag < 0x3c800000u) {
    // |f| < 2^-6, E4M3's smallest normal: the subnormal steps are 2^-9. Adding 2^-9 * 2^23
    // (= 2^14) puts the step at the float's last mantissa bit, and the float adder rounds the
    // sum to nearest even there; the step count is what the sum holds above 2^14.
    const uint32_t sum = float_bits(bits_float(mag) + 16384.0f);
    code = sum - 0x46800000u;  // 0x46800000 = bits of 2^14
  } else {
    // Normal: keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even
    // (add half a step less one, plus the kept part's lowest bit), and rebias the exponent
    // from 127 to 7. A carry out of the mantissa moves to the next exponent, as it should
    // (below 464 it never reaches 0x7F, the NaN).
    const uint32_t odd = (mag >> 20) & 1u;
    mag += 0x7ffffu + odd;
    code = ((mag >> 20) - (120u << 3)) & 0x7fu;
  }
  return static_cast<uint8_t>(code | sign);
}

// The float32 value of an E4M3 code (exact; a NaN code gives a quiet NaN of its sign).
UCCL_EP_FP8_HD float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exp = (code >> 3) & 0xfu, mant = code & 0x7u;
  if (exp == 15u && mant == 7u) return bits_float(sign | 0x7fc00000u);
  if (exp == 0u) {
    // Subnormal: mant * 2^-9, exact in float32.
    const float v = static_cast<float>(mant) * 0.001953125f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

}  // namespace uccl_ep::fp8

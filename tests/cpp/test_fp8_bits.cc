// The E4M3 conversions of the FP8 row kernels (kernels/fp8_bits.h) against an independent
// definition: the nearest of the format's finite values to the float, ties to the even code,
// anything past 448 (infinities too) saturating to +-448 and a NaN staying NaN, as torch 2.13's
// float8_e4m3fn cast does. Checked on a stride through every positive float, on every tie and on
// the floats next to it, and on the special values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "kernels/fp8_bits.h"

namespace uccl_ep::fp8 {
namespace {

// Value of positive code c computed from the format's definition (0x7F, the NaN, would be 480).
double code_value(int c) {
  const int exp = c >> 3, mant = c & 7;
  if (exp == 0) return std::ldexp(mant, -9);
  return std::ldexp(8 + mant, exp - 10);
}

// The finite code nearest to f, ties to even, past 448 the largest; the NaN code for a NaN.
uint8_t reference(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  if (std::isnan(f)) return 0x7F | sign;
  const double a = std::fabs(static_cast<double>(f));
  int best = 0;
  for (int c = 1; c < 127; ++c) {
    const double dc = std::fabs(code_value(c) - a), db = std::fabs(code_value(best) - a);
    if (dc < db || (dc == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(best) | sign;
}

float from_bits(uint32_t u) { return bits_float(u); }

TEST(Fp8Bits, DecodesTheFormatsValues) {
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x07), 7 * std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(float_bits(e4m3_to_float(0x80)), 0x80000000u);  // -0
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xFF)) && std::signbit(e4m3_to_float(0xFF)));
  for (int c = 0; c < 127; ++c) {
    EXPECT_EQ(static_cast<double>(e4m3_to_float(static_cast<uint8_t>(c))), code_value(c)) << c;
    EXPECT_EQ(e4m3_to_float(static_cast<uint8_t>(c | 0x80)), -e4m3_to_float(static_cast<uint8_t>(c))) << c;
  }
}

TEST(Fp8Bits, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<uint8_t>(c);
    EXPECT_EQ(e4m3_from_float(e4m3_to_float(code)), code) << c;
  }
}

TEST(Fp8Bits, SpecialValuesAndTheTopOfTheRange) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(e4m3_from_float(inf), 0x7E);  // saturates
  EXPECT_EQ(e4m3_from_float(-inf), 0xFE);
  EXPECT_EQ(e4m3_from_float(nan), 0x7F);
  EXPECT_EQ(e4m3_from_float(-nan), 0xFF);
  EXPECT_EQ(e4m3_from_float(464.0f), 0x7E);
  EXPECT_EQ(e4m3_from_float(std::nextafter(464.0f, 500.0f)), 0x7E);
  EXPECT_EQ(e4m3_from_float(std::nextafter(448.0f, 0.0f)), 0x7E);
  EXPECT_EQ(e4m3_from_float(-470.0f), 0xFE);
  EXPECT_EQ(e4m3_from_float(1e30f), 0x7E);
  EXPECT_EQ(e4m3_from_float(0.0f), 0x00);
  EXPECT_EQ(e4m3_from_float(-0.0f), 0x80);
  EXPECT_EQ(e4m3_from_float(std::ldexp(1.0f, -10)), 0x00);  // half the smallest step: to even 0
  EXPECT_EQ(e4m3_from_float(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(e4m3_from_float(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8Bits, TiesAndTheirNeighboursMatchTheNearestValue) {
  for (int c = 0; c < 127; ++c) {
    const float mid = static_cast<float>((code_value(c) + code_value(c + 1)) / 2);  // exact in float
    ASSERT_EQ(static_cast<double>(mid), (code_value(c) + code_value(c + 1)) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f), -mid}) {
      ASSERT_EQ(e4m3_from_float(f), reference(f)) << "f=" << f;
    }
  }
}

TEST(Fp8Bits, AStrideThroughEveryFloatMatchesTheNearestValue) {
  // Every 4099th positive float bit pattern (and its negative): ~524K values across all
  // exponents, subnormals, infinities and NaNs.
  int64_t checked = 0;
  for (uint64_t u = 0; u <= 0x7FFFFFFFu; u += 4099) {
    for (uint32_t s : {0u, 0x80000000u}) {
      const float f = from_bits(static_cast<uint32_t>(u) | s);
      ASSERT_EQ(e4m3_from_float(f), reference(f)) << "bits=0x" << std::hex << (static_cast<uint32_t>(u) | s);
      ++checked;
    }
  }
  EXPECT_GT(checked, 1000000);
}

}  // namespace
}  // namespace uccl_ep::fp8

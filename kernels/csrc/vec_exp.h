// exp(x) for float32 in a form the compiler vectorises inside `omp simd` loops (libm's expf
// is a scalar call there): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r
// (the Cephes coefficients, about 1 ulp), and 2^n put straight into the exponent bits.
// Saturates: below -87.3 it returns 0, above 88.7 +inf; NaN stays NaN.
#pragma once

#include <cstdint>
#include <cstring>

#pragma omp declare simd
inline float vec_exp(float x) {
  const float hi = 88.72283935546875f, lo = -87.33654022216797f;
  const float xc = x > hi ? hi : (x < lo ? lo : x);
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  // r = x - n ln2, ln2 split in two so that n * C1 is exact.
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float y = er * scale;
  return x != x ? x : (x > hi ? __builtin_inff() : (x < lo ? 0.f : y));
}

// exp(x) for float32 in a form the compiler vectorises inside `omp simd` loops (libm's expf
// is a scalar call there): x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial for e^r
// (the Cephes coefficients, about 1 ulp), and 2^n put straight into the exponent bits of two
// factors. Below about -103.97 it returns 0 (subnormals above that), at and past the largest
// float's log +inf; NaN stays NaN.
//
// Neither end nor NaN takes a select of its own, which in the vectorised loop costs compares and
// mask-register moves: x is clamped to [-104, 89] by two selects that keep a NaN (each returns x
// when its compare fails, as a NaN's always does: vmaxps and vminps), and 2^n, split in two
// factors, never wraps the exponent field for n in [-150, 129], so the products under- and
// overflow as exp does.
//
// exp16 is the same on sixteen lanes in AVX-512 intrinsics, for loops the compiler would not
// vectorise as well: the clamps are vmaxps and vminps, the steps multiply-adds, and 2^n goes in
// by vscalefps (one rounding, as the two factors' product has). The portable form, vectorised,
// spends twice its instructions: the compiler keeps each select's NaN case apart.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#pragma omp declare simd
inline float vec_exp(float x) {
  float xc = x < -104.f ? -104.f : x;
  xc = xc > 89.f ? 89.f : xc;
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
  const int32_t ni = static_cast<int32_t>(n);  // garbage for a NaN, whose er is NaN anyway
  const int32_t half = ni >> 1;
  const uint32_t bits_lo = static_cast<uint32_t>(half + 127) << 23;
  const uint32_t bits_hi = static_cast<uint32_t>(ni - half + 127) << 23;
  float lo, hi;
  std::memcpy(&lo, &bits_lo, sizeof lo);
  std::memcpy(&hi, &bits_hi, sizeof hi);
  return er * lo * hi;
}

#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  __m512 xc = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // x itself where x is NaN
  xc = _mm512_min_ps(_mm512_set1_ps(89.f), xc);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 er =
      _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(er, n);
}
#endif

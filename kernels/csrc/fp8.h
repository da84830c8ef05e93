// float8 e4m3 (torch.float8_e4m3fn) for a KV cache of its own dtype (kernels/kv_quant.py): the
// cache write narrows `x / scale` to it, attention reads it back widened.
//
// e4m3fn: a sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, 0x7f and 0xff are
// NaN, the largest finite magnitude is 448 and the smallest step 2^-9 (subnormals). Every e4m3
// value is a bfloat16 exactly (at most 4 significant bits, exponents 2^-9 .. 2^8), so
// attention widens a chunk of the cache to bf16 once (widen_rows) and reads it as a bf16 cache:
// the bf16 machinery (vdpbf16ps, the paired P V) serves it unchanged.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedserve {

// Storage of one e4m3 (at::Float8_e4m3fn has the same layout: one uint8_t).
struct fp8 {
  uint8_t bits;
};
static_assert(sizeof(fp8) == 1, "fp8 is one byte");

// The bf16 bits of e4m3 magnitude `m` (0 .. 127), exact; 0x7f (NaN) gives a quiet NaN.
constexpr uint16_t fp8_magnitude_as_bf16(int m) {
  if (m == 0x7f) return 0x7fc0;
  const int e = m >> 3, mant = m & 7;
  if (e > 0) return static_cast<uint16_t>(((e + 120) << 7) | (mant << 4));  // bias 7 -> 127
  // Subnormal: mant * 2^-9, normalised for bf16 (mant has 1 .. 3 significant bits).
  if (mant == 0) return 0;
  int shift = 0;
  while ((mant << shift) < 4) ++shift;  // leading bit to bit 2
  const int exp = 127 - 7 - shift;      // value (mant << shift) / 4 * 2^(-7 - shift)
  return static_cast<uint16_t>((exp << 7) | (((mant << shift) & 3) << 5));
}

inline float load(fp8 x) {
  const uint32_t u = (static_cast<uint32_t>(x.bits & 0x80u) << 24) |
                     (static_cast<uint32_t>(fp8_magnitude_as_bf16(x.bits & 0x7f)) << 16);
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch's .to(float8_e4m3fn) does, saturating at +-448 (where
// kv_quant.quantize_kv clamps first); NaN stays NaN.
template <>
inline fp8 store<fp8>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return fp8{static_cast<uint8_t>(sign | 0x7f)};
  const float ax = std::fabs(x);
  if (ax >= 448.f) return fp8{static_cast<uint8_t>(sign | 0x7e)};
  if (ax < 0x1p-6f) {  // subnormal: a multiple of 2^-9 (8 of them is 2^-6, encoded 0x08)
    return fp8{static_cast<uint8_t>(sign | static_cast<uint8_t>(std::nearbyint(ax * 512.f)))};
  }
  // Normal: keep three mantissa bits (a carry may step the exponent), rebias 127 -> 7.
  const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return fp8{static_cast<uint8_t>(sign | (r - (120u << 3)))};
}

#if defined(__AVX512F__) && defined(__AVX512VBMI__)
// 64 e4m3 values to bf16, in order: the high and low bytes of each bf16 are two 128-entry
// table lookups on the magnitude (vpermi2b ignores the index's top bit, the sign), the sign
// ORed into the high byte, and the bytes interleaved. unpacklo/hi_epi8 interleave within
// 128-bit lanes, so the input is first permuted for them to come out in order.
struct Fp8Tables {
  __m512i hi0, hi1, lo0, lo1, order;
  Fp8Tables() {
    alignas(64) uint8_t hi[128], lo[128], ord[64];
    for (int m = 0; m < 128; ++m) {
      hi[m] = static_cast<uint8_t>(fp8_magnitude_as_bf16(m) >> 8);
      lo[m] = static_cast<uint8_t>(fp8_magnitude_as_bf16(m) & 0xff);
    }
    // Lane L of the permuted input: elements 8L .. 8L+7 (unpacklo: output 16L ..), then
    // 32 + 8L .. 32 + 8L + 7 (unpackhi: output 32 + 16L ..).
    for (int lane = 0; lane < 4; ++lane) {
      for (int t = 0; t < 8; ++t) {
        ord[16 * lane + t] = static_cast<uint8_t>(8 * lane + t);
        ord[16 * lane + 8 + t] = static_cast<uint8_t>(32 + 8 * lane + t);
      }
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
    order = _mm512_load_si512(ord);
  }
};

// n <= 64 e4m3 values at src to bf16 at dst (64 written; the caller's buffer has room).
inline void widen64(const Fp8Tables& t, const fp8* src, int n, bf16* dst) {
  const __mmask64 in = n >= 64 ? ~__mmask64{0} : (__mmask64{1} << n) - 1;
  const __m512i x = _mm512_permutexvar_epi8(t.order, _mm512_maskz_loadu_epi8(in, src));
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, x, t.hi1), x,
                                               _mm512_set1_epi8(static_cast<char>(0x80)),
                                               0xf8);  // a | (b & c)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, x, t.lo1);
  _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(lo, hi));
  _mm512_storeu_si512(dst + 32, _mm512_unpackhi_epi8(lo, hi));
}
#endif

// Rows [0, n) of D e4m3 values each, `stride` elements apart, to bf16 rows D apart at dst.
template <int D>
inline void widen_rows(const fp8* src, int64_t stride, int64_t n, bf16* dst) {
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
  static const Fp8Tables tables;
  static_assert(D % 32 == 0, "rows of whole 32-element runs");
  for (int64_t j = 0; j < n; ++j) {
    for (int c = 0; c < D; c += 64) widen64(tables, src + j * stride + c, D - c, dst + j * D + c);
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    for (int i = 0; i < D; ++i) dst[j * D + i] = store<bf16>(load(src[j * stride + i]));
  }
#endif
}

}  // namespace pagedserve

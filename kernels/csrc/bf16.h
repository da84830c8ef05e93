// bfloat16 <-> float32 for the CPU kernels, by bit shifts: a bf16 is the top half of a float32.
// Widening is exact (shift left 16); narrowing rounds to nearest even, as torch's .to(bfloat16)
// does, and keeps a NaN a (quiet) NaN. Both are plain integer ops on 32-bit lanes, so the
// compiler vectorises them inside `omp simd` loops for whatever the build target has (AVX2,
// AVX-512): no intrinsics, nothing that an AVX2-only build lacks.
//
// The kernels are templates over their element types; `load` and `store<T>` read and write an
// element of either type as float32, and are the identity on float32, so the float32
// instantiations do exactly the arithmetic they did before bf16 existed.
#pragma once

#include <cstdint>
#include <cstring>

namespace pagedserve {

// Storage of one bfloat16 (at::BFloat16 has the same layout: one uint16_t).
struct bf16 {
  uint16_t bits;
};
static_assert(sizeof(bf16) == 2, "bf16 is two bytes");

inline float load(float x) { return x; }

inline float load(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

template <typename T>
inline T store(float x);

template <>
inline float store<float>(float x) {
  return x;
}

template <>
inline bf16 store<bf16>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  // Round to nearest even: add 0x7fff plus the lowest kept bit, then drop the low half. A NaN
  // (exponent all ones, mantissa non-zero) could round into infinity; set a quiet bit instead.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return bf16{static_cast<uint16_t>(is_nan ? nan : rounded)};
}

}  // namespace pagedserve

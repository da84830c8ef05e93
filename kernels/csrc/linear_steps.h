// One step of the K loop of csrc/linear_cpu.cpp's tiled matmul, per instruction set and weight
// dtype: the vector type, how many vectors a step of a tile holds, how a weight vector is read,
// how a row of x is broadcast against it, and how the products are summed.
//
// A step of a tile is 128 contiguous bytes: 32 output columns by 1 k (float32), 2 k (bf16) or
// 4 k (int8 codes). Each dtype struct D gives
//   W, X          the weight's and x's element types; kPerStep, the k values per step
//   kVecs         accumulator vectors per step (a block of rows covers kBlockVecs of them)
//   kPairs        accumulators per output vector: 1, or 2 where an accumulator holds 4 columns'
//                 k pairs (pair_sum folds two of them into 8 columns)
//   kFew          the most rows few_rows takes in one pass
//   load, bcast, madd, combine
// Built where the compiler targets AVX-512 (F: float32; BF16: bf16 by vdpbf16ps; VNNI: int8 by
// vpdpbusd) or AVX2 with FMA (float32, and bf16 weights widened to float32 as they are read).
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDSERVE_TILED 1
#endif

#include <cstdint>

#include "bf16.h"

namespace pagedserve::tiles {

constexpr int64_t kStepBytes = 128;  // bytes of a tile per step of the K loop

#if defined(__AVX512F__)

// One vector of 16 float32 lanes (int32 for int8's sums, reinterpreted); a step of a tile is
// two of them. 32 registers hold four rows' accumulators with two chains each (few_rows), or
// eight rows' over the whole tile with one (row_block).
using V = __m512;
constexpr int kLanes = 16;
constexpr int kFewRows = 4;
constexpr int kChainRegs = 16;
constexpr int kBlockRows = 8;
constexpr int kBlockVecs = 2;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const void* p) { return _mm512_loadu_ps(p); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vfma(V acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
inline V vbcast(const float* x) { return _mm512_set1_ps(*x); }
inline void vstore(float* o, V v) { _mm512_storeu_ps(o, v); }
inline V vload_out(const float* b) { return _mm512_loadu_ps(b); }

// bf16 output elements rounded to nearest even (vcvtneps2bf16, or bf16.h's store where the
// machine lacks it: AVX-512 without BF16, e.g. Ice Lake, whose int8 path still writes bf16);
// a bf16 bias, widened exactly.
inline void vstore(uint16_t* o, V v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float f[kLanes];
  _mm512_store_ps(f, v);
  auto* dst = reinterpret_cast<bf16*>(o);
#pragma omp simd
  for (int i = 0; i < kLanes; ++i) dst[i] = store<bf16>(f[i]);
#endif
}
inline V vload_out(const uint16_t* b) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#elif defined(PAGEDSERVE_TILED)

// AVX2: a vector is 8 lanes. 16 registers hold one row with two chains per float32 vector or
// four rows with one (few_rows, whose weight vectors the multiply-adds read from memory), or
// six rows over a quarter or half of a step (row_block: each weight vector loaded feeds six
// multiply-adds, where a whole step's vectors fit beside only two or three rows, whose blocks
// streamed the tile from L2 at half oneDNN's speed).
using V = __m256;
constexpr int kLanes = 8;
constexpr int kFewRows = 4;
constexpr int kChainRegs = 8;
constexpr int kBlockRows = 6;
constexpr int kBlockVecs = 2;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const void* p) { return _mm256_loadu_ps(static_cast<const float*>(p)); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vfma(V acc, V w, V x) { return _mm256_fmadd_ps(w, x, acc); }
inline V vbcast(const float* x) { return _mm256_broadcast_ss(x); }
inline void vstore(float* o, V v) { _mm256_storeu_ps(o, v); }
inline V vload_out(const float* b) { return _mm256_loadu_ps(b); }

// bf16 output elements, rounded by bf16.h's store (nearest even, as torch's .to(bfloat16); a
// NaN stays a quiet NaN), which the compiler vectorises; a bf16 bias, widened exactly.
inline void vstore(uint16_t* o, V v) {
  alignas(32) float f[kLanes];
  _mm256_store_ps(f, v);
  auto* dst = reinterpret_cast<bf16*>(o);
#pragma omp simd
  for (int i = 0; i < kLanes; ++i) dst[i] = store<bf16>(f[i]);
}
inline V vload_out(const uint16_t* b) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#endif

#if defined(PAGEDSERVE_TILED)

// A weight vector that is an output vector's columns: loaded as it lies.
struct Direct {
  static constexpr int kVecs = kStepBytes / (4 * kLanes);  // 2 or 4
  static constexpr int kPairs = 1;
  static constexpr int kFew = kFewRows;
  static V load(const void* p) { return vload(p); }
  static V pair_sum(V a, V) { return a; }
};

struct F32 : Direct {
  using W = float;
  using X = float;
  static constexpr int64_t kPerStep = 1;
  static V bcast(const float* x, int64_t p) { return vbcast(x + p); }
  static V madd(V acc, V w, V x) { return vfma(acc, w, x); }
  static V combine(V a, V b) { return vadd(a, b); }
};

#if defined(__AVX512BF16__)
struct BF16 : Direct {
  using W = uint16_t;
  using X = uint16_t;
  static constexpr int64_t kPerStep = 2;
  // x's k pair (2p, 2p + 1) as one 32-bit lane, in every lane
  static __m512 bcast(const uint16_t* x, int64_t p) {
    uint32_t pair;
    __builtin_memcpy(&pair, x + 2 * p, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
  }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
  static __m512 combine(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
};
#elif !defined(__AVX512F__)
// AVX2 has no bf16 product: each 16 bytes of a step (4 columns x 2 k) widen exactly to 8
// float32 lanes, multiplied by x's k pair in float32 (exact: 8-bit mantissas) and summed with
// FMA, so the sums and their one rounding are those of the AVX-512 path up to order. The weight
// stream stays bf16, half float32's bytes, which is what a decode step's speed is. x comes
// widened to float32 once per call (linear_tiled), so a k pair is one 8-byte broadcast.
struct BF16 {
  using W = uint16_t;
  using X = float;
  static constexpr int64_t kPerStep = 2;
  static constexpr int kVecs = 8;
  static constexpr int kPairs = 2;
  // Eight accumulators a row: two rows spill a few to the stack and still beat the blocks of
  // six rows (a quarter of a step each) at two rows; more rows go to those blocks.
  static constexpr int kFew = 2;
  static V load(const uint16_t* p) { return vload_out(p); }  // 8 bf16, widened exactly
  // x[2p] and x[2p + 1], alternating across the lanes
  static V bcast(const float* x, int64_t p) {
    return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + 2 * p)));
  }
  static V madd(V acc, V w, V x) { return vfma(acc, w, x); }
  static V combine(V a, V b) { return vadd(a, b); }
  // a: columns c..c+3, b: c+4..c+7, each as (k even, k odd) lane pairs -> columns c..c+7
  static V pair_sum(V a, V b) {
    const V h = _mm256_hadd_ps(a, b);  // c, c+1, c+4, c+5 | c+2, c+3, c+6, c+7
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0b11011000));
  }
};
#endif

#if defined(__AVX512VNNI__)
// int8 codes against int8 activations, summed exactly in int32 by vpdpbusd, which multiplies
// unsigned by signed bytes: the activation codes come offset by 128 (written so by
// quantize_rows_uint8 as it quantizes), and the epilogue takes 128 x the
// column's code sum back off. A k quad is then broadcast straight from memory (vpbroadcastd
// from m32: a load, no vector op); offset here, it went through a general register and a
// vector shuffle at every broadcast (docs/results/performance.md section 18).
struct I8 : Direct {
  using W = int8_t;
  using X = uint8_t;
  static constexpr int64_t kPerStep = 4;
  static __m512 bcast(const uint8_t* x, int64_t p) {
    uint32_t quad;
    __builtin_memcpy(&quad, x + 4 * p, sizeof quad);
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(quad)));
  }
  // acc += x (unsigned) . w (signed), by four byte products a lane. In assembly: through the
  // intrinsic, GCC 12 copies every accumulator out and back around each vpdpbusd and spills
  // some to the stack (32 extra moves a step of eight rows; section 18 of
  // docs/results/performance.md has what that cost).
  static __m512 madd(__m512 acc, __m512 w, __m512 x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "vm"(w));
    return acc;
  }
  static __m512 combine(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};
#endif

#endif  // PAGEDSERVE_TILED

}  // namespace pagedserve::tiles

// Sixteen keys at a time in one AVX-512 register: the primitives of paged attention's decode
// path (paged_attention_cpu.cpp, attend_rows).
//
// A decode step has a handful of query rows per (sequence, kv head): the group's G heads of one
// new token. Scoring them against a block one key at a time ends every dot product in a
// horizontal sum, which costs more than the multiply-adds. Here the D-long products of 16 keys
// are summed lane-wise first (one register per key) and the 16 registers are then folded into
// one register of 16 scores by a transposing tree (reduce16: 45 instructions where 16 horizontal
// sums take about 130). A bf16 query over a bf16 cache multiplies with vdpbf16ps straight from
// the cache (no widening; each product is exact in float32 and summed in float32).
//
// Only built where the compiler targets AVX-512 (-march=native on such a machine); elsewhere
// the kernel keeps its portable path.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <cstdint>

#include "bf16.h"

namespace pagedserve::keys16 {

// 16 consecutive elements as float32 (also SiLU-and-mul's loads, csrc/layers_cpu.cpp).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane j of the result: the sum of v[j]'s 16 lanes.
inline __m512 reduce16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  // a[k], per 128-bit lane: [v2k(0)+v2k(2), v2k+1(0)+v2k+1(2), v2k(1)+v2k(3), v2k+1(1)+v2k+1(3)]
  for (int k = 0; k < 8; ++k) {
    a[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                         _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  }
  // b[k], per 128-bit lane: the lane's sums of v4k .. v4k+3
  for (int k = 0; k < 4; ++k) {
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // c[k]: lanes (b2k: 0+1, 2+3; b2k+1: 0+1, 2+3)
  for (int k = 0; k < 2; ++k) {
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xdd));
  }
  // 128-bit lane L: the whole sums of keys 4L .. 4L+3
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// q . k_j for keys j < nj (k_j at k + j * stride), lane j; lanes nj.. are 0. q is D float32.
template <int D, typename KV>
inline __m512 scores16(const float* q, const KV* k, int64_t stride, int64_t nj) {
  __m512 qv[D / 16];
  for (int c = 0; c < D / 16; ++c) qv[c] = load16(q + 16 * c);
  __m512 v[16];
  for (int j = 0; j < 16; ++j) {
    v[j] = _mm512_setzero_ps();
    if (j < nj) {
      for (int c = 0; c < D / 16; ++c) {
        v[j] = _mm512_fmadd_ps(qv[c], load16(k + j * stride + 16 * c), v[j]);
      }
    }
  }
  return reduce16(v);
}

#if defined(__AVX512BF16__)
// The same for a bf16 query over a bf16 cache: pairs of elements multiplied and summed by
// vdpbf16ps, the key read as it is stored.
template <int D>
inline __m512 scores16(const bf16* q, const bf16* k, int64_t stride, int64_t nj) {
  __m512bh qv[D / 32];
  for (int c = 0; c < D / 32; ++c) {
    qv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + 32 * c));
  }
  __m512 v[16];
  for (int j = 0; j < 16; ++j) {
    v[j] = _mm512_setzero_ps();
    if (j < nj) {
      for (int c = 0; c < D / 32; ++c) {
        const __m512bh kc =
            reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + j * stride + 32 * c));
        v[j] = _mm512_dpbf16_ps(v[j], qv[c], kc);
      }
    }
  }
  return reduce16(v);
}

// scores16 for R query rows against the same keys: each key's row is loaded once for all R
// rows, and the keys go four at a time through the first two levels of reduce16's tree (whose
// pairing stays within runs of four keys), so the R * 4 products and the R * 4 partial trees
// fit the register file. Each row's result is scores16's, bit for bit.
template <int D, int R>
inline void scores16_rows(const bf16* const (&q)[R], const bf16* k, int64_t stride, int64_t nj,
                          __m512 (&out)[R]) {
  __m512bh qv[R][D / 32];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < D / 32; ++c) {
      qv[r][c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q[r] + 32 * c));
    }
  }
  // Every key row of the chunk asked for at once: the quarters below would otherwise have only
  // four keys' lines in flight, which starves a context that streams from memory.
  for (int64_t j = 0; j < nj; ++j) {
    for (int line = 0; line < D * 2; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k + j * stride) + line, _MM_HINT_T0);
    }
  }
  __m512 b[R][4];
  for (int quarter = 0; quarter < 4; ++quarter) {
    __m512 v[R][4];
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * quarter + jj;
      for (int r = 0; r < R; ++r) v[r][jj] = _mm512_setzero_ps();
      if (j < nj) {
        for (int c = 0; c < D / 32; ++c) {
          const __m512bh kc =
              reinterpret_cast<__m512bh>(_mm512_loadu_si512(k + j * stride + 32 * c));
          for (int r = 0; r < R; ++r) v[r][jj] = _mm512_dpbf16_ps(v[r][jj], qv[r][c], kc);
        }
      }
    }
    for (int r = 0; r < R; ++r) {  // reduce16's a and b levels for keys 4q .. 4q+3
      const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(v[r][0], v[r][1]),
                                      _mm512_unpackhi_ps(v[r][0], v[r][1]));
      const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(v[r][2], v[r][3]),
                                      _mm512_unpackhi_ps(v[r][2], v[r][3]));
      const __m512d x = _mm512_castps_pd(a0), y = _mm512_castps_pd(a1);
      b[r][quarter] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
  }
  for (int r = 0; r < R; ++r) {  // reduce16's c level and the last
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[r][0], b[r][1], 0x88),
                                    _mm512_shuffle_f32x4(b[r][0], b[r][1], 0xdd));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[r][2], b[r][3], 0x88),
                                    _mm512_shuffle_f32x4(b[r][2], b[r][3], 0xdd));
    out[r] = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xdd));
  }
}
#endif

}  // namespace pagedserve::keys16

#endif  // __AVX512F__

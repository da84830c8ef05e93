// One row's way into an int8 matmul, shared by the ops that quantize a row (csrc/quant_cpu.cpp)
// and those that compute one and quantize it in the same pass (csrc/layers_cpu.cpp: the norm
// before a projection, SiLU-and-mul before the down projection): the optional Hadamard rotation
// of hadamard_rows and the per-row symmetric quantization of quantize_rows_int8.
//
// The arithmetic follows kernels/quant_linear.py's references operation for operation, so each
// file that includes this header compiles with multiply-add contraction off (its own pragma):
// the codes are then the same bit for bit whichever op produced them.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"

namespace pagedserve::quant {

// 1.5 * 2^23: adding and subtracting it leaves a float of magnitude below 2^22 rounded to an
// integer in the current (round-to-nearest-even) mode.
constexpr float kRound = 12582912.f;

// One row's codes: scale = max(amax / 127, FLT_MIN), code = clamp(round_even(x / scale)),
// stored as int8 or, for Code = uint8_t, plus 128 (the unsigned operand of vpdpbusd,
// csrc/linear_steps.h). Returns the scale.
template <typename Code, typename S>
float quantize_row(const S* __restrict xr, int64_t k, Code* __restrict qr) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(load(xr[i])));
  const float s = std::max(amax / 127.f, FLT_MIN);  // a zero row: codes 0, not 0 * inf
  const float inv = 1.f / s;
  constexpr int32_t bias = std::is_same_v<Code, uint8_t> ? 128 : 0;
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) {
    // round half to even by the float adder (|v| <= 127 here, far below 2^22), where
    // nearbyint would be a library call per element
    float v = (load(xr[i]) * inv + kRound) - kRound;
    v = v > 127.f ? 127.f : v;
    v = v < -127.f ? -127.f : v;
    qr[i] = static_cast<Code>(static_cast<int32_t>(v) + bias);
  }
  return s;
}

// A quantizing op's outputs for t rows of k: the codes (int8, or uint8 for codes plus 128) and
// the row scales in float32.
inline std::tuple<at::Tensor, at::Tensor> empty_codes(const at::Tensor& like, int64_t t, int64_t k,
                                                      at::ScalarType code) {
  return {at::empty({t, k}, like.options().dtype(code)),
          at::empty({t}, like.options().dtype(at::kFloat))};
}

inline void check_block(int64_t k, int64_t block, const char* op) {
  TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && k % block == 0, op,
              ": block must be a power of two dividing K = ", k, ", got ", block);
}

#if defined(__AVX512F__)
// Stages h0, 2 h0, ..., 2^(G-1) h0 of the transform of v [block, run], 16 columns at a time:
// the 2^G view rows j = base + m h0 (m < 2^G) that those stages pair among themselves are held
// in registers through all G stages, so the row buffer is read and written once per G stages
// (the runs are short: 24 floats at K = 1536, block 64). Each element sees the same adds and
// subtracts, in the same order, as stage by stage.
template <int G>
void stages_in_registers(float* v, int64_t block, int64_t run, int64_t h0) {
  constexpr int span = 1 << G;
  const int64_t group_bits = h0 * (span - 1);
  for (int64_t c = 0; c < run; c += 16) {
    const __mmask16 m =
        run - c >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (run - c)) - 1);
    for (int64_t base = 0; base < block; ++base) {
      if (base & group_bits) continue;
      __m512 r[span];
      for (int i = 0; i < span; ++i) r[i] = _mm512_maskz_loadu_ps(m, v + (base + i * h0) * run + c);
      for (int s = 1; s < span; s <<= 1) {
        for (int i = 0; i < span; ++i) {
          if (i & s) continue;
          const __m512 a = r[i], d = r[i + s];
          r[i] = _mm512_add_ps(a, d);
          r[i + s] = _mm512_sub_ps(a, d);
        }
      }
      for (int i = 0; i < span; ++i) _mm512_mask_storeu_ps(v + (base + i * h0) * run + c, m, r[i]);
    }
  }
}
#endif

// v [K] <- the transform of hadamard_rows, unnormalised, in place: the row seen as
// [block, K / block], each stage pairing view rows h apart (an add and a subtract of two
// contiguous runs of K / block floats).
inline void hadamard_in_place(float* v, int64_t k, int64_t block) {
  const int64_t run = k / block;
#if defined(__AVX512F__)
  for (int64_t h = 1; h < block; h *= 8) {
    const int64_t left = block / h;  // 2^(stages left)
    if (left >= 8) {
      stages_in_registers<3>(v, block, run, h);
    } else if (left == 4) {
      stages_in_registers<2>(v, block, run, h);
    } else {
      stages_in_registers<1>(v, block, run, h);
    }
  }
#else
  for (int64_t h = 1; h < block; h *= 2) {
    for (int64_t i = 0; i < block; i += 2 * h) {
      for (int64_t j = i; j < i + h; ++j) {
        float* __restrict p = v + j * run;
        float* __restrict q = v + (j + h) * run;
        for (int64_t c = 0; c < run; ++c) {
          const float a = p[c], d = q[c];
          p[c] = a + d;
          q[c] = a - d;
        }
      }
    }
  }
#endif
}

// A row of k that fill(v) writes into a float32 buffer v (each element a value of T), rotated in
// blocks of `block` (0: not) and rounded back to T, as hadamard_rows' output is, then quantized
// into q (quantize_row's codes). Returns the row's scale. The buffer is the calling thread's
// own, kept from row to row.
template <typename T, typename Code, typename Fill>
float rotate_and_quantize(int64_t k, int64_t block, Code* q, Fill&& fill) {
  thread_local std::vector<float> buf;
  buf.resize(k);
  float* v = buf.data();
  fill(v);
  if (block > 0) {
    hadamard_in_place(v, k, block);
    const float norm = 1.f / std::sqrt(static_cast<float>(block));
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) v[i] = load(store<T>(v[i] * norm));
  }
  return quantize_row(v, k, q);
}

}  // namespace pagedserve::quant

// The per-layer pointwise work of a decoder on CPU, one pass each: on small models at decode
// batch sizes these run once per layer per step, and as torch expressions each costs 4-8
// operator launches (casts, views, temporaries) for a few microseconds of arithmetic.
//
//   rms_norm(x [T, H], weight [H], eps) -> [T, H]       weight * (x * rsqrt(mean(x^2) + eps))
//   add_rms_norm_(residual [T, H], x [T, H], weight, eps) -> [T, H]
//                                                       residual += x, then rms_norm(residual)
//   rotary(q [T, Hq, D], k [T, Hkv, D], positions [T], cos [P, D/2], sin [P, D/2])
//       -> (q, k) rotated, contiguous                   half-rotation layout (Llama, Qwen)
//   silu_and_mul(x [T, 2I]) -> [T, I]                   silu(x[:, :I]) * x[:, I:]
//   add_rms_norm_quant_(residual, x, weight, eps, block), silu_and_mul_quant(x, block)
//       -> (q [T, K] uint8, scale [T] float32)          the op's output row rotated and
//                                                       quantized for an int8 matmul as it is
//                                                       computed: quantize_rows_uint8 of the
//                                                       output (csrc/quant_cpu.cpp) bit for bit
//   reshape_and_cache(key, value [T, Hkv, D], kv_cache [NB, 2, B, Hkv, D], slots [T],
//                     k_scale, v_scale)                 slot < 0: skipped; x / scale stored,
//                                                       narrowed to a bf16 or e4m3 cache
//
// Tensors are float32 or bfloat16 (one dtype per call; rotary's cos/sin tables stay float32, the
// cache may be bf16 under float32 keys, or e4m3 under either: kernels/kv_quant.py); inputs need
// unit stride in their last dim (q/k/v arrive as views of the fused qkv projection) and are
// otherwise read through their strides. The arithmetic is float32 whatever the storage (bf16
// widened as read, rounded once when written, bf16.h) and follows the torch expressions in
// pagedserve/workers/layers, up to summation order; RMSNorm also rounds where the reference
// does (the normalised row to the input dtype before the weight multiplies it, as Hugging Face
// does), so a bf16 norm matches the bf16 reference up to the sum of squares. No multiply-add
// contraction in this file: torch rounds each product of those expressions on its own, and the
// float32 rotary result then matches it bit for bit.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "bf16.h"
#include "fp8.h"
#include "keys16.h"
#include "quant_rows.h"
#include "rows.h"
#include "vec_exp.h"

namespace {

using pagedserve::bf16;
using pagedserve::check_rows;
using pagedserve::check_same_dtype;
using pagedserve::dispatch;
using pagedserve::fp8;
using pagedserve::grain_rows;
#if defined(__AVX512F__)
using pagedserve::keys16::load16;
#endif
using pagedserve::load;
using pagedserve::ptr;
using pagedserve::store;
using pagedserve::quant::check_block;
using pagedserve::quant::empty_codes;
using pagedserve::quant::rotate_and_quantize;

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x [T, H], weight [H]");
  check_same_dtype(x, weight, "rms_norm");
}

// A value computed in T as a row of O holds it: T itself, or (O float32, a row about to be
// quantized) the T value widened, exactly.
template <typename O, typename T>
inline O keep(T v) {
  if constexpr (std::is_same_v<O, T>) {
    return v;
  } else {
    return load(v);
  }
}

// One row: orow = w * T(xr * rsqrt(mean(xr^2) + eps)), the product rounded to T.
template <typename T, typename O>
inline void norm_row(const T* xr, const T* wp, int64_t h, double eps, O* orow) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += load(xr[i]) * load(xr[i]);
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    orow[i] = keep<O>(store<T>(load(wp[i]) * load(store<T>(load(xr[i]) * inv))));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const int64_t t = x.size(0), h = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({t, h}, x.options());
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    const T* wp = ptr<T>(weight);
    T* op = ptr<T>(out);
    at::parallel_for(0, t, grain_rows(h), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, h, eps, op + r * h);
    });
  });
  return out;
}

void check_add_args(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                    const char* op) {
  check_norm_args(residual, weight);
  check_rows(x, "x");
  check_same_dtype(residual, x, op);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == residual.size(0) && x.size(1) == residual.size(1),
              op, ": x and residual must both be [T, H]");
}

// The residual add of a decoder layer fused into the norm that follows it: one pass adds the
// sublayer's output into the residual stream (in place, rounded to its dtype as the reference's
// out-of-place add would be) and hands the sum to row(r, summed row, norm weight) while it is
// in cache; row runs on the parallel loop's threads.
template <typename Row>
void add_rows_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
               int64_t grain, Row&& row) {
  const int64_t t = x.size(0), h = x.size(1), rs = residual.stride(0), xs = x.stride(0);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    T* rp = ptr<T>(residual);
    const T* xp = ptr<T>(x);
    const T* wp = ptr<T>(weight);
    at::parallel_for(0, t, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        T* rr = rp + r * rs;
        const T* xr = xp + r * xs;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) rr[i] = store<T>(load(rr[i]) + load(xr[i]));
        row(r, static_cast<const T*>(rr), wp);
      }
    });
  });
}

at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  check_add_args(residual, x, weight, "add_rms_norm_");
  const int64_t h = x.size(1);
  at::Tensor out = at::empty({x.size(0), h}, x.options());
  void* op = out.data_ptr();
  add_rows_(residual, x, weight, grain_rows(h), [&](int64_t r, auto* rr, auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(rr)>>;
    norm_row(rr, wp, h, eps, static_cast<T*>(op) + r * h);
  });
  return out;
}

// add_rms_norm_ with the normed row quantized for an int8 projection as it is computed (csrc/
// quant_rows.h: rotated in blocks of `block` first, 0: not): the codes (plus 128) and row scales
// are quantize_rows_uint8(add_rms_norm_(...), block)'s bit for bit, without the normed row.
std::tuple<at::Tensor, at::Tensor> add_rms_norm_quant_(at::Tensor& residual, const at::Tensor& x,
                                                       const at::Tensor& weight, double eps,
                                                       int64_t block) {
  check_add_args(residual, x, weight, "add_rms_norm_quant_");
  const int64_t t = x.size(0), h = x.size(1);
  if (block > 0) check_block(h, block, "add_rms_norm_quant_");
  auto [q, scale] = empty_codes(x, t, h, at::kByte);
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  add_rows_(residual, x, weight, grain_rows(2 * h), [&](int64_t r, auto* rr, auto* wp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(rr)>>;
    sp[r] = rotate_and_quantize<T>(h, block, qp + r * h,
                                   [&](float* v) { norm_row(rr, wp, h, eps, v); });
  });
  return {q, scale};
}

// One [heads, D] row of a token: out = (x1 * c - x2 * s, x2 * c + x1 * s), float32 math.
template <typename T>
inline void rotate_row(const T* x, int64_t heads, int64_t head_stride, int64_t d,
                       const float* c, const float* s, T* out) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x1 = x + h * head_stride;
    const T* x2 = x1 + half;
    T* o1 = out + h * d;
    T* o2 = o1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = load(x1[i]), b = load(x2[i]);
      o1[i] = store<T>(a * c[i] - b * s[i]);
      o2[i] = store<T>(b * c[i] + a * s[i]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& positions, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_same_dtype(q, k, "rotary");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary: q [T, Hq, D], k [T, Hkv, D]");
  const int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2);
  TORCH_CHECK(d % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.size(1) == d / 2 && sin.sizes() == cos.sizes(),
              "rotary: cos, sin [P, D/2] float32 contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == t,
              "rotary: positions [T] int64");
  at::Tensor qo = at::empty({t, hq, d}, q.options());
  at::Tensor ko = at::empty({t, hk, d}, k.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < max_pos, "rotary: position ", pos[i],
                " outside the table of ", max_pos);
  }
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  dispatch(q, [&](auto tag) {
    using T = decltype(tag);
    const T* qp = ptr<T>(q);
    const T* kp = ptr<T>(k);
    T* qop = ptr<T>(qo);
    T* kop = ptr<T>(ko);
    at::parallel_for(0, t, grain_rows((hq + hk) * d), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* c = cp + pos[i] * (d / 2);
        const float* s = sp + pos[i] * (d / 2);
        rotate_row(qp + i * q.stride(0), hq, q.stride(1), d, c, s, qop + i * hq * d);
        rotate_row(kp + i * k.stride(0), hk, k.stride(1), d, c, s, kop + i * hk * d);
      }
    });
  });
  return {qo, ko};
}

#if defined(__AVX512F__)
// Lanes rounded to T as bf16.h's store<T> rounds one (bf16: nearest even, a NaN quiet), written
// as O: T itself, or float32 (keep). In registers: through a buffer and the compiler's vectorised
// store<T>, the bf16 row ran slower by about the time the exp16 loop saved.
template <typename T, typename O>
inline void store16(O* o, __m512 v) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i h = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    h = _mm512_mask_or_epi32(h, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    if constexpr (std::is_same_v<O, bf16>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(h));
    } else {
      _mm512_storeu_ps(o, _mm512_castsi512_ps(_mm512_slli_epi32(h, 16)));
    }
  } else {
    _mm512_storeu_ps(o, v);
  }
}
#endif

// silu(g) * u over one row of n, each product rounded to T (kept as O: keep). Where the build
// targets AVX-512, sixteen at a time with exp16 (vec_exp.h), the rest as below.
template <typename T, typename O>
inline void silu_row(const T* __restrict g, const T* __restrict u, int64_t n, O* __restrict o) {
  int64_t i0 = 0;
#if defined(__AVX512F__)
  const __m512i sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
  for (; i0 + 16 <= n; i0 += 16) {
    const __m512 gi = load16(g + i0);
    const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gi), sign)));
    const __m512 y = _mm512_div_ps(gi, _mm512_add_ps(_mm512_set1_ps(1.f), e));
    store16<T>(o + i0, _mm512_mul_ps(y, load16(u + i0)));
  }
#endif
#pragma omp simd
  for (int64_t i = i0; i < n; ++i) {
    const float gi = load(g[i]);
    o[i] = keep<O>(store<T>(gi / (1.f + vec_exp(-gi)) * load(u[i])));
  }
}

void check_silu_args(const at::Tensor& x, const char* op) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, op, ": x [T, 2I]");
}

// The parallel loop of the two SiLU ops: row(r, gate row, up row, n).
template <typename Row>
void silu_rows(const at::Tensor& x, Row&& row) {
  const int64_t t = x.size(0), n = x.size(1) / 2, xs = x.stride(0);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    at::parallel_for(0, t, grain_rows(3 * n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) row(r, xp + r * xs, xp + r * xs + n, n);
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_silu_args(x, "silu_and_mul");
  at::Tensor out = at::empty({x.size(0), x.size(-1) / 2}, x.options());
  void* op = out.data_ptr();
  silu_rows(x, [&](int64_t r, auto* g, auto* u, int64_t n) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    silu_row(g, u, n, static_cast<T*>(op) + r * n);
  });
  return out;
}

// silu_and_mul with its row quantized for the int8 down projection as it is computed (see
// add_rms_norm_quant_): quantize_rows_uint8(silu_and_mul(x), block) bit for bit.
std::tuple<at::Tensor, at::Tensor> silu_and_mul_quant(const at::Tensor& x, int64_t block) {
  check_silu_args(x, "silu_and_mul_quant");
  const int64_t t = x.size(0), n = x.size(-1) / 2;
  if (block > 0) check_block(n, block, "silu_and_mul_quant");
  auto [q, scale] = empty_codes(x, t, n, at::kByte);
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  silu_rows(x, [&](int64_t r, auto* g, auto* u, int64_t n) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    sp[r] = rotate_and_quantize<T>(n, block, qp + r * n, [&](float* v) { silu_row(g, u, n, v); });
  });
  return {q, scale};
}

// One head row of d elements into the cache as kv_quant.quantize_kv stores it: copied, or
// divided by the scale in float32 and narrowed to the cache's type (fp8 saturating).
template <typename S, typename C>
inline void copy_row(C* __restrict dst, const S* __restrict src, int64_t d, float scale) {
  if constexpr (std::is_same_v<S, C>) {
    if (scale == 1.f) {
      std::memcpy(dst, src, d * sizeof(C));
      return;
    }
  }
  if constexpr (std::is_same_v<C, fp8>) {  // scalar: a few dozen elements a token and head
    for (int64_t i = 0; i < d; ++i) dst[i] = store<fp8>(load(src[i]) / scale);
  } else {
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dst[i] = store<C>(load(src[i]) / scale);
  }
}

template <typename S, typename C, typename Slot>
void write_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const Slot* sp, float k_scale, float v_scale) {
  const int64_t t = key.size(0), hk = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t bs = kv_cache.size(2), limit = kv_cache.size(0) * bs;
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sp[i] < limit, "slot ", sp[i], " outside a cache of ", limit, " slots");
  }
  const S* kp = ptr<S>(key);
  const S* vp = ptr<S>(value);
  C* cache = reinterpret_cast<C*>(kv_cache.data_ptr());
  const int64_t row = hk * d;
  at::parallel_for(0, t, grain_rows(4 * row), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t slot = sp[i];
      if (slot < 0) continue;  // another rank's token under context parallelism
      C* kd = cache + ((slot / bs) * 2 * bs + slot % bs) * row;
      C* vd = kd + bs * row;
      for (int64_t h = 0; h < hk; ++h) {
        copy_row(kd + h * d, kp + i * key.stride(0) + h * key.stride(1), d, k_scale);
        copy_row(vd + h * d, vp + i * value.stride(0) + h * value.stride(1), d, v_scale);
      }
    }
  });
}

template <typename S, typename C>
void write_typed(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const at::Tensor& slots, float k_scale, float v_scale) {
  if (slots.scalar_type() == at::kLong) {
    write_slots<S, C>(key, value, kv_cache, slots.data_ptr<int64_t>(), k_scale, v_scale);
  } else {
    TORCH_CHECK(slots.scalar_type() == at::kInt, "slots must be int32 or int64");
    write_slots<S, C>(key, value, kv_cache, slots.data_ptr<int32_t>(), k_scale, v_scale);
  }
}

template <typename S>
void write_from(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                const at::Tensor& slots, float k_scale, float v_scale) {
  switch (kv_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return write_typed<S, fp8>(key, value, kv_cache, slots, k_scale, v_scale);
    case at::kBFloat16:
      return write_typed<S, bf16>(key, value, kv_cache, slots, k_scale, v_scale);
    default:
      return write_typed<S, float>(key, value, kv_cache, slots, k_scale, v_scale);
  }
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slots, double k_scale, double v_scale) {
  check_rows(key, "key");
  check_rows(value, "value");
  check_same_dtype(key, value, "reshape_and_cache");
  TORCH_CHECK(key.is_cpu() && value.is_cpu() && kv_cache.is_cpu() && slots.is_cpu(),
              "reshape_and_cache (CPU kernel): every tensor must be on the CPU");
  const auto st = key.scalar_type(), ct = kv_cache.scalar_type();
  TORCH_CHECK((ct == st || ct == at::kBFloat16 || ct == at::kFloat8_e4m3fn) &&
                  kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(1) == 2,
              "kv_cache [NB, 2, B, Hkv, D] contiguous, of the keys' dtype, bfloat16 or "
              "float8_e4m3fn");
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "k_scale and v_scale must be finite and > 0");
  TORCH_CHECK(key.dim() == 3 && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4) && value.sizes() == key.sizes() &&
                  slots.dim() == 1 && slots.numel() == key.size(0) && slots.is_contiguous(),
              "key, value [T, Hkv, D] matching the cache; slots [T]");
  const auto ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  if (st == at::kFloat) {
    write_from<float>(key, value, kv_cache, slots, ks, vs);
  } else {
    write_from<bf16>(key, value, kv_cache, slots, ks, vs);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> "
          "(Tensor, Tensor)");
  lib.def("silu_and_mul(Tensor x) -> Tensor");
  lib.def("add_rms_norm_quant_(Tensor(a!) residual, Tensor x, Tensor weight, float eps, "
          "int block) -> (Tensor, Tensor)");
  lib.def("silu_and_mul_quant(Tensor x, int block) -> (Tensor, Tensor)");
  lib.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots, "
          "float k_scale, float v_scale) -> ()");
  lib.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  lib.impl("add_rms_norm_", c10::DispatchKey::CPU, add_rms_norm_);
  lib.impl("rotary", c10::DispatchKey::CPU, rotary);
  lib.impl("silu_and_mul", c10::DispatchKey::CPU, silu_and_mul);
  lib.impl("add_rms_norm_quant_", c10::DispatchKey::CPU, add_rms_norm_quant_);
  lib.impl("silu_and_mul_quant", c10::DispatchKey::CPU, silu_and_mul_quant);
  lib.impl("reshape_and_cache", c10::DispatchKey::CPU, reshape_and_cache);
}

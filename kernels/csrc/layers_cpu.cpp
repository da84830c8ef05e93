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
//   reshape_and_cache(key, value [T, Hkv, D], kv_cache [NB, 2, B, Hkv, D], slots [T])
//                                                       slot < 0: skipped
//
// All float32; inputs need unit stride in their last dim (q/k/v arrive as views of the fused
// qkv projection) and are otherwise read through their strides. The arithmetic follows the
// torch expressions in pagedserve/workers/layers (float32 throughout), up to summation order.
// No multiply-add contraction in this file: torch rounds each product of those expressions on
// its own, and the rotary result then matches it bit for bit.
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

#include "vec_exp.h"

namespace {

// Rows per parallel task, for rows of `width` floats: a task of fewer than ~32K elements (the
// grain torch's own pointwise kernels use) costs more in the thread hand-off than it saves, so
// a decode step's few rows run on the calling thread.
inline int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, width));
}

void check_float_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, " must be float32");
  TORCH_CHECK(x.stride(-1) == 1, name, " needs unit stride in its last dim");
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == at::kFloat,
              "rms_norm: x [T, H] float32, weight [H] float32");
}

// One row: orow = w * (xr * rsqrt(mean(xr^2) + eps)).
inline void norm_row(const float* xr, const float* wp, int64_t h, double eps, float* orow) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) orow[i] = wp[i] * (xr[i] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  const int64_t t = x.size(0), h = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({t, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, grain_rows(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) norm_row(xp + r * xs, wp, h, eps, op + r * h);
  });
  return out;
}

// The residual add of a decoder layer fused into the norm that follows it: one pass adds the
// sublayer's output into the residual stream (in place, as the reference's out-of-place add
// would give) and normalises the sum while its row is in cache.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                         double eps) {
  check_norm_args(residual, weight);
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == residual.size(0) && x.size(1) == residual.size(1),
              "add_rms_norm_: x and residual must both be [T, H]");
  const int64_t t = x.size(0), h = x.size(1), rs = residual.stride(0), xs = x.stride(0);
  at::Tensor out = at::empty({t, h}, x.options());
  float* rp = residual.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, grain_rows(h), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* rr = rp + r * rs;
      const float* xr = xp + r * xs;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) rr[i] += xr[i];
      norm_row(rr, wp, h, eps, op + r * h);
    }
  });
  return out;
}

// One [heads, D] row of a token: out = (x1 * c - x2 * s, x2 * c + x1 * s).
inline void rotate_row(const float* x, int64_t heads, int64_t head_stride, int64_t d,
                       const float* c, const float* s, float* out) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x1 = x + h * head_stride;
    const float* x2 = x1 + half;
    float* o1 = out + h * d;
    float* o2 = o1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      o1[i] = x1[i] * c[i] - x2[i] * s[i];
      o2[i] = x2[i] * c[i] + x1[i] * s[i];
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& positions, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  check_float_rows(q, "q");
  check_float_rows(k, "k");
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
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qop = qo.data_ptr<float>();
  float* kop = ko.data_ptr<float>();
  at::parallel_for(0, t, grain_rows((hq + hk) * d), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = cp + pos[i] * (d / 2);
      const float* s = sp + pos[i] * (d / 2);
      rotate_row(qp + i * q.stride(0), hq, q.stride(1), d, c, s, qop + i * hq * d);
      rotate_row(kp + i * k.stride(0), hk, k.stride(1), d, c, s, kop + i * hk * d);
    }
  });
  return {qo, ko};
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_float_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x [T, 2I]");
  const int64_t t = x.size(0), n = x.size(1) / 2, xs = x.stride(0);
  at::Tensor out = at::empty({t, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, grain_rows(3 * n), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* g = xp + r * xs;
      const float* u = g + n;
      float* o = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + vec_exp(-g[i])) * u[i];
    }
  });
  return out;
}

template <typename Slot>
void write_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                 const Slot* sp) {
  const int64_t t = key.size(0), hk = kv_cache.size(3), d = kv_cache.size(4);
  const int64_t bs = kv_cache.size(2), limit = kv_cache.size(0) * bs;
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sp[i] < limit, "slot ", sp[i], " outside a cache of ", limit, " slots");
  }
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* cache = kv_cache.data_ptr<float>();
  const int64_t row = hk * d;
  at::parallel_for(0, t, grain_rows(4 * row), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t slot = sp[i];
      if (slot < 0) continue;  // another rank's token under context parallelism
      float* kd = cache + ((slot / bs) * 2 * bs + slot % bs) * row;
      float* vd = kd + bs * row;
      for (int64_t h = 0; h < hk; ++h) {
        std::memcpy(kd + h * d, kp + i * key.stride(0) + h * key.stride(1), d * sizeof(float));
        std::memcpy(vd + h * d, vp + i * value.stride(0) + h * value.stride(1),
                    d * sizeof(float));
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                       const at::Tensor& slots) {
  check_float_rows(key, "key");
  check_float_rows(value, "value");
  TORCH_CHECK(key.is_cpu() && value.is_cpu() && kv_cache.is_cpu() && slots.is_cpu(),
              "reshape_and_cache (CPU kernel): every tensor must be on the CPU");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat && kv_cache.is_contiguous() &&
                  kv_cache.dim() == 5 && kv_cache.size(1) == 2,
              "kv_cache [NB, 2, B, Hkv, D] float32 contiguous");
  TORCH_CHECK(key.dim() == 3 && key.size(1) == kv_cache.size(3) &&
                  key.size(2) == kv_cache.size(4) && value.sizes() == key.sizes() &&
                  slots.dim() == 1 && slots.numel() == key.size(0) && slots.is_contiguous(),
              "key, value [T, Hkv, D] matching the cache; slots [T]");
  if (slots.scalar_type() == at::kLong) {
    write_slots(key, value, kv_cache, slots.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(slots.scalar_type() == at::kInt, "slots must be int32 or int64");
    write_slots(key, value, kv_cache, slots.data_ptr<int32_t>());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("rotary(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  lib.def("silu_and_mul(Tensor x) -> Tensor");
  lib.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slots) -> ()");
  lib.impl("rms_norm", c10::DispatchKey::CPU, rms_norm);
  lib.impl("add_rms_norm_", c10::DispatchKey::CPU, add_rms_norm_);
  lib.impl("rotary", c10::DispatchKey::CPU, rotary);
  lib.impl("silu_and_mul", c10::DispatchKey::CPU, silu_and_mul);
  lib.impl("reshape_and_cache", c10::DispatchKey::CPU, reshape_and_cache);
}

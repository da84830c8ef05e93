// The two passes around an int8 x int8 -> int32 matmul (torch._int_mm) that make it a linear
// layer with float activations: at a batch of rows the weight-only int8 kernel runs one
// matrix-vector product per row, so a batched step quantizes its activations instead.
//
//   quantize_rows_int8(x [T, K]) -> (q [T, K] int8, scale [T] float32)
//       per row: scale = max(amax|x| / 127, FLT_MIN), q = clamp(round_even(x * (1 / scale)),
//       -127, 127)
//   dequantize_int32(acc [T, N] int32, row_scale [T], col_scale [N] float32, dtype)
//       -> [T, N] in dtype                              (acc * row_scale) * col_scale
//   hadamard_rows(x [T, K], block) -> [T, K] in x's dtype
//       each row, seen as a matrix [block, K / block], multiplied from the left by Sylvester's
//       Hadamard matrix H_block / sqrt(block) (orthonormal; block a power of two dividing K):
//       each group of `block` channels K / block apart is rotated. The online half of a rotation
//       whose other half is folded into the weight (kernels/quant_linear.py); the strided groups
//       make every butterfly of the fast Walsh-Hadamard transform an add and a subtract of two
//       contiguous runs of K / block elements, in float32. Its reference,
//       `hadamard_rows_ref`, is one matmul: the two agree to float32 rounding, not bit for bit.
//
// x is float32 or bfloat16 with unit stride in its last dim; the arithmetic is float32 and follows
// the torch expressions of kernels/quant_linear.py (`quantize_rows_int8_ref`,
// `dequantize_int32_ref`) operation for operation, so the results are identical to them: no
// multiply-add contraction, and nearbyint rounds half to even as torch.round does.
#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "bf16.h"
#include "rows.h"

namespace {

using pagedserve::check_rows;
using pagedserve::dispatch;
using pagedserve::grain_rows;
using pagedserve::load;
using pagedserve::ptr;
using pagedserve::store;

// 1.5 * 2^23: adding and subtracting it leaves a float of magnitude below 2^22 rounded to an
// integer in the current (round-to-nearest-even) mode.
constexpr float kRound = 12582912.f;

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "quantize_rows_int8: x [T, K]");
  const int64_t t = x.size(0), k = x.size(1), xs = x.stride(0);
  at::Tensor q = at::empty({t, k}, x.options().dtype(at::kChar));
  at::Tensor scale = at::empty({t}, x.options().dtype(at::kFloat));
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    at::parallel_for(0, t, grain_rows(2 * k), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* xr = xp + r * xs;
        float amax = 0.f;
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(load(xr[i])));
        const float s = std::max(amax / 127.f, FLT_MIN);  // a zero row: codes 0, not 0 * inf
        const float inv = 1.f / s;
        sp[r] = s;
        int8_t* qr = qp + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) {
          // round half to even by the float adder (|v| <= 127 here, far below 2^22), where
          // nearbyint would be a library call per element
          float v = (load(xr[i]) * inv + kRound) - kRound;
          v = v > 127.f ? 127.f : v;
          v = v < -127.f ? -127.f : v;
          qr[i] = static_cast<int8_t>(static_cast<int32_t>(v));
        }
      }
    });
  });
  return {q, scale};
}

at::Tensor dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale,
                            const at::Tensor& col_scale, at::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == at::kInt && acc.is_contiguous(),
              "dequantize_int32: acc [T, N] int32, contiguous");
  const int64_t t = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
                  row_scale.numel() == t && col_scale.scalar_type() == at::kFloat &&
                  col_scale.is_contiguous() && col_scale.numel() == n,
              "dequantize_int32: row_scale [T] and col_scale [N] float32, contiguous");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "dequantize_int32: dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({t, n}, acc.options().dtype(dtype));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* rs = row_scale.data_ptr<float>();
  const float* cs = col_scale.data_ptr<float>();
  dispatch(out, [&](auto tag) {
    using T = decltype(tag);
    T* op = ptr<T>(out);
    at::parallel_for(0, t, grain_rows(n), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const int32_t* ar = ap + r * n;
        const float s = rs[r];
        T* o = op + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = store<T>(static_cast<float>(ar[i]) * s * cs[i]);
      }
    });
  });
  return out;
}

// p, q <- p + q, p - q over n floats (two distinct runs of one row).
inline void butterfly(float* __restrict p, float* __restrict q, int64_t n) {
  for (int64_t c = 0; c < n; ++c) {
    const float a = p[c], d = q[c];
    p[c] = a + d;
    q[c] = a - d;
  }
}

at::Tensor hadamard_rows(const at::Tensor& x, int64_t block) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "hadamard_rows: x [T, K]");
  const int64_t t = x.size(0), k = x.size(1), xs = x.stride(0);
  TORCH_CHECK(block >= 1 && (block & (block - 1)) == 0 && k % block == 0,
              "hadamard_rows: block must be a power of two dividing K = ", k, ", got ", block);
  const int64_t run = k / block;  // the length of one row of the [block, K / block] view
  at::Tensor out = at::empty({t, k}, x.options());
  const float norm = 1.f / std::sqrt(static_cast<float>(block));
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    T* op = ptr<T>(out);
    at::parallel_for(0, t, grain_rows(4 * k), [&](int64_t b, int64_t e) {
      std::vector<float> buf(k);  // one row in float32
      float* v = buf.data();
      for (int64_t r = b; r < e; ++r) {
        const T* xr = xp + r * xs;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) v[i] = load(xr[i]);
        for (int64_t h = 1; h < block; h *= 2) {  // each stage pairs view rows h apart
          for (int64_t i = 0; i < block; i += 2 * h) {
            for (int64_t j = i; j < i + h; ++j) butterfly(v + j * run, v + (j + h) * run, run);
          }
        }
        T* o = op + r * k;
#pragma omp simd
        for (int64_t i = 0; i < k; ++i) o[i] = store<T>(v[i] * norm);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("hadamard_rows(Tensor x, int block) -> Tensor");
  lib.impl("hadamard_rows", c10::DispatchKey::CPU, hadamard_rows);
  lib.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  lib.def("dequantize_int32(Tensor acc, Tensor row_scale, Tensor col_scale, ScalarType dtype) "
          "-> Tensor");
  lib.impl("quantize_rows_int8", c10::DispatchKey::CPU, quantize_rows_int8);
  lib.impl("dequantize_int32", c10::DispatchKey::CPU, dequantize_int32);
}

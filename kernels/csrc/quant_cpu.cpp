// The two passes around an int8 x int8 -> int32 matmul (torch._int_mm) that make it a linear
// layer with float activations: at a batch of rows the weight-only int8 kernel runs one
// matrix-vector product per row, so a batched step quantizes its activations instead.
//
//   quantize_rows_int8(x [T, K]) -> (q [T, K] int8, scale [T] float32)
//       per row: scale = max(amax|x| / 127, FLT_MIN), q = clamp(round_even(x * (1 / scale)),
//       -127, 127)
//   dequantize_int32(acc [T, N] int32, row_scale [T], col_scale [N] float32, dtype)
//       -> [T, N] in dtype                              (acc * row_scale) * col_scale
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

#include "bf16.h"
#include "rows.h"

namespace {

using pagedserve::check_rows;
using pagedserve::dispatch;
using pagedserve::grain_rows;
using pagedserve::load;
using pagedserve::ptr;
using pagedserve::store;

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
          const float v = std::nearbyint(load(xr[i]) * inv);
          qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("quantize_rows_int8(Tensor x) -> (Tensor, Tensor)");
  lib.def("dequantize_int32(Tensor acc, Tensor row_scale, Tensor col_scale, ScalarType dtype) "
          "-> Tensor");
  lib.impl("quantize_rows_int8", c10::DispatchKey::CPU, quantize_rows_int8);
  lib.impl("dequantize_int32", c10::DispatchKey::CPU, dequantize_int32);
}

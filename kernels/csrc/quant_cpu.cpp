// The two passes around an int8 x int8 -> int32 matmul (torch._int_mm) that make it a linear
// layer with float activations: at a batch of rows the weight-only int8 kernel runs one
// matrix-vector product per row, so a batched step quantizes its activations instead.
//
//   quantize_rows_int8(x [T, K]) -> (q [T, K] int8, scale [T] float32)
//       per row: scale = max(amax|x| / 127, FLT_MIN), q = clamp(round_even(x * (1 / scale)),
//       -127, 127)
//   dequantize_int32(acc [T, N] int32, row_scale [T], col_scale [N] float32, dtype)
//       -> [T, N] in dtype                              (acc * row_scale) * col_scale
//   quantize_rows_uint8(x [T, K], block) -> (q [T, K] uint8, scale [T] float32)
//       hadamard_rows(x, block) (block 0: x itself), then quantize_rows_int8, in one pass per
//       row (the rotated row stays in a float32 buffer, rounded to x's dtype as hadamard_rows
//       rounds its output, so the codes are the two ops' bit for bit), each code stored plus
//       128: the unsigned operand of the int8 matmul's vpdpbusd (csrc/linear_cpu.cpp)
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
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "quant_rows.h"
#include "rows.h"

namespace {

using pagedserve::check_rows;
using pagedserve::dispatch;
using pagedserve::grain_rows;
using pagedserve::load;
using pagedserve::ptr;
using pagedserve::store;
using pagedserve::quant::check_block;
using pagedserve::quant::empty_codes;
using pagedserve::quant::hadamard_in_place;
using pagedserve::quant::quantize_row;
using pagedserve::quant::rotate_and_quantize;

// Both quantizing ops: x rotated in blocks of `block` (0: not), then quantized per row into
// codes of type Code (uint8_t: plus 128).
template <typename Code>
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, int64_t block,
                                                 const char* op) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, op, ": x [T, K]");
  const int64_t t = x.size(0), k = x.size(1), xs = x.stride(0);
  if (block > 0) check_block(k, block, op);
  auto [q, scale] =
      empty_codes(x, t, k, std::is_same_v<Code, uint8_t> ? at::kByte : at::kChar);
  Code* qp = static_cast<Code*>(q.data_ptr());
  float* sp = static_cast<float*>(scale.data_ptr());
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    const T* xp = ptr<T>(x);
    at::parallel_for(0, t, grain_rows((block > 0 ? 4 : 2) * k), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const T* xr = xp + r * xs;
        if (block == 0) {  // read in place: nothing to rotate
          sp[r] = quantize_row(xr, k, qp + r * k);
          continue;
        }
        sp[r] = rotate_and_quantize<T>(k, block, qp + r * k, [&](float* v) {
#pragma omp simd
          for (int64_t i = 0; i < k; ++i) v[i] = load(xr[i]);
        });
      }
    });
  });
  return {q, scale};
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x) {
  return quantize_rows<int8_t>(x, 0, "quantize_rows_int8");
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_uint8(const at::Tensor& x, int64_t block) {
  return quantize_rows<uint8_t>(x, block, "quantize_rows_uint8");
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

at::Tensor hadamard_rows(const at::Tensor& x, int64_t block) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2, "hadamard_rows: x [T, K]");
  const int64_t t = x.size(0), k = x.size(1), xs = x.stride(0);
  check_block(k, block, "hadamard_rows");
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
        hadamard_in_place(v, k, block);
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
  lib.def("quantize_rows_uint8(Tensor x, int block) -> (Tensor, Tensor)");
  lib.def("dequantize_int32(Tensor acc, Tensor row_scale, Tensor col_scale, ScalarType dtype) "
          "-> Tensor");
  lib.impl("quantize_rows_int8", c10::DispatchKey::CPU, quantize_rows_int8);
  lib.impl("quantize_rows_uint8", c10::DispatchKey::CPU, quantize_rows_uint8);
  lib.impl("dequantize_int32", c10::DispatchKey::CPU, dequantize_int32);
}

// Row helpers shared by the CPU kernel files: the parallel grain, argument checks, typed
// element pointers and the float32 / bf16 dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "bf16.h"

namespace pagedserve {

// Rows per parallel task, for rows of `width` floats: a task of fewer than ~32K elements (the
// grain torch's own pointwise kernels use) costs more in the thread hand-off than it saves, so
// a decode step's few rows run on the calling thread.
inline int64_t grain_rows(int64_t width) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, width));
}

inline bool is_compute_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
}

inline void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(is_compute_dtype(x), name, " must be float32 or bfloat16");
  TORCH_CHECK(x.stride(-1) == 1, name, " needs unit stride in its last dim");
}

inline void check_same_dtype(const at::Tensor& x, const at::Tensor& y, const char* what) {
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), what, ": tensors must share one dtype, got ",
              x.scalar_type(), " and ", y.scalar_type());
}

// Typed element pointers of a float32 or bf16 tensor (at::BFloat16 is one uint16_t, as bf16).
template <typename T>
T* ptr(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, float>) {
    return t.data_ptr<float>();
  } else {
    return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>());
  }
}

// Calls fn(T{}) with T the element type of x: float or bf16.
template <typename Fn>
auto dispatch(const at::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == at::kBFloat16) return fn(bf16{});
  return fn(float{});
}

}  // namespace pagedserve

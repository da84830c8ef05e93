// The index of each row's largest value, as torch.argmax(x, -1) gives it: the first index of
// the maximum, a NaN counted above every number (then the first NaN's index).
//
//   argmax_rows(x [N, V] float32, unit stride in V) -> [N] int64
//
// The sampler takes it over a step's logits (the greedy pick, and the exponential race of a
// random one). torch's CPU argmax carries its index through a reduction the compiler does not
// vectorise, many times the cost of a pass over the logits' bytes (docs/results/performance.md
// section 21 has the figures). Here a row is read in runs of kLanes: lane l keeps the largest
// value it has seen and that value's index, replaced only by a strictly larger one so that
// the earlier index wins a tie, and the lanes fold at the end (the smallest index among those
// holding the maximum). Plain C++ that the compiler vectorises for whatever the target has.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>

#include "rows.h"

namespace {

constexpr int64_t kLanes = 16;

int64_t row_argmax(const float* x, int64_t n) {
  int64_t lead = 0;  // the first index of the largest value read so far, top
  float top = x[0];
  bool nan = false;
  const int64_t full = n / kLanes * kLanes;
  if (full > 0) {
    float best[kLanes];
    int32_t at[kLanes];        // V < 2^31 (checked by the caller)
    int32_t odd[kLanes] = {};  // a NaN seen (an int per lane: a bool reduction stays scalar)
    for (int l = 0; l < kLanes; ++l) {
      best[l] = x[l];
      at[l] = l;
    }
    for (int64_t c = kLanes; c < full; c += kLanes) {
      const float* run = x + c;
#pragma omp simd
      for (int l = 0; l < kLanes; ++l) {
        const float v = run[l];
        odd[l] |= v != v;
        const bool gt = v > best[l];
        best[l] = gt ? v : best[l];
        at[l] = gt ? static_cast<int32_t>(c) + l : at[l];
      }
    }
    for (int l = 0; l < kLanes; ++l) nan |= odd[l] != 0 || best[l] != best[l];  // (run 0's)
    top = best[0];
    lead = at[0];
    for (int l = 1; l < kLanes; ++l) {
      if (best[l] > top || (best[l] == top && at[l] < lead)) {
        top = best[l];
        lead = at[l];
      }
    }
  }
  for (int64_t i = full; i < n; ++i) {  // the tail, after every run's index
    nan |= x[i] != x[i];
    if (x[i] > top) {
      top = x[i];
      lead = i;
    }
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] != x[i]) return i;
    }
  }
  return lead;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: x [N, V] float32 with unit stride in V");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0 && n < std::numeric_limits<int32_t>::max(),
              "argmax_rows: rows of 1 to 2^31 - 2 values, got ", n);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* base = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, pagedserve::grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_argmax(base + r * stride, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("argmax_rows(Tensor x) -> Tensor");
  lib.impl("argmax_rows", c10::DispatchKey::CPU, argmax_rows);
}

// The linear layers' matmul, y = x W^T (+ b), on a weight packed once into column tiles.
//
//   linear_tiled(x [T, K], w_tiled, bias [N] or None) -> [T, N] in x's dtype (= w's)
//       bfloat16: w_tiled [N/32, K/2, 32, 2], w_tiled[t, p, c, j] = W[32 t + c, 2 p + j]
//       float32:  w_tiled [N/32, K, 32],      w_tiled[t, k, c]    = W[32 t + c, k]
//   int8_linear_tiled(x [T, K] float32 or bf16, q_tiled [N/32, K/4, 32, 4] int8,
//                     offset [N] int32, col_scale [N] float32, bias [N] or None,
//                     hadamard) -> [T, N]
//       kernels/quant_linear.py's dynamic int8 path: x rotated in blocks of `hadamard` columns
//       (0: not) and quantized per row (scale r), the int8 products summed exactly,
//       ((sum - offset) as float32 * r) * col_scale; offset = 128 x the column's code sum (see
//       I8 below)
//   int8_linear_codes(codes [T, K] uint8, row_scale [T], q_tiled, offset, col_scale, bias,
//                     dtype) -> [T, N]
//       the same on rows already quantized (codes plus 128, as quantize_rows_uint8 and the
//       *_quant ops of csrc/layers_cpu.cpp write them)
//   linear_tiled_dtypes() -> int        which weight dtypes this build serves: 1 float32,
//                                       2 bfloat16, 4 int8
//
// Why a kernel of our own: at one to a few rows (a decode step) a matmul reads every weight
// once and does little arithmetic on it, so its speed is the speed of the weight stream; oneDNN's
// matmul, called per row count, read a streamed weight at about two thirds of what a sum over
// memory reaches here, and paid a fixed cost per call that a 30-layer model pays 121 times a
// token. One tile is 32 output columns over the whole K: each step of the K loop reads 128
// contiguous bytes (32 columns x 2 k in bf16, 32 columns x 1 k in float32),
// a thread reads its tiles as one contiguous stream, left to the hardware prefetcher. (The
// engine's weights sit in 2 MiB pages, workers/huge_pages.py; there a software prefetch 2-64
// KiB ahead read slower than none, and 4 KiB pages were the one case it helped, by 2-3%:
// benchmarks/scripts/linear_ab.py, docs/results/performance.md section 12.)
//
// Arithmetic: bf16 weights multiply bf16 activations with vdpbf16ps (each product exact in
// float32, pairs of k summed in float32; on AVX2 widened and multiplied-added by FMA, equally
// exact), float32 with FMA; both accumulate in float32 and round
// the result once to x's dtype (bf16: round to nearest even). int8 codes multiply int8
// activation codes with vpdpbusd (four k a lane, exact int32 sums), so its result is the
// unfused path's (torch._int_mm, then dequantize_int32) exactly, up to where the bias is added.
// The bias is added in float32 before the rounding. Summation order differs from oneDNN's and
// MKL's; the parity tests (tests/kernels/test_linear.py) hold it to float64 at each dtype's
// tolerance.
//
// Rows (AVX-512; linear_steps.h gives AVX2's counts): up to four rows share one pass over a
// tile, with two accumulator chains per vector (odd and even k steps) so that a single row still
// keeps four multiply-adds in flight. Beyond four, rows go in blocks of eight (sixteen chains),
// 64 rows at a time against each tile, so that a chunk's activations stay in L2 while the tiles
// stream past; the work items are (row chunk, tile) pairs, chunk-major, split between the
// threads. Only the first block of rows reads a tile from memory, and it waited on those reads:
// a software prefetch of the thread's next tile during the current one (run) hides them. A few
// rows' passes keep the hardware prefetcher alone (above).
//
// Built where the compiler targets AVX-512 (F for float32, BF16 for bf16, VNNI for int8) or AVX2
// with FMA (float32, and bf16 weights widened as they are read): csrc/linear_steps.h holds what
// a step of the K loop is for each; elsewhere linear_tiled_dtypes() leaves the bit out and
// kernels/linear.py and kernels/quant_linear.py keep oneDNN's, torch's or aten's quantized
// matmuls.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "linear_steps.h"

namespace {

using namespace pagedserve::tiles;  // the step types, V, kLanes and the block sizes

constexpr int64_t kTile = 32;  // output columns per tile
constexpr int64_t kChunkRows = 64;

#if defined(PAGEDSERVE_TILED)

// The output vectors of n accumulators (n / D::kPairs of them) into out.
template <class D>
inline int fold(const V* acc, int n, V* out) {
#pragma GCC unroll 16
  for (int v = 0; v < n; v += D::kPairs) {
    out[v / D::kPairs] = D::pair_sum(acc[v], acc[v + D::kPairs - 1]);
  }
  return n / D::kPairs;
}

// Writes n vectors of a row's columns from col on, from float32 accumulators, plus the bias.
template <class T>
struct Plain {
  T* out;
  int64_t os;
  const T* bias;  // [N] or null
  void store(int64_t row, int64_t col, const V* acc, int n) const {
    for (int v = 0; v < n; ++v) {
      const int64_t c = col + v * kLanes;
      vstore(out + row * os + c, bias != nullptr ? vadd(acc[v], vload_out(bias + c)) : acc[v]);
    }
  }
};

#if defined(__AVX512VNNI__)
// The int8 epilogue: (sum - 128 colsum) as float32, times the row's scale, times the column's
// (two roundings, in dequantize_int32's order), plus the bias.
template <class T>
struct Dequant {
  T* out;
  int64_t os;
  const T* bias;
  const int32_t* offset;  // [N] 128 x the column's code sum
  const float* col_scale;  // [N]
  const float* row_scale;  // [T]
  void store(int64_t row, int64_t col, const V* acc, int n) const {
    for (int v = 0; v < n; ++v) {
      const int64_t c = col + v * kLanes;
      const __m512i exact = _mm512_sub_epi32(_mm512_castps_si512(acc[v]),
                                             _mm512_loadu_si512(offset + c));
      __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(row_scale[row]));
      y = _mm512_mul_ps(y, _mm512_loadu_ps(col_scale + c));
      vstore(out + row * os + c, bias != nullptr ? _mm512_add_ps(y, vload_out(bias + c)) : y);
    }
  }
};
#endif

// Up to D::kFew rows over one tile: w the tile, steps = K / kPerStep, x's rows xs elements
// apart, writing rows row0.. at column col. C chains per vector (consecutive k steps) keep a
// single row's multiply-adds in flight: two where the registers hold them (M x D::kVecs x 2 <=
// kChainRegs), else one.
template <class D, int M, class Out>
void few_rows(const typename D::W* w, int64_t steps, const typename D::X* x, int64_t xs,
              const Out& out, int64_t row0, int64_t col) {
  constexpr int kVecs = D::kVecs;
  constexpr int64_t kVec = kStepBytes / kVecs / sizeof(typename D::W);  // elements per vector
  constexpr int C = M * kVecs * 2 <= kChainRegs ? 2 : 1;
  V acc[M][C][kVecs];  // [row][k step mod C][vector]
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) acc[m][c][v] = vzero();
  int64_t p = 0;
  for (; p + C <= steps; p += C) {
    const auto* s = w + p * kVecs * kVec;
    V a[C][kVecs];
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) a[c][v] = D::load(s + (c * kVecs + v) * kVec);
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const V xc = D::bcast(x + m * xs, p + c);
#pragma GCC unroll 16
        for (int v = 0; v < kVecs; ++v) acc[m][c][v] = D::madd(acc[m][c][v], a[c][v], xc);
      }
  }
  if (p < steps) {  // one step left over where C = 2 and steps is odd
    const auto* s = w + p * kVecs * kVec;
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const V xa = D::bcast(x + m * xs, p);
#pragma GCC unroll 16
      for (int v = 0; v < kVecs; ++v) {
        acc[m][0][v] = D::madd(acc[m][0][v], D::load(s + v * kVec), xa);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    V sum[kVecs], outv[kVecs];
#pragma GCC unroll 16
    for (int v = 0; v < kVecs; ++v) sum[v] = C == 2 ? D::combine(acc[m][0][v], acc[m][C - 1][v])
                                                   : acc[m][0][v];
    out.store(row0 + m, col, outv, fold<D>(sum, kVecs, outv));
  }
}

// A block of R rows over vectors [v0, v0 + kBlockVecs) of each step of one tile (columns
// col + v0 / D::kPairs * kLanes on), one chain per (row, vector). ahead (null: none): lines of
// another tile asked into L2, one a step from ahead on (whole_tile: a tile's 2 x steps lines,
// two a step), for run's read-ahead.
template <class D, int R, class Out>
void row_block(const typename D::W* w, int64_t steps, const typename D::X* x, int64_t xs,
               const Out& out, int64_t row0, int64_t col, int v0, const char* ahead,
               bool whole_tile) {
  constexpr int64_t kVec = kStepBytes / D::kVecs / sizeof(typename D::W);
  V acc[R][kBlockVecs];
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < kBlockVecs; ++v) acc[m][v] = vzero();
  for (int64_t p = 0; p < steps; ++p) {
    if (ahead != nullptr) {
      _mm_prefetch(ahead + p * 64, _MM_HINT_T1);
      if (whole_tile) _mm_prefetch(ahead + (steps + p) * 64, _MM_HINT_T1);
    }
    const auto* s = w + (p * D::kVecs + v0) * kVec;
    V a[kBlockVecs];
#pragma GCC unroll 16
    for (int v = 0; v < kBlockVecs; ++v) a[v] = D::load(s + v * kVec);
#pragma GCC unroll 16
    for (int m = 0; m < R; ++m) {
      const V xa = D::bcast(x + m * xs, p);
#pragma GCC unroll 16
      for (int v = 0; v < kBlockVecs; ++v) acc[m][v] = D::madd(acc[m][v], a[v], xa);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < R; ++m) {
    // Folded into a copy for the store to take by address: were acc's own address to escape,
    // the compiler would store every accumulator to the stack at each step of the loop above.
    V outv[kBlockVecs];
    const int n = fold<D>(acc[m], kBlockVecs, outv);
    out.store(row0 + m, col + v0 / D::kPairs * kLanes, outv, n);
  }
}

// row_block<D, rows> for a run-time rows in [1, R].
template <class D, int R, class Out>
void row_block_of(int rows, const typename D::W* w, int64_t steps, const typename D::X* x,
                  int64_t xs, const Out& out, int64_t row0, int64_t col, int v0,
                  const char* ahead, bool whole_tile) {
  if constexpr (R > 0) {
    if (rows == R) return row_block<D, R>(w, steps, x, xs, out, row0, col, v0, ahead, whole_tile);
    row_block_of<D, R - 1>(rows, w, steps, x, xs, out, row0, col, v0, ahead, whole_tile);
  }
}

// few_rows<D, t> for a run-time t in [1, M].
template <class D, int M, class Out>
void few_rows_of(int64_t t, const typename D::W* w, int64_t steps, const typename D::X* x,
                 int64_t xs, const Out& out, int64_t col) {
  if constexpr (M > 0) {
    if (t == M) return few_rows<D, M>(w, steps, x, xs, out, 0, col);
    few_rows_of<D, M - 1>(t, w, steps, x, xs, out, col);
  }
}

// x [t, K] (rows xs elements apart) against the tiled weight w of `tiles` tiles.
template <class D, class Out>
void run(const typename D::X* xp, int64_t t, int64_t xs, int64_t k, const typename D::W* wp,
         int64_t tiles, const Out& out) {
  const int64_t steps = k / D::kPerStep;
  const int64_t tile_elems = steps * kStepBytes / sizeof(typename D::W);
  // A call of fewer than ~32K weight elements runs on the calling thread.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, tile_elems));
  if (t <= D::kFew) {
    at::parallel_for(0, tiles, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        few_rows_of<D, D::kFew>(t, wp + i * tile_elems, steps, xp, xs, out, i * kTile);
    });
    return;
  }
  const int64_t chunks = (t + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = i / tiles, tile = i % tiles;
      const auto* wt = wp + tile * tile_elems;
      const int64_t begin = c * kChunkRows, end = std::min(t, begin + kChunkRows);
      // The tile this thread takes next, into L2 while this one's later row blocks read it from
      // cache: the first and second row blocks each ask for half of its lines, a line a step,
      // so the next item's first row block reads its tile from L2, not from memory. A chunk of
      // one block asks for all of them in it; only int8's, whose half-length tiles streamed
      // below the memory's speed there, where bf16's streamed near it and slowed down.
      const bool one_block = end - begin <= kBlockRows;
      const char* next = i + 1 < hi && (!one_block || sizeof(typename D::W) == 1)
                             ? reinterpret_cast<const char*>(wp + (i + 1) % tiles * tile_elems)
                             : nullptr;
      for (int64_t r = begin; r < end; r += kBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, end - r));
        const int64_t half = (r - begin) / kBlockRows;  // 0, 1: this block's half of the lines
        const char* ahead = next != nullptr && half < 2 ? next + half * steps * 64 : nullptr;
        for (int v0 = 0; v0 < D::kVecs; v0 += kBlockVecs)
          row_block_of<D, kBlockRows>(rows, wt, steps, xp + r * xs, xs, out, r, tile * kTile, v0,
                                      v0 == 0 ? ahead : nullptr, one_block);
      }
    }
  });
}

// bf16 x [t, K] (rows xs apart) against a bf16 tiled weight. Where D multiplies in float32
// (AVX2), x is widened here, once, rather than a k pair at every step of every tile, into a
// plain buffer (a tensor's allocation and copy weighed on a decode step's matmuls:
// docs/results/performance.md section 14), kWideRows rows at a time so that a long prefill
// chunk's buffer stays a few MB.
constexpr int64_t kWideRows = 4 * kChunkRows;

template <class D>
void run_bf16(const uint16_t* x, int64_t t, int64_t xs, int64_t k, const uint16_t* w,
              int64_t tiles, const Plain<uint16_t>& out) {
  if constexpr (std::is_same_v<typename D::X, float>) {
    std::vector<float> wide(static_cast<size_t>(std::min(t, kWideRows) * k));
    for (int64_t r0 = 0; r0 < t; r0 += kWideRows) {
      const int64_t rows = std::min(kWideRows, t - r0);
      for (int64_t r = 0; r < rows; ++r) {
        const auto* row = reinterpret_cast<const pagedserve::bf16*>(x + (r0 + r) * xs);
        float* dst = wide.data() + r * k;
#pragma omp simd
        for (int64_t c = 0; c < k; ++c) dst[c] = pagedserve::load(row[c]);
      }
      run<D>(wide.data(), rows, k, k, w, tiles,
             Plain<uint16_t>{out.out + r0 * out.os, out.os, out.bias});
    }
  } else {
    run<D>(x, t, xs, k, w, tiles, out);
  }
}

#endif  // PAGEDSERVE_TILED

// Which weight dtypes this build serves (kernels/linear.py and kernels/quant_linear.py ask).
int64_t linear_tiled_dtypes() {
  int64_t served = 0;
#if defined(PAGEDSERVE_TILED)
  served |= 1;
#endif
#if defined(__AVX512BF16__) || (defined(PAGEDSERVE_TILED) && !defined(__AVX512F__))
  served |= 2;
#endif
#if defined(__AVX512VNNI__)
  served |= 4;
#endif
  return served;
}

int64_t dtype_bit(at::ScalarType w) {
  return w == at::kFloat ? 1 : w == at::kBFloat16 ? 2 : w == at::kChar ? 4 : 0;
}

// The checks every tiled op shares: w a contiguous tiled weight this build serves, for rows of
// k columns, and the bias [N] in the output's dtype.
void check_tiled_weight(const at::Tensor& w, int64_t k, at::ScalarType out_dtype,
                        const std::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(linear_tiled_dtypes() & dtype_bit(w.scalar_type()), op,
              ": this build has no tiled kernel for ", w.scalar_type());
  // k per step of the K loop: the layout's last dim (float32 has none)
  const at::ScalarType wt = w.scalar_type();
  const int64_t per_step = wt == at::kFloat ? 1 : wt == at::kBFloat16 ? 2 : 4;
  TORCH_CHECK(w.is_contiguous() && w.dim() == (per_step == 1 ? 3 : 4) && w.size(2) == kTile &&
                  (per_step == 1 || w.size(3) == per_step),
              op, ": w must be a contiguous tiled weight");
  TORCH_CHECK(w.size(1) * per_step == k, op, ": the input has ", k, " columns, the weight ",
              w.size(1) * per_step);
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == w.size(0) * kTile &&
                                    bias->scalar_type() == out_dtype),
              op, ": bias [N] in the output's dtype, contiguous");
}

// x [T, K] float32 or bf16 against a tiled weight, the result (and the bias) in out_dtype.
void check_tiled(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 at::ScalarType out_dtype, const char* op) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x [T, K] float32 or bfloat16");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, op,
              ": dtype must be float32 or bfloat16");
  check_tiled_weight(w, x.size(1), out_dtype, bias, op);
}

template <class T>
const T* bias_ptr(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr;
}

at::Tensor linear_tiled(const at::Tensor& x_in, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  check_tiled(x_in, w, bias, x_in.scalar_type(), "linear_tiled");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x_in.scalar_type() == w.scalar_type(), "linear_tiled: x in the weight's dtype");
  // bf16 rows are read as 32-bit k pairs: unit stride, an even row stride, a 4-byte start.
  const bool readable = x_in.stride(1) == 1 &&
                        (!bf16 || (x_in.stride(0) % 2 == 0 &&
                                   reinterpret_cast<uintptr_t>(x_in.data_ptr()) % 4 == 0));
  const at::Tensor x = readable ? x_in : x_in.contiguous();
  const int64_t t = x.size(0), k = x.size(1), tiles = w.size(0), n = tiles * kTile;
  at::Tensor out = at::empty({t, n}, x.options());
  if (t == 0) return out;
#if defined(PAGEDSERVE_TILED)
#if defined(__AVX512BF16__) || !defined(__AVX512F__)
  if (bf16) {
    using E = uint16_t;
    run_bf16<BF16>(static_cast<const E*>(x.data_ptr()), t, x.stride(0), k,
                   static_cast<const E*>(w.data_ptr()), tiles,
                   Plain<E>{static_cast<E*>(out.data_ptr()), n, bias_ptr<E>(bias)});
    return out;
  }
#endif
  run<F32>(x.data_ptr<float>(), t, x.stride(0), k, w.data_ptr<float>(), tiles,
           Plain<float>{out.data_ptr<float>(), n, bias_ptr<float>(bias)});
#endif
  return out;
}

using QuantizeRows = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, int64_t);

// The checks of the int8 epilogue's vectors against a weight of N = tiles * 32 columns.
void check_int8_epilogue(const at::Tensor& w, const at::Tensor& offset,
                         const at::Tensor& col_scale, const char* op) {
  TORCH_CHECK(w.scalar_type() == at::kChar, op, ": w must hold int8 codes");
  const int64_t n = w.size(0) * kTile;
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.is_contiguous() && offset.numel() == n &&
                  col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() &&
                  col_scale.numel() == n,
              op, ": offset [N] int32 and col_scale [N] float32, contiguous");
}

// The codes (plus 128) [T, K] times w through the Dequant epilogue, into out [T, N].
void int8_matmul(const at::Tensor& codes, const at::Tensor& row_scale, const at::Tensor& w,
                 const at::Tensor& offset, const at::Tensor& col_scale,
                 const std::optional<at::Tensor>& bias, at::Tensor& out) {
#if defined(__AVX512VNNI__)
  const int64_t t = codes.size(0), k = codes.size(1), tiles = w.size(0), n = tiles * kTile;
  auto go = [&](auto* o) {
    using E = std::remove_pointer_t<decltype(o)>;
    run<I8>(codes.data_ptr<uint8_t>(), t, k, k, w.data_ptr<int8_t>(), tiles,
            Dequant<E>{o, n, bias_ptr<E>(bias), offset.data_ptr<int32_t>(),
                       col_scale.data_ptr<float>(), row_scale.data_ptr<float>()});
  };
  if (out.scalar_type() == at::kBFloat16) {
    go(static_cast<uint16_t*>(out.data_ptr()));
  } else {
    go(out.data_ptr<float>());
  }
#endif
}

// x rotated (hadamard > 0) and quantized per row (csrc/quant_cpu.cpp's quantize_rows_uint8),
// times the int8 codes w, through the Dequant epilogue: kernels/quant_linear.py's dynamic path
// in one call. The result in dtype (default x's; float32 for the LM head's logits, which then
// skip a rounding to bf16 and a widening pass), the bias in that dtype.
at::Tensor int8_linear_tiled(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offset,
                             const at::Tensor& col_scale, const std::optional<at::Tensor>& bias,
                             int64_t hadamard, std::optional<at::ScalarType> dtype) {
  check_int8_epilogue(w, offset, col_scale, "int8_linear_tiled");
  const at::ScalarType out_dtype = dtype.value_or(x.scalar_type());
  check_tiled(x, w, bias, out_dtype, "int8_linear_tiled");
  at::Tensor out = at::empty({x.size(0), w.size(0) * kTile}, x.options().dtype(out_dtype));
  if (x.size(0) == 0) return out;
  static const auto quantize = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("pagedserve_cpu::quantize_rows_uint8", "")
                                   .typed<QuantizeRows>();
  const auto [q, row_scale] = quantize.call(x.stride(1) == 1 ? x : x.contiguous(), hadamard);
  int8_matmul(q, row_scale, w, offset, col_scale, bias, out);
  return out;
}

// int8_linear_tiled on rows already quantized (csrc/layers_cpu.cpp's *_quant ops, which
// quantize the row they compute): codes [T, K] uint8 (plus 128), row_scale [T] float32, the
// result in dtype.
at::Tensor int8_linear_codes(const at::Tensor& codes, const at::Tensor& row_scale,
                             const at::Tensor& w, const at::Tensor& offset,
                             const at::Tensor& col_scale, const std::optional<at::Tensor>& bias,
                             at::ScalarType dtype) {
  check_int8_epilogue(w, offset, col_scale, "int8_linear_codes");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "int8_linear_codes: codes [T, K] uint8, contiguous");
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
                  row_scale.numel() == codes.size(0),
              "int8_linear_codes: row_scale [T] float32, contiguous");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "int8_linear_codes: dtype must be float32 or bfloat16");
  check_tiled_weight(w, codes.size(1), dtype, bias, "int8_linear_codes");
  at::Tensor out = at::empty({codes.size(0), w.size(0) * kTile}, codes.options().dtype(dtype));
  if (codes.size(0) > 0) int8_matmul(codes, row_scale, w, offset, col_scale, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("linear_tiled(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  lib.def("int8_linear_tiled(Tensor x, Tensor w, Tensor offset, Tensor col_scale, Tensor? bias, "
          "int hadamard=0, ScalarType? dtype=None) -> Tensor");
  lib.impl("int8_linear_tiled", c10::DispatchKey::CPU, int8_linear_tiled);
  lib.def("int8_linear_codes(Tensor codes, Tensor row_scale, Tensor w, Tensor offset, "
          "Tensor col_scale, Tensor? bias, ScalarType dtype) -> Tensor");
  lib.impl("int8_linear_codes", c10::DispatchKey::CPU, int8_linear_codes);
  lib.def("linear_tiled_dtypes() -> int", linear_tiled_dtypes);
  lib.impl("linear_tiled", c10::DispatchKey::CPU, linear_tiled);
}

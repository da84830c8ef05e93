// The linear layers' matmul, y = x W^T (+ b), on a weight packed once into column tiles.
//
//   linear_tiled(x [T, K], w_tiled, bias [N] or None) -> [T, N] in x's dtype (= w's)
//       bfloat16: w_tiled [N/32, K/2, 32, 2], w_tiled[t, p, c, j] = W[32 t + c, 2 p + j]
//       float32:  w_tiled [N/32, K, 32],      w_tiled[t, k, c]    = W[32 t + c, k]
//   int8_linear_tiled(x [T, K] float32 or bf16, q_tiled [N/32, K/4, 32, 4] int8,
//                     offset [N] int32, col_scale [N] float32, bias [N] or None) -> [T, N]
//       kernels/quant_linear.py's dynamic int8 path: x quantized per row (scale r), the int8
//       products summed exactly, ((sum - offset) as float32 * r) * col_scale; offset = 128 x the
//       column's code sum (see I8 below)
//   linear_tiled_dtypes() -> int        which weight dtypes this build serves: 1 float32,
//                                       2 bfloat16, 4 int8
//
// Why a kernel of our own: at one to a few rows (a decode step) a matmul reads every weight
// once and does little arithmetic on it, so its speed is the speed of the weight stream; oneDNN's
// matmul, called per row count, read a streamed weight at about two thirds of what a sum over
// memory reaches here, and paid a fixed cost per call that a 30-layer model pays 121 times a
// token. One tile is 32 output columns over the whole K: each step of the K loop reads 128
// contiguous bytes (two 512-bit vectors: 32 columns x 2 k in bf16, 32 columns x 1 k in float32),
// a thread reads its tiles as one contiguous stream, left to the hardware prefetcher. (The
// engine's weights sit in 2 MiB pages, workers/huge_pages.py; there a software prefetch 2-64
// KiB ahead read slower than none, and 4 KiB pages were the one case it helped, by 2-3%:
// benchmarks/scripts/linear_ab.py, docs/results/performance.md section 12.)
//
// Arithmetic: bf16 weights multiply bf16 activations with vdpbf16ps (each product exact in
// float32, pairs of k summed in float32), float32 with FMA; both accumulate in float32 and round
// the result once to x's dtype (bf16: round to nearest even). int8 codes multiply int8
// activation codes with vpdpbusd (four k a lane, exact int32 sums), so its result is the
// unfused path's (torch._int_mm, then dequantize_int32) exactly, up to where the bias is added.
// The bias is added in float32 before the rounding. Summation order differs from oneDNN's and MKL's; the parity tests
// (tests/kernels/test_linear.py) hold it to float64 at each dtype's tolerance.
//
// Rows: up to four rows share one pass over a tile, with two accumulator chains per vector (odd
// and even k steps) so that a single row still keeps four multiply-adds in flight. Beyond four,
// rows go in blocks of eight (sixteen chains), 64 rows at a time against each tile, so that a
// chunk's activations stay in L2 while the tiles stream past; the work items are (row chunk,
// tile) pairs, chunk-major, split between the threads.
//
// Built where the compiler targets AVX-512 (F for float32, BF16 for bf16, VNNI for int8) or,
// for float32 alone, AVX2 with FMA (a step is then four 256-bit vectors, and a block six rows
// over half a tile: see the AVX2 constants below); elsewhere linear_tiled_dtypes() leaves the bit out and
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAGEDSERVE_TILED 1
#endif

namespace {

constexpr int64_t kTile = 32;        // output columns per tile
constexpr int64_t kStepBytes = 128;  // bytes of a tile per step of the K loop
constexpr int64_t kChunkRows = 64;

#if defined(__AVX512F__)

// One vector of 16 float32 lanes (int32 for int8's sums, reinterpreted); a step of a tile is
// two of them. 32 registers hold four rows' accumulators with two chains each (few_rows), or
// eight rows' over the whole tile with one (row_block).
using V = __m512;
constexpr int kLanes = 16;
constexpr int kFewRows = 4;
constexpr int kChainRegs = 16;
constexpr int kBlockRows = 8;
constexpr int kBlockVecs = 2;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vload(const void* p) { return _mm512_loadu_ps(p); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline void vstore(float* o, V v) { _mm512_storeu_ps(o, v); }
inline V vload_out(const float* b) { return _mm512_loadu_ps(b); }

#elif defined(PAGEDSERVE_TILED)

// AVX2 (float32 only): a vector is 8 lanes, a step of a tile four of them, and 16 registers
// hold one row with two chains per vector or four rows with one (few_rows, whose weight
// vectors the multiply-adds read from memory), or six rows over half the tile (row_block: each
// weight vector loaded feeds six multiply-adds, where a whole tile's four vectors fit beside
// only two or three rows, whose blocks streamed the tile from L2 at half oneDNN's speed).
using V = __m256;
constexpr int kLanes = 8;
constexpr int kFewRows = 4;
constexpr int kChainRegs = 8;
constexpr int kBlockRows = 6;
constexpr int kBlockVecs = 2;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vload(const void* p) { return _mm256_loadu_ps(static_cast<const float*>(p)); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline void vstore(float* o, V v) { _mm256_storeu_ps(o, v); }
inline V vload_out(const float* b) { return _mm256_loadu_ps(b); }

#endif

#if defined(PAGEDSERVE_TILED)

constexpr int kVecs = kStepBytes / (4 * kLanes);  // vectors per step of a tile: 2 or 4

// What a step of K is for each weight dtype, and how a row of x takes part in it.
struct F32 {
  using W = float;
  using X = float;
  static constexpr int64_t kPerStep = 1;  // k values per step
#if defined(__AVX512F__)
  static V bcast(const float* x, int64_t p) { return _mm512_set1_ps(x[p]); }
  static V madd(V acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
#else
  static V bcast(const float* x, int64_t p) { return _mm256_broadcast_ss(x + p); }
  static V madd(V acc, V w, V x) { return _mm256_fmadd_ps(w, x, acc); }
#endif
  static V combine(V a, V b) { return vadd(a, b); }
};

#if defined(__AVX512BF16__)
struct BF16 {
  using W = uint16_t;
  using X = uint16_t;
  static constexpr int64_t kPerStep = 2;
  // x's k pair (2p, 2p + 1) as one 32-bit lane, in every lane
  static __m512 bcast(const uint16_t* x, int64_t p) {
    uint32_t pair;
    __builtin_memcpy(&pair, x + 2 * p, sizeof pair);
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(pair)));
  }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
  static __m512 combine(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
};

// bf16 output elements, rounded to nearest even; a bf16 bias, widened exactly.
inline void vstore(uint16_t* o, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 vload_out(const uint16_t* b) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX512VNNI__)
// int8 codes against int8 activations, summed exactly in int32 by vpdpbusd, which multiplies
// unsigned by signed bytes: the activation codes go in offset by 128 (q ^ 0x80 is q + 128 as an
// unsigned byte), and the epilogue takes 128 x the column's code sum back off.
struct I8 {
  using W = int8_t;
  using X = int8_t;
  static constexpr int64_t kPerStep = 4;
  static __m512 bcast(const int8_t* x, int64_t p) {
    uint32_t quad;
    __builtin_memcpy(&quad, x + 4 * p, sizeof quad);
    return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(quad ^ 0x80808080u)));
  }
  static __m512 madd(__m512 acc, __m512 w, __m512 x) {
    return _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(acc),
                                                   _mm512_castps_si512(x),
                                                   _mm512_castps_si512(w)));
  }
  static __m512 combine(__m512 a, __m512 b) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  }
};
#endif

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

// Up to kFewRows rows over one tile: w the tile, steps = K / kPerStep, x's rows xs elements
// apart, writing rows row0.. at column col. C chains per vector (consecutive k steps) keep a
// single row's multiply-adds in flight: two where the registers hold them (M x kVecs x 2 <=
// kChainRegs), else one.
template <class D, int M, class Out>
void few_rows(const typename D::W* w, int64_t steps, const typename D::X* x, int64_t xs,
              const Out& out, int64_t row0, int64_t col) {
  constexpr int64_t kVec = kStepBytes / kVecs / sizeof(typename D::W);  // elements per vector
  constexpr int C = M * kVecs * 2 <= kChainRegs ? 2 : 1;
  V acc[M][C][kVecs];  // [row][k step mod C][vector]
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[m][c][v] = vzero();
  int64_t p = 0;
  for (; p + C <= steps; p += C) {
    const auto* s = w + p * kVecs * kVec;
    V a[C][kVecs];
#pragma GCC unroll 2
    for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) a[c][v] = vload(s + (c * kVecs + v) * kVec);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        const V xc = D::bcast(x + m * xs, p + c);
#pragma GCC unroll 4
        for (int v = 0; v < kVecs; ++v) acc[m][c][v] = D::madd(acc[m][c][v], a[c][v], xc);
      }
  }
  if (p < steps) {  // one step left over where C = 2 and steps is odd
    const auto* s = w + p * kVecs * kVec;
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const V xa = D::bcast(x + m * xs, p);
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) acc[m][0][v] = D::madd(acc[m][0][v], vload(s + v * kVec), xa);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    V sum[kVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kVecs; ++v) sum[v] = C == 2 ? D::combine(acc[m][0][v], acc[m][C - 1][v])
                                                   : acc[m][0][v];
    out.store(row0 + m, col, sum, kVecs);
  }
}

// A block of R rows over vectors [v0, v0 + kBlockVecs) of each step of one tile (columns
// col + v0 * kLanes on), one chain per (row, vector).
template <class D, int R, class Out>
void row_block(const typename D::W* w, int64_t steps, const typename D::X* x, int64_t xs,
               const Out& out, int64_t row0, int64_t col, int v0) {
  constexpr int64_t kVec = kStepBytes / kVecs / sizeof(typename D::W);
  V acc[R][kBlockVecs];
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < kBlockVecs; ++v) acc[m][v] = vzero();
  for (int64_t p = 0; p < steps; ++p) {
    const auto* s = w + (p * kVecs + v0) * kVec;
    V a[kBlockVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kBlockVecs; ++v) a[v] = vload(s + v * kVec);
#pragma GCC unroll 8
    for (int m = 0; m < R; ++m) {
      const V xa = D::bcast(x + m * xs, p);
#pragma GCC unroll 4
      for (int v = 0; v < kBlockVecs; ++v) acc[m][v] = D::madd(acc[m][v], a[v], xa);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < R; ++m) {
    // A copy for the store to take by address: were acc's own address to escape, the compiler
    // would store every accumulator to the stack at each step of the loop above.
    V sum[kBlockVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kBlockVecs; ++v) sum[v] = acc[m][v];
    out.store(row0 + m, col + v0 * kLanes, sum, kBlockVecs);
  }
}

// row_block<D, rows> for a run-time rows in [1, R].
template <class D, int R, class Out>
void row_block_of(int rows, const typename D::W* w, int64_t steps, const typename D::X* x,
                  int64_t xs, const Out& out, int64_t row0, int64_t col, int v0) {
  if constexpr (R > 0) {
    if (rows == R) return row_block<D, R>(w, steps, x, xs, out, row0, col, v0);
    row_block_of<D, R - 1>(rows, w, steps, x, xs, out, row0, col, v0);
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
  if (t <= kFewRows) {
    at::parallel_for(0, tiles, grain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        few_rows_of<D, kFewRows>(t, wp + i * tile_elems, steps, xp, xs, out, i * kTile);
    });
    return;
  }
  const int64_t chunks = (t + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * tiles, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t c = i / tiles, tile = i % tiles;
      const auto* wt = wp + tile * tile_elems;
      const int64_t end = std::min(t, (c + 1) * kChunkRows);
      for (int64_t r = c * kChunkRows; r < end; r += kBlockRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlockRows, end - r));
        for (int v0 = 0; v0 < kVecs; v0 += kBlockVecs)
          row_block_of<D, kBlockRows>(rows, wt, steps, xp + r * xs, xs, out, r, tile * kTile, v0);
      }
    }
  });
}

#endif  // PAGEDSERVE_TILED

// Which weight dtypes this build serves (kernels/linear.py and kernels/quant_linear.py ask).
int64_t linear_tiled_dtypes() {
  int64_t served = 0;
#if defined(PAGEDSERVE_TILED)
  served |= 1;
#endif
#if defined(__AVX512BF16__)
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

// The checks both ops share: x [T, K] against a tiled weight of `per_step` k per step.
void check_tiled(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                 const char* op) {
  TORCH_CHECK(linear_tiled_dtypes() & dtype_bit(w.scalar_type()), op,
              ": this build has no tiled kernel for ", w.scalar_type());
  // k per step of the K loop: the layout's last dim (float32 has none)
  const at::ScalarType wt = w.scalar_type();
  const int64_t per_step = wt == at::kFloat ? 1 : wt == at::kBFloat16 ? 2 : 4;
  TORCH_CHECK(w.is_contiguous() && w.dim() == (per_step == 1 ? 3 : 4) && w.size(2) == kTile &&
                  (per_step == 1 || w.size(3) == per_step),
              op, ": w must be a contiguous tiled weight");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x [T, K] float32 or bfloat16");
  TORCH_CHECK(w.size(1) * per_step == x.size(1), op, ": x has ", x.size(1),
              " columns, the weight ", w.size(1) * per_step);
  TORCH_CHECK(!bias.has_value() || (bias->is_contiguous() && bias->numel() == w.size(0) * kTile &&
                                    bias->scalar_type() == x.scalar_type()),
              op, ": bias [N] in x's dtype, contiguous");
}

template <class T>
const T* bias_ptr(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? static_cast<const T*>(bias->data_ptr()) : nullptr;
}

at::Tensor linear_tiled(const at::Tensor& x_in, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  check_tiled(x_in, w, bias, "linear_tiled");
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
#if defined(__AVX512BF16__)
  if (bf16) {
    using E = uint16_t;
    run<BF16>(static_cast<const E*>(x.data_ptr()), t, x.stride(0), k,
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

using QuantizeRows = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&);

// x quantized per row (csrc/quant_cpu.cpp's quantize_rows_int8), times the int8 codes w, through
// the Dequant epilogue: kernels/quant_linear.py's dynamic path in one call.
at::Tensor int8_linear_tiled(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offset,
                             const at::Tensor& col_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.scalar_type() == at::kChar, "int8_linear_tiled: w must hold int8 codes");
  check_tiled(x, w, bias, "int8_linear_tiled");
  const int64_t t = x.size(0), k = x.size(1), tiles = w.size(0), n = tiles * kTile;
  TORCH_CHECK(offset.scalar_type() == at::kInt && offset.is_contiguous() && offset.numel() == n &&
                  col_scale.scalar_type() == at::kFloat && col_scale.is_contiguous() &&
                  col_scale.numel() == n,
              "int8_linear_tiled: offset [N] int32 and col_scale [N] float32, contiguous");
  at::Tensor out = at::empty({t, n}, x.options());
  if (t == 0) return out;
#if defined(__AVX512VNNI__)
  static const auto quantize = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("pagedserve_cpu::quantize_rows_int8", "")
                                   .typed<QuantizeRows>();
  const auto [q, row_scale] = quantize.call(x.stride(1) == 1 ? x : x.contiguous());
  auto go = [&](auto* o) {
    using E = std::remove_pointer_t<decltype(o)>;
    run<I8>(q.data_ptr<int8_t>(), t, k, k, w.data_ptr<int8_t>(), tiles,
            Dequant<E>{o, n, bias_ptr<E>(bias), offset.data_ptr<int32_t>(),
                       col_scale.data_ptr<float>(), row_scale.data_ptr<float>()});
  };
  if (x.scalar_type() == at::kBFloat16) {
    go(static_cast<uint16_t*>(out.data_ptr()));
  } else {
    go(out.data_ptr<float>());
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def("linear_tiled(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  lib.def("int8_linear_tiled(Tensor x, Tensor w, Tensor offset, Tensor col_scale, Tensor? bias) "
          "-> Tensor");
  lib.impl("int8_linear_tiled", c10::DispatchKey::CPU, int8_linear_tiled);
  lib.def("linear_tiled_dtypes() -> int", linear_tiled_dtypes);
  lib.impl("linear_tiled", c10::DispatchKey::CPU, linear_tiled);
}

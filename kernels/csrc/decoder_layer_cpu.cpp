// One Llama-family decoder layer in one call: the same operators, in the same order, as the
// Python modules of pagedserve/workers/models/llama.py run them (the norms, rotary, cache write
// and paged attention of this library; the four projections through the tiled matmul of
// csrc/linear_cpu.cpp, oneDNN's packed matmul, at::linear or the quantized kernels of
// kernels/quant_linear.py), so the result is the modules' bit for bit. What it removes is the
// Python between them: about fifteen module calls, wrapper checks and views a layer, which at
// decode batch sizes cost as much as the arithmetic. The choice between int8 weight-only and
// dynamic activations repeats kernels/quant_linear.py's int8_linear (rows against
// weight_only_rows); the bit-for-bit tests in tests/workers/test_quantized_model.py hold the
// two together.
//
//   decoder_layer(x [T, H], residual [T, H] or None, positions [T] int64, cos, sin [P, D/2],
//                 input_norm [H], post_norm [H], eps,
//                 weights, kinds (qkv [Q+2K, H], o [H, Q], gate_up [2I, H], down [H, I]: each
//                 plain, tiled (csrc/linear_cpu.cpp), oneDNN-packed, int8 or int4, held by one
//                 to three tensors),
//                 hadamard (per projection: rotate x in blocks of this many columns first,
//                 0: not; an int8 weight quantized with its input rotated),
//                 weight_only_rows, group_size (the quantized kernels' settings),
//                 qkv_bias [Q+2K] or None, num_heads, num_kv_heads,
//                 kv_cache [NB, 2, B, Hkv, D], slot_mapping [T], cu_seqlens_q [S+1],
//                 seq_lens [S], block_table [S, max_blocks], scale, window (-1: none),
//                 k_scale, v_scale (the cache's scales, kernels/kv_quant.py))
//       -> (mlp_out [T, H], residual [T, H])
//
// As in the modules, the residual add of this layer's attention output happens inside the
// second norm, and the MLP output is left for the next layer's first norm to add. Without a
// residual (the first layer) x starts the residual stream and is updated in place later.
// Every tensor is float32 or bfloat16 alike (cos/sin float32; the KV cache may be a bf16 or
// scaled e4m3 one, as the cache write and attention take it); the caller decides eligibility
// (one rank, no long float32 prefill rows; workers/models/fused_layers.py).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string_view>
#include <tuple>

namespace {

template <typename Sig>
c10::TypedOperatorHandle<Sig> typed_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = at::Tensor(at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using Rotary = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&);
using SiluAndMul = at::Tensor(const at::Tensor&);
using Codes = std::tuple<at::Tensor, at::Tensor>;  // uint8 codes plus 128, row scales
using AddRmsNormQuant = Codes(at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t);
using SiluAndMulQuant = Codes(const at::Tensor&, int64_t);
using Int8LinearCodes = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, at::ScalarType);
using ReshapeAndCache = void(const at::Tensor&, const at::Tensor&, at::Tensor&,
                             const at::Tensor&, double, double);
using PagedAttention = int64_t(const at::Tensor&, const at::Tensor&, at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                               int64_t, double, double, at::Tensor&);
using QuantizeRows = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&);
using HadamardRows = at::Tensor(const at::Tensor&, int64_t);
using Dequantize = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              at::ScalarType);
using LinearTiled = at::Tensor(const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&);
using Int8LinearTiled = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const std::optional<at::Tensor>&,
                                   int64_t, std::optional<at::ScalarType>);
using LinearPointwise = at::Tensor(const at::Tensor&, const at::Tensor&,
                                   const std::optional<at::Tensor>&, std::string_view,
                                   c10::List<std::optional<at::Scalar>>,
                                   std::optional<std::string_view>);

// The handles, looked up once (the ops are registered when the library loads).
struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = typed_op<RmsNorm>("pagedserve_cpu::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm =
      typed_op<AddRmsNorm>("pagedserve_cpu::add_rms_norm_");
  c10::TypedOperatorHandle<Rotary> rotary = typed_op<Rotary>("pagedserve_cpu::rotary");
  c10::TypedOperatorHandle<SiluAndMul> silu_and_mul =
      typed_op<SiluAndMul>("pagedserve_cpu::silu_and_mul");
  c10::TypedOperatorHandle<AddRmsNormQuant> add_rms_norm_quant =
      typed_op<AddRmsNormQuant>("pagedserve_cpu::add_rms_norm_quant_");
  c10::TypedOperatorHandle<SiluAndMulQuant> silu_and_mul_quant =
      typed_op<SiluAndMulQuant>("pagedserve_cpu::silu_and_mul_quant");
  c10::TypedOperatorHandle<Int8LinearCodes> int8_linear_codes =
      typed_op<Int8LinearCodes>("pagedserve_cpu::int8_linear_codes");
  c10::TypedOperatorHandle<ReshapeAndCache> reshape_and_cache =
      typed_op<ReshapeAndCache>("pagedserve_cpu::reshape_and_cache");
  c10::TypedOperatorHandle<PagedAttention> paged_attention =
      typed_op<PagedAttention>("pagedserve_cpu::paged_attention");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// How a projection's weight is held (kernels/decoder_layer.py's LINEAR_* constants), and how
// many tensors of `weights` it takes.
enum Kind : int64_t {
  kPlain = 0, kPacked = 1, kInt8 = 2, kInt8Dynamic = 3, kInt4 = 4, kTiled = 5, kInt8Tiled = 6
};

int64_t tensors_of(int64_t kind) {
  return kind == kInt8 || kind == kInt8Dynamic || kind == kInt8Tiled ? 3 : kind == kInt4 ? 2 : 1;
}

// One projection, as kernels/linear.py's `linear` and kernels/quant_linear.py's
// `quantized_linear` compute it: w points at its tensors in `weights`.
at::Tensor linear(const at::Tensor& x_in, const at::Tensor* w, int64_t kind, int64_t hadamard,
                  const std::optional<at::Tensor>& bias, int64_t weight_only_rows,
                  int64_t group_size) {
  if (kind == kInt8Tiled) {  // w: codes tiled, offset [N] int32, col_scale [N] float32
    // rotates x itself, in the pass that quantizes it
    static const auto op = typed_op<Int8LinearTiled>("pagedserve_cpu::int8_linear_tiled");
    return op.call(x_in, w[0], w[1], w[2], bias, hadamard, std::nullopt);
  }
  static const auto rotate = typed_op<HadamardRows>("pagedserve_cpu::hadamard_rows");
  const at::Tensor x = hadamard > 0 ? rotate.call(x_in, hadamard) : x_in;
  at::Tensor y;
  switch (kind) {
    case kPlain:
      return at::linear(x, w[0], bias);
    case kTiled: {  // csrc/linear_cpu.cpp
      static const auto op = typed_op<LinearTiled>("pagedserve_cpu::linear_tiled");
      return op.call(x, w[0], bias);
    }
    case kPacked: {  // a packed weight exists only where torch has this op
      static const auto op = typed_op<LinearPointwise>("mkldnn::_linear_pointwise");
      return op.call(x, w[0], bias, "none", c10::List<std::optional<at::Scalar>>(),
                     std::string_view(""));
    }
    case kInt8:
    case kInt8Dynamic:  // w: qweight [N, K] int8, scale [N] bf16, col_scale [N] float32
      if (kind == kInt8 || x.size(0) <= weight_only_rows) {
        y = at::_weight_int8pack_mm(x.to(at::kBFloat16), w[0], w[1]).to(x.scalar_type());
      } else {
        static const auto quantize = typed_op<QuantizeRows>("pagedserve_cpu::quantize_rows_int8");
        static const auto dequantize = typed_op<Dequantize>("pagedserve_cpu::dequantize_int32");
        auto [q, row_scale] = quantize.call(x);
        y = dequantize.call(at::_int_mm(q, w[0].t()).contiguous(), row_scale, w[2],
                            x.scalar_type());
      }
      break;
    case kInt4:  // w: packed codes, scale_zeros [groups, N, 2] bf16
      y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w[0], group_size, w[1])
              .to(x.scalar_type());
      break;
    default:
      TORCH_CHECK(false, "decoder_layer: unknown weight kind ", kind);
  }
  return bias.has_value() ? y + *bias : y;
}

std::tuple<at::Tensor, at::Tensor> decoder_layer(
    at::Tensor& x, const std::optional<at::Tensor>& residual_in,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& input_norm, const at::Tensor& post_norm, double eps,
    at::TensorList weights, at::IntArrayRef kinds, at::IntArrayRef hadamard,
    int64_t weight_only_rows, int64_t group_size,
    const std::optional<at::Tensor>& qkv_bias,
    int64_t num_heads, int64_t num_kv_heads, at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
    const at::Tensor& block_table, double scale, int64_t window, double k_scale,
    double v_scale) {
  TORCH_CHECK(kinds.size() == 4 && hadamard.size() == 4,
              "decoder_layer: four projections: qkv, o, gate_up, down");
  const at::Tensor* w[4];  // each projection's first tensor in `weights`
  size_t used = 0;
  for (size_t i = 0; i < 4; ++i) {
    w[i] = weights.data() + used;
    used += tensors_of(kinds[i]);
  }
  TORCH_CHECK(used == weights.size(), "decoder_layer: ", weights.size(),
              " weight tensors for these kinds, expected ", used);
  auto project = [&](const at::Tensor& x, int i, const std::optional<at::Tensor>& bias) {
    return linear(x, w[i], kinds[i], hadamard[i], bias, weight_only_rows, group_size);
  };
  TORCH_CHECK(x.dim() == 2, "decoder_layer: x [T, H]");
  const Ops& o = ops();
  // A tiled int8 projection after the second norm or SiLU takes its input as codes: that op
  // rotates and quantizes each row as it computes it (csrc/layers_cpu.cpp's *_quant ops), where
  // int8_linear_tiled would read the row back to do so. The result is the same bit for bit.
  auto project_codes = [&](const Codes& codes, int i, const std::optional<at::Tensor>& bias) {
    return o.int8_linear_codes.call(std::get<0>(codes), std::get<1>(codes), w[i][0], w[i][1],
                                    w[i][2], bias, x.scalar_type());
  };
  const int64_t t = x.size(0), d = kv_cache.size(4);
  const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;

  at::Tensor residual;
  at::Tensor qkv;  // [T, Q + 2K]
  if (!residual_in.has_value()) {
    residual = x;  // the embedding starts the stream
    qkv = project(o.rms_norm.call(x, input_norm, eps), 0, qkv_bias);
  } else {
    residual = *residual_in;
    qkv = kinds[0] == kInt8Tiled
              ? project_codes(o.add_rms_norm_quant.call(residual, x, input_norm, eps, hadamard[0]),
                              0, qkv_bias)
              : project(o.add_rms_norm.call(residual, x, input_norm, eps), 0, qkv_bias);
  }

  // Attention: q, k, v are views of the fused projection (unit stride in D).
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, num_heads, d});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, d});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, d});
  auto [qr, kr] = o.rotary.call(q, k, positions, cos, sin);  // contiguous
  o.reshape_and_cache.call(kr, v, kv_cache, slot_mapping, k_scale, v_scale);
  at::Tensor out = at::empty_like(qr);
  at::Tensor no_lse = at::empty({0}, x.options().dtype(at::kFloat));
  const int64_t bad = o.paged_attention.call(qr, kv_cache, out, cu_seqlens_q, seq_lens,
                                             block_table, scale, window, k_scale, v_scale,
                                             no_lse);
  TORCH_CHECK(bad < 0, "decoder_layer: sequence ", bad,
              " does not fit its block-table row or the pool");
  const at::Tensor attn = project(out.view({t, q_size}), 1, std::nullopt);

  // MLP, after the residual add of the attention output.
  const at::Tensor gate_up =
      kinds[2] == kInt8Tiled
          ? project_codes(o.add_rms_norm_quant.call(residual, attn, post_norm, eps, hadamard[2]),
                          2, std::nullopt)
          : project(o.add_rms_norm.call(residual, attn, post_norm, eps), 2, std::nullopt);
  if (kinds[3] == kInt8Tiled) {
    return {project_codes(o.silu_and_mul_quant.call(gate_up, hadamard[3]), 3, std::nullopt),
            residual};
  }
  return {project(o.silu_and_mul.call(gate_up), 3, std::nullopt), residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, lib) {
  lib.def(
      "decoder_layer(Tensor(a!) x, Tensor(b!)? residual, Tensor positions, Tensor cos, Tensor sin, "
      "Tensor input_norm, Tensor post_norm, float eps, Tensor[] weights, int[] kinds, "
      "int[] hadamard, int weight_only_rows, int group_size, "
      "Tensor? qkv_bias, int num_heads, int num_kv_heads, Tensor(c!) kv_cache, "
      "Tensor slot_mapping, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, "
      "float scale, int window, float k_scale, float v_scale) -> (Tensor, Tensor)");
  // A float32 weight packed by oneDNN is an MKLDNN tensor: the call then dispatches on it.
  lib.impl("decoder_layer", c10::DispatchKey::CPU, decoder_layer);
  lib.impl("decoder_layer", c10::DispatchKey::MkldnnCPU, decoder_layer);
}

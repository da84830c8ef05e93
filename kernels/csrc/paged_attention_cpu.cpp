// Paged attention on CPU, reading K and V through the block table in place.
//
// The torch reference has to copy every sequence's K/V out of its blocks into a contiguous
// tensor before SDPA can read it, in every layer of every step: three passes over the context's
// bytes (read, write, read again) where attention needs one. This kernel walks each sequence's
// blocks and keeps a flash-style running softmax per query row, so the cache is read once.
//
// Semantics are those of paged_attention_ref without context parallelism: query i of a
// sequence of L tokens, q_len of them new, sits at position L - q_len + i and sees the keys at
// positions p <= pos (and p > pos - window when window >= 1; -1: no window). Math is float32
// whatever the storage: q, out and the cache are float32 or bfloat16 (q and out alike; the cache
// bf16 under a float32 q too), every bf16 element widened in registers as it is read (bf16.h)
// or, a bf16 q against a bf16 key, multiplied pairwise by vdpbf16ps (exact products, float32
// sums), the scores, the running softmax and the accumulators float32, the output rounded once.
// A scaled e4m3 cache (under either q) is widened to bf16 a chunk at a time (fp8.h) and read as a
// bf16 cache; its k_scale multiplies the softmax scale and its v_scale the output, in float32.
//
// Two paths compute this. Where the build targets AVX-512 and D is 32, 64 or 128, attend_vec
// takes every item: sixteen keys per register (keys16.h), up to four query rows at a time with
// their accumulators in registers, a decode's kv heads together when sequences are many, a lone
// decode's keys split between the threads when items are too few to share (split_decodes).
// Elsewhere `attend` does, in plain C++ that the compiler vectorises for whatever the target
// has.
//
// Layouts: q and out [T, H_q, D] with unit stride in D; kv_cache [num_blocks, 2, B, H_kv, D]
// contiguous; block_table [S, max_blocks] int32 contiguous; lse [T, H_q] float32 or empty.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16.h"
#include "fp8.h"
#include "keys16.h"
#include "vec_exp.h"

namespace {

using pagedserve::bf16;
using pagedserve::fp8;
using pagedserve::load;
using pagedserve::store;

// New tokens of one sequence handled by one work item; bounds the per-item accumulators at
// kQueryTile * G rows of D floats.
constexpr int64_t kQueryTile = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// kv heads [kv_head, kv_head + kv_heads) of new tokens [q_begin, q_end) of one sequence; more
// than one head only for a decode through the vectorised path (attend_heads).
struct Item {
  int64_t seq, kv_head, kv_heads, q_begin, q_end, cost;
  // A part of a decode's keys (split_decodes): keys [key_lo, key_hi), its rows' normalised
  // output, max and sum written to `partial` ([kv_heads][G][D + 2] floats) for merge_parts.
  // key_hi < 0: every key the rows see, written to out.
  int64_t key_lo = 0, key_hi = -1;
  float* partial = nullptr;
};
constexpr int64_t kMaxHeadsPerItem = 8;
// A part of a split decode holds at least this many keys: below it, the merge and the extra
// item cost more than the thread it wakes gains.
constexpr int64_t kMinKeysPerPart = 256;

template <typename KV>
inline float dot(const float* __restrict a, const KV* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * load(b[i]);
  return s;
}

template <typename KV>
inline void axpy(float* __restrict y, float a, const KV* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * load(x[i]);
}

// acc[0, d) += sum_j p[j] * v_j over nv value rows. With d known at compile time the row of
// accumulators stays in registers across the keys instead of being loaded and stored per key.
template <int64_t D, typename KV>
inline void pv_fixed(float* __restrict acc, const float* __restrict p, const KV* v,
                     int64_t stride, int64_t nv) {
  float reg[D];
  for (int64_t i = 0; i < D; ++i) reg[i] = acc[i];
  for (int64_t j = 0; j < nv; ++j) {
    const float pj = p[j];
    const KV* vj = v + j * stride;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) reg[i] += pj * load(vj[i]);
  }
  for (int64_t i = 0; i < D; ++i) acc[i] = reg[i];
}

template <typename KV>
inline void pv(float* acc, const float* p, const KV* v, int64_t stride, int64_t nv,
               int64_t d) {
  switch (d) {
    case 64: return pv_fixed<64>(acc, p, v, stride, nv);
    case 128: return pv_fixed<128>(acc, p, v, stride, nv);
    case 32: return pv_fixed<32>(acc, p, v, stride, nv);
    default:
      for (int64_t j = 0; j < nv; ++j) axpy(acc, p[j], v + j * stride, d);
  }
}

inline void scale_row(float* __restrict y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// What the kernel reads besides q, out and the cache.
struct Meta {
  float* lse;  // nullptr: not asked for
  const int32_t* cu;
  const int32_t* lens;
  const int32_t* table;
  int64_t max_blocks, block, hkv, group, dim, window;
  float scale;    // the softmax scale times k_scale: a stored key reads as itself times k_scale
  float v_scale;  // a stored value reads as itself times v_scale; applied to the output once

  // The first key a query at position pos sees: 0, or the start of its window.
  int64_t first_key(int64_t pos) const {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
  }
};

// Q: the element type of q and out; KV: the cache's.
template <typename Q, typename KV>
struct Args : Meta {
  const Q* q;
  int64_t q_st, q_sh;  // token and head strides of q
  const KV* kv;
  Q* out;
  int64_t o_st, o_sh;
};

template <typename Q, typename KV>
Args<Q, KV> make_args(const Q* q, const KV* kv, Q* out, const at::Tensor& qt,
                      const at::Tensor& ot, const Meta& meta) {
  return Args<Q, KV>{meta, q, qt.stride(0), qt.stride(1), kv, out, ot.stride(0), ot.stride(1)};
}

struct Scratch {
  std::vector<float> acc, m, l, s, kt, qf;
};

// Row r of the tile's queries as float32: float32 q is read in place (the float32 kernel stays
// as it was), a bf16 one was widened once per work item into `qf`.
template <typename Q, typename KV>
inline const float* query_row(const Args<Q, KV>& a, const Q* q, const Scratch& scr, int64_t r) {
  if constexpr (std::is_same_v<Q, float>) {
    return q;
  } else {
    return scr.qf.data() + r * a.dim;
  }
}

// One (sequence, kv head, query tile): the tile's G * nq query rows over the visible keys.
template <typename Q, typename KV>
void attend(const Args<Q, KV>& a, const Item& it, Scratch& scr) {
  std::vector<float>&acc = scr.acc, &m = scr.m, &l = scr.l, &s = scr.s, &kt = scr.kt;
  const int64_t d = a.dim, g_n = a.group, bs = a.block;
  const int64_t nq = it.q_end - it.q_begin, rows = nq * g_n;
  const int64_t tok0 = a.cu[it.seq], q_len = a.cu[it.seq + 1] - tok0;
  const int64_t ctx = a.lens[it.seq] - q_len;  // position of new token 0
  const int64_t row_stride = a.hkv * d;        // between consecutive tokens of a block
  acc.assign(rows * d, 0.f);
  m.assign(rows, kNegInf);
  l.assign(rows, 0.f);
  s.resize(bs);
  if constexpr (!std::is_same_v<Q, float>) {  // widen the tile's query rows once
    scr.qf.resize(rows * d);
    for (int64_t qi = 0; qi < nq; ++qi) {
      for (int64_t g = 0; g < g_n; ++g) {
        const Q* src = a.q + (tok0 + it.q_begin + qi) * a.q_st + (it.kv_head * g_n + g) * a.q_sh;
        float* dst = scr.qf.data() + (qi * g_n + g) * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = load(src[i]);
      }
    }
  }
  const int64_t hi = ctx + it.q_end;  // keys [lo, hi) cover the tile
  const int64_t lo = a.first_key(ctx + it.q_begin);
  const int32_t* blocks = a.table + it.seq * a.max_blocks;
  for (int64_t b = lo / bs; b * bs < hi; ++b) {
    const KV* kb = a.kv + (static_cast<int64_t>(blocks[b]) * 2 * bs) * row_stride +
                   it.kv_head * d;
    const KV* vb = kb + bs * row_stride;
    const int64_t j0 = std::max(lo, b * bs), j1 = std::min(hi, b * bs + bs), nj = j1 - j0;
    // Many rows against this block (a prefill tile): transpose its keys to [D, nj] once, so
    // each row's scores are D broadcast multiply-adds over nj lanes instead of nj dot products
    // that each end in a horizontal sum.
    const bool transposed = rows >= 8;
    if (transposed) {
      kt.resize(d * bs);
      for (int64_t j = 0; j < nj; ++j) {
        const KV* kr = kb + (j0 + j - b * bs) * row_stride;
        for (int64_t i = 0; i < d; ++i) kt[i * bs + j] = load(kr[i]);
      }
    }
    for (int64_t qi = 0; qi < nq; ++qi) {
      const int64_t pos = ctx + it.q_begin + qi;
      const int64_t ja = std::max(j0, a.first_key(pos));
      const int64_t jb = std::min(j1, pos + 1);
      if (ja >= jb) continue;
      const int64_t tok = tok0 + it.q_begin + qi;
      for (int64_t g = 0; g < g_n; ++g) {
        const int64_t r = qi * g_n + g;
        const float* qr =
            query_row(a, a.q + tok * a.q_st + (it.kv_head * g_n + g) * a.q_sh, scr, r);
        float* sc = s.data();  // scores of keys [ja, jb) at sc[j - j0]
        if (transposed) {
          std::fill(sc, sc + nj, 0.f);
          for (int64_t i = 0; i < d; ++i) {
            const float qd = qr[i] * a.scale;
            const float* kd = kt.data() + i * bs;
#pragma omp simd
            for (int64_t j = 0; j < nj; ++j) sc[j] += qd * kd[j];
          }
        } else {
          for (int64_t j = ja; j < jb; ++j) {
            sc[j - j0] = dot(qr, kb + (j - b * bs) * row_stride, d) * a.scale;
          }
        }
        float mx = kNegInf;
        for (int64_t j = ja; j < jb; ++j) mx = std::max(mx, sc[j - j0]);
        const float m_new = std::max(m[r], mx);
        float* ar = acc.data() + r * d;
        if (m[r] != m_new) {  // rescale what was summed under the old maximum
          const float corr = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
          l[r] *= corr;
          scale_row(ar, corr, d);
          m[r] = m_new;
        }
        float* pr = sc + (ja - j0);  // probabilities in place of the scores
        const int64_t nv = jb - ja;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < nv; ++j) {
          pr[j] = vec_exp(pr[j] - m_new);
          sum += pr[j];
        }
        pv(ar, pr, vb + (ja - b * bs) * row_stride, row_stride, nv, d);
        l[r] += sum;
      }
    }
  }
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t tok = tok0 + it.q_begin + qi;
    for (int64_t g = 0; g < g_n; ++g) {
      const int64_t r = qi * g_n + g, head = it.kv_head * g_n + g;
      Q* o = a.out + tok * a.o_st + head * a.o_sh;
      const float inv = l[r] > 0.f ? a.v_scale / l[r] : 0.f;
      const float* ar = acc.data() + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) o[i] = store<Q>(ar[i] * inv);
      if (a.lse != nullptr) {
        a.lse[tok * (a.hkv * g_n) + head] = l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
      }
    }
  }
}

#if defined(__AVX512F__)

// R query rows of one kv head (row r: new token r / G, head r % G of the group) and their
// running softmax, fed sixteen keys at a time (keys16.h): scores as one register per row, the
// softmax on it, then P V with each value row widened once for all R rows. The R * D / 16
// accumulators are registers wherever the caller's loop keeps one Rows.
template <int D, int R, typename Q, typename KV>
struct Rows {
  static constexpr int C = D / 16;
  // A float32 query scores straight from q; a bf16 one over a bf16 cache by vdpbf16ps where the
  // machine has it, else widened once here.
#if defined(__AVX512BF16__)
  static constexpr bool widen_q = !std::is_same_v<Q, float> && !std::is_same_v<KV, bf16>;
#else
  static constexpr bool widen_q = !std::is_same_v<Q, float>;
#endif
  // P V by vdpbf16ps where q and the cache are bf16: the probabilities rounded to bf16 (as the
  // model's own matmuls round their inputs) and two keys' value rows per instruction, read as
  // stored. Each accumulator pair then holds a 32-dim run of the output in the lane order of
  // unpacklo/hi_epi16 (per 128-bit lane: dims 0-3 in the first, 4-7 in the second), which
  // finish() puts back. Half the vector ops of widening every value row and one FMA per key
  // and row: a decode's attention is bound by its vector ops, not by the bytes it reads.
#if defined(__AVX512BF16__)
  static constexpr bool pv_pairs = std::is_same_v<Q, bf16> && std::is_same_v<KV, bf16>;
#else
  static constexpr bool pv_pairs = false;
#endif
  const Q* q[R];
  int64_t pos[R], tok[R], head[R];
  alignas(64) float qf[widen_q ? R : 1][D];
  __m512 acc[R][C];
  float m[R], l[R];
  // Rows of another block (the next one's K and V rows of this head, ahead_stride bytes apart)
  // to ask into L2 while the next keys() sums its values, a few rows at each step of that loop
  // (null: none; keys() clears it). A row is kAheadLines lines, its D elements as Rows reads
  // them: an fp8 pool's row is half of that, and the rest the next head's row of the same key.
  const char* ahead = nullptr;
  int64_t ahead_rows = 0, ahead_stride = 0;
  static constexpr int kAheadLines = D * static_cast<int>(sizeof(KV)) / 64;

  // The ahead rows [row, row + n) into L2 (as many as are left).
  __attribute__((always_inline)) inline void ask_ahead(int64_t row, int64_t n) const {
    const char* p = ahead + row * ahead_stride;
    for (int64_t end = std::min(ahead_rows, row + n); row < end; ++row, p += ahead_stride) {
      for (int line = 0; line < kAheadLines; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T1);
    }
  }

  // a: the kernel's Args over the cache as stored (an fp8 cache's rows reach keys() widened).
  template <typename A>
  void init(const A& a, const Item& it, int64_t kv_head, int64_t r0) {
    const int64_t g_n = a.group, tok0 = a.cu[it.seq], q_len = a.cu[it.seq + 1] - tok0;
    const int64_t ctx = a.lens[it.seq] - q_len;  // position of new token 0
    for (int r = 0; r < R; ++r) {
      const int64_t qi = (r0 + r) / g_n;
      tok[r] = tok0 + it.q_begin + qi;
      pos[r] = ctx + it.q_begin + qi;
      head[r] = kv_head * g_n + (r0 + r) % g_n;
      q[r] = a.q + tok[r] * a.q_st + head[r] * a.q_sh;
      if constexpr (widen_q) {
        for (int i = 0; i < D; ++i) qf[r][i] = load(q[r][i]);
      }
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
      m[r] = kNegInf;
      l[r] = 0.f;
    }
  }

  // Keys j0 .. j0 + nj (nj <= 16), their K rows from k and V rows from v, row_stride apart.
  __attribute__((always_inline)) inline void keys(const Meta& a, const KV* k, const KV* v,
                                                  int64_t row_stride, int64_t j0, int64_t nj) {
    using pagedserve::keys16::load16;
    using pagedserve::keys16::scores16;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(j0)));
    const __mmask16 in_chunk = static_cast<__mmask16>((1u << nj) - 1u);
    alignas(64) float p[R][16];
    __m512 s_rows[R];  // every row's scores at once where rows share the key loads (bf16 pairs)
#if defined(__AVX512BF16__)  // scores16_rows exists only there (pv_pairs is false elsewhere)
    if constexpr (pv_pairs && R > 1) {
      for (int64_t j = 0; j < nj; ++j) {  // the value rows on their way while the keys score
        for (int line = 0; line < D * 2; line += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(v + j * row_stride) + line, _MM_HINT_T0);
        }
      }
      pagedserve::keys16::scores16_rows<D, R>(q, k, row_stride, nj, s_rows);
    }
#endif
    for (int r = 0; r < R; ++r) {
      __mmask16 ok = in_chunk & _mm512_cmple_epi32_mask(
                                    key, _mm512_set1_epi32(static_cast<int32_t>(pos[r])));
      if (a.window > 0) {
        ok &= _mm512_cmpgt_epi32_mask(
            key, _mm512_set1_epi32(static_cast<int32_t>(pos[r] - a.window)));
      }
      if (ok == 0) {
        _mm512_store_ps(p[r], _mm512_setzero_ps());
        continue;
      }
      __m512 s;
      if constexpr (pv_pairs && R > 1) {
        s = s_rows[r];
      } else if constexpr (widen_q) {
        s = scores16<D>(qf[r], k, row_stride, nj);
      } else {
        s = scores16<D>(q[r], k, row_stride, nj);
      }
      s = _mm512_mask_blend_ps(ok, _mm512_set1_ps(kNegInf),
                               _mm512_mul_ps(s, _mm512_set1_ps(a.scale)));
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(s));
      if (m_new != m[r]) {  // rescale what was summed under the old maximum
        const float corr = m[r] == kNegInf ? 0.f : std::exp(m[r] - m_new);
        const __m512 cv = _mm512_set1_ps(corr);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(acc[r][c], cv);
        l[r] *= corr;
        m[r] = m_new;
      }
      const __m512 e = exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new)));
      _mm512_store_ps(p[r], e);
      l[r] += _mm512_reduce_add_ps(e);
    }
    if constexpr (pv_pairs) {
      pv_by_pairs(p, v, row_stride, nj);
    } else {
      const int64_t per = (ahead_rows + nj - 1) / nj;  // ahead rows a key
      for (int64_t j = 0; j < nj; ++j) {
        if (ahead != nullptr) ask_ahead(j * per, per);
        for (int c = 0; c < C; ++c) {
          const __m512 vv = load16(v + j * row_stride + 16 * c);
          for (int r = 0; r < R; ++r) {
            acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vv, acc[r][c]);
          }
        }
      }
    }
    ahead = nullptr;
  }

#if defined(__AVX512BF16__)
  // acc += p V over nj keys (p zero past nj), keys paired: lane i of a pair register holds
  // (v_j[d], v_j+1[d]) and the broadcast (p_j, p_j+1), so vdpbf16ps adds both products. An odd
  // last key pairs with zeros, not with the row past the chunk (another block's bytes).
  __attribute__((always_inline)) inline void pv_by_pairs(const float (&p)[R][16], const KV* v,
                                                         int64_t row_stride, int64_t nj) {
    alignas(64) uint32_t pp[R][8];  // bf16 pairs (p_2i, p_2i+1)
    for (int r = 0; r < R; ++r) {
      const __m256bh pb = _mm512_cvtneps_pbh(_mm512_load_ps(p[r]));
      _mm256_store_si256(reinterpret_cast<__m256i*>(pp[r]), reinterpret_cast<__m256i>(pb));
    }
    const int64_t per = (ahead_rows + (nj + 1) / 2 - 1) / ((nj + 1) / 2);  // a pair of keys
    for (int64_t j = 0; j < nj; j += 2) {
      if (ahead != nullptr) ask_ahead(j / 2 * per, per);
      const bool two = j + 1 < nj;
      for (int h = 0; h < D / 32; ++h) {
        const __m512i a = _mm512_loadu_si512(v + j * row_stride + 32 * h);
        const __m512i b = two ? _mm512_loadu_si512(v + (j + 1) * row_stride + 32 * h)
                              : _mm512_setzero_si512();
        const __m512bh lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(a, b));
        const __m512bh hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(a, b));
        for (int r = 0; r < R; ++r) {
          const __m512bh pr = reinterpret_cast<__m512bh>(
              _mm512_set1_epi32(static_cast<int32_t>(pp[r][j / 2])));
          acc[r][2 * h] = _mm512_dpbf16_ps(acc[r][2 * h], lo, pr);
          acc[r][2 * h + 1] = _mm512_dpbf16_ps(acc[r][2 * h + 1], hi, pr);
        }
      }
    }
  }
#endif

  // Row r's output in float32, in order: the accumulators over the sum, times v_scale.
  void output_row(const Meta& a, int r, float (&row)[D]) const {
    const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? a.v_scale / l[r] : 0.f);
    if constexpr (pv_pairs) {  // lane 4L + t of a pair: dims 8L + t and 8L + 4 + t of its run
      alignas(64) float lo[16], hi[16];
      for (int h = 0; h < D / 32; ++h) {
        _mm512_store_ps(lo, _mm512_mul_ps(acc[r][2 * h], inv));
        _mm512_store_ps(hi, _mm512_mul_ps(acc[r][2 * h + 1], inv));
        for (int lane = 0; lane < 4; ++lane) {
          for (int t = 0; t < 4; ++t) {
            row[32 * h + 8 * lane + t] = lo[4 * lane + t];
            row[32 * h + 8 * lane + 4 + t] = hi[4 * lane + t];
          }
        }
      }
    } else {
      for (int c = 0; c < C; ++c) _mm512_store_ps(row + 16 * c, _mm512_mul_ps(acc[r][c], inv));
    }
  }

  template <typename A>
  void finish(const A& a) const {
    for (int r = 0; r < R; ++r) {
      Q* o = a.out + tok[r] * a.o_st + head[r] * a.o_sh;
      alignas(64) float row[D];
      output_row(a, r, row);
#pragma omp simd
      for (int i = 0; i < D; ++i) o[i] = store<Q>(row[i]);
      if (a.lse != nullptr) {
        a.lse[tok[r] * (a.hkv * a.group) + head[r]] =
            l[r] > 0.f ? m[r] + std::log(l[r]) : kNegInf;
      }
    }
  }

  // A part's rows r0.. into `partial` (Item::partial): each row's output, max and sum.
  void keep(const Meta& a, float* partial, int64_t r0) const {
    for (int r = 0; r < R; ++r) {
      float* dst = partial + (r0 + r) * (D + 2);
      alignas(64) float row[D];
      output_row(a, r, row);
      std::copy(row, row + D, dst);
      dst[D] = m[r];
      dst[D + 1] = l[r];
    }
  }
};

// The key range [lo, hi) of a sequence in chunks of at most 16 keys within a block:
// f(K of the chunk's first key at kv head 0, V the same, j0, nj, next), next being the start of
// the following block of the range, or `after` during the range's last block (what the caller
// will read next, or null).
template <typename Q, typename KV, typename F>
__attribute__((always_inline)) inline void for_chunks(const Args<Q, KV>& a, int64_t seq,
                                                      int64_t lo, int64_t hi, F&& f,
                                                      const KV* after = nullptr) {
  const int64_t bs = a.block, row_stride = a.hkv * a.dim;
  const int32_t* blocks = a.table + seq * a.max_blocks;
  for (int64_t b = lo / bs; b * bs < hi; ++b) {
    const KV* kb = a.kv + (static_cast<int64_t>(blocks[b]) * 2 * bs) * row_stride;
    const KV* next = (b + 1) * bs < hi
                         ? a.kv + (static_cast<int64_t>(blocks[b + 1]) * 2 * bs) * row_stride
                         : after;
    const int64_t end = std::min(hi, b * bs + bs);
    for (int64_t j0 = std::max(lo, b * bs); j0 < end; j0 += 16) {
      const KV* k = kb + (j0 - b * bs) * row_stride;
      f(k, k + bs * row_stride, j0, std::min<int64_t>(16, end - j0), next);
    }
  }
}

// What Rows reads a cache of KV as: an fp8 cache as bf16 (every e4m3 is one exactly), widened a
// chunk at a time into Wide; any other in place.
template <typename KV>
using Read = std::conditional_t<std::is_same_v<KV, fp8>, bf16, KV>;

template <int D, typename KV>
struct Wide {};

template <int D>
struct Wide<D, fp8> {  // one head's K and V rows of a chunk; widen64 writes whole 64-runs
  alignas(64) bf16 k[16 * D + 32], v[16 * D + 32];
};

// One head's rows of a chunk (k, v: its first key's K and V rows) into `rows`.
template <int D, typename R, typename KV>
__attribute__((always_inline)) inline void feed(R& rows, const Meta& a, const KV* k, const KV* v,
                                                int64_t j0, int64_t nj, Wide<D, KV>& wide) {
  if constexpr (std::is_same_v<KV, fp8>) {
    pagedserve::widen_rows<D>(k, a.hkv * D, nj, wide.k);
    pagedserve::widen_rows<D>(v, a.hkv * D, nj, wide.v);
    rows.keys(a, wide.k, wide.v, D, j0, nj);
  } else {
    rows.keys(a, k, v, a.hkv * D, j0, nj);
  }
}

// Rows r0 .. r0 + R of one kv head's item, over all the keys they see.
template <int D, int R, typename Q, typename KV>
void attend_rows(const Args<Q, KV>& a, const Item& it, int64_t r0) {
  Rows<D, R, Q, Read<KV>> rows;
  Wide<D, KV> wide;
  rows.init(a, it, it.kv_head, r0);
  // Rows go by position: the last sees the most keys, the first from the earliest.
  const int64_t hi = it.key_hi >= 0 ? it.key_hi : rows.pos[R - 1] + 1;
  const int64_t lo = it.key_hi >= 0 ? it.key_lo : a.first_key(rows.pos[0]);
  const int64_t off = it.kv_head * D;
  for_chunks(a, it.seq, lo, hi, [&](const KV* k, const KV* v, int64_t j0, int64_t nj, const KV*) {
    feed<D>(rows, a, k + off, v + off, j0, nj, wide);
  });
  if (it.partial != nullptr) {
    rows.keep(a, it.partial, r0);
  } else {
    rows.finish(a);
  }
}

// A decode over every kv head at once (R = G rows each): each block's K and V rows of all
// heads, contiguous in the pool, are read together, a stream the hardware prefetcher follows,
// where one head's rows are short runs a head's width apart.
template <int D, int R, typename Q, typename KV>
void attend_heads(const Args<Q, KV>& a, const Item& it, const KV* after) {
  Rows<D, R, Q, Read<KV>> rows[kMaxHeadsPerItem];
  Wide<D, KV> wide;
  for (int64_t h = 0; h < it.kv_heads; ++h) rows[h].init(a, it, it.kv_head + h, 0);
  const int64_t hi = it.key_hi >= 0 ? it.key_hi : rows[0].pos[0] + 1;
  const int64_t lo = it.key_hi >= 0 ? it.key_lo : a.first_key(rows[0].pos[0]);
  const int64_t bs = a.block, row_stride = a.hkv * D;
  for_chunks(a, it.seq, lo, hi, [&](const KV* k, const KV* v, int64_t j0, int64_t nj,
                                    const KV* next) {
    for (int64_t h = 0; h < it.kv_heads; ++h) {
      const int64_t off = (it.kv_head + h) * D;
      // The next block's K and V rows of this head (of the next item's first block: the same
      // heads' rows) into L2, a head at a time and, within a head, a few rows at each step of
      // its value sum (Rows::ask_ahead): spread out, the requests overlap the arithmetic (asked
      // for all at once, they queue behind each other and the loads behind them), and L2
      // rather than L1, where they would evict the block in use.
      if (next != nullptr && j0 % bs == 0) {
        rows[h].ahead = reinterpret_cast<const char*>(next + off);
        rows[h].ahead_rows = 2 * bs;
        rows[h].ahead_stride = row_stride * static_cast<int64_t>(sizeof(KV));
      }
      feed<D>(rows[h], a, k + off, v + off, j0, nj, wide);
    }
  }, after);
  for (int64_t h = 0; h < it.kv_heads; ++h) {
    if (it.partial != nullptr) {
      rows[h].keep(a, it.partial + h * R * (D + 2), 0);
    } else {
      rows[h].finish(a);
    }
  }
}

template <int D>
constexpr int kRowsAtOnce = D >= 128 ? 2 : 4;  // four rows of D = 64: half the register file

// An item's rows: a decode over several heads through attend_heads, else at most
// kRowsAtOnce rows at a time through attend_rows.
template <int D, typename Q, typename KV>
void attend_vec(const Args<Q, KV>& a, const Item& it, const KV* after) {
  constexpr int kRows = kRowsAtOnce<D>;
  if (it.kv_heads > 1) {
    switch (a.group) {
      case 1: return attend_heads<D, 1>(a, it, after);
      case 2: return attend_heads<D, 2>(a, it, after);
      case 3: if constexpr (kRows > 2) return attend_heads<D, 3>(a, it, after); break;
      default: if constexpr (kRows > 2) return attend_heads<D, 4>(a, it, after); break;
    }
  }
  const int64_t rows = (it.q_end - it.q_begin) * a.group;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    switch (std::min<int64_t>(kRows, rows - r0)) {
      case 1: attend_rows<D, 1>(a, it, r0); break;
      case 2: attend_rows<D, 2>(a, it, r0); break;
      case 3: if constexpr (kRows > 2) attend_rows<D, 3>(a, it, r0); break;
      default: if constexpr (kRows > 2) attend_rows<D, 4>(a, it, r0); break;
    }
  }
}

// Whether attend_vec serves this head dim and group; items it takes may span kv heads.
inline bool vec_serves(int64_t dim, int64_t group) {
  switch (dim) {
    case 32: case 64: return group <= kRowsAtOnce<64>;
    case 128: return group <= kRowsAtOnce<128>;
    default: return false;
  }
}

// Whether attend_vec takes this item; it returns false for what it leaves to attend.
template <typename Q, typename KV>
bool attend_fast(const Args<Q, KV>& a, const Item& it, const KV* after) {
  switch (a.dim) {
    case 64: attend_vec<64>(a, it, after); return true;
    case 128: attend_vec<128>(a, it, after); return true;
    case 32: attend_vec<32>(a, it, after); return true;
    default: return false;
  }
}
#else
inline bool vec_serves(int64_t, int64_t) { return false; }

template <typename Q, typename KV>
bool attend_fast(const Args<Q, KV>&, const Item&, const KV*) {
  return false;
}
#endif

// One new token's rows of kv heads [kv_head, kv_head + kv_heads), their keys split into parts
// (split_decodes).
struct Split {
  int64_t tok, kv_head, kv_heads, parts;
  const float* partial;  // [parts][kv_heads][G][D + 2]: each part's rows as Rows::keep writes
};

// Few items for the threads (a few sequences decoding: a single user's stream) leave threads
// idle while the longest items run. Where attend_vec serves, each one-token item
// with enough keys is split into parts of its key range that the threads share, each part's
// rows kept apart in `buf` (flash-decoding); merge_parts then combines them by their maxima and
// sums. Such a decode comes here with its kv heads together (run), so that each part streams
// its blocks whole.
std::vector<Split> split_decodes(const Meta& a, std::vector<Item>& items, std::vector<float>& buf,
                                 int64_t threads) {
  std::vector<Split> splits;
  const int64_t n = static_cast<int64_t>(items.size());
  if (threads < 2 || n == 0 || n >= 4 * threads || !vec_serves(a.dim, a.group)) return splits;
  // Parts enough for four items a thread, which the threads' dynamic claiming keeps level.
  const int64_t per_head = a.group * (a.dim + 2), want = (4 * threads + n - 1) / n;
  auto keys_of = [&](const Item& it) {  // [lo, hi) of a one-token item
    const int64_t pos = a.lens[it.seq] - (a.cu[it.seq + 1] - a.cu[it.seq]) + it.q_begin;
    return std::pair<int64_t, int64_t>{a.first_key(pos), pos + 1};
  };
  auto parts_of = [&](const Item& it) -> int64_t {
    if (it.q_end - it.q_begin != 1) return 1;
    const auto [lo, hi] = keys_of(it);
    return std::clamp<int64_t>((hi - lo) / kMinKeysPerPart, 1, want);
  };
  int64_t total = 0;  // heads' worth of partial rows
  for (const Item& it : items) {
    const int64_t parts = parts_of(it);
    if (parts > 1) total += parts * it.kv_heads;
  }
  if (total == 0) return splits;
  buf.assign(total * per_head, 0.f);
  std::vector<Item> out;
  float* next = buf.data();
  for (const Item& it : items) {
    const int64_t parts = parts_of(it);
    if (parts == 1) {
      out.push_back(it);
      continue;
    }
    const auto [lo, hi] = keys_of(it);
    splits.push_back({a.cu[it.seq] + it.q_begin, it.kv_head, it.kv_heads, parts, next});
    for (int64_t p = 0; p < parts; ++p) {  // boundaries on 16-key chunks from lo
      const int64_t b0 = lo + (hi - lo) * p / parts / 16 * 16;
      const int64_t b1 = p + 1 == parts ? hi : lo + (hi - lo) * (p + 1) / parts / 16 * 16;
      Item part = it;
      part.cost = it.cost * (b1 - b0) / (hi - lo);
      part.key_lo = b0;
      part.key_hi = b1;
      part.partial = next;
      next += it.kv_heads * per_head;
      out.push_back(part);
    }
  }
  items.swap(out);
  return splits;
}

// The parts of each split into out (and lse): the rows' outputs weighted by l * exp(m - M),
// M the largest part maximum.
template <typename Q, typename KV>
void merge_parts(const Args<Q, KV>& a, const std::vector<Split>& splits) {
  const int64_t d = a.dim;
  std::vector<float> row(d);
  for (const Split& sp : splits) {
    const int64_t per_part = sp.kv_heads * a.group * (d + 2);
    for (int64_t r = 0; r < sp.kv_heads * a.group; ++r) {  // head sp.kv_head * G + r
      float mx = kNegInf;
      for (int64_t p = 0; p < sp.parts; ++p) {
        mx = std::max(mx, sp.partial[p * per_part + r * (d + 2) + d]);
      }
      float sum = 0.f;
      std::fill(row.begin(), row.end(), 0.f);
      for (int64_t p = 0; p < sp.parts; ++p) {
        const float* part = sp.partial + p * per_part + r * (d + 2);
        if (part[d + 1] == 0.f) continue;  // saw no key
        const float w = part[d + 1] * std::exp(part[d] - mx);
        sum += w;
        for (int64_t i = 0; i < d; ++i) row[i] += w * part[i];
      }
      const int64_t head = sp.kv_head * a.group + r;
      Q* o = a.out + sp.tok * a.o_st + head * a.o_sh;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      for (int64_t i = 0; i < d; ++i) o[i] = store<Q>(row[i] * inv);
      if (a.lse != nullptr) {
        a.lse[sp.tok * (a.hkv * a.group) + head] = sum > 0.f ? mx + std::log(sum) : kNegInf;
      }
    }
  }
}

template <typename Q, typename KV>
int64_t run(const Args<Q, KV>& a, int64_t num_tokens, int64_t num_blocks, int64_t num_seqs) {
  std::vector<Item> items;
  // Many sequences: a decode's kv heads go together (its blocks read as one stream), enough
  // items are left for the threads to share.
  const bool heads_together =
      vec_serves(a.dim, a.group) && num_seqs >= 4 * at::get_num_threads();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = a.cu[s + 1] - a.cu[s];
    if (q_len == 0) continue;
    if (a.cu[s] < 0 || a.cu[s + 1] > num_tokens) return s;
    const int64_t len = a.lens[s];
    if (q_len < 0 || q_len > len || len > a.max_blocks * a.block) return s;
    const int64_t first = a.first_key(len - q_len);
    for (int64_t b = first / a.block; b * a.block < len; ++b) {
      const int32_t id = a.table[s * a.max_blocks + b];
      if (id < 0 || id >= num_blocks) return s;
    }
    // A decode's kv heads go together where sequences are many, and where its keys are enough
    // for split_decodes to split them (a part then streams its blocks whole).
    const bool long_decode = vec_serves(a.dim, a.group) && len - first >= 2 * kMinKeysPerPart;
    const int64_t per_item = q_len == 1 && (heads_together || long_decode) ? kMaxHeadsPerItem : 1;
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryTile) {
      const int64_t q1 = std::min(q_len, q0 + kQueryTile);
      const int64_t keys = a.lens[s] - q_len + q1;
      const int64_t cost = (q1 - q0) * (a.window > 0 ? std::min(keys, a.window + q1 - q0) : keys);
      for (int64_t h = 0; h < a.hkv; h += per_item) {
        const int64_t heads = std::min(per_item, a.hkv - h);
        items.push_back({s, h, heads, q0, q1, cost * heads});
      }
    }
  }
  std::vector<float> partials;
  const std::vector<Split> splits = split_decodes(a, items, partials, at::get_num_threads());
  // Longest first, handed out one at a time: the threads finish together whatever the mix.
  std::sort(items.begin(), items.end(),
            [](const Item& x, const Item& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(items.size());
  auto worker = [&](int64_t, int64_t) {
    Scratch scratch;  // per thread, reused across items
    // Each thread claims its next item before it works on this one, so that the next item's
    // first block can be on its way during this one's last (attend_heads).
    for (int64_t i = next++; i < n;) {
      const int64_t j = next++;
      const KV* after = nullptr;
      if (j < n) {
        const Item& it = items[j];
        const int64_t lo = it.key_hi >= 0 ? it.key_lo : a.first_key(a.lens[it.seq] - 1);
        after = a.kv + static_cast<int64_t>(a.table[it.seq * a.max_blocks + lo / a.block]) * 2 *
                           a.block * a.hkv * a.dim;
      }
      if (!attend_fast(a, items[i], after)) attend(a, items[i], scratch);
      i = j;
    }
  };
  int64_t work = 0;  // multiply-adds, roughly
  for (const Item& it : items) work += it.cost * a.group * a.dim * 2;
  // Below ~64K multiply-adds (a single short decode) waking the other threads costs more.
  const int64_t threads =
      work < (int64_t{1} << 16) ? 1 : std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, threads, 1, worker);
  }
  merge_parts(a, splits);
  return -1;
}

// Returns -1, or the first sequence whose metadata the kernel cannot follow (more new tokens
// than its length, a length past its block-table row, a block id outside the pool): the caller
// raises its typed error, and nothing was read or written.
int64_t paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, at::Tensor& out,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                     const at::Tensor& block_table, double scale, int64_t window,
                     double k_scale, double v_scale, at::Tensor& lse) {
  const auto qt = q.scalar_type(), ct = kv_cache.scalar_type();
  TORCH_CHECK((qt == at::kFloat || qt == at::kBFloat16) && out.scalar_type() == qt &&
                  (ct == qt || ct == at::kBFloat16 || ct == at::kFloat8_e4m3fn),
              "paged_attention (CPU kernel): q and out float32 or bfloat16 alike, kv_cache "
              "the same, bfloat16 or float8_e4m3fn");
  TORCH_CHECK(q.is_cpu() && kv_cache.is_cpu() && out.is_cpu() && cu_seqlens_q.is_cpu() &&
                  seq_lens.is_cpu() && block_table.is_cpu() && (!lse.defined() || lse.is_cpu()),
              "paged_attention (CPU kernel): every tensor must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && kv_cache.dim() == 5 &&
                  kv_cache.size(1) == 2 && kv_cache.size(4) == q.size(2),
              "q and out [T, H_q, D], kv_cache [NB, 2, B, H_kv, D]");
  TORCH_CHECK(seq_lens.dim() == 1 && cu_seqlens_q.dim() == 1 &&
                  cu_seqlens_q.size(0) == seq_lens.size(0) + 1 && block_table.dim() == 2 &&
                  block_table.size(0) == seq_lens.size(0) && cu_seqlens_q.is_contiguous() &&
                  seq_lens.is_contiguous(),
              "cu_seqlens_q [S + 1], seq_lens [S], block_table [S, max_blocks]");
  TORCH_CHECK(window == -1 || window >= 1, "sliding_window must be >= 1");
  TORCH_CHECK(scale > 0, "softmax_scale must be > 0");
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "k_scale and v_scale must be finite and > 0");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need unit stride in D");
  TORCH_CHECK(kv_cache.is_contiguous() && block_table.is_contiguous(), "need contiguous");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_table.scalar_type() == at::kInt,
              "metadata must be int32");
  const int64_t hq = q.size(1), hkv = kv_cache.size(3), num_seqs = seq_lens.size(0);
  TORCH_CHECK(hq % hkv == 0, "num_q_heads must be a multiple of num_kv_heads");
  const bool want_lse = lse.numel() > 0;
  TORCH_CHECK(!want_lse || (lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                            lse.size(1) == hq),
              "lse must be [T, H_q] float32 contiguous");
  const Meta meta{want_lse ? lse.data_ptr<float>() : nullptr, cu_seqlens_q.data_ptr<int32_t>(),
                  seq_lens.data_ptr<int32_t>(), block_table.data_ptr<int32_t>(),
                  block_table.size(1), kv_cache.size(2), hkv, hq / hkv, q.size(2), window,
                  static_cast<float>(scale * k_scale), static_cast<float>(v_scale)};
  // at::BFloat16 is one uint16_t, as pagedserve::bf16; at::Float8_e4m3fn one uint8_t, as fp8.
  auto bf = [](const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); };
  const auto* f8 = reinterpret_cast<const fp8*>(kv_cache.data_ptr());
  if (ct == at::kFloat8_e4m3fn && qt == at::kFloat) {
    return run(make_args(q.data_ptr<float>(), f8, out.data_ptr<float>(), q, out, meta),
               q.size(0), kv_cache.size(0), num_seqs);
  }
  if (ct == at::kFloat8_e4m3fn) {
    return run(make_args(static_cast<const bf16*>(bf(q)), f8, bf(out), q, out, meta), q.size(0),
               kv_cache.size(0), num_seqs);
  }
  if (qt == at::kFloat && ct == at::kFloat) {
    return run(make_args(q.data_ptr<float>(), kv_cache.data_ptr<float>(),
                         out.data_ptr<float>(), q, out, meta),
               q.size(0), kv_cache.size(0), num_seqs);
  }
  if (qt == at::kFloat) {
    return run(make_args(q.data_ptr<float>(), static_cast<const bf16*>(bf(kv_cache)),
                         out.data_ptr<float>(), q, out, meta),
               q.size(0), kv_cache.size(0), num_seqs);
  }
  return run(make_args(static_cast<const bf16*>(bf(q)), static_cast<const bf16*>(bf(kv_cache)),
                       bf(out), q, out, meta),
             q.size(0), kv_cache.size(0), num_seqs);
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, lib) {
  lib.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor(a!) out, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_table, float scale, int window, float k_scale, "
      "float v_scale, Tensor(b!) lse) -> int");
  lib.impl("paged_attention", c10::DispatchKey::CPU, paged_attention);
}

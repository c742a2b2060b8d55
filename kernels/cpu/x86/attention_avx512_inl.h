// The attention primitives with 512-bit registers, in the orders of
// kernel_table.h (bit-identical to the scalar and 256-bit versions). Included
// into the AVX-512 translation unit only.
//  - kq_scores: a key row's 16 lanes are one register; the 16 lane trees of
//    a 16-row segment are summed together, two or four rows per add
//    (tree_sum16_rows). Each key is converted from F16 once for all the
//    query heads that share it.
//  - kqv_sum: the (group, slot) chains of 64 values of d, two slots and up to
//    three query heads at a time, stay in registers while the value rows
//    stream past, each converted once for those heads. The prefill tiles'
//    kqv_sum_tile takes four heads (a Llama 3 KV head's) one slot at a time.
// Conversions from F16 cost more than FMAs on the machines measured (Zen 5:
// about 0.8 cycle per 16 values), hence the sharing.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace attention512 {

// Heads of more than this many elements use the 256-bit kq_scores.
constexpr int64_t kMaxDim = 256;
// Query elements (heads x dim) converted to float at once.
constexpr int64_t kMaxQueryFloats = 4096;
// Query heads whose value chains share one pass over V (registers: 2 slots x
// 4 vectors per head).
constexpr int kMaxHeadsPerPass = 3;

// 16 halves (fewer: `valid` lanes, the rest 0) as floats.
inline __m512 load_half16(const uint16_t* p, __mmask16 valid = 0xffff) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, p));
}

// Lane r of the result is lane_tree_sum16 of v[r]: the tree (l, l+8),
// (l, l+4), (0+2)+(1+3) of every vector, the rows paired up in the halves,
// quarters and pairs of lanes of shared registers at each level.
inline __m512 tree_sum16_rows(const __m512 (&v)[16]) {
  __m512 a[8];  // rows 2i, 2i + 1 in the 256-bit halves of a[i]
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  }
  __m512 b[4];  // rows 4i .. 4i + 3 in the 128-bit lanes of b[i]
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xdd));
  }
  __m512 c[2];  // 128-bit lane k of c[i]: (0+2, 1+3) of rows 8i + k, 8i + 4 + k
  for (int i = 0; i < 2; ++i) {
    const __m512d lo =
        _mm512_unpacklo_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    const __m512d hi =
        _mm512_unpackhi_pd(_mm512_castps_pd(b[2 * i]), _mm512_castps_pd(b[2 * i + 1]));
    c[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  // Lane 4k + j: row 4j + k.
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i rows = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(rows, d);
}

// The 16 lanes of one query head (qf: n_whole floats) against the rows of kf
// (16 rows of n_whole floats; rows from n_rows on are unused, row 0 stands in):
// groups 1, one FMA chain per row over the 16-element chunks; groups 4, chunk
// c into accumulator c % 4, then (a0 + a2) + (a1 + a3). The chunk loop is
// outermost so that the rows' chains overlap.
inline void kq_lanes(const float* qf, const float* kf, int64_t n_rows, int64_t n_whole, int groups,
                     __m512 (&lanes)[16]) {
  const float* rows[16];
  for (int r = 0; r < 16; ++r) rows[r] = kf + (r < n_rows ? r : 0) * n_whole;
  for (auto& l : lanes) l = _mm512_setzero_ps();
  if (groups == 1) {
    for (int64_t e = 0; e < n_whole; e += 16) {
      const __m512 qv = _mm512_load_ps(qf + e);
      for (int r = 0; r < 16; ++r)
        lanes[r] = _mm512_fmadd_ps(_mm512_load_ps(rows[r] + e), qv, lanes[r]);
    }
    return;
  }
  for (int r0 = 0; r0 < 16; r0 += 4) {
    __m512 acc[4][4];  // [row][group]: indexed by constants only, so in registers
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t e = 0; e < n_whole; e += 64) {  // n_whole: whole 64-chunks
      for (int g = 0; g < 4; ++g) {
        const __m512 qv = _mm512_load_ps(qf + e + 16 * g);
        for (int r = 0; r < 4; ++r) {
          acc[r][g] = _mm512_fmadd_ps(_mm512_load_ps(rows[r0 + r] + e + 16 * g), qv, acc[r][g]);
        }
      }
    }
    for (int r = 0; r < 4; ++r) {
      lanes[r0 + r] =
          _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][2]), _mm512_add_ps(acc[r][1], acc[r][3]));
    }
  }
}

// The 16 x 16 floats of r transposed in place: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// kq_scores in the multi-token order (groups 1, dim a multiple of 16) for
// many query heads (a prefill tile's): the segment is transposed once
// (kt[e]: element e of its 16 keys, one key per register lane), so that a
// head's 16 lane chains for all 16 keys are 16 registers of vertical FMAs
// against its broadcast query elements, and the lane tree is vertical adds
// too: no horizontal sums. The same FMAs in the same order as kq_lanes, so
// the same bits. kHeads heads at a time, their lanes in the tree's order
// so that few registers are live.
template <int kHeads>
inline void kq_transposed_heads(const float* kt, const float* qf, int64_t dim,
                                __m512 (&result)[kHeads]) {
  const int64_t n_chunks = dim / 16;
  // v[h] = lane l of head h's chain: fma over the chunks in order, from 0.
  auto lane = [&](int l, __m512(&v)[kHeads]) {
    for (auto& x : v) x = _mm512_setzero_ps();
    for (int64_t c = 0; c < n_chunks; ++c) {
      const __m512 k = _mm512_load_ps(kt + (16 * c + l) * 16);
      for (int h = 0; h < kHeads; ++h)
        v[h] = _mm512_fmadd_ps(k, _mm512_set1_ps(qf[h * dim + 16 * c + l]), v[h]);
    }
  };
  // b_l = (v_{l+12} + v_{l+4}) + (v_{l+8} + v_l): the tree's second level.
  auto quarter = [&](int l, __m512(&b)[kHeads]) {
    __m512 v0[kHeads], v8[kHeads], v4[kHeads], v12[kHeads];
    lane(l, v0);
    lane(l + 8, v8);
    lane(l + 4, v4);
    lane(l + 12, v12);
    for (int h = 0; h < kHeads; ++h)
      b[h] = _mm512_add_ps(_mm512_add_ps(v12[h], v4[h]), _mm512_add_ps(v8[h], v0[h]));
  };
  __m512 b0[kHeads], b1[kHeads];
  quarter(0, b0);
  quarter(2, b1);
  __m512 even[kHeads];  // b0 + b2
  for (int h = 0; h < kHeads; ++h) even[h] = _mm512_add_ps(b0[h], b1[h]);
  quarter(1, b0);
  quarter(3, b1);
  for (int h = 0; h < kHeads; ++h) result[h] = _mm512_add_ps(even[h], _mm512_add_ps(b0[h], b1[h]));
}

// Heads from which kq_scores takes the transposed path (the transposition
// of a segment costs about a head's FMAs).
constexpr int64_t kTransposedMinHeads = 6;
constexpr int kTransposedHeadsPerPass = 4;

void kq_scores_transposed(const uint16_t* q, int64_t n_q, const uint16_t* const* segments,
                          int64_t n_keys, int64_t dim, float* out, int64_t ld_out) {
  alignas(64) float qf[kMaxQueryFloats];  // head h at qf + h * dim
  alignas(64) float kt[kMaxDim * 16];     // element e of the segment's keys at kt + 16 e
  for (int64_t i = 0; i < n_q * dim; i += 16) _mm512_store_ps(qf + i, load_half16(q + i));
  for (int64_t t0 = 0; t0 < n_keys; t0 += 16) {
    const uint16_t* segment = segments[t0 / 16];
    const int rows = static_cast<int>(std::min<int64_t>(16, n_keys - t0));
    if (t0 + 16 < n_keys) {  // the next segment, from wherever in the cache it is
      const auto* next = reinterpret_cast<const char*>(segments[t0 / 16 + 1]);
      const int64_t next_rows = std::min<int64_t>(16, n_keys - t0 - 16);
      for (int64_t b = 0; b < next_rows * dim * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
    for (int64_t e0 = 0; e0 < dim; e0 += 16) {
      __m512 r[16];  // rows past the last key stand in as row 0
      for (int i = 0; i < 16; ++i) r[i] = load_half16(segment + (i < rows ? i : 0) * dim + e0);
      transpose16(r);
      for (int l = 0; l < 16; ++l) _mm512_store_ps(kt + (e0 + l) * 16, r[l]);
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << rows) - 1);
    int64_t h = 0;
    for (; h + kTransposedHeadsPerPass <= n_q; h += kTransposedHeadsPerPass) {
      __m512 sums[kTransposedHeadsPerPass];
      kq_transposed_heads<kTransposedHeadsPerPass>(kt, qf + h * dim, dim, sums);
      for (int i = 0; i < kTransposedHeadsPerPass; ++i)
        _mm512_mask_storeu_ps(out + (h + i) * ld_out + t0, valid, sums[i]);
    }
    for (; h < n_q; ++h) {
      __m512 sums[1];
      kq_transposed_heads<1>(kt, qf + h * dim, dim, sums);
      _mm512_mask_storeu_ps(out + h * ld_out + t0, valid, sums[0]);
    }
  }
}

// kq_scores: each key segment is converted to float once and used by every
// query head.
void kq_scores(const uint16_t* q, int64_t n_q, const uint16_t* const* segments, int64_t n_keys,
               int64_t dim, int groups, float* out, int64_t ld_out) {
  if (dim > kMaxDim) return kq_scores_avx(q, n_q, segments, n_keys, dim, groups, out, ld_out);
  const int64_t max_heads = kMaxQueryFloats / dim;
  if (n_q > max_heads) {
    for (int64_t h0 = 0; h0 < n_q; h0 += max_heads) {
      kq_scores(q + h0 * dim, std::min(max_heads, n_q - h0), segments, n_keys, dim, groups,
                out + h0 * ld_out, ld_out);
    }
    return;
  }
  if (groups == 1 && dim % 16 == 0 && n_q >= kTransposedMinHeads)
    return kq_scores_transposed(q, n_q, segments, n_keys, dim, out, ld_out);
  const int64_t chunk = groups == 1 ? 16 : 64;
  const int64_t n_whole = dim - dim % chunk;
  alignas(64) float qf[kMaxQueryFloats];  // head h at qf + h * n_whole
  alignas(64) float kf[16 * kMaxDim];     // row r of the segment at kf + r * n_whole
  for (int64_t h = 0; h < n_q; ++h) {
    for (int64_t e = 0; e < n_whole; e += 16)
      _mm512_store_ps(qf + h * n_whole + e, load_half16(q + h * dim + e));
  }
  for (int64_t t0 = 0; t0 < n_keys; t0 += 16) {
    const uint16_t* segment = segments[t0 / 16];
    const int rows = static_cast<int>(std::min<int64_t>(16, n_keys - t0));
    if (t0 + 16 < n_keys) {  // the next segment, from wherever in the cache it is
      const auto* next = reinterpret_cast<const char*>(segments[t0 / 16 + 1]);
      const int64_t next_rows = std::min<int64_t>(16, n_keys - t0 - 16);
      for (int64_t b = 0; b < next_rows * dim * 2; b += 64) _mm_prefetch(next + b, _MM_HINT_T0);
    }
    for (int r = 0; r < rows; ++r) {
      for (int64_t e = 0; e < n_whole; e += 16)
        _mm512_store_ps(kf + r * n_whole + e, load_half16(segment + r * dim + e));
    }
    for (int64_t h = 0; h < n_q; ++h) {
      __m512 lanes[16];
      kq_lanes(qf + h * n_whole, kf, rows, n_whole, groups, lanes);
      const __m512 sums = tree_sum16_rows(lanes);
      float* o = out + h * ld_out + t0;
      if (n_whole == dim) {
        _mm512_mask_storeu_ps(o, static_cast<__mmask16>((1u << rows) - 1), sums);
        continue;
      }
      // Elements past the last whole 64-chunk (groups 4): added in double, in order.
      alignas(64) float tree[16];
      _mm512_store_ps(tree, sums);
      const uint16_t* qh = q + h * dim;
      for (int r = 0; r < rows; ++r) {
        const uint16_t* kr = segment + r * dim;
        double sum = tree[r];
        for (int64_t e = n_whole; e < dim; ++e) {
          sum += static_cast<double>(half_to_float(kr[e]) * half_to_float(qh[e]));
        }
        o[r] = static_cast<float>(sum);
      }
    }
  }
}

// One value row t for kHeads query heads: acc[h] = fma(v[t], p_h[t], acc[h])
// for d in [d0, d0 + 16 kVecs), the row converted once.
template <int kVecs, int kHeads>
inline void kqv_row(const float* p, int64_t ld_p, const uint16_t* const* segments, int64_t dim,
                    int64_t t, int64_t d0, __mmask16 last, __m512 (&acc)[kHeads][kVecs]) {
  const uint16_t* v = segments[t / 16] + t % 16 * dim + d0;
  __m512 vf[kVecs];
  for (int c = 0; c < kVecs; ++c) vf[c] = load_half16(v + 16 * c, c == kVecs - 1 ? last : 0xffff);
  for (int h = 0; h < kHeads; ++h) {
    const __m512 pt = _mm512_set1_ps(p[h * ld_p + t]);
    for (int c = 0; c < kVecs; ++c) acc[h][c] = _mm512_fmadd_ps(vf[c], pt, acc[h][c]);
  }
}

// The (group, slot) chains of slots s and s + 1 of kHeads query heads, for d
// in [d0, d0 + 16 kVecs) (the last vector `last` lanes wide): acc = fma(v, p,
// acc) over the rows t = first, first + step, .. (slot s) and t + 1 (slot
// s + 1, which may have one row fewer, never more), in order. Each value row
// is converted once for the heads. out: [head][slot][vector].
template <int kVecs, int kHeads>
inline void kqv_chains(const float* p, int64_t ld_p, const uint16_t* const* segments,
                       int64_t n_keys, int64_t dim, int64_t first, int64_t step, int64_t d0,
                       __mmask16 last, __m512 (&out)[kHeads][2][kVecs]) {
  // Two plain arrays indexed by constants only, so that they live in registers.
  __m512 acc0[kHeads][kVecs], acc1[kHeads][kVecs];
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kVecs; ++c) acc0[h][c] = acc1[h][c] = _mm512_setzero_ps();
  int64_t t = first;
  for (; t + 1 < n_keys; t += step) {
    kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t, d0, last, acc0);
    kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t + 1, d0, last, acc1);
  }
  if (t < n_keys) kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t, d0, last, acc0);
  for (int h = 0; h < kHeads; ++h)
    for (int c = 0; c < kVecs; ++c) {
      out[h][0][c] = acc0[h][c];
      out[h][1][c] = acc1[h][c];
    }
}

// kqv_sum of kHeads query heads for d in [d0, d0 + 16 kVecs).
template <int kVecs, int kHeads>
void kqv_sum_pass(const float* p, int64_t ld_p, const uint16_t* const* segments, int64_t n_keys,
                  int64_t dim, int groups, int64_t d0, __mmask16 last, float* out) {
  using Acc = __m512[kHeads][2][kVecs];  // [head][slot s, s + 1][vector]
  auto chains = [&](int group, int s, Acc& acc) {
    kqv_chains<kVecs, kHeads>(p, ld_p, segments, n_keys, dim, 16 * group + s, 16 * groups, d0, last,
                              acc);
  };
  __m512 g[16][kHeads][kVecs];
  for (int s = 0; s < 16; s += 2) {
    Acc acc;
    if (groups == 1) {
      chains(0, s, acc);
      for (int h = 0; h < kHeads; ++h)
        for (int c = 0; c < kVecs; ++c) {
          g[s][h][c] = acc[h][0][c];
          g[s + 1][h][c] = acc[h][1][c];
        }
      continue;
    }
    // (g0 + g2) + (g1 + g3), for slots s and s + 1.
    Acc even, odd;
    chains(0, s, even);
    chains(2, s, acc);
    for (int h = 0; h < kHeads; ++h)
      for (int i = 0; i < 2; ++i)
        for (int c = 0; c < kVecs; ++c) even[h][i][c] = _mm512_add_ps(even[h][i][c], acc[h][i][c]);
    chains(1, s, odd);
    chains(3, s, acc);
    for (int h = 0; h < kHeads; ++h)
      for (int i = 0; i < 2; ++i)
        for (int c = 0; c < kVecs; ++c)
          g[s + i][h][c] = _mm512_add_ps(even[h][i][c], _mm512_add_ps(odd[h][i][c], acc[h][i][c]));
  }
  for (int h = 0; h < kHeads; ++h) {
    for (int c = 0; c < kVecs; ++c) {
      __m512 a[8], b[4];
      for (int l = 0; l < 8; ++l) a[l] = _mm512_add_ps(g[l + 8][h][c], g[l][h][c]);
      for (int l = 0; l < 4; ++l) b[l] = _mm512_add_ps(a[l + 4], a[l]);
      _mm512_mask_storeu_ps(out + h * dim + d0 + 16 * c, c == kVecs - 1 ? last : 0xffff,
                            _mm512_add_ps(_mm512_add_ps(b[0], b[2]), _mm512_add_ps(b[1], b[3])));
    }
  }
}

template <int kVecs>
void kqv_sum_vecs(const float* p, int64_t ld_p, int64_t n_q, const uint16_t* const* segments,
                  int64_t n_keys, int64_t dim, int groups, int64_t d0, __mmask16 last, float* out) {
  for (int64_t h = 0; h < n_q; h += kMaxHeadsPerPass) {
    const float* ph = p + h * ld_p;
    float* oh = out + h * dim;
    switch (std::min<int64_t>(kMaxHeadsPerPass, n_q - h)) {
      case 1:
        kqv_sum_pass<kVecs, 1>(ph, ld_p, segments, n_keys, dim, groups, d0, last, oh);
        break;
      case 2:
        kqv_sum_pass<kVecs, 2>(ph, ld_p, segments, n_keys, dim, groups, d0, last, oh);
        break;
      default:
        kqv_sum_pass<kVecs, 3>(ph, ld_p, segments, n_keys, dim, groups, d0, last, oh);
        break;
    }
  }
}

// fn(std::integral_constant<int, kVecs>, d0, last) for d in 64-value chunks
// [d0, d0 + 16 kVecs), the last vector `last` lanes wide. Callers capture by
// value: a kernel reading its arguments through references ran 25% slower.
template <typename Fn>
void for_each_d_chunk(int64_t dim, Fn&& fn) {
  for (int64_t d0 = 0; d0 < dim; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, dim - d0);
    const __mmask16 last = static_cast<__mmask16>(0xffffu >> ((16 - width % 16) % 16));
    switch ((width + 15) / 16) {
      case 1:
        fn(std::integral_constant<int, 1>{}, d0, last);
        break;
      case 2:
        fn(std::integral_constant<int, 2>{}, d0, last);
        break;
      case 3:
        fn(std::integral_constant<int, 3>{}, d0, last);
        break;
      default:
        fn(std::integral_constant<int, 4>{}, d0, last);
        break;
    }
  }
}

// kqv_sum, 64 values of d at a time (a masked last vector for the rest).
void kqv_sum(const float* p, int64_t ld_p, int64_t n_q, const uint16_t* const* segments,
             int64_t n_keys, int64_t dim, int groups, float* out) {
  for_each_d_chunk(dim, [=](auto vecs, int64_t d0, __mmask16 last) {
    kqv_sum_vecs<decltype(vecs)::value>(p, ld_p, n_q, segments, n_keys, dim, groups, d0, last, out);
  });
}

// kqv_sum_tile (kernel_table.h) in the multi-token order: the value rows
// stream past in blocks of kTileKeyBlock keys; for each block, every row of
// the tile resumes its (slot, head) chains from memory (state: [row][head]
// [slot][dim] floats), runs them over the block's rows in increasing t, and
// leaves them there. A chain is the same sequence of FMAs as kqv_sum's, only
// suspended between blocks, so each row's result is kqv_sum's; but a block of
// values is read from memory once for the whole tile, not once per row.
constexpr int64_t kTileKeyBlock = 128;

template <int kVecs, int kHeads>
void kqv_tile_block(const float* p, int64_t ld_p, const uint16_t* const* segments, int64_t dim,
                    int64_t b0, int64_t end, int64_t d0, __mmask16 last, float* state) {
  // state: this row's heads [kHeads][16 slots][dim], from head h0.
  for (int s = 0; s < 16; s += 2) {
    __m512 acc0[kHeads][kVecs], acc1[kHeads][kVecs];
    for (int h = 0; h < kHeads; ++h) {
      for (int c = 0; c < kVecs; ++c) {
        const __mmask16 m = c == kVecs - 1 ? last : 0xffff;
        acc0[h][c] = _mm512_maskz_loadu_ps(m, state + (h * 16 + s) * dim + d0 + 16 * c);
        acc1[h][c] = _mm512_maskz_loadu_ps(m, state + (h * 16 + s + 1) * dim + d0 + 16 * c);
      }
    }
    int64_t t = b0 + s;
    for (; t + 1 < end; t += 16) {
      kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t, d0, last, acc0);
      kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t + 1, d0, last, acc1);
    }
    if (t < end) kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t, d0, last, acc0);
    for (int h = 0; h < kHeads; ++h) {
      for (int c = 0; c < kVecs; ++c) {
        const __mmask16 m = c == kVecs - 1 ? last : 0xffff;
        _mm512_mask_storeu_ps(state + (h * 16 + s) * dim + d0 + 16 * c, m, acc0[h][c]);
        _mm512_mask_storeu_ps(state + (h * 16 + s + 1) * dim + d0 + 16 * c, m, acc1[h][c]);
      }
    }
  }
}

// Query heads whose chains kqv_tile_block1 runs together: 4 heads of 4
// vectors are 16 accumulators.
constexpr int kHeadsPerSlotPass = 4;

// The same chains one slot at a time, for kHeads heads: each value row is
// converted once for all of them.
template <int kVecs, int kHeads>
void kqv_tile_block1(const float* p, int64_t ld_p, const uint16_t* const* segments, int64_t dim,
                     int64_t b0, int64_t end, int64_t d0, __mmask16 last, float* state) {
  for (int s = 0; s < 16; ++s) {
    __m512 acc[kHeads][kVecs];
    for (int h = 0; h < kHeads; ++h) {
      for (int c = 0; c < kVecs; ++c) {
        const __mmask16 m = c == kVecs - 1 ? last : 0xffff;
        acc[h][c] = _mm512_maskz_loadu_ps(m, state + (h * 16 + s) * dim + d0 + 16 * c);
      }
    }
    for (int64_t t = b0 + s; t < end; t += 16)
      kqv_row<kVecs, kHeads>(p, ld_p, segments, dim, t, d0, last, acc);
    for (int h = 0; h < kHeads; ++h) {
      for (int c = 0; c < kVecs; ++c) {
        const __mmask16 m = c == kVecs - 1 ? last : 0xffff;
        _mm512_mask_storeu_ps(state + (h * 16 + s) * dim + d0 + 16 * c, m, acc[h][c]);
      }
    }
  }
}

template <int kVecs>
void kqv_tile_heads(const float* p, int64_t ld_p, int64_t n_q, const uint16_t* const* segments,
                    int64_t dim, int64_t b0, int64_t end, int64_t d0, __mmask16 last,
                    float* state) {
  int64_t h = 0;
  for (; h + kHeadsPerSlotPass <= n_q; h += kHeadsPerSlotPass)
    kqv_tile_block1<kVecs, kHeadsPerSlotPass>(p + h * ld_p, ld_p, segments, dim, b0, end, d0, last,
                                              state + h * 16 * dim);
  for (; h < n_q; h += kMaxHeadsPerPass) {
    const float* ph = p + h * ld_p;
    float* sh = state + h * 16 * dim;
    switch (std::min<int64_t>(kMaxHeadsPerPass, n_q - h)) {
      case 1:
        kqv_tile_block<kVecs, 1>(ph, ld_p, segments, dim, b0, end, d0, last, sh);
        break;
      case 2:
        kqv_tile_block<kVecs, 2>(ph, ld_p, segments, dim, b0, end, d0, last, sh);
        break;
      default:
        kqv_tile_block<kVecs, 3>(ph, ld_p, segments, dim, b0, end, d0, last, sh);
        break;
    }
  }
}

void kqv_sum_tile(const float* p, int64_t ld_p, int64_t n_q, int64_t n_rows, int64_t n_keys0,
                  const uint16_t* const* segments, int64_t dim, int groups, float* out,
                  int64_t ld_out) {
  if (groups != 1) {  // the one-token order's chains skip segments: row by row
    for (int64_t r = 0; r < n_rows; ++r)
      kqv_sum(p + r * n_q * ld_p, ld_p, n_q, segments, n_keys0 + r, dim, groups, out + r * ld_out);
    return;
  }
  thread_local std::vector<float> state_buffer;
  const size_t state_floats = static_cast<size_t>(n_rows * n_q * 16 * dim);
  if (state_buffer.size() < state_floats) state_buffer.resize(state_floats);
  float* state = state_buffer.data();
  std::fill(state, state + state_floats, 0.0f);
  const int64_t n_keys_max = n_keys0 + n_rows - 1;
  for (int64_t b0 = 0; b0 < n_keys_max; b0 += kTileKeyBlock) {
    const int64_t b1 = std::min(b0 + kTileKeyBlock, n_keys_max);
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t end = std::min(b1, n_keys0 + r);
      if (end <= b0) continue;
      const float* pr = p + r * n_q * ld_p;
      float* sr = state + r * n_q * 16 * dim;
      for_each_d_chunk(dim, [=](auto vecs, int64_t d0, __mmask16 last) {
        kqv_tile_heads<decltype(vecs)::value>(pr, ld_p, n_q, segments, dim, b0, end, d0, last, sr);
      });
    }
  }
  // The 16-lane tree over the slots, as kqv_sum_pass ends.
  for (int64_t r = 0; r < n_rows; ++r) {
    for (int64_t h = 0; h < n_q; ++h) {
      const float* g = state + (r * n_q + h) * 16 * dim;
      float* o = out + r * ld_out + h * dim;
      for (int64_t d0 = 0; d0 < dim; d0 += 16) {
        const __mmask16 m =
            static_cast<__mmask16>(dim - d0 >= 16 ? 0xffffu : (1u << (dim - d0)) - 1);
        __m512 a[8], b[4];
        for (int l = 0; l < 8; ++l) {
          a[l] = _mm512_add_ps(_mm512_maskz_loadu_ps(m, g + (l + 8) * dim + d0),
                               _mm512_maskz_loadu_ps(m, g + l * dim + d0));
        }
        for (int l = 0; l < 4; ++l) b[l] = _mm512_add_ps(a[l + 4], a[l]);
        _mm512_mask_storeu_ps(o + d0, m,
                              _mm512_add_ps(_mm512_add_ps(b[0], b[2]), _mm512_add_ps(b[1], b[3])));
      }
    }
  }
}

}  // namespace attention512
}  // namespace
}  // namespace duet::cpu

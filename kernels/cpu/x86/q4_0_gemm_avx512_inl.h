// Tiled GEMM for Q4_0 weights with AVX-512 VNNI, for the batched shapes
// (prefill, batched decode), on GGUF rows or rows interleaved by 8
// (interleave.h; rows by 16 have quant_x16_avx512_inl.h's tiles). Included
// into the AVX-512 translation unit only; it shares kquant_gemm_avx512_inl.h's
// transpose.
//
// Q4_0's order (kernel_table.h) keeps one exact integer S per block and pair,
// so the integer work may take any shape; it is kquant512's. A zmm holds 16
// activation rows, one per int32 lane: vpdpbusd adds 4 unsigned nibbles of
// one weight row (broadcast) times the same 4 elements of 16 activation
// rows, and a lane starts from -8 * (its row's sum over the block), so after
// the block's 8 groups it holds S. Then y = fma(float(S), d_w * d_x, y), per
// block in order in the pair's lane: bit-identical to the row kernels.
// A register tile is 8 weight rows x 16 activation rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/x86/x86_kquant_inl.h"

namespace duet::cpu {
namespace {
namespace q40x512 {

constexpr int kLanes = kquant512::kLanes;        // activation rows per zmm
constexpr int kTileRows = kquant512::kTileRows;  // weight rows per register tile
constexpr int kGroups = kQuantBlock / 4;

// One block of 16 activation rows.
struct alignas(64) ActBlock {
  __m512i codes[kGroups];  // group g: lane c holds row c's elements 4g .. 4g + 3
  __m512i start;           // -8 * the sum of row c's 32 elements
  __m512 d;
};

// Where a matrix's rows are: GGUF's rows or groups of 8 rows.
enum class Layout { kRows, kBy8 };

// One block of 8 weight rows: each row's nibbles as unsigned bytes, 4 per
// word (group g: elements 4g .. 4g + 3), and the rows' scales.
struct alignas(64) WeightBlock {
  uint32_t q[kTileRows * kGroups];
  float d[kTileRows];
};

// Where row t's group g is in WeightBlock::q.
constexpr int word_index(int t, int g) { return t * kGroups + g; }

// Activation rows [0, n_rows) (n_rows <= 16), blocks [0, nb).
inline void pack_act_group(const uint8_t* x, size_t x_stride, int64_t n_rows, int64_t nb,
                           ActBlock* out) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t b = 0; b < nb; b += 2) {
    const bool pair = b + 1 < nb;
    // Row c's two blocks side by side, then word c of every row in v[c]:
    // v[0 .. 7] are block b's groups, v[8 .. 15] block b + 1's.
    __m512i v[kLanes];
    alignas(64) float d[2][kLanes] = {};
    for (int c = 0; c < kLanes; ++c) {
      v[c] = _mm512_setzero_si512();
      if (c >= n_rows) continue;
      const auto* row = reinterpret_cast<const BlockQ8_0*>(x + c * x_stride) + b;
      const __m256i hi = pair ? load_i8x32(row[1].qs) : _mm256_setzero_si256();
      v[c] = _mm512_inserti64x4(_mm512_castsi256_si512(load_i8x32(row[0].qs)), hi, 1);
      d[0][c] = half_to_float(row[0].d);
      if (pair) d[1][c] = half_to_float(row[1].d);
    }
    kquant512::transpose16(v);
    for (int h = 0; h < (pair ? 2 : 1); ++h) {
      ActBlock& o = out[b + h];
      __m512i sum = _mm512_setzero_si512();
      for (int g = 0; g < kGroups; ++g) {
        o.codes[g] = v[kGroups * h + g];
        sum = _mm512_dpbusd_epi32(sum, ones, o.codes[g]);
      }
      o.start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 3));
      o.d = _mm512_load_ps(d[h]);
    }
  }
}

// Weight rows [j0, j0 + n_rows) (n_rows <= 8; a whole group when
// interleaved) of a matrix of nb blocks per row, blocks [0, nb).
template <Layout kLayout>
void pack_weight_group(const uint8_t* w, size_t w_stride, int64_t j0, int64_t n_rows, int64_t nb,
                       WeightBlock* out) {
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  for (int64_t b = 0; b < nb; ++b) {
    WeightBlock& o = out[b];
    if constexpr (kLayout == Layout::kBy8) {
      const BlockQ4_0x8& blk =
          reinterpret_cast<const BlockQ4_0x8*>(w)[j0 / kInterleavedRows * nb + b];
      for (int p = 0; p < kTileRows / 2; ++p) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk.qs[p]));
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + word_index(2 * p, 0)),
                           _mm256_and_si256(q, low_nibbles));
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + word_index(2 * p + 1, 0)),
                           _mm256_and_si256(_mm256_srli_epi16(q, 4), low_nibbles));
      }
      _mm256_store_ps(o.d,
                      _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.d))));
    } else {
      for (int t = 0; t < kTileRows; ++t) {
        __m256i q = _mm256_setzero_si256();
        o.d[t] = 0.0f;  // rows past the end add zeros
        if (t < n_rows) {
          const auto& blk = reinterpret_cast<const BlockQ4_0*>(w + (j0 + t) * w_stride)[b];
          q = unpack_nibbles(blk.qs);
          o.d[t] = half_to_float(blk.d);
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(o.q + word_index(t, 0)), q);
      }
    }
  }
}

// Weight rows [0, 8) of the panel x the 16 activation rows of act, over nb
// blocks; writes y[c * ldy + t] for c < n_cols, t < n_w.
inline void run_tile(const WeightBlock* panel, const ActBlock* act, int64_t nb, float* y,
                     int64_t ldy, int64_t n_cols, int64_t n_w,
                     const kquant512::Prefetch& prefetch) {
  __m512 acc[kTileRows];
  for (int t = 0; t < kTileRows; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch.at(b);
    const WeightBlock& w = panel[b];
    const ActBlock& a = act[b];
    __m512i s[kTileRows];
    for (int t = 0; t < kTileRows; ++t) s[t] = a.start;
    for (int g = 0; g < kGroups; ++g) {
      const __m512i codes = _mm512_load_si512(&a.codes[g]);
      for (int t = 0; t < kTileRows; ++t) {
        s[t] = _mm512_dpbusd_epi32(s[t], _mm512_set1_epi32(static_cast<int>(w.q[word_index(t, g)])),
                                   codes);
      }
    }
    for (int t = 0; t < kTileRows; ++t) {
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(w.d[t]), a.d);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), scale, acc[t]);
    }
  }
  alignas(64) float out[kTileRows][kLanes];
  for (int t = 0; t < kTileRows; ++t) _mm512_store_ps(out[t], acc[t]);
  for (int64_t c = 0; c < n_cols; ++c)
    for (int64_t t = 0; t < n_w; ++t) y[c * ldy + t] = out[t][c];
}

// The same for at most 8 activation rows (n_cols <= 8), in the low halves of
// act's registers: 256-bit vpdpbusd runs two per cycle where 512-bit runs one
// (Zen 4, Sapphire Rapids), so 8 lanes cost half of 16.
inline void run_tile8(const WeightBlock* panel, const ActBlock* act, int64_t nb, float* y,
                      int64_t ldy, int64_t n_cols, int64_t n_w,
                      const kquant512::Prefetch& prefetch) {
  __m256 acc[kTileRows];
  for (int t = 0; t < kTileRows; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch.at(b);
    const WeightBlock& w = panel[b];
    const ActBlock& a = act[b];
    const __m256i start = _mm512_castsi512_si256(a.start);
    __m256i s[kTileRows];
    for (int t = 0; t < kTileRows; ++t) s[t] = start;
    for (int g = 0; g < kGroups; ++g) {
      const __m256i codes = _mm256_load_si256(reinterpret_cast<const __m256i*>(&a.codes[g]));
      for (int t = 0; t < kTileRows; ++t) {
        s[t] = _mm256_dpbusd_epi32(s[t], _mm256_set1_epi32(static_cast<int>(w.q[word_index(t, g)])),
                                   codes);
      }
    }
    const __m256 dx = _mm512_castps512_ps256(a.d);
    for (int t = 0; t < kTileRows; ++t) {
      const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(w.d[t]), dx);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[t]), scale, acc[t]);
    }
  }
  alignas(32) float out[kTileRows][kLanes / 2];
  for (int t = 0; t < kTileRows; ++t) _mm256_store_ps(out[t], acc[t]);
  for (int64_t c = 0; c < n_cols; ++c)
    for (int64_t t = 0; t < n_w; ++t) y[c * ldy + t] = out[t][c];
}

// The DotTileFn contract (kernel_table.h); interleaved: n_w a multiple of the
// group's rows, `w` at a group's start. kquant512's passes, with this file's
// panels.
template <Layout kLayout>
void gemm(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
          int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t nb = k / kQuantBlock;
  kquant512::run_passes<ActBlock, WeightBlock>(
      n_w, x, x_stride, n_x, nb, y, ldy,
      [&](const uint8_t* rows, int64_t n_rows, ActBlock* out) {
        pack_act_group(rows, x_stride, n_rows, nb, out);
      },
      [&](int64_t j0, int64_t n_j, WeightBlock* out) {
        pack_weight_group<kLayout>(w, w_stride, j0, n_j, nb, out);
      },
      [&](int64_t j0, int64_t n_j) {
        if constexpr (kLayout == Layout::kBy8) {
          const int64_t group_bytes = nb * static_cast<int64_t>(sizeof(BlockQ4_0x8));
          return std::pair<const uint8_t*, int64_t>{w + j0 / kInterleavedRows * group_bytes,
                                                    group_bytes};
        } else {
          return kquant512::row_bytes(w, w_stride, j0, n_j);
        }
      },
      [&](const WeightBlock* panel, const ActBlock* act, float* out, int64_t n_cols, int64_t n_j,
          const kquant512::Prefetch& prefetch) {
        if (n_cols <= kLanes / 2) {
          run_tile8(panel, act, nb, out, ldy, n_cols, n_j, prefetch);
        } else {
          run_tile(panel, act, nb, out, ldy, n_cols, n_j, prefetch);
        }
      });
}

}  // namespace q40x512
}  // namespace
}  // namespace duet::cpu

// Q8_0, Q4_1 and Q4_0 weights interleaved by 16 rows (interleave.h) with
// AVX-512 VNNI, on the driver of kquant_x16_avx512_inl.h: Q8_0 and Q4_1 for
// every shape from decode's one activation row up, Q4_0 (below) for decode
// and small batches. Included into the AVX-512 translation unit only.
//
// Q8_0 and Q4_1 keep the lane order of kernel_table.h: per block and pair, 8
// int32 lanes L[m] = sum_{e=4m..4m+3} w[e] x[e], each added to a float lane
// of its own as acc[m] = fma(d_w * d_x, float(L[m]), acc[m]), the lanes summed
// as ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) at the
// end (and Q4_1's mins, sum_b m_w * s_x, added last). Here a register's 16
// int32 lanes are the group's 16 weight rows, so L[m] of all 16 comes from
// one vpdpbusd on word m of every row against word m of the activation,
// broadcast; acc[m] is a register of 16 rows. d_w * d_x and m_w * s_x
// multiply two halves and are exact in float. Every output is bit-identical
// to the row kernels' on the file's rows.
//
// vpdpbusd multiplies unsigned by signed bytes. Q4_1's nibbles (0..15) are
// unsigned as they are. Q8_0's weights and activations are both signed: the
// activations are taken + 128 (their sign bits flipped, once per call) and
// each lane starts from -128 times its row's sum of the word's 4 weights,
// which one more vpdpbusd gives per word for every activation row at once,
// so that it ends at exactly L[m].
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/x86/kquant_x16_avx512_inl.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace quantx16 {

constexpr int kWords = kQuantBlock / 4;  // the lanes of the order: 4 elements each

// Activation rows per register tile: each takes 8 accumulators (a word's
// lane each), so three take 24 of the 32 registers.
constexpr int kActRows = 3;

// y[0 .. 15] = the lanes' sum in kernel_table.h's order, plus `mins`.
[[gnu::always_inline]] inline void store_sum(const __m512 (&acc)[kWords], __m512 mins, float* y) {
  const __m512 c0 = _mm512_add_ps(acc[0], acc[4]), c1 = _mm512_add_ps(acc[1], acc[5]);
  const __m512 c2 = _mm512_add_ps(acc[2], acc[6]), c3 = _mm512_add_ps(acc[3], acc[7]);
  _mm512_storeu_ps(
      y, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c2), _mm512_add_ps(c1, c3)), mins));
}

}  // namespace quantx16

namespace q80x16 {

using quantx16::kActRows;
using quantx16::kWords;
using x16::broadcast_word;

// The group's 16 rows (nb blocks at `blocks`) x activation rows [0, NX)
// whose bytes are + 128: writes y[r * ldy + 0 .. 15].
template <int NX>
struct Tile {
  static void run(const BlockQ8_0x16* blocks, const void* /*panel*/, int64_t nb, const uint8_t* x,
                  size_t x_stride, float* y, int64_t ldy) {
    const BlockQ8_0* xr[NX];
    for (int r = 0; r < NX; ++r) xr[r] = reinterpret_cast<const BlockQ8_0*>(x + r * x_stride);
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[NX][kWords];
    for (int r = 0; r < NX; ++r)
      for (int m = 0; m < kWords; ++m) acc[r][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ8_0x16& w = blocks[b];
      prefetch_ahead(&w);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d)));
      __m512 scale[NX];
      for (int r = 0; r < NX; ++r) {
        scale[r] = _mm512_mul_ps(d, _mm512_set1_ps(half_to_float(xr[r][b].d)));
      }
      for (int m = 0; m < kWords; ++m) {
        const __m512i q = _mm512_loadu_si512(w.qs[m]);
        const __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, q);
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
        for (int r = 0; r < NX; ++r) {
          const __m512i lane = _mm512_dpbusd_epi32(start, broadcast_word(xr[r][b].qs + 4 * m), q);
          acc[r][m] = _mm512_fmadd_ps(scale[r], _mm512_cvtepi32_ps(lane), acc[r][m]);
        }
      }
    }
    for (int r = 0; r < NX; ++r) quantx16::store_sum(acc[r], _mm512_setzero_ps(), y + r * ldy);
  }
};

// Lanes that start from the activations' sums (the weights + 128) cost a
// broadcast of the start per word and activation row, where the weights'
// sums cost one vpdpbusd per word for the whole tile: 285 against 337
// GFLOP/s at 512 rows (duet-matmul-bench, 8B gate shape, Zen 5).
void dot(const uint8_t* w, size_t /*w_stride*/, int64_t n_w, const uint8_t* x, size_t x_stride,
         int64_t n_x, int64_t k, float* y, int64_t ldy) {
  thread_local std::vector<uint8_t> flipped;
  flipped.resize(static_cast<size_t>(n_x) * x_stride);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t i = 0; i < n_x; ++i) {
    const auto* from = reinterpret_cast<const BlockQ8_0*>(x + i * x_stride);
    auto* to = reinterpret_cast<BlockQ8_0*>(flipped.data() + i * x_stride);
    for (int64_t b = 0; b < k / kQuantBlock; ++b) {
      to[b].d = from[b].d;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to[b].qs),
                          _mm256_xor_si256(load_i8x32(from[b].qs), flip));
    }
  }
  x16::dot<BlockQ8_0x16, void, kActRows, Tile>(w, n_w, flipped.data(), x_stride, n_x, k, y, ldy);
}

}  // namespace q80x16

namespace q41x16 {

using quantx16::kActRows;
using quantx16::kWords;
using x16::broadcast_word;

// The group's 16 rows x activation rows [0, NX), as q80x16::Tile: word m's
// low nibbles are lane m, its high nibbles lane m + 4.
template <int NX>
struct Tile {
  static void run(const BlockQ4_1x16* blocks, const void* /*panel*/, int64_t nb, const uint8_t* x,
                  size_t x_stride, float* y, int64_t ldy) {
    const BlockQ8_1* xr[NX];
    for (int r = 0; r < NX; ++r) xr[r] = reinterpret_cast<const BlockQ8_1*>(x + r * x_stride);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[NX][kWords];
    __m512 mins[NX];
    for (int r = 0; r < NX; ++r) {
      mins[r] = _mm512_setzero_ps();
      for (int m = 0; m < kWords; ++m) acc[r][m] = _mm512_setzero_ps();
    }
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ4_1x16& w = blocks[b];
      prefetch_ahead(&w);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d)));
      const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.m)));
      __m512 scale[NX];
      for (int r = 0; r < NX; ++r) {
        scale[r] = _mm512_mul_ps(d, _mm512_set1_ps(half_to_float(xr[r][b].d)));
        mins[r] = _mm512_fmadd_ps(dm, _mm512_set1_ps(half_to_float(xr[r][b].s)), mins[r]);
      }
      for (int m = 0; m < kWords / 2; ++m) {
        const __m512i v = _mm512_loadu_si512(w.qs[m]);
        const __m512i low = _mm512_and_si512(v, low4);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < NX; ++r) {
          const __m512i lane_low =
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, broadcast_word(xr[r][b].qs + 4 * m));
          const __m512i lane_high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), high,
                                                        broadcast_word(xr[r][b].qs + 16 + 4 * m));
          acc[r][m] = _mm512_fmadd_ps(scale[r], _mm512_cvtepi32_ps(lane_low), acc[r][m]);
          acc[r][m + 4] = _mm512_fmadd_ps(scale[r], _mm512_cvtepi32_ps(lane_high), acc[r][m + 4]);
        }
      }
    }
    for (int r = 0; r < NX; ++r) quantx16::store_sum(acc[r], mins[r], y + r * ldy);
  }
};

void dot(const uint8_t* w, size_t /*w_stride*/, int64_t n_w, const uint8_t* x, size_t x_stride,
         int64_t n_x, int64_t k, float* y, int64_t ldy) {
  x16::dot<BlockQ4_1x16, void, kActRows, Tile>(w, n_w, x, x_stride, n_x, k, y, ldy);
}

}  // namespace q41x16

// Q4_0 by 16 rows keeps Q4_0's own order (kernel_table.h): per block and
// pair one exact integer S = sum (q - 8) x, then y = fma(float(S), d_w d_x,
// y). A lane is a weight row: it starts from -8 x the activation's block
// sum, and the block's 8 words (4 of low nibbles, 4 of high) add into it
// with vpdpbusd, so it holds S; one FMA per block and pair follows. This
// serves every batch size: a block's words are unpacked into 8 registers
// once and meet up to 16 activation rows, whose accumulators take 16 more.
namespace q40x16 {

using x16::broadcast_word;

constexpr int kActRows = 16;  // activation rows per register tile: a register each

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// An activation block as the tiles read it: -8 x its sum, its scale as a
// float, its 32 values.
struct ActBlock {
  int32_t start;
  float d;
  int8_t qs[kQuantBlock];
};

// The group's 16 rows (nb blocks at `blocks`) x the NX activation rows of
// one chunk of dot's (at x, block b of row r at b * NX + r: one pointer and
// constant offsets reach all of them, where NX row pointers would not fit in
// the general registers): writes y[r * ldy + 0 .. 15].
template <int NX>
struct Tile {
  static void run(const BlockQ4_0x16* blocks, const void* /*panel*/, int64_t nb, const uint8_t* x,
                  size_t /*x_stride*/, float* y, int64_t ldy) {
    const auto* xb = reinterpret_cast<const ActBlock*>(x);
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc[NX];
    for (int r = 0; r < NX; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ4_0x16& w = blocks[b];
      prefetch_ahead(&w);
      __m512i words[kQuantBlock / 4];
      for (int m = 0; m < kQuantBlock / 8; ++m) {
        const __m512i v = _mm512_loadu_si512(w.qs[m]);
        words[m] = _mm512_and_si512(v, low4);
        words[m + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d)));
      const ActBlock* xr = xb + b * NX;
#pragma GCC unroll 16
      for (int r = 0; r < NX; ++r) {
        __m512i s = _mm512_set1_epi32(xr[r].start);
        for (int m = 0; m < kQuantBlock / 8; ++m) {
          s = _mm512_dpbusd_epi32(s, words[m], broadcast_word(xr[r].qs + 4 * m));
          s = _mm512_dpbusd_epi32(s, words[m + 4], broadcast_word(xr[r].qs + 16 + 4 * m));
        }
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xr[r].d));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
      }
    }
    for (int r = 0; r < NX; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
  }
};

// The activations are prepared once per call (their block sums and scales),
// so that the tiles' only per-block work on them is a broadcast, in chunks
// of kActRows rows (the last may be shorter), each laid out block by block.
void dot(const uint8_t* w, size_t /*w_stride*/, int64_t n_w, const uint8_t* x, size_t x_stride,
         int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t nb = k / kQuantBlock;
  thread_local std::vector<ActBlock> act;
  act.resize(static_cast<size_t>(n_x * nb));
  const __m256i ones = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < n_x; ++i) {
    const auto* from = reinterpret_cast<const BlockQ8_0*>(x + i * x_stride);
    const int64_t chunk = i / kActRows;
    const int64_t rows = std::min<int64_t>(kActRows, n_x - chunk * kActRows);
    ActBlock* chunk_blocks = act.data() + chunk * kActRows * nb;
    for (int64_t b = 0; b < nb; ++b) {
      ActBlock& to = chunk_blocks[b * rows + i % kActRows];
      const __m256i q = load_i8x32(from[b].qs);
      const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, q);
      to.start = -8 * sum_lanes(sums);
      to.d = half_to_float(from[b].d);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to.qs), q);
    }
  }
  // A row's worth of blocks as the stride: the driver's x + i * stride, i a
  // multiple of kActRows, is then chunk i / kActRows's first block.
  x16::dot<BlockQ4_0x16, void, kActRows, Tile>(w, n_w, reinterpret_cast<const uint8_t*>(act.data()),
                                               nb * sizeof(ActBlock), n_x, k, y, ldy);
}

}  // namespace q40x16
}  // namespace
}  // namespace duet::cpu

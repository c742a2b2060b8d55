// 256-bit x86 kernels shared by the AVX2 and AVX-512 paths. Included into each
// path's translation unit (internal linkage) and compiled with its flags.
//
// Tiles: each weight row j is loaded (and for Q4 unpacked) once per block and
// used for up to kRowTile activation rows, each with its own accumulators.
// The per-pair operation sequence is independent of the tile's row count.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/lane_math.h"

namespace duet::cpu {
namespace {

constexpr int kRowTile = 4;  // activation rows per tile (the AVX-512 quantized tiles take 8)

inline float hsum_ps(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Asks for every cache line of a weight block 4 KiB ahead of it. Decode reads
// each weight once, from memory, and the hardware prefetchers stop at page
// boundaries: without this a Zen 3 core streams a third less than it can.
template <typename Block>
inline void prefetch_ahead(const Block* block) {
  constexpr size_t kAheadBytes = 4096, kLineBytes = 64;
  const char* ahead = reinterpret_cast<const char*>(block) + kAheadBytes;
  for (size_t line = 0; line < sizeof(Block); line += kLineBytes) {
    _mm_prefetch(ahead + line, _MM_HINT_T0);
  }
}

// 16 bytes of packed nibbles -> 32 bytes 0..15: element j low nibble, j+16 high.
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0f));
}

inline __m256i load_i8x32(const int8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Quantized block formats as (unsigned, signed) byte operands of an integer
// dot product: lane l of the 8 int32 lanes sums bytes 4l..4l+3, which
// maddubs+madd and vpdpbusd compute identically (no operand here saturates).
// Each block then adds scale * float(lanes) into 8 float lanes with one FMA,
// and Q4_1 adds min * s separately: llama.cpp's AVX2 order, which every path
// follows so that all paths agree bit for bit (Q4_0 sums each block first: below).
struct Q4_1Format {
  using WeightBlock = BlockQ4_1;
  using ActBlock = BlockQ8_1;
  static constexpr bool kHasMin = true;
  static __m256i weights(const WeightBlock& b) { return unpack_nibbles(b.qs); }
  static void operands(__m256i w, const ActBlock& x, __m256i* u, __m256i* s) {
    *u = w;
    *s = load_i8x32(x.qs);
  }
  static float min_term(const WeightBlock& w, const ActBlock& x) {
    return half_to_float(w.m) * half_to_float(x.s);
  }
};

template <typename Block>
struct SymmetricFormat {
  using WeightBlock = Block;
  using ActBlock = BlockQ8_0;
  static constexpr bool kHasMin = false;
  static __m256i weights(const WeightBlock& b) {
    if constexpr (sizeof(Block) == sizeof(BlockQ4_0)) {
      return _mm256_sub_epi8(unpack_nibbles(b.qs), _mm256_set1_epi8(8));
    } else if constexpr (sizeof(Block) == sizeof(BlockQ5_0)) {
      // The fifth bits as bytes (element j's bit j of qh), 0xF0 where it is
      // clear: nibble | 0xF0 is nibble - 16 as int8 (llama.cpp's AVX2 way).
      uint32_t qh;
      std::memcpy(&qh, b.qh, sizeof qh);
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int>(qh)),
          _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
      const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      return _mm256_or_si256(unpack_nibbles(b.qs),
                             _mm256_andnot_si256(set, _mm256_set1_epi8(static_cast<char>(0xF0))));
    } else {
      return load_i8x32(b.qs);
    }
  }
  // |w| . (x with the sign of w) = w . x
  static void operands(__m256i w, const ActBlock& x, __m256i* u, __m256i* s) {
    *u = _mm256_sign_epi8(w, w);
    *s = _mm256_sign_epi8(load_i8x32(x.qs), w);
  }
  static float min_term(const WeightBlock&, const ActBlock&) { return 0.0f; }
};

using Q8_0Format = SymmetricFormat<BlockQ8_0>;
using Q4_0Format = SymmetricFormat<BlockQ4_0>;
using Q5_0Format = SymmetricFormat<BlockQ5_0>;

// Q4_0's order is its own (kernel_table.h): one exact integer per block and
// pair, then y = fma(float(S), d_w * d_x, y). The integers come as 8 int32
// lanes of 4 products each (maddubs + madd on |w| and x with the sign of w,
// as above), whose totals several pairs reduce together.
inline __m256i lane_sums(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Lane r of the result: the total of v_r's 8 lanes.
inline __m128i sum_lanes4(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// Lane r of the result: the total of v[r]'s 8 lanes.
inline __m256i sum_lanes8(const __m256i (&v)[8]) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// Q4_0 row tiles of up to 4 activation rows: 4 / NX weight rows at a time,
// whose pairs' integers are reduced together per block and whose float steps
// are one 128-bit FMA (lane jj * NX + r: weight row jj, activation row r).
template <int NX>
struct Q4_0RowTile {
  static_assert(NX >= 1 && NX <= 4);
  static constexpr int kRows = 4 / NX;  // weight rows at a time
  static void run(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                  int64_t k, float* y, int64_t ldy) {
    const int64_t nb = k / kQuantBlock;
    const BlockQ8_0* xr[NX];
    for (int r = 0; r < NX; ++r) xr[r] = reinterpret_cast<const BlockQ8_0*>(x + r * x_stride);
    for (int64_t j0 = 0; j0 < n_w; j0 += kRows) {
      const int n_j = static_cast<int>(std::min<int64_t>(kRows, n_w - j0));
      const BlockQ4_0* wb[kRows];
      for (int jj = 0; jj < kRows; ++jj) {  // rows past the end repeat the last (never stored)
        wb[jj] = reinterpret_cast<const BlockQ4_0*>(w + (j0 + std::min(jj, n_j - 1)) * w_stride);
      }
      __m128 acc = _mm_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        __m256i lanes[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};
        float scale[4] = {};
        for (int jj = 0; jj < kRows; ++jj) {
          prefetch_ahead(wb[jj] + b);
          const __m256i wq = Q4_0Format::weights(wb[jj][b]);
          const __m256i u = _mm256_sign_epi8(wq, wq);
          const float dw = half_to_float(wb[jj][b].d);
          for (int r = 0; r < NX; ++r) {
            lanes[jj * NX + r] = lane_sums(u, _mm256_sign_epi8(load_i8x32(xr[r][b].qs), wq));
            scale[jj * NX + r] = dw * half_to_float(xr[r][b].d);
          }
        }
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(sum_lanes4(lanes[0], lanes[1], lanes[2], lanes[3])),
                           _mm_setr_ps(scale[0], scale[1], scale[2], scale[3]), acc);
      }
      alignas(16) float out[4];
      _mm_store_ps(out, acc);
      for (int jj = 0; jj < n_j; ++jj)
        for (int r = 0; r < NX; ++r) y[r * ldy + j0 + jj] = out[jj * NX + r];
    }
  }
};

// Runs Tile<kTile> over the activation rows in tiles of kTile rows, then one
// smaller tile for the rest (Tile<r> for r < kTile computes each pair with
// the same operations, so where a row falls does not change its result).
template <int kTile, template <int> class Tile, int kRest = kTile - 1>
void run_rest_tile(int64_t rest, const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                   size_t x_stride, int64_t k, float* y, int64_t ldy) {
  if constexpr (kRest > 0) {
    if (rest == kRest) {
      Tile<kRest>::run(w, w_stride, n_w, x, x_stride, k, y, ldy);
    } else {
      run_rest_tile<kTile, Tile, kRest - 1>(rest, w, w_stride, n_w, x, x_stride, k, y, ldy);
    }
  }
}

template <template <int> class Tile, int kTile = kRowTile>
void run_row_tiles(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                   size_t x_stride, int64_t n_x, int64_t k, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + kTile <= n_x; i += kTile) {
    Tile<kTile>::run(w, w_stride, n_w, x + i * x_stride, x_stride, k, y + i * ldy, ldy);
  }
  run_rest_tile<kTile, Tile>(n_x - i, w, w_stride, n_w, x + i * x_stride, x_stride, k, y + i * ldy,
                             ldy);
}

// F32 and F16 rows: 8 lanes per step, then a scalar tail in order.
template <bool kHalf>
struct DenseTile {
  static __m256 load(const uint8_t* row, int64_t e) {
    if constexpr (kHalf) {
      return _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + e * sizeof(uint16_t))));
    } else {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + e);
    }
  }
  static float scalar(const uint8_t* row, int64_t e) {
    if constexpr (kHalf) {
      return half_to_float(reinterpret_cast<const uint16_t*>(row)[e]);
    } else {
      return reinterpret_cast<const float*>(row)[e];
    }
  }
  template <int NX>
  struct Tile {
    static void run(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                    size_t x_stride, int64_t k, float* y, int64_t ldy) {
      const int64_t k8 = k - k % 8;
      for (int64_t j = 0; j < n_w; ++j) {
        const uint8_t* wr = w + j * w_stride;
        __m256 acc[NX];
        for (int r = 0; r < NX; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t e = 0; e < k8; e += 8) {
          const __m256 wv = load(wr, e);
          for (int r = 0; r < NX; ++r)
            acc[r] = _mm256_fmadd_ps(wv, load(x + r * x_stride, e), acc[r]);
        }
        for (int r = 0; r < NX; ++r) {
          float sum = hsum_ps(acc[r]);
          for (int64_t e = k8; e < k; ++e) sum += scalar(wr, e) * scalar(x + r * x_stride, e);
          y[r * ldy + j] = sum;
        }
      }
    }
  };
};

template <int NX>
using F32Tile = DenseTile<false>::Tile<NX>;
template <int NX>
using F16Tile = DenseTile<true>::Tile<NX>;

void dot_f32_avx(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  run_row_tiles<F32Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_f16_avx(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  run_row_tiles<F16Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void convert_f16_avx(const float* x, void* out, int64_t n) {
  auto* h = static_cast<uint16_t*>(out);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) h[i] = fp32_to_fp16(x[i]);
}

// Attention primitives in the fixed lane orders of kernel_table.h: 16 lanes
// held as two 8-lane halves, so AVX2 and AVX-512 compute identical values.
inline __m256 load_half8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The 16-lane tree sum: (l, l+8) is hi + lo, then hsum_ps's (l, l+4), (0+2)+(1+3).
inline float tree_sum16(__m256 lo, __m256 hi) { return hsum_ps(_mm256_add_ps(hi, lo)); }

// The 16-lane part of kq_scores's and dot_f32_lanes's orders over the first
// n_whole elements of a and b (load(p) gives 8 floats): chunk e / 16 into
// accumulator 0 (groups 1) or (e / 16) % 4 (groups 4), in order; the groups
// added (0 + 2) + (1 + 3); the lanes summed by the tree.
template <typename T, typename Load>
inline float lanes16_dot(const T* a, const T* b, int64_t n_whole, int groups, Load load) {
  __m256 lo[4], hi[4];  // indexed by constants only, so in registers
  for (int g = 0; g < 4; ++g) lo[g] = hi[g] = _mm256_setzero_ps();
  auto chunk_into = [&](int g, int64_t e) {
    lo[g] = _mm256_fmadd_ps(load(a + e), load(b + e), lo[g]);
    hi[g] = _mm256_fmadd_ps(load(a + e + 8), load(b + e + 8), hi[g]);
  };
  if (groups == 1) {
    for (int64_t e = 0; e < n_whole; e += 16) chunk_into(0, e);
  } else {
    for (int64_t e = 0; e < n_whole; e += 64)
      for (int g = 0; g < 4; ++g) chunk_into(g, e + 16 * g);
    lo[0] = _mm256_add_ps(_mm256_add_ps(lo[0], lo[2]), _mm256_add_ps(lo[1], lo[3]));
    hi[0] = _mm256_add_ps(_mm256_add_ps(hi[0], hi[2]), _mm256_add_ps(hi[1], hi[3]));
  }
  return tree_sum16(lo[0], hi[0]);
}

// One query head against one key row, in kq_scores's order.
inline float kq_score_avx(const uint16_t* q, const uint16_t* kr, int64_t dim, int groups) {
  const int64_t n_whole = dim - dim % (groups == 1 ? 16 : 64);
  double sum = lanes16_dot(kr, q, n_whole, groups, load_half8);
  for (int64_t e = n_whole; e < dim; ++e) {
    sum += static_cast<double>(half_to_float(kr[e]) * half_to_float(q[e]));
  }
  return static_cast<float>(sum);
}

// dot_f32_lanes's orders with 16 lanes as two 8-lane halves (the same bits
// on AVX2 and AVX-512).
void dot_f32_lanes_avx(const float* w, int64_t n_w, const float* x, int64_t k, int groups,
                       float* y) {
  const int64_t n_whole = k - k % (groups == 1 ? 16 : 64);
  for (int64_t j = 0; j < n_w; ++j) {
    const float* row = w + j * k;
    float sum =
        lanes16_dot(row, x, n_whole, groups, [](const float* p) { return _mm256_loadu_ps(p); });
    for (int64_t e = n_whole; e < k; ++e) sum = std::fma(row[e], x[e], sum);
    y[j] = sum;
  }
}

void kq_scores_avx(const uint16_t* q, int64_t n_q, const uint16_t* const* segments, int64_t n_keys,
                   int64_t dim, int groups, float* out, int64_t ld_out) {
  for (int64_t h = 0; h < n_q; ++h) {
    for (int64_t t = 0; t < n_keys; ++t) {
      out[h * ld_out + t] = kq_score_avx(q + h * dim, segments[t / 16] + t % 16 * dim, dim, groups);
    }
  }
}

}  // namespace
}  // namespace duet::cpu

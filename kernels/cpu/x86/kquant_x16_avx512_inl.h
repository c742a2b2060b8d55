// Q4_K and Q6_K weights interleaved by 16 rows (interleave.h) with AVX-512
// VNNI, for every shape from decode's one activation row up. Included into
// the AVX-512 translation unit only. Its driver, x16::dot, runs Q8_0's and
// Q4_1's 16-row kernels too (quant_x16_avx512_inl.h).
//
// Q4_K: a register's 16 int32 lanes are a group's 16 weight rows, so one 64-byte
// load holds a 4-byte word of every row: its low nibbles are 4 weights of
// sub-block 2q, its high nibbles 4 of sub-block 2q + 1 (q the 32-byte group).
// vpdpbusd multiplies them by the same 4 activation bytes, broadcast, for
// all 16 rows at once; a sub-block's 8 words accumulate in the lane before
// its 16 scales multiply them. The scales and mins of the 16 rows are
// unpacked together, lane by lane, as q4_k_scales_mins unpacks one row's.
// Each pair's integers S and M are exact and its float steps are
// kernel_table.h's, per super-block in order in its lane: every output is
// bit-identical to the row kernels' on the file's rows.
//
// Q6_K likewise, a row per lane: a word of ql gives 4 weights' low bits in
// each of 2 chunks (its low and high nibbles), a word of qh their 2 high bits
// in each of 4 chunks, so two ql words and one qh word make 4 weights (0..63)
// of each of 4 chunks. A sub-block (16 elements) accumulates 4 vpdpbusd in its
// lane, starting from -32 x the activation's sum of it (the weights' offset),
// before its 16 scales multiply it; the sum over sub-blocks is the row
// kernels' exact S, and the float step theirs.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace x16 {

inline __m512i broadcast_word(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Tile<n_rows>::run(args...), for 0 < n_rows <= NX.
template <template <int> class Tile, int NX, typename... Args>
void run_rows(int64_t n_rows, Args... args) {
  if constexpr (NX > 0) {
    if (n_rows == NX) return Tile<NX>::run(args...);
    run_rows<Tile, NX - 1>(n_rows, args...);
  }
}

// The DotTileFn contract (kernel_table.h) for weights interleaved by 16 rows
// in Block (Block::kElements to a block of each row): n_w a multiple of 16,
// `w` at a group's start. Each group meets
// the activations kActRows rows at a time (Tile<NX>::run(group, panel, nb,
// x, x_stride, y, ldy)). A format with an Unpacked form (not void) whose
// unpacking costs more than storing and loading it again has each group's
// super-blocks unpacked once into a panel, when more rows than one tile
// takes share them; otherwise the tiles unpack as they go (panel null).
template <typename Block, typename Unpacked, int kActRows, template <int> class Tile>
void dot(const uint8_t* w, int64_t n_w, const uint8_t* x, size_t x_stride, int64_t n_x, int64_t k,
         float* y, int64_t ldy, void (*unpack)(const Block&, Unpacked*) = nullptr) {
  constexpr int kRows = 16;
  static_assert(sizeof(Block) % kRows == 0);
  constexpr bool kHasPanel = !std::is_void_v<Unpacked>;
  const int64_t nb = k / Block::kElements;
  const auto* groups = reinterpret_cast<const Block*>(w);
  const bool use_panel = kHasPanel && n_x > kActRows;
  Unpacked* panel = nullptr;
  if constexpr (kHasPanel) {
    thread_local std::vector<Unpacked> unpacked;
    if (use_panel) {
      unpacked.resize(static_cast<size_t>(nb));
      panel = unpacked.data();
    }
  }
  for (int64_t g = 0; g < n_w / kRows; ++g) {
    const Block* group = groups + g * nb;
    if constexpr (kHasPanel) {
      for (int64_t b = 0; use_panel && b < nb; ++b) {
        prefetch_ahead(group + b);
        unpack(group[b], panel + b);
      }
    }
    for (int64_t i = 0; i < n_x; i += kActRows) {
      run_rows<Tile, kActRows>(std::min<int64_t>(kActRows, n_x - i), group,
                               static_cast<const Unpacked*>(panel), nb, x + i * x_stride, x_stride,
                               y + i * ldy + g * kRows, ldy);
    }
  }
}

}  // namespace x16

namespace q4kx16 {

constexpr int kActRows = 8;  // activation rows per register tile

// One super-block's scales of the group's 16 rows, a row per lane.
struct Scales {
  __m512i sc[8];     // sub-block scales (int32)
  __m512i mpair[8];  // each sub-block's min twice, as an int16 pair
  __m512 d, dmin;
};

[[gnu::always_inline]] inline void unpack_scales(const BlockQ4_Kx16& b, Scales* out) {
  const __m512i u0 = _mm512_loadu_si512(b.scales[0]);
  const __m512i u1 = _mm512_loadu_si512(b.scales[1]);
  const __m512i u2 = _mm512_loadu_si512(b.scales[2]);
  const __m512i k1 = _mm512_set1_epi32(0x3f3f3f3f), k2 = _mm512_set1_epi32(0x0f0f0f0f);
  const __m512i k3 = _mm512_set1_epi32(0x03030303);
  // The 4 words of scales 0-3, 4-7, mins 0-3, 4-7 (q4_k_scales_mins, per lane).
  __m512i t[4];
  t[0] = _mm512_and_si512(u0, k1);
  t[1] = _mm512_or_si512(_mm512_and_si512(u2, k2),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), k3), 4));
  t[2] = _mm512_and_si512(u1, k1);
  t[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), k2),
                         _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), k3), 4));
  const __m512i byte = _mm512_set1_epi32(0xff);
  for (int s = 0; s < 8; ++s) {
    const int shift = 8 * (s % 4);
    out->sc[s] = _mm512_and_si512(_mm512_srli_epi32(t[s / 4], shift), byte);
    const __m512i m = _mm512_and_si512(_mm512_srli_epi32(t[2 + s / 4], shift), byte);
    out->mpair[s] = _mm512_or_si512(m, _mm512_slli_epi32(m, 16));
  }
  out->d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.d)));
  out->dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.dmin)));
}

using x16::broadcast_word;

// The group's 16 rows (nb super-blocks at `blocks`) x activation rows [0, NX):
// writes y[r * ldy + 0 .. 15]. No panel: the tiles unpack as they go.
template <int NX>
struct Tile {
  static void run(const BlockQ4_Kx16* blocks, const void* /*panel*/, int64_t nb, const uint8_t* x,
                  size_t x_stride, float* y, int64_t ldy) {
    const BlockQ8_K* xr[NX];
    for (int r = 0; r < NX; ++r) xr[r] = reinterpret_cast<const BlockQ8_K*>(x + r * x_stride);
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512 acc[NX];
    for (int r = 0; r < NX; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ4_Kx16& w = blocks[b];
      prefetch_ahead(&w);
      Scales sc;
      unpack_scales(w, &sc);
      __m512i s_int[NX];
      for (int r = 0; r < NX; ++r) s_int[r] = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) {
        for (int half = 0; half < 2; ++half) {
          __m512i dot[NX];
          for (int r = 0; r < NX; ++r) dot[r] = _mm512_setzero_si512();
          for (int m = 0; m < 8; ++m) {
            const __m512i v = _mm512_loadu_si512(w.qs[q][m]);
            const __m512i weights =
                half == 0 ? _mm512_and_si512(v, m4) : _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            for (int r = 0; r < NX; ++r) {
              dot[r] = _mm512_dpbusd_epi32(
                  dot[r], weights, broadcast_word(xr[r][b].qs + 64 * q + 32 * half + 4 * m));
            }
          }
          for (int r = 0; r < NX; ++r) {
            s_int[r] = _mm512_add_epi32(s_int[r], _mm512_mullo_epi32(dot[r], sc.sc[2 * q + half]));
          }
        }
      }
      for (int r = 0; r < NX; ++r) {
        // M: each sub-block's min times the activation's two bsums of it.
        __m512i m_int = _mm512_setzero_si512();
        for (int s = 0; s < 8; ++s) {
          m_int = _mm512_dpwssd_epi32(m_int, sc.mpair[s], broadcast_word(&xr[r][b].bsums[2 * s]));
        }
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s_int[r]), sc.d);
        f = _mm512_fnmadd_ps(sc.dmin, _mm512_cvtepi32_ps(m_int), f);
        acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(xr[r][b].d), acc[r]);
      }
    }
    for (int r = 0; r < NX; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
  }
};

// Unpacked as it goes at every row count: its nibbles cost a mask (and a
// shift) per word, less than a panel's stores and loads (duet-matmul-bench,
// 16 rows: 575 GFLOP/s without, 415 with).
void dot(const uint8_t* w, size_t /*w_stride*/, int64_t n_w, const uint8_t* x, size_t x_stride,
         int64_t n_x, int64_t k, float* y, int64_t ldy) {
  x16::dot<BlockQ4_Kx16, void, kActRows, Tile>(w, n_w, x, x_stride, n_x, k, y, ldy);
}

}  // namespace q4kx16

namespace q6kx16 {

constexpr int kActRows = 8;  // activation rows per register tile
constexpr int kWords = 64;   // 4-weight words per row and super-block

using x16::broadcast_word;

// The weights (0..63) of elements 128h + 32j + 4m .. + 3 of the group's 16
// rows: the low (j < 2) or high nibbles of ql[64h + 32 (j % 2) + 4m ..] with
// bits 2j, 2j + 1 of qh[32h + 4m ..] above them.
[[gnu::always_inline]] inline __m512i weights(const BlockQ6_Kx16& w, int h, int j, int m) {
  const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
  const __m512i ql = _mm512_loadu_si512(w.ql[h][j % 2][m]);
  const __m512i qh = _mm512_loadu_si512(w.qh[h][m]);
  const __m512i low = _mm512_and_si512(j < 2 ? ql : _mm512_srli_epi16(ql, 4), low4);
  __m512i high = qh;  // bits 2j, 2j + 1 of each byte moved to bits 4, 5
  if (j == 0) high = _mm512_slli_epi16(qh, 4);
  if (j == 1) high = _mm512_slli_epi16(qh, 2);
  if (j == 3) high = _mm512_srli_epi16(qh, 2);
  return _mm512_ternarylogic_epi32(low, high, high2, 0xf8);  // low | (high & high2)
}

// A super-block's words as weights(): word 32h + 8j + m is elements 128h +
// 32j + 4m .. + 3 of each row, a row per lane.
struct alignas(64) Unpacked {
  __m512i q[kWords];
};

inline void unpack(const BlockQ6_Kx16& w, Unpacked* out) {
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 4; ++j)
      for (int m = 0; m < 8; ++m) out->q[32 * h + 8 * j + m] = weights(w, h, j, m);
}

// The group's 16 rows (nb super-blocks at `blocks`, or their words unpacked
// in `panel` where it is not null) x activation rows [0, NX): writes y[r *
// ldy + 0 .. 15].
template <int NX>
struct Tile {
  static void run(const BlockQ6_Kx16* blocks, const Unpacked* panel, int64_t nb, const uint8_t* x,
                  size_t x_stride, float* y, int64_t ldy) {
    if (panel != nullptr) return run_blocks<true>(blocks, panel, nb, x, x_stride, y, ldy);
    run_blocks<false>(blocks, panel, nb, x, x_stride, y, ldy);
  }

  template <bool kFromPanel>
  static void run_blocks(const BlockQ6_Kx16* blocks, const Unpacked* panel, int64_t nb,
                         const uint8_t* x, size_t x_stride, float* y, int64_t ldy) {
    const BlockQ8_K* xr[NX];
    for (int r = 0; r < NX; ++r) xr[r] = reinterpret_cast<const BlockQ8_K*>(x + r * x_stride);
    __m512 acc[NX];
    for (int r = 0; r < NX; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ6_Kx16& w = blocks[b];
      if constexpr (!kFromPanel) prefetch_ahead(&w);
      // -32 x each row's sum of each sub-block: where its dot products start.
      alignas(64) int32_t offset[NX][16];
      for (int r = 0; r < NX; ++r) {
        const __m512i bsums = _mm512_cvtepi16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r][b].bsums)));
        _mm512_store_si512(offset[r],
                           _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(bsums, 5)));
      }
      __m512i s_int[NX];
      for (int r = 0; r < NX; ++r) s_int[r] = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        for (int j = 0; j < 4; ++j) {
          for (int half = 0; half < 2; ++half) {  // sub-block 8h + 2j + half: words 4 half ..
            const int sub = 8 * h + 2 * j + half;
            __m512i dot[NX];
            for (int r = 0; r < NX; ++r) dot[r] = _mm512_set1_epi32(offset[r][sub]);
            for (int m = 4 * half; m < 4 * half + 4; ++m) {
              __m512i q;
              if constexpr (kFromPanel) {
                q = _mm512_load_si512(&panel[b].q[32 * h + 8 * j + m]);
              } else {
                q = weights(w, h, j, m);
              }
              for (int r = 0; r < NX; ++r) {
                dot[r] = _mm512_dpbusd_epi32(
                    dot[r], q, broadcast_word(xr[r][b].qs + 128 * h + 32 * j + 4 * m));
              }
            }
            const __m512i scale = _mm512_cvtepi8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales[sub])));
            for (int r = 0; r < NX; ++r) {
              s_int[r] = _mm512_add_epi32(s_int[r], _mm512_mullo_epi32(dot[r], scale));
            }
          }
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d)));
      for (int r = 0; r < NX; ++r) {
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s_int[r]), d);
        acc[r] = _mm512_fmadd_ps(f, _mm512_set1_ps(xr[r][b].d), acc[r]);
      }
    }
    for (int r = 0; r < NX; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
  }
};

// Unpacked into a panel above one tile's rows: a word's mask, shifts and
// ternary-logic op cost more than storing it and loading it again
// (duet-matmul-bench, 8B gate shape, 32 rows: 440-489 GFLOP/s with a
// panel, 390 without).
void dot(const uint8_t* w, size_t /*w_stride*/, int64_t n_w, const uint8_t* x, size_t x_stride,
         int64_t n_x, int64_t k, float* y, int64_t ldy) {
  x16::dot<BlockQ6_Kx16, Unpacked, kActRows, Tile>(w, n_w, x, x_stride, n_x, k, y, ldy, unpack);
}

}  // namespace q6kx16
}  // namespace
}  // namespace duet::cpu

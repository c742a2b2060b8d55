// Q4_K weights interleaved by 16 rows (interleave.h) with AVX-512 VNNI, for
// every shape from decode's one activation row up. Included into the AVX-512
// translation unit only.
//
// A register's 16 int32 lanes are a group's 16 weight rows, so one 64-byte
// load holds a 4-byte word of every row: its low nibbles are 4 weights of
// sub-block 2q, its high nibbles 4 of sub-block 2q + 1 (q the 32-byte group).
// vpdpbusd multiplies them by the same 4 activation bytes, broadcast, for
// all 16 rows at once; a sub-block's 8 words accumulate in the lane before
// its 16 scales multiply them. The scales and mins of the 16 rows are
// unpacked together, lane by lane, as q4_k_scales_mins unpacks one row's.
// Each pair's integers S and M are exact and its float steps are
// kernel_table.h's, per super-block in order in its lane: every output is
// bit-identical to the row kernels' on the file's rows.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace q4kx16 {

constexpr int kRows = kInterleavedRowsQ4_K;
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

inline __m512i broadcast_word(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The group's 16 rows (nb super-blocks at `blocks`) x activation rows [0, NX):
// writes y[r * ldy + 0 .. 15].
template <int NX>
void run_tile(const BlockQ4_Kx16* blocks, int64_t nb, const uint8_t* x, size_t x_stride, float* y,
              int64_t ldy) {
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
            dot[r] = _mm512_dpbusd_epi32(dot[r], weights,
                                         broadcast_word(xr[r][b].qs + 64 * q + 32 * half + 4 * m));
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

template <int NX = kActRows>
void run_rows(int64_t n_rows, const BlockQ4_Kx16* blocks, int64_t nb, const uint8_t* x,
              size_t x_stride, float* y, int64_t ldy) {
  if constexpr (NX > 0) {
    if (n_rows == NX) return run_tile<NX>(blocks, nb, x, x_stride, y, ldy);
    run_rows<NX - 1>(n_rows, blocks, nb, x, x_stride, y, ldy);
  }
}

// The DotTileFn contract (kernel_table.h) for interleaved Q4_K: n_w a
// multiple of 16, `w` at a group's start.
void dot(const uint8_t* w, size_t /*w_stride*/, int64_t n_w, const uint8_t* x, size_t x_stride,
         int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t nb = k / kSuperBlock;
  const auto* groups = reinterpret_cast<const BlockQ4_Kx16*>(w);
  for (int64_t g = 0; g < n_w / kRows; ++g) {
    for (int64_t i = 0; i < n_x; i += kActRows) {
      run_rows(std::min<int64_t>(kActRows, n_x - i), groups + g * nb, nb, x + i * x_stride,
               x_stride, y + i * ldy + g * kRows, ldy);
    }
  }
}

}  // namespace q4kx16
}  // namespace
}  // namespace duet::cpu

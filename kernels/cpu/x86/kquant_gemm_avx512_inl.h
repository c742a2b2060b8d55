// Tiled GEMM for K-quant weights (Q4_K, Q5_K, Q6_K) with AVX-512 VNNI, for
// the batched shapes (prefill, batched decode). Included by x86_kquant_inl.h
// into the AVX-512 translation unit only, after the formats.
//
// The K-quant order (kernel_table.h) keeps one exact integer S (and M) per
// super-block and pair, so the integer work may take any shape. Here a zmm
// holds 16 activation rows, one per int32 lane, as in llama.cpp's tiled
// kernels: vpdpbusd adds 4 elements of one weight row (broadcast) times the
// same 4 elements of 16 activation rows, and a sub-block's 8 (Q6_K: 4)
// groups of 4 accumulate in the lane before its scale multiplies them once.
// A register tile is 8 weight rows x 16 activation rows. Every pair's float
// steps are kernel_table.h's, per super-block in order from 0, in its lane,
// so each output is bit-identical to the row kernels'.
//
// Panels: the activation rows of a call are transposed once into groups of
// 16 (the 4 bytes of element group g of each row side by side); each group of
// 8 weight rows is unpacked once (unsigned bytes, scales and the correction
// pairs as int32) and serves every activation group of the call.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/x86/quant_gemm_avx512_inl.h"

namespace duet::cpu {
namespace {
namespace kquant512 {

constexpr int kLanes = 16;    // activation rows per zmm
constexpr int kTileRows = 8;  // weight rows per register tile
constexpr int kGroups = 64;   // 4-element groups per super-block
// From this many activation rows on; below, the row tiles unpack each weight
// row once for all of them and lose nothing to empty lanes.
constexpr int64_t kMinRows = 8;
// Activation rows per pass: the panel of a pass is read once per weight group.
constexpr int64_t kPassRows = 64;

// The bytes of the next group of weight rows, fetched into the cache a slice
// per block while a tile of the current group computes: the tiles are bound
// by arithmetic and packing a group by memory, so streaming the next group's
// weights under the tiles' arithmetic keeps both busy. Prefetches change no
// value.
struct Prefetch {
  const char* next = nullptr;  // the group's first byte
  int64_t begin = 0;           // this tile's share: bytes [begin, end) of it
  int64_t end = 0;
  int64_t step = 0;  // bytes per block

  void at(int64_t b) const {
    const int64_t from = begin + b * step;
    const int64_t to = std::min(from + step, end);
    for (int64_t o = from; o < to; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
  }
};

// The bytes of rows [j0, j0 + n_j) of a matrix stored as GGUF rows: the
// weight_bytes of run_passes for that layout.
inline std::pair<const uint8_t*, int64_t> row_bytes(const uint8_t* w, size_t w_stride, int64_t j0,
                                                    int64_t n_j) {
  return {w + j0 * w_stride, n_j * static_cast<int64_t>(w_stride)};
}

// One super-block of 16 activation rows.
struct alignas(64) ActBlock {
  __m512i codes[kGroups];  // group g: lane c holds row c's elements 4g .. 4g + 3
  __m512i bsum_pairs[8];   // word i of each row's bsums: (bsums[2i], bsums[2i + 1])
  __m512 d;
};

// One super-block of 8 weight rows.
struct alignas(64) WeightBlock {
  uint32_t q[kTileRows][kGroups];  // each row's unsigned bytes, 4 per word, in element order
  int32_t scale[kTileRows][16];    // sub-block scales (8 used by Q4_K and Q5_K)
  uint32_t corr[kTileRows][8];     // int16 pairs against bsum_pairs: mins (Q4_K, Q5_K) or scales
  float d[kTileRows], dmin[kTileRows];
};

// v[r] (row r, 16 words) -> v[c] (word c of each row, row r in lane r).
inline void transpose16(__m512i (&v)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // v[4q + m], 128-bit lane L: word 4L + m of rows 4q .. 4q + 3.
  for (int m = 0; m < 4; ++m) {
    const __m512i a0 = _mm512_shuffle_i32x4(v[m], v[4 + m], 0x88);
    const __m512i a1 = _mm512_shuffle_i32x4(v[m], v[4 + m], 0xdd);
    const __m512i b0 = _mm512_shuffle_i32x4(v[8 + m], v[12 + m], 0x88);
    const __m512i b1 = _mm512_shuffle_i32x4(v[8 + m], v[12 + m], 0xdd);
    t[m] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    t[8 + m] = _mm512_shuffle_i32x4(a0, b0, 0xdd);
    t[4 + m] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    t[12 + m] = _mm512_shuffle_i32x4(a1, b1, 0xdd);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// Activation rows [0, n_rows) (n_rows <= 16), super-blocks [0, nb).
inline void pack_act_group(const uint8_t* x, size_t x_stride, int64_t n_rows, int64_t nb,
                           ActBlock* out) {
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ8_K* rows[kLanes];
    for (int c = 0; c < kLanes; ++c) {
      rows[c] = c < n_rows ? reinterpret_cast<const BlockQ8_K*>(x + c * x_stride) + b : nullptr;
    }
    for (int quarter = 0; quarter < 4; ++quarter) {
      __m512i v[16];
      for (int c = 0; c < kLanes; ++c) {
        v[c] = rows[c] ? _mm512_loadu_si512(rows[c]->qs + 64 * quarter) : _mm512_setzero_si512();
      }
      transpose16(v);
      for (int g = 0; g < 16; ++g) _mm512_store_si512(&out[b].codes[16 * quarter + g], v[g]);
    }
    alignas(64) int32_t pairs[8][kLanes] = {};
    alignas(64) float d[kLanes] = {};
    for (int c = 0; c < n_rows; ++c) {
      int32_t words[8];
      std::memcpy(words, rows[c]->bsums, sizeof(words));
      for (int i = 0; i < 8; ++i) pairs[i][c] = words[i];
      d[c] = rows[c]->d;
    }
    for (int i = 0; i < 8; ++i) out[b].bsum_pairs[i] = _mm512_load_si512(pairs[i]);
    out[b].d = _mm512_load_ps(d);
  }
}

inline uint32_t int16_pair(int lo, int hi) {
  return static_cast<uint16_t>(lo) | static_cast<uint32_t>(static_cast<uint16_t>(hi)) << 16;
}

// Weight rows [0, n_rows) (n_rows <= 8) of the matrix at w, super-blocks [0, nb).
template <typename Format>
void pack_weight_group(const uint8_t* w, size_t w_stride, int64_t n_rows, int64_t nb,
                       WeightBlock* out) {
  using WB = typename Format::WeightBlock;
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t t = n_rows; t < kTileRows; ++t) {  // rows past the end add zeros
      WeightBlock& o = out[b];
      std::memset(o.q[t], 0, sizeof(o.q[t]));
      std::memset(o.scale[t], 0, sizeof(o.scale[t]));
      std::memset(o.corr[t], 0, sizeof(o.corr[t]));
      o.d[t] = o.dmin[t] = 0.0f;
    }
  }
  for (int64_t t = 0; t < n_rows; ++t) {
    const WB* row = reinterpret_cast<const WB*>(w + t * w_stride);
    for (int64_t b = 0; b < nb; ++b) {
      const WB& blk = row[b];
      WeightBlock& o = out[b];
      __m256i q[8];
      Format::unpack_q(blk, q);
      for (int c = 0; c < 8; ++c) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&o.q[t][8 * c]), q[c]);
      }
      o.d[t] = half_to_float(blk.d);
      if constexpr (Format::kHasMin) {
        uint8_t sc_m[16];
        q4_k_scales_mins(blk.scales, sc_m);
        for (int s = 0; s < 8; ++s) {
          o.scale[t][s] = sc_m[s];
          o.corr[t][s] = int16_pair(sc_m[8 + s], sc_m[8 + s]);
        }
        o.dmin[t] = half_to_float(blk.dmin);
      } else {
        for (int s = 0; s < 16; ++s) o.scale[t][s] = blk.scales[s];
        for (int i = 0; i < 8; ++i)
          o.corr[t][i] = int16_pair(blk.scales[2 * i], blk.scales[2 * i + 1]);
      }
    }
  }
}

// Weight rows [0, 8) of the panel x the 16 activation rows of act, over nb
// super-blocks; writes y[c * ldy + t] for c < n_cols, t < n_w.
template <typename Format>
void run_tile(const WeightBlock* panel, const ActBlock* act, int64_t nb, float* y, int64_t ldy,
              int64_t n_cols, int64_t n_w, Prefetch prefetch) {
  constexpr int kSub = Format::kSubBlocks;
  constexpr int kGroupsPerSub = kGroups / kSub;
  __m512 acc[kTileRows];
  for (int t = 0; t < kTileRows; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch.at(b);
    const WeightBlock& w = panel[b];
    const ActBlock& a = act[b];
    __m512i s_int[kTileRows];
    for (int t = 0; t < kTileRows; ++t) s_int[t] = _mm512_setzero_si512();
    for (int s = 0; s < kSub; ++s) {
      __m512i dot[kTileRows];
      for (int t = 0; t < kTileRows; ++t) dot[t] = gemm512::fresh_zero();
      for (int g = s * kGroupsPerSub; g < (s + 1) * kGroupsPerSub; ++g) {
        const __m512i codes = _mm512_load_si512(&a.codes[g]);
        for (int t = 0; t < kTileRows; ++t) {
          dot[t] =
              _mm512_dpbusd_epi32(dot[t], _mm512_set1_epi32(static_cast<int>(w.q[t][g])), codes);
        }
      }
      for (int t = 0; t < kTileRows; ++t) {
        s_int[t] = _mm512_add_epi32(s_int[t],
                                    _mm512_mullo_epi32(dot[t], _mm512_set1_epi32(w.scale[t][s])));
      }
    }
    __m512i corr[kTileRows];
    for (int t = 0; t < kTileRows; ++t) corr[t] = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      const __m512i pairs = _mm512_load_si512(&a.bsum_pairs[i]);
      for (int t = 0; t < kTileRows; ++t) {
        corr[t] =
            _mm512_dpwssd_epi32(corr[t], pairs, _mm512_set1_epi32(static_cast<int>(w.corr[t][i])));
      }
    }
    for (int t = 0; t < kTileRows; ++t) {
      __m512 r;
      if constexpr (Format::kHasMin) {
        r = _mm512_mul_ps(_mm512_cvtepi32_ps(s_int[t]), _mm512_set1_ps(w.d[t]));
        r = _mm512_fnmadd_ps(_mm512_set1_ps(w.dmin[t]), _mm512_cvtepi32_ps(corr[t]), r);
      } else {
        const __m512i s = _mm512_sub_epi32(s_int[t], _mm512_slli_epi32(corr[t], 5));
        r = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(w.d[t]));
      }
      acc[t] = _mm512_fmadd_ps(r, a.d, acc[t]);
    }
  }
  alignas(64) float out[kTileRows][kLanes];
  for (int t = 0; t < kTileRows; ++t) _mm512_store_ps(out[t], acc[t]);
  for (int64_t c = 0; c < n_cols; ++c)
    for (int64_t t = 0; t < n_w; ++t) y[c * ldy + t] = out[t][c];
}

// The passes of a GEMM whose panels hold 16 activation rows per group (Act)
// and kTileRows weight rows (Weight), nb blocks of each: up to kPassRows
// activation rows are packed once per pass (pack_act(x, n_rows, act)), each
// group of kTileRows weight rows once per pass (pack_weights(j0, n_j,
// panel)), and run(panel, act, y, n_cols, n_j, prefetch) writes a group's
// outputs. weight_bytes(j0, n_j) names the contiguous bytes pack_weights
// reads for those rows; the tiles of a group fetch the next group's.
template <typename Act, typename Weight, typename PackAct, typename PackWeights,
          typename WeightBytes, typename Run>
void run_passes(int64_t n_w, const uint8_t* x, size_t x_stride, int64_t n_x, int64_t nb, float* y,
                int64_t ldy, PackAct pack_act, PackWeights pack_weights, WeightBytes weight_bytes,
                Run run) {
  thread_local std::vector<Act> act;
  thread_local std::vector<Weight> panel;
  act.resize(static_cast<size_t>(kPassRows / kLanes * nb));
  panel.resize(static_cast<size_t>(nb));
  for (int64_t i0 = 0; i0 < n_x; i0 += kPassRows) {
    const int64_t n_i = std::min(kPassRows, n_x - i0);
    const int64_t n_groups = (n_i + kLanes - 1) / kLanes;
    for (int64_t g = 0; g < n_groups; ++g) {
      pack_act(x + (i0 + g * kLanes) * x_stride, std::min<int64_t>(kLanes, n_i - g * kLanes),
               act.data() + g * nb);
    }
    for (int64_t j0 = 0; j0 < n_w; j0 += kTileRows) {
      const int64_t n_j = std::min<int64_t>(kTileRows, n_w - j0);
      pack_weights(j0, n_j, panel.data());
      // The next group's bytes, spread over this group's tiles and blocks.
      const char* next = nullptr;
      int64_t bytes = 0, step = 0;
      if (const int64_t j1 = j0 + kTileRows; j1 < n_w && nb > 0) {
        const auto [first, n_bytes] = weight_bytes(j1, std::min<int64_t>(kTileRows, n_w - j1));
        next = reinterpret_cast<const char*>(first);
        bytes = n_bytes;
        step = (bytes + n_groups * nb - 1) / (n_groups * nb);
      }
      for (int64_t g = 0; g < n_groups; ++g) {
        const int64_t i = i0 + g * kLanes;
        const int64_t share = std::min(g * nb * step, bytes);
        const Prefetch prefetch{next, share, std::min(share + nb * step, bytes), step};
        run(panel.data(), act.data() + g * nb, y + i * ldy + j0, std::min<int64_t>(kLanes, n_x - i),
            n_j, prefetch);
      }
    }
  }
}

// The DotTileFn contract (kernel_table.h) for n_x >= kMinRows.
template <typename Format>
void gemm(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
          int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t nb = k / kSuperBlock;
  run_passes<ActBlock, WeightBlock>(
      n_w, x, x_stride, n_x, nb, y, ldy,
      [&](const uint8_t* rows, int64_t n_rows, ActBlock* out) {
        pack_act_group(rows, x_stride, n_rows, nb, out);
      },
      [&](int64_t j0, int64_t n_j, WeightBlock* out) {
        pack_weight_group<Format>(w + j0 * w_stride, w_stride, n_j, nb, out);
      },
      [&](int64_t j0, int64_t n_j) { return row_bytes(w, w_stride, j0, n_j); },
      [&](const WeightBlock* panel, const ActBlock* act, float* out, int64_t n_cols, int64_t n_j,
          Prefetch prefetch) {
        run_tile<Format>(panel, act, nb, out, ldy, n_cols, n_j, prefetch);
      });
}

}  // namespace kquant512
}  // namespace
}  // namespace duet::cpu

// Register-blocked GEMM for block-quantized weights (AVX2): tiles of 2 weight
// rows x 4 activation rows, for the batched shapes. Included into the AVX2
// translation unit only. It keeps the contract that the AVX-512 path
// (kernels/cpu/x86/quant_gemm_avx512_inl.h) states: every output element
// bit-identical to the row tiles and the scalar path; only the reuse of
// unpacked weights and converted scales changes.
//
// Scales. Per block, the 8 products d_w * d_x of the tile are one multiply in
// "E order": lane L holds weight row (L % 4) / 2 and activation row
// 2 (L % 2) + L / 4, the order in which reduce_tile's transposing sum gives
// the tile's 8 lane trees (the mins are accumulated in it too).
//
// Operands. Q4_1: the nibbles are the unsigned operand, the Q8_1 activations
// the signed one. Q8_0 and Q4_0: |w| and x with the sign of w, as the row
// tiles (an offset like the AVX-512 path's would saturate maddubs).
//
// Q4_0 (kBlockSum) keeps one integer per block and pair (kernel_table.h): the
// tile's 8 pairs' lanes are reduced per block into one register in E order,
// and one FMA does the 8 pairs' float steps.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace gemm256 {

constexpr int kWeightRows = 2;
constexpr int kActRows = 4;
// Blocking. A weight group's panel holds a chunk of kChunkBlocks blocks
// (k = 2048: 10 KiB, beside a tile's 12 KiB of activations in a 32 KiB L1;
// 128 blocks ran 10% slower), unpacked once for a pass of activation tiles
// whose chunks (an ActBlock4 per tile and block) fill at most half of a
// core's L2. The rows are taken a chunk at a time for a block of weight
// groups, every tile's accumulators carried from one chunk to the next: the
// sums run in the same order whatever the blocking.
constexpr int64_t kChunkBlocks = 64;
constexpr int64_t kMaxTilesPerPass = 16;  // 64 rows: a matmul task's at most
constexpr int64_t kGroupsPerBlock = 16;   // their tiles' states: 72 KiB at most

struct Q4_1Gemm {
  using WeightBlock = BlockQ4_1;
  using ActBlock = BlockQ8_1;
  static constexpr bool kInterleaved = false;
  static constexpr bool kHasMin = true;
  static constexpr bool kSigned = false;
  static constexpr bool kBlockSum = false;
  static __m256i weights(const WeightBlock& b) { return unpack_nibbles(b.qs); }
  static float min(const WeightBlock& b) { return half_to_float(b.m); }
  static float act_sum(const ActBlock& b) { return half_to_float(b.s); }
};

template <typename Block>
struct SymmetricGemm {
  using WeightBlock = Block;
  using ActBlock = BlockQ8_0;
  static constexpr bool kInterleaved = false;
  static constexpr bool kHasMin = false;
  static constexpr bool kSigned = true;
  static constexpr bool kBlockSum = std::is_same_v<Block, BlockQ4_0>;
  static __m256i weights(const WeightBlock& b) { return SymmetricFormat<Block>::weights(b); }
  static float min(const WeightBlock&) { return 0.0f; }
  static float act_sum(const ActBlock&) { return 0.0f; }
};

using Q8_0Gemm = SymmetricGemm<BlockQ8_0>;
using Q4_0Gemm = SymmetricGemm<BlockQ4_0>;
using Q5_0Gemm = SymmetricGemm<BlockQ5_0>;  // weights -16..15: no operand saturates

// Q4_0 interleaved by 8 rows (interleave.h): a weight group is one pair of a
// BlockQ4_0x8, each row's nibbles in a half of each byte, in element order.
// The panel holds the same signed weights as Q4_0Gemm's.
struct Q4_0x8Gemm : SymmetricGemm<BlockQ4_0> {
  static constexpr bool kInterleaved = true;
};

// Signed formats: the weights themselves, whose signs go onto the activations.
template <bool kSigned>
struct PanelSigns {};
template <>
struct PanelSigns<true> {
  __m256i w[kWeightRows];
};

// Q4_1: the mins, in the scales' order.
template <bool kHasMin>
struct PanelMins {};
template <>
struct PanelMins<true> {
  float m[8];
};

// One block of a weight group (2 rows), prepared once per group and chunk of
// activation rows: 160 bytes (Q4_0, Q8_0) or 128 (Q4_1), so that a chunk's
// panel and a tile's activations share L1. Rows past the matrix's end are
// zero (and never stored).
template <typename Format>
struct alignas(32) PanelBlock : PanelSigns<Format::kSigned>, PanelMins<Format::kHasMin> {
  __m256i u[kWeightRows];  // the unsigned operands: nibbles, or |w|
  float d[8];              // d_w in E order: {d0, d0, d1, d1, d0, d0, d1, d1}
};

// One block of an activation tile, copied out of the rows' blocks so that the
// tile loop reads one aligned stream (a row's 34- or 36-byte blocks put half
// of their 32-byte loads across two cache lines): the rows' quants, then
// their scales in E order {x0, x2, x0, x2, x1, x3, x1, x3}. Rows past the
// tile's end are 0.
struct alignas(32) ActBlock4 {
  int8_t q[kActRows][kQuantBlock];
  float d[8];
  float s[8];  // Q8_1 sums (Q4_1 only)
};

// The panel of weight rows [j0, j0 + n_j) (n_j <= 2), blocks [c0, c0 + n_c)
// of rows of nb blocks.
template <typename Format>
void pack_weight_group(const uint8_t* w, size_t w_stride, int64_t nb, int64_t j0, int64_t n_j,
                       int64_t c0, int64_t n_c, PanelBlock<Format>* panel) {
  using WB = typename Format::WeightBlock;
  auto store = [panel](int j, int64_t b, __m256i q, float d, float m) {
    PanelBlock<Format>& out = panel[b];
    if constexpr (Format::kSigned) {
      out.w[j] = q;
      out.u[j] = _mm256_sign_epi8(q, q);
    } else {
      out.u[j] = q;
    }
    for (int half = 0; half < 2; ++half) {
      out.d[4 * half + 2 * j] = out.d[4 * half + 2 * j + 1] = d;
      if constexpr (Format::kHasMin) out.m[4 * half + 2 * j] = out.m[4 * half + 2 * j + 1] = m;
    }
  };
  if constexpr (Format::kInterleaved) {  // j0 is even and n_j 2: groups are whole
    const auto* blocks = reinterpret_cast<const BlockQ4_0x8*>(w) + j0 / kInterleavedRows * nb + c0;
    const int pair = static_cast<int>(j0 % kInterleavedRows) / 2;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f), eights = _mm256_set1_epi8(8);
    for (int64_t b = 0; b < n_c; ++b) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blocks[b].qs[pair]));
      store(0, b, _mm256_sub_epi8(_mm256_and_si256(q, low_nibbles), eights),
            half_to_float(blocks[b].d[2 * pair]), 0.0f);
      store(1, b, _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(q, 4), low_nibbles), eights),
            half_to_float(blocks[b].d[2 * pair + 1]), 0.0f);
    }
    return;
  }
  for (int j = 0; j < kWeightRows; ++j) {
    const auto* wb =
        reinterpret_cast<const WB*>(w + (j0 + std::min<int64_t>(j, n_j - 1)) * w_stride) + c0;
    for (int64_t b = 0; b < n_c; ++b) {
      if (j < n_j) {
        store(j, b, Format::weights(wb[b]), half_to_float(wb[b].d), Format::min(wb[b]));
      } else {
        store(j, b, _mm256_setzero_si256(), 0.0f, 0.0f);
      }
    }
  }
}

// Blocks [0, nb) of activation rows [0, n_rows) (n_rows <= 4) as a tile.
template <typename Format>
void copy_act_tile(const uint8_t* x, size_t x_stride, int64_t n_rows, int64_t nb, ActBlock4* out) {
  using XB = typename Format::ActBlock;
  constexpr int kRowOfLane[8] = {0, 2, 0, 2, 1, 3, 1, 3};
  for (int64_t b = 0; b < nb; ++b) {
    float d[kActRows] = {}, s[kActRows] = {};
    for (int64_t r = 0; r < kActRows; ++r) {
      __m256i q = _mm256_setzero_si256();
      if (r < n_rows) {
        const XB& xb = reinterpret_cast<const XB*>(x + r * x_stride)[b];
        q = load_i8x32(xb.qs);
        d[r] = half_to_float(xb.d);
        s[r] = Format::act_sum(xb);
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[b].q[r]), q);
    }
    for (int l = 0; l < 8; ++l) {
      out[b].d[l] = d[kRowOfLane[l]];
      out[b].s[l] = s[kRowOfLane[l]];
    }
  }
}

// The lane trees of the tile's 8 accumulators a[j][i] (zero where i is past
// the tile), in E order: lane L is hsum_ps's ((L0 + L4) + (L2 + L6)) +
// ((L1 + L5) + (L3 + L7)) of a[(L % 4) / 2][2 (L % 2) + L / 4], two to four
// accumulators per add.
inline __m256 reduce_tile(const __m256 (&a)[kWeightRows][kActRows]) {
  const __m256* v = &a[0][0];  // v[4 j + i]
  __m256 c[4];                 // (l, l+4): accumulators 2k, 2k + 1 in the 128-bit halves of c[k]
  for (int k = 0; k < 4; ++k) {
    c[k] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * k], v[2 * k + 1], 0x31));
  }
  __m256 d[2];  // (l, l+2): the 64-bit halves of each 128-bit lane, two accumulators at once
  for (int k = 0; k < 2; ++k) {
    const __m256d lo =
        _mm256_unpacklo_pd(_mm256_castps_pd(c[2 * k]), _mm256_castps_pd(c[2 * k + 1]));
    const __m256d hi =
        _mm256_unpackhi_pd(_mm256_castps_pd(c[2 * k]), _mm256_castps_pd(c[2 * k + 1]));
    d[k] = _mm256_add_ps(_mm256_castpd_ps(lo), _mm256_castpd_ps(hi));
  }
  // (0, 1): lane k of each 128-bit lane: accumulators 2k (low lane) and 2k + 1 (high).
  return _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The same sum of int32 lanes: lane L is the total of a[(L % 4) / 2][2 (L % 2) + L / 4]'s.
inline __m256i reduce_tile_epi32(const __m256i (&a)[kWeightRows][kActRows]) {
  const __m256i* v = &a[0][0];
  __m256i c[4];
  for (int k = 0; k < 4; ++k) {
    c[k] = _mm256_add_epi32(_mm256_permute2x128_si256(v[2 * k], v[2 * k + 1], 0x20),
                            _mm256_permute2x128_si256(v[2 * k], v[2 * k + 1], 0x31));
  }
  __m256i d[2];
  for (int k = 0; k < 2; ++k) {
    d[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(c[2 * k], c[2 * k + 1]),
                            _mm256_unpackhi_epi64(c[2 * k], c[2 * k + 1]));
  }
  const __m256 d0 = _mm256_castsi256_ps(d[0]), d1 = _mm256_castsi256_ps(d[1]);
  return _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(d0, d1, _MM_SHUFFLE(2, 0, 2, 0))),
                          _mm256_castps_si256(_mm256_shuffle_ps(d0, d1, _MM_SHUFFLE(3, 1, 3, 1))));
}

// A register tile's accumulators between chunks of k (kBlockSum: `sums`, in E order).
struct TileState {
  __m256 acc[kWeightRows][kActRows];
  __m256 mins;
  __m256 sums;
};

// Register layout: one accumulator per (weight row j, activation row i), its
// 8 float lanes the 8 int32 lanes of the block dot products (maddubs + madd,
// as the AVX2 row tiles; no operand saturates). 8 accumulators, the two
// weight rows' unsigned operands, an activation row and temporaries fill the
// 16 registers.
//
// One register tile: the group's 2 weight rows (n_j valid) x the tile's
// activation rows [0, NX), NX <= 4, over one chunk of blocks [0, nb) (panel
// and act start at the chunk's first block). The first chunk starts from zero, the
// others from `state`; the last writes y[i * ldy + j] for i < NX, j < n_j,
// the others leave their sums in `state`.
template <typename Format, int NX>
struct Tile {
  static void run(const PanelBlock<Format>* panel, const ActBlock4* act, int64_t nb, bool first,
                  bool last, TileState& state, float* y, int64_t ldy, int64_t n_j) {
    if constexpr (Format::kBlockSum) {
      run_block_sums(panel, act, nb, first, last, state, y, ldy, n_j);
    } else {
      run_lanes(panel, act, nb, first, last, state, y, ldy, n_j);
    }
  }

  // Q4_0: per block, the 8 pairs' integers in E order, one FMA with their scales.
  static void run_block_sums(const PanelBlock<Format>* panel, const ActBlock4* act, int64_t nb,
                             bool first, bool last, TileState& state, float* y, int64_t ldy,
                             int64_t n_j) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 sums = first ? _mm256_setzero_ps() : state.sums;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i lanes[kWeightRows][kActRows];
      for (int j = 0; j < kWeightRows; ++j) {
        const __m256i u = _mm256_load_si256(&panel[b].u[j]);
        const __m256i wq = _mm256_load_si256(&panel[b].w[j]);
        for (int i = 0; i < kActRows; ++i) {
          lanes[j][i] = _mm256_setzero_si256();
          if (i < NX) {
            const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(act[b].q[i]));
            lanes[j][i] =
                _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(xv, wq)), ones);
          }
        }
      }
      const __m256 scales = _mm256_mul_ps(_mm256_load_ps(panel[b].d), _mm256_load_ps(act[b].d));
      sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce_tile_epi32(lanes)), scales, sums);
    }
    if (!last) {
      state.sums = sums;
      return;
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, sums);
    for (int i = 0; i < NX; ++i) {
      for (int64_t j = 0; j < n_j; ++j) y[i * ldy + j] = out[2 * j + i / 2 + 4 * (i % 2)];
    }
  }

  static void run_lanes(const PanelBlock<Format>* panel, const ActBlock4* act, int64_t nb,
                        bool first, bool last, TileState& state, float* y, int64_t ldy,
                        int64_t n_j) {
    __m256 acc[kWeightRows][kActRows];
    __m256 mins;
    if (first) {
      for (auto& row : acc)
        for (auto& a : row) a = _mm256_setzero_ps();
      mins = _mm256_setzero_ps();
    } else {
      for (int j = 0; j < kWeightRows; ++j)
        for (int i = 0; i < kActRows; ++i) acc[j][i] = state.acc[j][i];
      mins = state.mins;
    }
    // Per block, the tile's 8 scale products in E order; and the mins.
    alignas(32) float scales[kChunkBlocks][8];
    for (int64_t b = 0; b < nb; ++b) {
      _mm256_store_ps(scales[b],
                      _mm256_mul_ps(_mm256_load_ps(panel[b].d), _mm256_load_ps(act[b].d)));
      if constexpr (Format::kHasMin) {  // an exact product, so the FMA is the multiply-add
        mins = _mm256_fmadd_ps(_mm256_load_ps(panel[b].m), _mm256_load_ps(act[b].s), mins);
      }
    }

    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i u0 = _mm256_load_si256(&panel[b].u[0]);
      const __m256i u1 = _mm256_load_si256(&panel[b].u[1]);
      for (int i = 0; i < NX; ++i) {
        const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(act[b].q[i]));
        for (int j = 0; j < kWeightRows; ++j) {
          __m256i s = xv;
          if constexpr (Format::kSigned)
            s = _mm256_sign_epi8(xv, _mm256_load_si256(&panel[b].w[j]));
          const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(j == 0 ? u0 : u1, s), ones);
          const __m256 scale = _mm256_broadcast_ss(&scales[b][2 * j + i / 2 + 4 * (i % 2)]);
          acc[j][i] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(lanes), acc[j][i]);
        }
      }
    }

    if (!last) {
      for (int j = 0; j < kWeightRows; ++j)
        for (int i = 0; i < kActRows; ++i) state.acc[j][i] = acc[j][i];
      state.mins = mins;
      return;
    }
    // hsum + mins, as the row tiles (mins is 0 for the formats without them).
    alignas(32) float out[8];
    _mm256_store_ps(out, _mm256_add_ps(reduce_tile(acc), mins));
    for (int i = 0; i < NX; ++i) {
      for (int64_t j = 0; j < n_j; ++j) y[i * ldy + j] = out[2 * j + i / 2 + 4 * (i % 2)];
    }
  }
};

template <typename Format, int NX = kActRows>
void run_tile(int64_t n_rows, const PanelBlock<Format>* panel, const ActBlock4* act, int64_t nb,
              bool first, bool last, TileState& state, float* y, int64_t ldy, int64_t n_j) {
  if constexpr (NX > 0) {
    if (n_rows == NX) {
      return Tile<Format, NX>::run(panel, act, nb, first, last, state, y, ldy, n_j);
    }
    run_tile<Format, NX - 1>(n_rows, panel, act, nb, first, last, state, y, ldy, n_j);
  }
}

// The activation tiles of one pass: as many as half of L2 holds a chunk of,
// the n_tiles of a task split into passes of equal size.
inline int64_t tiles_per_pass(int64_t n_tiles) {
  const int64_t fit = std::clamp<int64_t>(
      l2_cache_bytes() / 2 / (kChunkBlocks * static_cast<int64_t>(sizeof(ActBlock4))), 1,
      kMaxTilesPerPass);
  const int64_t passes = (n_tiles + fit - 1) / fit;
  return (n_tiles + passes - 1) / passes;
}

// The DotTileFn contract (kernel_table.h); for interleaved weights, n_w is a
// multiple of 8 and w their first group.
template <typename Format>
void gemm(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
          int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t nb = k / kQuantBlock;
  const int64_t pass_tiles = tiles_per_pass((n_x + kActRows - 1) / kActRows);
  thread_local std::vector<ActBlock4> act;
  act.resize(static_cast<size_t>(pass_tiles * nb));
  alignas(32) PanelBlock<Format> panel[kChunkBlocks];
  TileState states[kGroupsPerBlock][kMaxTilesPerPass];
  for (int64_t i0 = 0; i0 < n_x; i0 += pass_tiles * kActRows) {
    const int64_t n_i = std::min(n_x - i0, pass_tiles * kActRows);
    const int64_t n_tiles = (n_i + kActRows - 1) / kActRows;
    for (int64_t t = 0; t < n_tiles; ++t) {
      copy_act_tile<Format>(x + (i0 + t * kActRows) * x_stride, x_stride,
                            std::min<int64_t>(kActRows, n_i - t * kActRows), nb,
                            act.data() + t * nb);
    }
    for (int64_t g0 = 0; g0 < n_w; g0 += kGroupsPerBlock * kWeightRows) {
      const int64_t g_end = std::min(n_w, g0 + kGroupsPerBlock * kWeightRows);
      for (int64_t c0 = 0; c0 < nb; c0 += kChunkBlocks) {
        const int64_t n_c = std::min(kChunkBlocks, nb - c0);
        for (int64_t j0 = g0; j0 < g_end; j0 += kWeightRows) {
          const int64_t n_j = std::min<int64_t>(kWeightRows, n_w - j0);
          pack_weight_group<Format>(w, w_stride, nb, j0, n_j, c0, n_c, panel);
          for (int64_t t = 0; t < n_tiles; ++t) {
            const int64_t i = i0 + t * kActRows;
            run_tile<Format>(std::min<int64_t>(kActRows, n_x - i), panel, act.data() + t * nb + c0,
                             n_c, c0 == 0, c0 + n_c == nb, states[(j0 - g0) / kWeightRows][t],
                             y + i * ldy + j0, ldy, n_j);
          }
        }
      }
    }
  }
}

}  // namespace gemm256
}  // namespace
}  // namespace duet::cpu

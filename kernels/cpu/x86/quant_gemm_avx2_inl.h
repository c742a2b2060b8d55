// Register-blocked GEMM for block-quantized weights (AVX2): tiles of 2 weight
// rows x 4 activation rows, for the batched shapes. Included into the AVX2
// translation unit only; the AVX-512 path has its own (quant_gemm_avx512_inl.h,
// which states the contract both keep: every output element bit-identical to
// the row tiles and the scalar path, only the reuse of unpacked weights and
// converted scales changes).
//
// Register layout: one accumulator per (weight row j, activation row i), its
// 8 float lanes the 8 int32 lanes of the block dot products (maddubs + madd,
// as the AVX2 row tiles; no operand saturates). 8 accumulators, the two
// weight rows' unsigned operands, an activation row and temporaries fill the
// 16 registers.
//
// Scales. Per block, the 8 products d_w * d_x of the tile are one multiply in
// "E order": lane L holds weight row (L % 4) / 2 and activation row
// 2 (L % 2) + L / 4, the order in which the 8 lane trees of the tile come out
// of the transposing sum in reduce_tile (the mins are accumulated in it too).
//
// Operands. Q4_1: the nibbles are the unsigned operand, the Q8_1 activations
// the signed one. Q8_0 and Q4_0: |w| and x with the sign of w, as the row
// tiles (an offset like the AVX-512 path's would saturate maddubs).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace gemm256 {

constexpr int kWeightRows = 2;
constexpr int kActRows = 4;
// A weight group's panel holds this many blocks (k = 4096); longer rows are
// taken a chunk of blocks at a time, every tile's accumulators carried from
// one chunk to the next, so the sums run in the same order whatever k is.
constexpr int64_t kChunkBlocks = 128;
// Rows of up to this many blocks (k <= 32768) take this path: the bound of
// the activation scales prepared at once, on the stack (64 KiB).
constexpr int64_t kMaxBlocks = 1024;
constexpr int64_t kActScaleBlocks = kMaxBlocks;
// The activation rows a weight group is unpacked for are chosen so that
// their quantized blocks and scales (kActBytesPerTileBlock per tile and
// block) fit in this many bytes, about half of a core's L2: every weight
// group streams them again. More rows amortize the unpacking better; rows
// that spill to L3 cost more than they save.
constexpr int64_t kActBudgetBytes = 256 << 10;
constexpr int64_t kActBytesPerTileBlock = sizeof(float) * 16 + kActRows * 36;
constexpr int64_t kMaxTilesPerChunk = 16;  // 64 rows: a matmul task's at most

struct Q4_1Gemm {
  using WeightBlock = BlockQ4_1;
  using ActBlock = BlockQ8_1;
  static constexpr bool kHasMin = true;
  static constexpr bool kSigned = false;
  static __m256i weights(const WeightBlock& b) { return unpack_nibbles(b.qs); }
  static float min(const WeightBlock& b) { return half_to_float(b.m); }
  static float act_sum(const ActBlock& b) { return half_to_float(b.s); }
};

template <typename Block>
struct SymmetricGemm {
  using WeightBlock = Block;
  using ActBlock = BlockQ8_0;
  static constexpr bool kHasMin = false;
  static constexpr bool kSigned = true;
  static __m256i weights(const WeightBlock& b) { return SymmetricFormat<Block>::weights(b); }
  static float min(const WeightBlock&) { return 0.0f; }
  static float act_sum(const ActBlock&) { return 0.0f; }
};

using Q8_0Gemm = SymmetricGemm<BlockQ8_0>;
using Q4_0Gemm = SymmetricGemm<BlockQ4_0>;

// Signed formats: the weights themselves, whose signs go onto the activations.
template <bool kSigned>
struct PanelSigns {};
template <>
struct PanelSigns<true> {
  __m256i w[kWeightRows];
};

// One block of a weight group (2 rows), prepared once per group and chunk of
// activation rows. Rows past the matrix's end are zero (and never stored).
template <typename Format>
struct alignas(32) PanelBlock : PanelSigns<Format::kSigned> {
  __m256i u[kWeightRows];  // the unsigned operands: nibbles, or |w|
  float d[8];              // d_w in E order: {d0, d0, d1, d1, d0, d0, d1, d1}
  float m[8];              // the same for the Q4_1 mins
};

// One block of an activation tile's scales in E order:
// {x0, x2, x0, x2, x1, x3, x1, x3} (rows past the tile's end are 0).
struct alignas(32) ActScales {
  float d[8];
  float s[8];  // Q8_1 sums (Q4_1 only)
};

template <typename Format>
void pack_weight_group(const uint8_t* w, size_t w_stride, int64_t n_j, int64_t nb,
                       PanelBlock<Format>* panel) {
  using WB = typename Format::WeightBlock;
  for (int j = 0; j < kWeightRows; ++j) {
    const auto* wb = reinterpret_cast<const WB*>(w + std::min<int64_t>(j, n_j - 1) * w_stride);
    for (int64_t b = 0; b < nb; ++b) {
      PanelBlock<Format>& out = panel[b];
      __m256i q = _mm256_setzero_si256();
      float d = 0.0f, m = 0.0f;
      if (j < n_j) {
        q = Format::weights(wb[b]);
        d = half_to_float(wb[b].d);
        m = Format::min(wb[b]);
      }
      if constexpr (Format::kSigned) {
        out.w[j] = q;
        out.u[j] = _mm256_sign_epi8(q, q);
      } else {
        out.u[j] = q;
      }
      for (int half = 0; half < 2; ++half) {
        out.d[4 * half + 2 * j] = out.d[4 * half + 2 * j + 1] = d;
        out.m[4 * half + 2 * j] = out.m[4 * half + 2 * j + 1] = m;
      }
    }
  }
}

// Scales of activation rows [0, n_rows) (n_rows <= 4), blocks [0, nb).
template <typename Format>
void convert_act_scales(const uint8_t* x, size_t x_stride, int64_t n_rows, int64_t nb,
                        ActScales* out) {
  using XB = typename Format::ActBlock;
  constexpr int kRowOfLane[8] = {0, 2, 0, 2, 1, 3, 1, 3};
  for (int64_t b = 0; b < nb; ++b) {
    float d[kActRows] = {}, s[kActRows] = {};
    for (int64_t r = 0; r < n_rows; ++r) {
      const XB& xb = reinterpret_cast<const XB*>(x + r * x_stride)[b];
      d[r] = half_to_float(xb.d);
      s[r] = Format::act_sum(xb);
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

// A register tile's accumulators between chunks of k.
struct TileState {
  __m256 acc[kWeightRows][kActRows];
  __m256 mins;
};

// One register tile: the group's 2 weight rows (n_j valid) x activation rows
// [0, NX) of x, NX <= 4, over one chunk of blocks [0, nb) (panel, act and x
// start at the chunk's first block). The first chunk starts from zero, the
// others from `state`; the last writes y[i * ldy + j] for i < NX, j < n_j,
// the others leave their sums in `state`.
template <typename Format, int NX>
struct Tile {
  static void run(const PanelBlock<Format>* panel, const ActScales* act, const uint8_t* x,
                  size_t x_stride, int64_t nb, bool first, bool last, TileState& state, float* y,
                  int64_t ldy, int64_t n_j) {
    using XB = typename Format::ActBlock;
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

    const XB* rows[kActRows];
    for (int i = 0; i < NX; ++i) rows[i] = reinterpret_cast<const XB*>(x + i * x_stride);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
      const __m256i u0 = _mm256_load_si256(&panel[b].u[0]);
      const __m256i u1 = _mm256_load_si256(&panel[b].u[1]);
      for (int i = 0; i < NX; ++i) {
        const __m256i xv = load_i8x32(rows[i][b].qs);
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
void run_tile(int64_t n_rows, const PanelBlock<Format>* panel, const ActScales* act,
              const uint8_t* x, size_t x_stride, int64_t nb, bool first, bool last,
              TileState& state, float* y, int64_t ldy, int64_t n_j) {
  if constexpr (NX > 0) {
    if (n_rows == NX) {
      return Tile<Format, NX>::run(panel, act, x, x_stride, nb, first, last, state, y, ldy, n_j);
    }
    run_tile<Format, NX - 1>(n_rows, panel, act, x, x_stride, nb, first, last, state, y, ldy, n_j);
  }
}

// The activation tiles a weight group is unpacked for, for rows of nb blocks.
inline int64_t tiles_per_chunk(int64_t nb) {
  return std::clamp<int64_t>(kActBudgetBytes / (nb * kActBytesPerTileBlock), 1,
                             std::min<int64_t>(kMaxTilesPerChunk, kActScaleBlocks / nb));
}

// The DotTileFn contract (kernel_table.h) for k / 32 <= kMaxBlocks.
template <typename Format>
void gemm(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
          int64_t n_x, int64_t k, float* y, int64_t ldy) {
  using XB = typename Format::ActBlock;
  const int64_t nb = k / kQuantBlock;
  const int64_t n_chunk_tiles = tiles_per_chunk(nb);
  alignas(32) ActScales act[kActScaleBlocks];
  alignas(32) PanelBlock<Format> panel[kChunkBlocks];
  TileState states[kMaxTilesPerChunk];
  for (int64_t i0 = 0; i0 < n_x; i0 += n_chunk_tiles * kActRows) {
    const int64_t n_i = std::min(n_x - i0, n_chunk_tiles * kActRows);
    const int64_t n_tiles = (n_i + kActRows - 1) / kActRows;
    for (int64_t t = 0; t < n_tiles; ++t) {
      convert_act_scales<Format>(x + (i0 + t * kActRows) * x_stride, x_stride,
                                 std::min<int64_t>(kActRows, n_i - t * kActRows), nb, act + t * nb);
    }
    for (int64_t j0 = 0; j0 < n_w; j0 += kWeightRows) {
      const int64_t n_j = std::min<int64_t>(kWeightRows, n_w - j0);
      for (int64_t c0 = 0; c0 < nb; c0 += kChunkBlocks) {
        const int64_t n_c = std::min(kChunkBlocks, nb - c0);
        pack_weight_group<Format>(w + j0 * w_stride + c0 * sizeof(typename Format::WeightBlock),
                                  w_stride, n_j, n_c, panel);
        for (int64_t t = 0; t < n_tiles; ++t) {
          const int64_t i = i0 + t * kActRows;
          run_tile<Format>(std::min<int64_t>(kActRows, n_x - i), panel, act + t * nb + c0,
                           x + i * x_stride + c0 * sizeof(XB), x_stride, n_c, c0 == 0,
                           c0 + n_c == nb, states[t], y + i * ldy + j0, ldy, n_j);
        }
      }
    }
  }
}

}  // namespace gemm256
}  // namespace
}  // namespace duet::cpu

// Register-blocked GEMM for Q8_0, Q5_0 and Q4_1 weights (AVX-512 VNNI; Q4_0's
// order has a GEMM of its own, q4_0_gemm_avx512_inl.h): tiles of
// 4 weight rows x 8 activation rows, for the batched shapes (several
// activation rows per call: batched decode and prefill). Included into the
// AVX-512 translation unit only.
//
// Contract: every output element is bit-identical to QuantTile's (and so to
// the scalar path's). Per (weight row, activation row) pair and block b in
// order, the 8 int32 lanes L[m] = sum_{e=4m..4m+3} w[e] x[e] (exact, however
// computed) are added as acc[m] = fma(d_w * d_x, float(L[m]), acc[m]); the
// result is ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7))
// plus mins = sum_b m_w * s_x added in block order from 0 (Q4_1; 0 for the
// others). d_w * d_x and m_w * s_x multiply two halves, so they are exact in
// float and an FMA on them equals QuantTile's multiply-then-add. Only the
// reuse differs: a weight block is unpacked once per weight group for every
// activation row, and one instruction serves two pairs (layout: Tile).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"

namespace duet::cpu {
namespace {
namespace gemm512 {

constexpr int kWeightRows = 4;  // weight rows per register tile (two weight pairs)
constexpr int kActRows = 8;     // activation rows per register tile (four pairs)
constexpr int kActPairs = kActRows / 2;
// A weight group's panel holds this many blocks at a time (k in chunks of
// 1024): with a tile's slice of the activation panel, 30 KiB that stay in L1
// while the tiles take turns (128 blocks, 120 KiB, ran 5-7% slower on Zen 4).
// A tile carries its accumulators from chunk to chunk, so a row adds its
// blocks in order whatever the chunks (the contract above).
constexpr int64_t kChunkBlocks = 32;
// Rows of up to this many blocks (k <= 32768) take this path; longer ones
// fall back to QuantTile.
constexpr int64_t kMaxBlocks = 1024;
// Activation tiles x blocks prepared at once (one tile's whole row when
// longer): 1.5 MiB of panels, so that each weight group, packed once per
// chunk, serves up to 32 tiles (256 rows at k = 4096, 72 at k = 14336).
// At 256 blocks it served 2 tiles at the 8B shapes, and packing the weights
// again every 16 rows held Q8_0 to 74-88 GFLOP/s a thread on Zen 4 (143-147
// now, with the chunks above; duet-matmul-bench matmul8b, n_x 512).
constexpr int64_t kActPanelBlocks = 4096;

struct Q4_1Gemm {
  using WeightBlock = BlockQ4_1;
  using ActBlock = BlockQ8_1;
  static constexpr bool kHasMin = true;
  static constexpr bool kOffsetActivations = false;
  static __m256i weights(const WeightBlock& b) { return unpack_nibbles(b.qs); }
  // The half bits d | m << 16.
  static uint32_t scale_bits(const WeightBlock& b) { return b.d | uint32_t{b.m} << 16; }
  static float act_sum(const ActBlock& b) { return half_to_float(b.s); }
};

template <typename Block>
struct SymmetricGemm {
  using WeightBlock = Block;
  using ActBlock = BlockQ8_0;
  static constexpr bool kHasMin = false;
  static constexpr bool kOffsetActivations = true;
  static __m256i weights(const WeightBlock& b) { return SymmetricFormat<Block>::weights(b); }
  static uint32_t scale_bits(const WeightBlock& b) { return b.d; }
  static float act_sum(const ActBlock&) { return 0.0f; }
};

using Q8_0Gemm = SymmetricGemm<BlockQ8_0>;
using Q5_0Gemm = SymmetricGemm<BlockQ5_0>;  // weights -16..15: no operand saturates

// vpdpbusd multiplies unsigned by signed bytes. Q4_1: the nibbles (0..15) are
// the unsigned operand, the Q8_1 activations the signed one. Q8_0 and Q5_0
// (offset formats): the activations + 128 are the unsigned operand, the
// weights the signed one, and each lane starts from -128 * (the sum of its
// 4-byte weight group), kept here in the lanes of q: the lane is exactly sum(w x).
template <bool kOffset>
struct PanelInit {};
template <>
struct PanelInit<true> {
  __m512i init[kWeightRows];
};

// One block of a weight group (4 rows), prepared once per group and chunk of
// activation rows. Rows past the matrix's end are zero (and never stored).
template <typename Format>
struct alignas(64) PanelBlock : PanelInit<Format::kOffsetActivations> {
  __m512i q[kWeightRows];  // each row's 32 operand bytes, 4-byte groups repeated twice
  float d[2][4];  // per weight pair: {d_w0, d_w0, d_w1, d_w1}, the E order of one 128-bit lane
  float m[2][4];  // the same for the Q4_1 mins
};

// One block of an activation tile (8 rows), prepared once per call: the
// operands of the 4 row pairs, and the scales in E order (lane 4p + 2q + h
// holds row 2p + h, so each value twice). Rows past the end are zero.
struct alignas(64) ActPanelBlock {
  __m512i x[kActPairs];  // 4-byte groups of rows 2p and 2p + 1 interleaved (+ 128: offset formats)
  float d[16];
  float s[16];  // Q8_1 sums (Q4_1 only)
};

// Row j of the group of rows [j0, j0 + n_j) of the matrix at w, block b: its
// 32 weights in element order and its scale's bits.
template <typename Format>
struct GroupRows {
  using WB = typename Format::WeightBlock;
  const WB* rows[kWeightRows];
  GroupRows(const uint8_t* w, size_t w_stride, int64_t j0, int64_t n_j) {
    for (int j = 0; j < kWeightRows; ++j)
      rows[j] = reinterpret_cast<const WB*>(w + (j0 + std::min<int64_t>(j, n_j - 1)) * w_stride);
  }
  __m256i weights(int j, int64_t b) const { return Format::weights(rows[j][b]); }
  uint32_t scale_bits(int j, int64_t b) const { return Format::scale_bits(rows[j][b]); }
};

// Blocks [b0, b0 + n_blocks) of the group of rows [j0, j0 + n_j) of a matrix,
// into panel[0, n_blocks).
template <typename Format>
void pack_weight_group(const uint8_t* w, size_t w_stride, int64_t j0, int64_t n_j, int64_t b0,
                       int64_t n_blocks, PanelBlock<Format>* panel) {
  const GroupRows<Format> rows(w, w_stride, j0, n_j);
  const __m512i repeat = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m256i d_pattern = _mm256_set_epi32(6, 6, 4, 4, 2, 2, 0, 0);
  const __m256i m_pattern = _mm256_set_epi32(7, 7, 5, 5, 3, 3, 1, 1);
  for (int64_t b = 0; b < n_blocks; ++b) {
    PanelBlock<Format>& out = panel[b];
    uint32_t scales[kWeightRows];
    for (int j = 0; j < kWeightRows; ++j) {
      __m512i q = _mm512_setzero_si512();
      scales[j] = 0;
      if (j < n_j) {
        q = _mm512_permutexvar_epi32(repeat, _mm512_zextsi256_si512(rows.weights(j, b0 + b)));
        scales[j] = rows.scale_bits(j, b0 + b);
      }
      _mm512_store_si512(&out.q[j], q);
      if constexpr (Format::kOffsetActivations) {
        const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
        _mm512_store_si512(&out.init[j],
                           _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sums, 7)));
      }
    }
    // {d0, m0, d1, m1, d2, m2, d3, m3} converted at once (the same rounding-free
    // conversion as half_to_float), then spread into the E-order patterns.
    const __m256 dm =
        _mm256_cvtph_ps(_mm_setr_epi32(static_cast<int>(scales[0]), static_cast<int>(scales[1]),
                                       static_cast<int>(scales[2]), static_cast<int>(scales[3])));
    _mm256_store_ps(&out.d[0][0], _mm256_permutevar8x32_ps(dm, d_pattern));
    if constexpr (Format::kHasMin) {
      _mm256_store_ps(&out.m[0][0], _mm256_permutevar8x32_ps(dm, m_pattern));
    }
  }
}

// Activation rows [0, n_rows) (n_rows <= 8), blocks [0, nb), as one tile's panel.
template <typename Format>
void pack_act_tile(const uint8_t* x, size_t x_stride, int64_t n_rows, int64_t nb,
                   ActPanelBlock* out) {
  using XB = typename Format::ActBlock;
  const __m512i interleave =
      _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i e_order = _mm512_set_epi32(7, 6, 7, 6, 5, 4, 5, 4, 3, 2, 3, 2, 1, 0, 1, 0);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i q[kActRows];
    alignas(32) float d[kActRows] = {};
    alignas(32) float s[kActRows] = {};
    for (int r = 0; r < kActRows; ++r) {
      q[r] = _mm256_setzero_si256();
      if (r < n_rows) {
        const XB& xb = reinterpret_cast<const XB*>(x + r * x_stride)[b];
        q[r] = load_i8x32(xb.qs);
        d[r] = half_to_float(xb.d);
        s[r] = Format::act_sum(xb);
      }
    }
    for (int p = 0; p < kActPairs; ++p) {
      __m512i v = _mm512_permutex2var_epi32(_mm512_zextsi256_si512(q[2 * p]), interleave,
                                            _mm512_zextsi256_si512(q[2 * p + 1]));
      if constexpr (Format::kOffsetActivations) {
        v = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
      }
      _mm512_store_si512(&out[b].x[p], v);
    }
    _mm512_store_ps(out[b].d,
                    _mm512_permutexvar_ps(e_order, _mm512_zextps256_ps512(_mm256_load_ps(d))));
    if constexpr (Format::kHasMin) {
      _mm512_store_ps(out[b].s,
                      _mm512_permutexvar_ps(e_order, _mm512_zextps256_ps512(_mm256_load_ps(s))));
    }
  }
}

// A zero register made by the zeroing idiom, which needs no execution unit.
// Compilers otherwise keep one zero register and copy it before every
// destructive vpdpbusd, and on Zen 5 the copies take a vector pipe (2-4% of
// the kernel's time in duet-matmul-bench). Volatile, so that it is not merged.
inline __m512i fresh_zero() {
  __m512i r;
  asm volatile("vpxord %0, %0, %0" : "=v"(r));
  return r;
}

// The lane-tree sums of a weight pair's accumulators, in E order: a[q][p] is
// weight row q of the pair against activation pair p. Lane 4p + 2q + h of the
// result is ((L0 + L4) + (L2 + L6)) + ((L1 + L5) + (L3 + L7)) of lanes
// L_m = a[q][p] lane 2m + h: the tree of hsum_ps, two pairs per add.
inline __m512 reduce_pair(const __m512 (&a)[2][4]) {
  __m512 d[2];
  for (int q = 0; q < 2; ++q) {
    // (m, m + 4): the 256-bit halves, two accumulators per add.
    const __m512 c01 = _mm512_add_ps(_mm512_shuffle_f32x4(a[q][0], a[q][1], 0x44),
                                     _mm512_shuffle_f32x4(a[q][0], a[q][1], 0xee));
    const __m512 c23 = _mm512_add_ps(_mm512_shuffle_f32x4(a[q][2], a[q][3], 0x44),
                                     _mm512_shuffle_f32x4(a[q][2], a[q][3], 0xee));
    // (m, m + 2): the 128-bit quarters; 128-bit lane p of d[q] is activation pair p.
    d[q] =
        _mm512_add_ps(_mm512_shuffle_f32x4(c01, c23, 0x88), _mm512_shuffle_f32x4(c01, c23, 0xdd));
  }
  // (0, 1): the 64-bit halves of each 128-bit lane, both weight rows at once.
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

// Where (activation row i, weight row j) of a tile is in the concatenated E-order
// results of its two weight pairs (16 lanes each).
constexpr int e_order_index(int i, int j) {
  return 16 * (j / 2) + 4 * (i / 2) + 2 * (j % 2) + i % 2;
}
alignas(64) constexpr std::array<int32_t, 32> kRowMajorIndex = [] {
  std::array<int32_t, 32> index{};
  for (int i = 0; i < kActRows; ++i)
    for (int j = 0; j < kWeightRows; ++j) index[4 * i + j] = e_order_index(i, j);
  return index;
}();

// One register tile: the group's 4 weight rows (n_j valid, from the weight
// panel) x the activation tile's rows [0, NX) (from its panel), NX <= 8.
// Writes y[i * ldy + j] for i < NX, j < n_j.
//
// An accumulator holds one weight row j and two activation rows r0 = 2p,
// r1 = 2p + 1: lane 2m + h is int lane m of the pair (j, r_h). So the weight
// operand repeats each 4-byte group twice and the activation operand
// interleaves the groups of the two rows (both built once, into the panels).
// 4 weight rows x 4 activation pairs = 16 accumulators, plus 4 activation
// operands and temporaries; per block and pair of pairs the loop issues
// vpdpbusd, vcvtdq2ps, a broadcast load of the scales and one FMA. The scales
// d_w * d_x and the mins come in E order (lane 4p + 2q + h: weight row 2jp + q,
// activation row 2p + h), where the tile's final lane sums land too; they are
// computed before the block loop, one multiply and one FMA per 16 pairs and
// block: an eighth of the loop's work, which the numerics leave no way around.
// A tile's accumulators between two chunks of k.
struct TileCarry {
  __m512 acc[kWeightRows][kActPairs];
  __m512 mins[2];
};

template <typename Format, int NX>
struct Tile {
  static constexpr int kPairs = (NX + 1) / 2;

  // The blocks [0, nb) of panel and act (nb <= kChunkBlocks), a chunk of the
  // rows' k: continued from `carry` unless `first`; left in it unless `last`,
  // which writes y.
  static void run(const PanelBlock<Format>* panel, const ActPanelBlock* act, int64_t nb, float* y,
                  int64_t ldy, int64_t n_j, TileCarry& carry, bool first, bool last) {
    // Per block and weight pair, the 16 scale products in E order (as doubles:
    // element 2p + q is the pair of lanes 4p + 2q, 4p + 2q + 1).
    alignas(64) double scales[kChunkBlocks][2][8];
    __m512 mins[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    if (!first) {
      mins[0] = carry.mins[0];
      mins[1] = carry.mins[1];
    }
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 dx = _mm512_load_ps(act[b].d);
      for (int jp = 0; jp < 2; ++jp) {
        const __m512 dw = _mm512_broadcast_f32x4(_mm_load_ps(panel[b].d[jp]));
        _mm512_store_pd(scales[b][jp], _mm512_castps_pd(_mm512_mul_ps(dw, dx)));
        if constexpr (Format::kHasMin) {
          const __m512 mw = _mm512_broadcast_f32x4(_mm_load_ps(panel[b].m[jp]));
          mins[jp] = _mm512_fmadd_ps(mw, _mm512_load_ps(act[b].s), mins[jp]);  // exact product
        }
      }
    }

    __m512 acc[kWeightRows][kPairs];
    for (int j = 0; j < kWeightRows; ++j)
      for (int p = 0; p < kPairs; ++p) acc[j][p] = first ? _mm512_setzero_ps() : carry.acc[j][p];
    for (int64_t b = 0; b < nb; ++b) {
      __m512i xv[kPairs];
      for (int p = 0; p < kPairs; ++p) xv[p] = _mm512_load_si512(&act[b].x[p]);
      for (int j = 0; j < kWeightRows; ++j) {
        const __m512i wv = _mm512_load_si512(&panel[b].q[j]);
        for (int p = 0; p < kPairs; ++p) {
          __m512i dot;
          if constexpr (Format::kOffsetActivations) {
            dot = _mm512_dpbusd_epi32(_mm512_load_si512(&panel[b].init[j]), xv[p], wv);
          } else {
            dot = _mm512_dpbusd_epi32(fresh_zero(), wv, xv[p]);
          }
          const __m512 scale = _mm512_castpd_ps(_mm512_set1_pd(scales[b][j / 2][2 * p + j % 2]));
          acc[j][p] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), acc[j][p]);
        }
      }
    }

    if (!last) {
      for (int j = 0; j < kWeightRows; ++j)
        for (int p = 0; p < kPairs; ++p) carry.acc[j][p] = acc[j][p];
      carry.mins[0] = mins[0];
      carry.mins[1] = mins[1];
      return;
    }
    __m512 out[2];
    for (int jp = 0; jp < 2; ++jp) {
      __m512 a[2][4];
      for (int q = 0; q < 2; ++q)
        for (int p = 0; p < 4; ++p) a[q][p] = p < kPairs ? acc[2 * jp + q][p] : _mm512_setzero_ps();
      // hsum + mins, as QuantTile (mins is 0 for the formats without them).
      out[jp] = _mm512_add_ps(reduce_pair(a), mins[jp]);
    }
    // E order -> row-major: element 4 i + j is (activation row i, weight row j).
    alignas(64) float rows[kActRows * kWeightRows];
    for (int half = 0; half < 2; ++half) {
      const __m512i index = _mm512_load_si512(kRowMajorIndex.data() + 16 * half);
      _mm512_store_ps(rows + 16 * half, _mm512_permutex2var_ps(out[0], index, out[1]));
    }
    const __mmask8 columns = static_cast<__mmask8>((1u << n_j) - 1);
    for (int i = 0; i < NX; ++i) {
      _mm_mask_storeu_ps(y + i * ldy, columns, _mm_load_ps(rows + kWeightRows * i));
    }
  }
};

template <typename Format, int NX = kActRows>
void run_tile(int64_t n_rows, const PanelBlock<Format>* panel, const ActPanelBlock* act, int64_t nb,
              float* y, int64_t ldy, int64_t n_j, TileCarry& carry, bool first, bool last) {
  if constexpr (NX > 0) {
    if (n_rows == NX) return Tile<Format, NX>::run(panel, act, nb, y, ldy, n_j, carry, first, last);
    run_tile<Format, NX - 1>(n_rows, panel, act, nb, y, ldy, n_j, carry, first, last);
  }
}

// The DotTileFn contract (kernel_table.h) for k / 32 <= kMaxBlocks.
template <typename Format>
void gemm(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
          int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t nb = k / kQuantBlock;
  const int64_t tiles_per_chunk = std::max<int64_t>(1, kActPanelBlocks / nb);
  const int64_t n_chunks = (nb + kChunkBlocks - 1) / kChunkBlocks;
  thread_local std::vector<ActPanelBlock> act_storage;
  act_storage.resize(static_cast<size_t>(std::max(kActPanelBlocks, nb)));
  ActPanelBlock* act = act_storage.data();
  alignas(64) PanelBlock<Format> panel[kChunkBlocks];
  // Each tile's accumulators between chunks (the tiles of a pass take turns).
  thread_local std::vector<TileCarry> carries;
  carries.resize(static_cast<size_t>(tiles_per_chunk));
  for (int64_t i0 = 0; i0 < n_x; i0 += tiles_per_chunk * kActRows) {
    const int64_t n_i = std::min(n_x - i0, tiles_per_chunk * kActRows);
    const int64_t n_tiles = (n_i + kActRows - 1) / kActRows;
    for (int64_t t = 0; t < n_tiles; ++t) {
      pack_act_tile<Format>(x + (i0 + t * kActRows) * x_stride, x_stride,
                            std::min<int64_t>(kActRows, n_i - t * kActRows), nb, act + t * nb);
    }
    for (int64_t j0 = 0; j0 < n_w; j0 += kWeightRows) {
      const int64_t n_j = std::min<int64_t>(kWeightRows, n_w - j0);
      // The next group's rows, fetched while this group's tiles compute (a
      // large matrix, such as the output head, does not stay in cache).
      if (j0 + 2 * kWeightRows <= n_w) {
        const uint8_t* next = w + (j0 + kWeightRows) * w_stride;
        for (size_t offset = 0; offset < kWeightRows * w_stride; offset += 64)
          _mm_prefetch(reinterpret_cast<const char*>(next + offset), _MM_HINT_T0);
      }
      // Likewise, every 4 groups, the outputs 16 columns on (a wide output,
      // such as the logits, is not in cache either).
      if (j0 % 16 == 0 && j0 + 16 < n_w) {
        for (int64_t i = i0; i < i0 + n_i; ++i)
          _mm_prefetch(reinterpret_cast<const char*>(y + i * ldy + j0 + 16), _MM_HINT_T0);
      }
      for (int64_t c = 0; c < n_chunks; ++c) {
        const int64_t b0 = c * kChunkBlocks;
        const int64_t n_blocks = std::min(kChunkBlocks, nb - b0);
        pack_weight_group<Format>(w, w_stride, j0, n_j, b0, n_blocks, panel);
        for (int64_t t = 0; t < n_tiles; ++t) {
          const int64_t i = i0 + t * kActRows;
          run_tile<Format>(std::min<int64_t>(kActRows, n_x - i), panel, act + t * nb + b0, n_blocks,
                           y + i * ldy + j0, ldy, n_j, carries[static_cast<size_t>(t)], c == 0,
                           c + 1 == n_chunks);
        }
      }
    }
  }
}

}  // namespace gemm512
}  // namespace
}  // namespace duet::cpu

// The AVX-512 path (F/BW/VL/DQ + VNNI). Quantized dot products on the file's
// rows compute the same 8 int32 lanes per block as the AVX2 path with
// vpdpbusd, two (weight, activation) pairs per 512-bit register in prefill
// (two activation rows against one weight row) and one pair per 256-bit
// register in decode. Each
// half goes through exactly the AVX2 path's operations, so the
// results are bit-identical to it. From a few activation rows on (batched
// decode, prefill) the register-blocked GEMM of quant_gemm_avx512_inl.h takes
// over, with the same operations per pair. The attention primitives and the
// activation quantizers have 512-bit versions of their own
// (attention_avx512_inl.h, quantize_rows_avx512_inl.h); dense kernels are the
// shared 256-bit ones, compiled here with AVX-512 encodings; BF16 and the
// K-quants (x86_kquant_inl.h) use 512-bit registers for their lanes. Q4_0,
// whose order keeps one integer per block, has a GEMM of its own on the
// file's rows and groups of 8 (q4_0_gemm_avx512_inl.h) and shares the AVX2
// path's row tiles. The loader lays Q4_0, Q8_0, Q4_1 and the K-quants out by
// 16 rows for this path, whose lane-per-row kernels (quant_x16_avx512_inl.h,
// kquant_x16_avx512_inl.h) run every batch size on them.

// GCC 12 reports the _mm512_undefined_*() inside its own AVX-512 intrinsics as
// uninitialized once they are inlined (GCC bug 105593; the build already
// turns off the "maybe" form for this file). Not about our code.
#pragma GCC diagnostic ignored "-Wuninitialized"

#include "kernels/cpu/interleave.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quantize_rows_inl.h"
#include "kernels/cpu/x86/attention_avx512_inl.h"
#include "kernels/cpu/x86/kquant_x16_avx512_inl.h"
#include "kernels/cpu/x86/q4_0_gemm_avx512_inl.h"
#include "kernels/cpu/x86/quant_gemm_avx512_inl.h"
#include "kernels/cpu/x86/quant_x16_avx512_inl.h"
#include "kernels/cpu/x86/quantize_rows_avx512_inl.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"
#include "kernels/cpu/x86/x86_kquant_inl.h"

namespace duet::cpu {
namespace {

inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

inline __m512 join_scales(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

inline __m512 lane_dot2(__m256i u0, __m256i s0, __m256i u1, __m256i s1) {
  return _mm512_cvtepi32_ps(
      _mm512_dpbusd_epi32(_mm512_setzero_si512(), join(u0, u1), join(s0, s1)));
}

inline __m256 lane_dot1(__m256i u, __m256i s) {
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s));
}

inline float hsum_lo(__m512 v) { return hsum_ps(_mm512_castps512_ps256(v)); }
inline float hsum_hi(__m512 v) { return hsum_ps(_mm512_extractf32x8_ps(v, 1)); }

template <typename Format>
struct QuantTile {
  using WB = typename Format::WeightBlock;
  using XB = typename Format::ActBlock;

  // Rows of up to this many blocks (k <= 8192) use activation scales converted
  // once per call instead of once per weight row.
  static constexpr int64_t kMaxScaleBlocks = 256;

  // One weight row against one activation row, 256 bits (the odd one out).
  static float single(const WB* wb, const XB* xb, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_ahead(wb + b);
      __m256i u, s;
      Format::operands(Format::weights(wb[b]), xb[b], &u, &s);
      const float scale = half_to_float(wb[b].d) * half_to_float(xb[b].d);
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), lane_dot1(u, s), acc);
      if constexpr (Format::kHasMin) mins += Format::min_term(wb[b], xb[b]);
    }
    return hsum_ps(acc) + mins;
  }

  // single() with the activation's scales (and Q4_1 sums) already converted.
  static float single_scaled(const WB* wb, const XB* xb, const float* dx, const float* sx,
                             int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    float mins = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_ahead(wb + b);
      __m256i u, s;
      Format::operands(Format::weights(wb[b]), xb[b], &u, &s);
      const float scale = half_to_float(wb[b].d) * dx[b];
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scale), lane_dot1(u, s), acc);
      if constexpr (Format::kHasMin) mins += half_to_float(wb[b].m) * sx[b];
    }
    return hsum_ps(acc) + mins;
  }

  // Activation blocks x0 and x1 (of two rows) against one weight block's
  // quants `wq`: the two 8-lane integer dot products, x0's in the low half.
  static __m512 pair_dot(__m256i wq, const XB& x0, const XB& x1) {
    __m256i u0, s0, u1, s1;
    Format::operands(wq, x0, &u0, &s0);
    Format::operands(wq, x1, &u1, &s1);
    return lane_dot2(u0, s0, u1, s1);
  }

  // Decode shape: one weight row after the other, so the weights stream
  // through memory in order (interleaving rows measured slower here); the
  // activation's scales are converted once for all rows.
  static void one_row(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, int64_t k,
                      float* y) {
    const int64_t nb = k / kQuantBlock;
    const auto* xb = reinterpret_cast<const XB*>(x);
    if (nb > kMaxScaleBlocks) {
      for (int64_t j = 0; j < n_w; ++j)
        y[j] = single(reinterpret_cast<const WB*>(w + j * w_stride), xb, nb);
      return;
    }
    float dx[kMaxScaleBlocks];
    float sx[kMaxScaleBlocks];
    for (int64_t b = 0; b < nb; ++b) {
      dx[b] = half_to_float(xb[b].d);
      if constexpr (Format::kHasMin) sx[b] = half_to_float(xb[b].s);
    }
    for (int64_t j = 0; j < n_w; ++j)
      y[j] = single_scaled(reinterpret_cast<const WB*>(w + j * w_stride), xb, dx, sx, nb);
  }

  // Prefill shape: one weight row against pairs of activation rows.

  template <int NX>
  struct Tile {
    // Scales converted per weight row: for rows longer than kMaxScaleBlocks blocks.
    static void run_direct(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                           size_t x_stride, int64_t k, float* y, int64_t ldy) {
      constexpr int kPairs = NX / 2;
      const int64_t nb = k / kQuantBlock;
      for (int64_t j = 0; j < n_w; ++j) {
        const auto* wb = reinterpret_cast<const WB*>(w + j * w_stride);
        __m512 acc[kPairs];
        float mins[NX];
        for (int p = 0; p < kPairs; ++p) acc[p] = _mm512_setzero_ps();
        for (int r = 0; r < NX; ++r) mins[r] = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const __m256i wq = Format::weights(wb[b]);
          const float dw = half_to_float(wb[b].d);
          for (int p = 0; p < kPairs; ++p) {
            const XB& x0 = reinterpret_cast<const XB*>(x + (2 * p) * x_stride)[b];
            const XB& x1 = reinterpret_cast<const XB*>(x + (2 * p + 1) * x_stride)[b];
            const __m512 scale = join_scales(dw * half_to_float(x0.d), dw * half_to_float(x1.d));
            acc[p] = _mm512_fmadd_ps(scale, pair_dot(wq, x0, x1), acc[p]);
            if constexpr (Format::kHasMin) {
              mins[2 * p] += Format::min_term(wb[b], x0);
              mins[2 * p + 1] += Format::min_term(wb[b], x1);
            }
          }
        }
        for (int p = 0; p < kPairs; ++p) {
          y[(2 * p) * ldy + j] = hsum_lo(acc[p]) + mins[2 * p];
          y[(2 * p + 1) * ldy + j] = hsum_hi(acc[p]) + mins[2 * p + 1];
        }
        if constexpr (NX % 2 == 1) {
          y[(NX - 1) * ldy + j] =
              single(wb, reinterpret_cast<const XB*>(x + (NX - 1) * x_stride), nb);
        }
      }
    }

    static void run(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                    size_t x_stride, int64_t k, float* y, int64_t ldy) {
      if constexpr (NX == 1) {
        one_row(w, w_stride, n_w, x, k, y);
      } else {
        constexpr int kPairs = NX / 2;
        const int64_t nb = k / kQuantBlock;
        if (nb > kMaxScaleBlocks) return run_direct(w, w_stride, n_w, x, x_stride, k, y, ldy);
        // The activations' scales, converted once for all weight rows: per
        // block every row's d (8 KiB at most, beside the activation rows in
        // L1; a copy widened per pair, 16 lanes, took 4 times that and
        // spilled to L2 from 4 rows on) and its Q8_1 sum s (Q4_1 only).
        // Per block and weight row, dw times the 8 d's is one multiply, and
        // each pair's 16 lanes {dw dx0 x8, dw dx1 x8} a permutation of it:
        // the same IEEE products as run_direct's, lane for lane.
        alignas(32) float dx[kMaxScaleBlocks][8];
        alignas(32) float sx[kMaxScaleBlocks][8];
        for (int64_t b = 0; b < nb; ++b) {
          for (int r = 0; r < 8; ++r) {
            const XB* row = reinterpret_cast<const XB*>(x + r * x_stride);
            dx[b][r] = r < NX ? half_to_float(row[b].d) : 0.0f;
            if constexpr (Format::kHasMin) sx[b][r] = r < NX ? half_to_float(row[b].s) : 0.0f;
          }
        }
        __m512i pair_lanes[kPairs];
        for (int p = 0; p < kPairs; ++p) {
          pair_lanes[p] =
              _mm512_inserti64x4(_mm512_set1_epi32(2 * p), _mm256_set1_epi32(2 * p + 1), 1);
        }
        for (int64_t j = 0; j < n_w; ++j) {
          const auto* wb = reinterpret_cast<const WB*>(w + j * w_stride);
          __m512 acc[kPairs];
          __m256 mins = _mm256_setzero_ps();
          for (int p = 0; p < kPairs; ++p) acc[p] = _mm512_setzero_ps();
          for (int64_t b = 0; b < nb; ++b) {
            prefetch_ahead(wb + b);
            const __m256i wq = Format::weights(wb[b]);
            const __m512 scales = _mm512_zextps256_ps512(
                _mm256_mul_ps(_mm256_set1_ps(half_to_float(wb[b].d)), _mm256_load_ps(dx[b])));
            for (int p = 0; p < kPairs; ++p) {
              const XB& x0 = reinterpret_cast<const XB*>(x + (2 * p) * x_stride)[b];
              const XB& x1 = reinterpret_cast<const XB*>(x + (2 * p + 1) * x_stride)[b];
              acc[p] = _mm512_fmadd_ps(_mm512_permutexvar_ps(pair_lanes[p], scales),
                                       pair_dot(wq, x0, x1), acc[p]);
            }
            if constexpr (Format::kHasMin) {
              const __m256 mw = _mm256_set1_ps(half_to_float(wb[b].m));
              mins = _mm256_add_ps(mins, _mm256_mul_ps(mw, _mm256_load_ps(sx[b])));
            }
          }
          alignas(32) float min_lanes[8];
          _mm256_store_ps(min_lanes, mins);
          for (int p = 0; p < kPairs; ++p) {
            y[(2 * p) * ldy + j] = hsum_lo(acc[p]) + min_lanes[2 * p];
            y[(2 * p + 1) * ldy + j] = hsum_hi(acc[p]) + min_lanes[2 * p + 1];
          }
          if constexpr (NX % 2 == 1) {
            y[(NX - 1) * ldy + j] =
                single(wb, reinterpret_cast<const XB*>(x + (NX - 1) * x_stride), nb);
          }
        }
      }
    }
  };
};

// Activation rows per prefill tile: four 512-bit pair accumulators.
constexpr int kQuantRowTile = 8;
// From this many activation rows on, the register-blocked GEMM
// (quant_gemm_avx512_inl.h) runs instead of the tiles above: below, preparing
// its weight panels costs more than it saves (measured with
// duet-matmul-bench, 576 x 1536, and for the signed formats at the 8B gate
// shape, 1 thread, Zen 4: Q8_0 at 8 rows 10.2 ms in one Tile<8> against
// 12.8 in the GEMM, at 16 rows 20.0 in two against 18.0; Q5_0 at 8 rows 11.9
// against 12.6).
constexpr int64_t kGemmMinRowsQ4_1 = 3;
constexpr int64_t kGemmMinRowsSymmetric = 9;

template <int NX>
using Q8_0Tile = QuantTile<Q8_0Format>::Tile<NX>;
template <int NX>
using Q4_1Tile = QuantTile<Q4_1Format>::Tile<NX>;
template <int NX>
using Q5_0Tile = QuantTile<Q5_0Format>::Tile<NX>;

template <typename GemmFormat, template <int> class Tile>
void dot_quant(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
               int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t min_rows =
      GemmFormat::kOffsetActivations ? kGemmMinRowsSymmetric : kGemmMinRowsQ4_1;
  if (n_x >= min_rows && k / kQuantBlock <= gemm512::kMaxBlocks) {
    gemm512::gemm<GemmFormat>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  } else {
    run_row_tiles<Tile, kQuantRowTile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  }
}

void dot_q8_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm512::Q8_0Gemm, Q8_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// Q4_0 in the file's rows (a matrix whose rows fill no group of 16 or 8):
// the tiled VNNI GEMM (q4_0_gemm_avx512_inl.h) from kGemmMinRowsQ4_0
// activation rows on, the shared 256-bit row tiles below; at 5 rows the two
// are level (duet-matmul-bench, 8B gate shape, Zen 4).
constexpr int64_t kGemmMinRowsQ4_0 = 5;

void dot_q4_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  if (n_x >= kGemmMinRowsQ4_0) {
    q40x512::gemm<q40x512::Layout::kRows>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  } else {
    run_row_tiles<Q4_0RowTile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  }
}

// Q5_0 (most of a Gemma 3 Q4_K_M file, and Q4_K's fallback type): the
// signed formats' GEMM, its weights 5-bit.
void dot_q5_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm512::Q5_0Gemm, Q5_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_1(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm512::Q4_1Gemm, Q4_1Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// Q4_0 interleaved by 8 (AVX2's layout; this path lays it out by 16): decode
// runs the AVX2 path's kernel (the contract's order makes its bits this
// path's); the GEMM packs its panels straight from the groups.
void dot_q4_0x8(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                int64_t n_x, int64_t k, float* y, int64_t ldy) {
  if (n_x >= kGemmMinRowsQ4_0) {
    q40x512::gemm<q40x512::Layout::kBy8>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  } else {
    avx2_kernel_table().dot_q4_0x8(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  }
}

// Q4_0 by 16 rows: the lane-per-row tiles (quant_x16_avx512_inl.h) for
// every batch size. They beat q4_0_gemm_avx512_inl.h's packed panels from 16
// activation rows up (Zen 5, 2 threads, duet-matmul-bench's 8B shapes:
// 1.41-1.44 against 1.26-1.28 TFLOP/s at 32 rows and k = 4096, 1.42-1.45
// against 1.11-1.18 at k = 14336, level or better at 512 rows).
void dot_q4_0x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  q40x16::dot(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// ggml's 16-lane exponential, lane for lane the same as ggml_expf().
inline __m512 expf16(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 z = _mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r);
  const __m512 n = _mm512_sub_ps(z, r);
  const __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __mmask16 saturate = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192), _CMP_GT_OQ);
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(
          _mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
          _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
  const __m512 result = _mm512_scalef_ps(j, n);
  if (_mm512_kortestz(saturate, saturate)) return result;
  const __m512 zero = _mm512_setzero_ps();
  const __m512 limit =
      _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, zero, _CMP_LE_OQ), _mm512_set1_ps(INFINITY), zero);
  return _mm512_mask_blend_ps(saturate, result, limit);
}

double softmax_exp_avx512(const float* x, int64_t n, float max, float* y) {
  double sum = 0.0;
  const __m512 m = _mm512_set1_ps(max);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    // Lanes past n count as exp(-inf) = 0, as llama.cpp's masked columns do.
    const __m512 xv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, x + i);
    const __m512 e = expf16(_mm512_sub_ps(xv, m));
    _mm512_mask_storeu_ps(y + i, valid, e);
    sum += static_cast<double>(tree_sum16(_mm512_castps512_ps256(e), _mm512_extractf32x8_ps(e, 1)));
  }
  return sum;
}

void scale_round_f16_avx512(float* x, int64_t n, float factor) {
  const __m512 f = _mm512_set1_ps(factor);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, x + i), f);
    _mm512_mask_storeu_ps(x + i, valid,
                          _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
  }
}

void silu_mul_avx512(const float* x, const float* g, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    const __m512 e = expf16(_mm512_sub_ps(_mm512_setzero_ps(), xv));
    const __m512 silu = _mm512_div_ps(xv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(silu, _mm512_loadu_ps(g + i)));
  }
  for (; i < n; ++i) out[i] = x[i] / (1.0f + ggml_expf(-x[i])) * g[i];
}

constexpr KernelTable kAvx512Table = {
    .isa = Isa::kAvx512,
    .quantize_q8_0 = quantize_rows_q8_0_avx512,
    .quantize_q8_1 = quantize_rows_q8_1_avx512,
    .quantize_q8_k = quantize_rows_q8_k_inl,
    .convert_f16 = convert_f16_avx,
    .convert_bf16 = convert_rows_bf16_inl,
    .dot_f32 = dot_f32_avx,
    .dot_f16 = dot_f16_avx,
    .dot_q8_0 = dot_q8_0,
    .dot_q4_0 = dot_q4_0,
    .dot_q4_1 = dot_q4_1,
    .dot_q5_0 = dot_q5_0,
    .dot_bf16 = dot_bf16_x86,
    .dot_q4_k = dot_q4_k_x86,
    .dot_q5_k = dot_q5_k_x86,
    .dot_q6_k = dot_q6_k_x86,
    .dot_q4_0x8 = dot_q4_0x8,
    .interleave_q4_0 = true,
    .dot_q4_0x16 = dot_q4_0x16,
    .interleave_q4_0_by_16 = true,
    .dot_q4_kx16 = q4kx16::dot,
    .interleave_q4_k = true,
    .dot_q6_kx16 = q6kx16::dot,
    .interleave_q6_k = true,
    .dot_q8_0x16 = q80x16::dot,
    .interleave_q8_0 = true,
    .dot_q4_1x16 = q41x16::dot,
    .interleave_q4_1 = true,
    .kq_scores = attention512::kq_scores,
    .kqv_sum = attention512::kqv_sum,
    .softmax_exp = softmax_exp_avx512,
    .dot_f32_lanes = dot_f32_lanes_avx,
    .silu_mul = silu_mul_avx512,
    .scale_round_f16 = scale_round_f16_avx512,
    .kqv_sum_tile = attention512::kqv_sum_tile,
};

}  // namespace

const KernelTable& avx512_kernel_table() { return kAvx512Table; }

}  // namespace duet::cpu

// The AVX2 path (AVX2 + FMA + F16C). Integer block dot products use maddubs
// (u8 x i8 -> i16 pairs) and madd (-> i32 lanes), one block per step: row
// tiles below for few activation rows, the register-blocked GEMM of
// quant_gemm_avx2_inl.h from a few on (the same operations per pair). BF16 and
// the K-quants are in x86_kquant_inl.h.
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quantize_rows_inl.h"
#include "kernels/cpu/x86/quant_gemm_avx2_inl.h"
#include "kernels/cpu/x86/x86_kernels_inl.h"
#include "kernels/cpu/x86/x86_kquant_inl.h"

namespace duet::cpu {
namespace {

template <typename Format>
struct QuantTile {
  template <int NX>
  struct Tile {
    static void run(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x,
                    size_t x_stride, int64_t k, float* y, int64_t ldy) {
      using WB = typename Format::WeightBlock;
      using XB = typename Format::ActBlock;
      const int64_t nb = k / kQuantBlock;
      for (int64_t j = 0; j < n_w; ++j) {
        const auto* wb = reinterpret_cast<const WB*>(w + j * w_stride);
        __m256 acc[NX];
        float mins[NX];
        for (int r = 0; r < NX; ++r) {
          acc[r] = _mm256_setzero_ps();
          mins[r] = 0.0f;
        }
        for (int64_t b = 0; b < nb; ++b) {
          prefetch_ahead(wb + b);
          const __m256i wq = Format::weights(wb[b]);
          const float dw = half_to_float(wb[b].d);
          for (int r = 0; r < NX; ++r) {
            const XB& xb = reinterpret_cast<const XB*>(x + r * x_stride)[b];
            __m256i u, s;
            Format::operands(wq, xb, &u, &s);
            const __m256 p = _mm256_cvtepi32_ps(lane_sums(u, s));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * half_to_float(xb.d)), p, acc[r]);
            if constexpr (Format::kHasMin) mins[r] += Format::min_term(wb[b], xb);
          }
        }
        for (int r = 0; r < NX; ++r) y[r * ldy + j] = hsum_ps(acc[r]) + mins[r];
      }
    }
  };
};

template <int NX>
using Q8_0Tile = QuantTile<Q8_0Format>::Tile<NX>;
template <int NX>
using Q4_0Tile = Q4_0RowTile<NX>;
template <int NX>
using Q4_1Tile = QuantTile<Q4_1Format>::Tile<NX>;
template <int NX>
using Q5_0Tile = QuantTile<Q5_0Format>::Tile<NX>;

// From this many activation rows on, the register-blocked GEMM
// (quant_gemm_avx2_inl.h) runs instead of the row tiles: below, preparing its
// weight panels costs more than it saves (duet-matmul-bench, 576 x 1536). The
// signed formats prepare two operands per weight block.
constexpr int64_t kGemmMinRowsQ4_1 = 3;
constexpr int64_t kGemmMinRowsSymmetric = 6;

template <typename GemmFormat, template <int> class Tile>
void dot_quant(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
               int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t min_rows = GemmFormat::kSigned ? kGemmMinRowsSymmetric : kGemmMinRowsQ4_1;
  if (n_x >= min_rows) {
    gemm256::gemm<GemmFormat>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  } else {
    run_row_tiles<Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
  }
}

void dot_q8_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm256::Q8_0Gemm, Q8_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm256::Q4_0Gemm, Q4_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// Q5_0 (most of a Gemma 3 Q4_K_M file, and Q4_K's fallback type): the
// signed formats' GEMM, its weights 5-bit.
void dot_q5_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm256::Q5_0Gemm, Q5_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_1(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_quant<gemm256::Q4_1Gemm, Q4_1Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// Decode on interleaved Q4_0 (interleave.h): the 8 rows of a group at once,
// one sequential stream. Each row's integer is nibbles . x - 8 * (the sum of
// x), the same as the row tiles' |w| . (x with the sign of w) (no operand
// saturates maddubs either way), with two rows' weights per load; the 8
// rows' totals land in the 8 lanes of one register, whose float step
// (kernel_table.h) is one FMA per block for all 8.
// Asking for every line (a block is 144 bytes: 3 lines) 4 KiB ahead lets it
// stream at its in-cache speed, about 19.5 GB/s on a Zen 3 core (13 without).

// NX activation rows (NX <= 4) against every group: the weights unpacked
// once per block for all of them.
template <int NX>
void gemv_q4_0x8(const uint8_t* w, int64_t n_w, const uint8_t* x, size_t x_stride, int64_t k,
                 float* y, int64_t ldy) {
  const int64_t nb = k / kQuantBlock;
  const BlockQ8_0* xr[NX];
  for (int r = 0; r < NX; ++r) xr[r] = reinterpret_cast<const BlockQ8_0*>(x + r * x_stride);
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
  const __m256i eights = _mm256_set1_epi8(8);
  for (int64_t g = 0; g < n_w / kInterleavedRows; ++g) {
    const auto* wb = reinterpret_cast<const BlockQ4_0x8*>(w) + g * nb;
    __m256 acc[NX];
    for (__m256& a : acc) a = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_ahead(wb + b);
      __m256i q[kInterleavedRows];
      for (int p = 0; p < kInterleavedRows / 2; ++p) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb[b].qs[p]));
        q[2 * p] = _mm256_and_si256(both, low_nibbles);
        q[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(both, 4), low_nibbles);
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb[b].d)));
      for (int r = 0; r < NX; ++r) {
        const __m256i xq = load_i8x32(xr[r][b].qs);
        const __m256i correction = lane_sums(eights, xq);
        __m256i lanes[kInterleavedRows];
        for (int i = 0; i < kInterleavedRows; ++i) {
          lanes[i] = _mm256_sub_epi32(lane_sums(q[i], xq), correction);
        }
        const __m256 scales = _mm256_mul_ps(dw, _mm256_set1_ps(half_to_float(xr[r][b].d)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum_lanes8(lanes)), scales, acc[r]);
      }
    }
    for (int r = 0; r < NX; ++r) _mm256_storeu_ps(y + r * ldy + g * kInterleavedRows, acc[r]);
  }
}

constexpr int kGemvRows = 4;

template <int NX = kGemvRows>
void gemv_rows(int64_t n_rows, const uint8_t* w, int64_t n_w, const uint8_t* x, size_t x_stride,
               int64_t k, float* y, int64_t ldy) {
  if constexpr (NX > 0) {
    if (n_rows == NX) return gemv_q4_0x8<NX>(w, n_w, x, x_stride, k, y, ldy);
    gemv_rows<NX - 1>(n_rows, w, n_w, x, x_stride, k, y, ldy);
  }
}

void dot_q4_0x8(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                int64_t n_x, int64_t k, float* y, int64_t ldy) {
  if (n_x >= kGemmMinRowsSymmetric) {
    gemm256::gemm<gemm256::Q4_0x8Gemm>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
    return;
  }
  for (int64_t i = 0; i < n_x; i += kGemvRows) {
    gemv_rows(std::min<int64_t>(kGemvRows, n_x - i), w, n_w, x + i * x_stride, x_stride, k,
              y + i * ldy, ldy);
  }
}

// Q4_0 by 16 rows and interleaved Q4_K, Q6_K, Q8_0 and Q4_1 (laid out so
// only for the AVX-512 path; this path runs them when asked, by rows).
void dot_q4_0x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_0, WeightLayout::kInterleaved16, dot_q4_0, w, w_stride, n_w, x,
                          x_stride, n_x, k, y, ldy);
}

void dot_q4_kx16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_K, WeightLayout::kInterleaved, dot_q4_k_x86, w, w_stride, n_w,
                          x, x_stride, n_x, k, y, ldy);
}

void dot_q6_kx16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ6_K, WeightLayout::kInterleaved, dot_q6_k_x86, w, w_stride, n_w,
                          x, x_stride, n_x, k, y, ldy);
}

void dot_q8_0x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ8_0, WeightLayout::kInterleaved, dot_q8_0, w, w_stride, n_w, x,
                          x_stride, n_x, k, y, ldy);
}

void dot_q4_1x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_1, WeightLayout::kInterleaved, dot_q4_1, w, w_stride, n_w, x,
                          x_stride, n_x, k, y, ldy);
}

// The elementwise 16-lane tree over g[s] (lane_tree_sum16's order).
inline __m256 tree_sum16_elementwise(const __m256* g) {
  __m256 a[8], b[4];
  for (int l = 0; l < 8; ++l) a[l] = _mm256_add_ps(g[l + 8], g[l]);
  for (int l = 0; l < 4; ++l) b[l] = _mm256_add_ps(a[l + 4], a[l]);
  return _mm256_add_ps(_mm256_add_ps(b[0], b[2]), _mm256_add_ps(b[1], b[3]));
}

// The (group, slot) chains of slots s and s + 1 for d in [d0, d0 + 8 kVecs):
// acc = fma(v, p, acc) over the rows first, first + step, .. (slot s) and the
// rows after them (slot s + 1, which may have one row fewer, never more), in
// order; the two slots interleaved so that the chains overlap.
template <int kVecs>
inline void kqv_chains(const float* p, const uint16_t* const* segments, int64_t n_keys, int64_t dim,
                       int64_t first, int64_t step, int64_t d0, __m256 (&out0)[kVecs],
                       __m256 (&out1)[kVecs]) {
  __m256 acc0[kVecs], acc1[kVecs];
  for (int c = 0; c < kVecs; ++c) acc0[c] = acc1[c] = _mm256_setzero_ps();
  auto row = [&](int64_t t, __m256(&acc)[kVecs]) {
    const uint16_t* v = segments[t / 16] + t % 16 * dim + d0;
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int c = 0; c < kVecs; ++c) acc[c] = _mm256_fmadd_ps(load_half8(v + 8 * c), pt, acc[c]);
  };
  int64_t t = first;
  for (; t + 1 < n_keys; t += step) {
    row(t, acc0);
    row(t + 1, acc1);
  }
  if (t < n_keys) row(t, acc0);
  for (int c = 0; c < kVecs; ++c) {
    out0[c] = acc0[c];
    out1[c] = acc1[c];
  }
}

// kqv_sum of one query head for d in [d0, d0 + 8 kVecs).
template <int kVecs>
void kqv_sum_chunk(const float* p, const uint16_t* const* segments, int64_t n_keys, int64_t dim,
                   int groups, int64_t d0, float* out) {
  __m256 g[16][kVecs];
  for (int s = 0; s < 16; s += 2) {
    if (groups == 1) {
      kqv_chains<kVecs>(p, segments, n_keys, dim, s, 16, d0, g[s], g[s + 1]);
      continue;
    }
    // (g0 + g2) + (g1 + g3), for slots s and s + 1.
    __m256 a[2][kVecs], b[2][kVecs];
    kqv_chains<kVecs>(p, segments, n_keys, dim, s, 64, d0, a[0], a[1]);
    kqv_chains<kVecs>(p, segments, n_keys, dim, 32 + s, 64, d0, b[0], b[1]);
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < kVecs; ++c) g[s + i][c] = _mm256_add_ps(a[i][c], b[i][c]);
    kqv_chains<kVecs>(p, segments, n_keys, dim, 16 + s, 64, d0, a[0], a[1]);
    kqv_chains<kVecs>(p, segments, n_keys, dim, 48 + s, 64, d0, b[0], b[1]);
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < kVecs; ++c)
        g[s + i][c] = _mm256_add_ps(g[s + i][c], _mm256_add_ps(a[i][c], b[i][c]));
  }
  for (int c = 0; c < kVecs; ++c) {
    __m256 column[16];
    for (int s = 0; s < 16; ++s) column[s] = g[s][c];
    _mm256_storeu_ps(out + d0 + 8 * c, tree_sum16_elementwise(column));
  }
}

// kqv_sum: 32 values of d at a time, then 8, then one by one.
void kqv_sum_avx2(const float* p, int64_t ld_p, int64_t n_q, const uint16_t* const* segments,
                  int64_t n_keys, int64_t dim, int groups, float* out) {
  for (int64_t h = 0; h < n_q; ++h) {
    const float* ph = p + h * ld_p;
    float* oh = out + h * dim;
    int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32) kqv_sum_chunk<4>(ph, segments, n_keys, dim, groups, d0, oh);
    for (; d0 + 8 <= dim; d0 += 8) kqv_sum_chunk<1>(ph, segments, n_keys, dim, groups, d0, oh);
    for (; d0 < dim; ++d0) oh[d0] = kqv_sum_at(ph, segments, n_keys, dim, groups, d0);
  }
}

double softmax_exp_avx2(const float* x, int64_t n, float max, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i += 16) {
    float chunk[16] = {};
    for (int64_t l = 0; l < 16 && i + l < n; ++l) chunk[l] = y[i + l] = ggml_expf(x[i + l] - max);
    sum += static_cast<double>(tree_sum16(_mm256_loadu_ps(chunk), _mm256_loadu_ps(chunk + 8)));
  }
  return sum;
}

void silu_mul_avx2(const float* x, const float* g, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / (1.0f + ggml_expf(-x[i])) * g[i];
}

void scale_round_f16_avx(float* x, int64_t n, float factor) {
  const __m256 f = _mm256_set1_ps(factor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), f);
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT)));
  }
  for (; i < n; ++i) x[i] = fp16_to_fp32(fp32_to_fp16(x[i] * factor));
}

constexpr KernelTable kAvx2Table = {
    .isa = Isa::kAvx2,
    .quantize_q8_0 = quantize_rows_q8_0_inl,
    .quantize_q8_1 = quantize_rows_q8_1_inl,
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
    .interleave_q4_0_by_16 = false,
    .dot_q4_kx16 = dot_q4_kx16,
    .interleave_q4_k = false,
    .dot_q6_kx16 = dot_q6_kx16,
    .interleave_q6_k = false,
    .dot_q8_0x16 = dot_q8_0x16,
    .interleave_q8_0 = false,
    .dot_q4_1x16 = dot_q4_1x16,
    .interleave_q4_1 = false,
    .kq_scores = kq_scores_avx,
    .kqv_sum = kqv_sum_avx2,
    .softmax_exp = softmax_exp_avx2,
    .dot_f32_lanes = dot_f32_lanes_avx,
    .silu_mul = silu_mul_avx2,
    .scale_round_f16 = scale_round_f16_avx,
};

}  // namespace

const KernelTable& avx2_kernel_table() { return kAvx2Table; }

}  // namespace duet::cpu

// The AVX2 path (AVX2 + FMA + F16C). Integer block dot products use maddubs
// (u8 x i8 -> i16 pairs) and madd (-> i32 lanes), one block per step; BF16 and
// the K-quants are in x86_kquant_inl.h.
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/quantize_rows_inl.h"
#include "kernels/cpu/x86_kernels_inl.h"
#include "kernels/cpu/x86_kquant_inl.h"

namespace duet::cpu {
namespace {

inline __m256i lane_dot(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

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
          const __m256i wq = Format::weights(wb[b]);
          const float dw = half_to_float(wb[b].d);
          for (int r = 0; r < NX; ++r) {
            const XB& xb = reinterpret_cast<const XB*>(x + r * x_stride)[b];
            __m256i u, s;
            Format::operands(wq, xb, &u, &s);
            const __m256 p = _mm256_cvtepi32_ps(lane_dot(u, s));
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
using Q4_0Tile = QuantTile<Q4_0Format>::Tile<NX>;
template <int NX>
using Q4_1Tile = QuantTile<Q4_1Format>::Tile<NX>;

void dot_q8_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  run_row_tiles<Q8_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_0(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  run_row_tiles<Q4_0Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_1(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  run_row_tiles<Q4_1Tile>(w, w_stride, n_w, x, x_stride, n_x, k, y, ldy);
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
    .dot_bf16 = dot_bf16_x86,
    .dot_q4_k = dot_q4_k_x86,
    .dot_q6_k = dot_q6_k_x86,
    .kq_scores = kq_scores_avx,
    .kqv_accumulate = kqv_accumulate_avx,
    .softmax_exp = softmax_exp_avx2,
    .silu_mul = silu_mul_avx2,
    .round_f16 = round_f16_avx,
};

}  // namespace

const KernelTable& avx2_kernel_table() { return kAvx2Table; }

}  // namespace duet::cpu

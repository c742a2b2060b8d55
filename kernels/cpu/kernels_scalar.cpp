// The portable path: plain C++ that any compiler and CPU runs. It computes the
// same integer block sums as the SIMD paths, accumulating in a fixed order.
#include <cmath>
#include <cstring>

#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/lane_math.h"
#include "kernels/cpu/quantize.h"

namespace duet::cpu {
namespace {

float dot_row_f32(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* a = reinterpret_cast<const float*>(w);
  const auto* b = reinterpret_cast<const float*>(x);
  float sum = 0.0f;
  for (int64_t i = 0; i < k; ++i) sum += a[i] * b[i];
  return sum;
}

float dot_row_f16(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* a = reinterpret_cast<const uint16_t*>(w);
  const auto* b = reinterpret_cast<const uint16_t*>(x);
  float sum = 0.0f;
  for (int64_t i = 0; i < k; ++i) sum += fp16_to_fp32(a[i]) * fp16_to_fp32(b[i]);
  return sum;
}

// The quantized dot products in the SIMD paths' order: per block, 8 int32
// lanes (lane l sums elements 4l..4l+3), each added to its float lane as
// fma(scale, lane, acc); the lanes summed as (l, l+4), then (0+2)+(1+3).
float sum_lanes8(const float* acc) {
  float c[4];
  for (int l = 0; l < 4; ++l) c[l] = acc[l] + acc[l + 4];
  return (c[0] + c[2]) + (c[1] + c[3]);
}

template <typename WeightAt>
void accumulate_block(WeightAt weight_at, const int8_t* x, float scale, float* acc) {
  for (int l = 0; l < 8; ++l) {
    int32_t lane = 0;
    for (int e = 4 * l; e < 4 * l + 4; ++e) lane += weight_at(e) * x[e];
    acc[l] = std::fma(scale, static_cast<float>(lane), acc[l]);
  }
}

float dot_row_q8_0(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* wb = reinterpret_cast<const BlockQ8_0*>(w);
  const auto* xb = reinterpret_cast<const BlockQ8_0*>(x);
  float acc[8] = {};
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float scale = fp16_to_fp32(wb[b].d) * fp16_to_fp32(xb[b].d);
    accumulate_block([&](int e) { return static_cast<int32_t>(wb[b].qs[e]); }, xb[b].qs, scale,
                     acc);
  }
  return sum_lanes8(acc);
}

inline int32_t nibble(const uint8_t* qs, int e) {
  return e < kQuantBlock / 2 ? (qs[e] & 0x0f) : (qs[e - kQuantBlock / 2] >> 4);
}

// Q4_0 keeps one exact integer per block (kernel_table.h): y = fma(S, d_w d_x, y).
float dot_row_q4_0(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* wb = reinterpret_cast<const BlockQ4_0*>(w);
  const auto* xb = reinterpret_cast<const BlockQ8_0*>(x);
  float y = 0.0f;
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    int32_t sum = 0;
    for (int e = 0; e < kQuantBlock; ++e) sum += (nibble(wb[b].qs, e) - 8) * xb[b].qs[e];
    const float scale = fp16_to_fp32(wb[b].d) * fp16_to_fp32(xb[b].d);
    y = std::fma(static_cast<float>(sum), scale, y);
  }
  return y;
}

float dot_row_q5_0(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* wb = reinterpret_cast<const BlockQ5_0*>(w);
  const auto* xb = reinterpret_cast<const BlockQ8_0*>(x);
  float acc[8] = {};
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float scale = fp16_to_fp32(wb[b].d) * fp16_to_fp32(xb[b].d);
    uint32_t qh;
    std::memcpy(&qh, wb[b].qh, sizeof qh);
    accumulate_block(
        [&](int e) {
          return (nibble(wb[b].qs, e) | static_cast<int32_t>((qh >> e) & 1) << 4) - 16;
        },
        xb[b].qs, scale, acc);
  }
  return sum_lanes8(acc);
}

float dot_row_q4_1(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* wb = reinterpret_cast<const BlockQ4_1*>(w);
  const auto* xb = reinterpret_cast<const BlockQ8_1*>(x);
  float acc[8] = {};
  float mins = 0.0f;
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float scale = fp16_to_fp32(wb[b].d) * fp16_to_fp32(xb[b].d);
    accumulate_block([&](int e) { return nibble(wb[b].qs, e); }, xb[b].qs, scale, acc);
    mins += fp16_to_fp32(wb[b].m) * fp16_to_fp32(xb[b].s);
  }
  return sum_lanes8(acc) + mins;
}

// BF16 in vdpbf16ps's order (kernel_table.h): 16 lanes per 32-element chunk.
float dot_row_bf16(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* a = reinterpret_cast<const uint16_t*>(w);
  const auto* b = reinterpret_cast<const uint16_t*>(x);
  float acc[16] = {};
  const int64_t k32 = k - k % 32;
  for (int64_t c = 0; c < k32; c += 32) {
    for (int l = 0; l < 16; ++l) {
      const int64_t odd = c + 2 * l + 1, even = c + 2 * l;
      acc[l] = std::fma(bf16_to_fp32(a[odd]), bf16_to_fp32(b[odd]), acc[l]);
      acc[l] = std::fma(bf16_to_fp32(a[even]), bf16_to_fp32(b[even]), acc[l]);
    }
  }
  float sum = lane_tree_sum16(acc);
  for (int64_t e = k32; e < k; ++e) sum = std::fma(bf16_to_fp32(a[e]), bf16_to_fp32(b[e]), sum);
  return sum;
}

// The integer dot of q with x over elements [begin, end) of a super-block.
template <typename WeightAt>
int32_t int_dot(WeightAt weight_at, const int8_t* x, int begin, int end) {
  int32_t dot = 0;
  for (int e = begin; e < end; ++e) dot += weight_at(e) * x[e];
  return dot;
}

// The 4-bit value (0..15) of Q4_K element e: group e / 64, low nibbles first.
inline int32_t q4_k_at(const BlockQ4_K& b, int e) {
  const int g = e / 64, r = e % 64;
  return r < 32 ? (b.qs[32 * g + r] & 0x0f) : (b.qs[32 * g + r - 32] >> 4);
}

// The 5-bit value (0..31) of Q5_K element e: Q4_K's nibble and bit e / 32 of qh[e % 32].
inline int32_t q5_k_at(const BlockQ5_K& b, int e) {
  const int g = e / 64, r = e % 64;
  const int32_t low = r < 32 ? (b.qs[32 * g + r] & 0x0f) : (b.qs[32 * g + r - 32] >> 4);
  return low | (((b.qh[e % 32] >> (e / 32)) & 1) << 4);
}

// Q6_K element e, signed (the stored 6-bit value minus 32).
inline int32_t q6_k_at(const BlockQ6_K& b, int e) {
  const int h = e / 128, part = (e % 128) / 32, l = e % 32;
  const uint8_t low = b.ql[64 * h + 32 * (part & 1) + l];
  const int32_t low4 = part < 2 ? (low & 0x0f) : (low >> 4);
  return (low4 | (((b.qh[32 * h + l] >> (2 * part)) & 3) << 4)) - 32;
}

// The K-quants' float steps for one super-block (kernel_table.h).
inline float kquant_step(int32_t s, int32_t m, float d_w, float dmin_w, float d_x, float y) {
  float r = static_cast<float>(s) * d_w;
  r = std::fma(-dmin_w, static_cast<float>(m), r);
  return std::fma(r, d_x, y);
}

// Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins.
template <typename Block, int32_t (*kAt)(const Block&, int)>
float dot_row_q45_k(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* wb = reinterpret_cast<const Block*>(w);
  const auto* xb = reinterpret_cast<const BlockQ8_K*>(x);
  float y = 0.0f;
  for (int64_t b = 0; b < k / kSuperBlock; ++b) {
    int32_t s_sum = 0, m_sum = 0;
    for (int s = 0; s < 8; ++s) {
      uint8_t sc, m;
      q4_k_scale_min(wb[b].scales, s, &sc, &m);
      s_sum += sc * int_dot([&](int e) { return kAt(wb[b], e); }, xb[b].qs, 32 * s, 32 * s + 32);
      m_sum += m * (xb[b].bsums[2 * s] + xb[b].bsums[2 * s + 1]);
    }
    y = kquant_step(s_sum, m_sum, fp16_to_fp32(wb[b].d), fp16_to_fp32(wb[b].dmin), xb[b].d, y);
  }
  return y;
}

float dot_row_q4_k(const uint8_t* w, const uint8_t* x, int64_t k) {
  return dot_row_q45_k<BlockQ4_K, q4_k_at>(w, x, k);
}

float dot_row_q5_k(const uint8_t* w, const uint8_t* x, int64_t k) {
  return dot_row_q45_k<BlockQ5_K, q5_k_at>(w, x, k);
}

// Q6_K: 16 sub-blocks of 16 with signed 8-bit scales, no mins.
float dot_row_q6_k(const uint8_t* w, const uint8_t* x, int64_t k) {
  const auto* wb = reinterpret_cast<const BlockQ6_K*>(w);
  const auto* xb = reinterpret_cast<const BlockQ8_K*>(x);
  float y = 0.0f;
  for (int64_t b = 0; b < k / kSuperBlock; ++b) {
    int32_t s_sum = 0;
    for (int s = 0; s < 16; ++s) {
      s_sum += wb[b].scales[s] *
               int_dot([&](int e) { return q6_k_at(wb[b], e); }, xb[b].qs, 16 * s, 16 * s + 16);
    }
    float r = static_cast<float>(s_sum) * fp16_to_fp32(wb[b].d);
    y = std::fma(r, xb[b].d, y);
  }
  return y;
}

template <float (*kDot)(const uint8_t*, const uint8_t*, int64_t)>
void dot_tile(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
              int64_t n_x, int64_t k, float* y, int64_t ldy) {
  for (int64_t i = 0; i < n_x; ++i) {
    for (int64_t j = 0; j < n_w; ++j) y[i * ldy + j] = kDot(w + j * w_stride, x + i * x_stride, k);
  }
}

void dot_q4_0x8(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_0, WeightLayout::kInterleaved, dot_tile<dot_row_q4_0>, w,
                          w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_0x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_0, WeightLayout::kInterleaved16, dot_tile<dot_row_q4_0>, w,
                          w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_kx16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_K, WeightLayout::kInterleaved, dot_tile<dot_row_q4_k>, w,
                          w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q6_kx16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ6_K, WeightLayout::kInterleaved, dot_tile<dot_row_q6_k>, w,
                          w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q8_0x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ8_0, WeightLayout::kInterleaved, dot_tile<dot_row_q8_0>, w,
                          w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

void dot_q4_1x16(const uint8_t* w, size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                 int64_t n_x, int64_t k, float* y, int64_t ldy) {
  dot_interleaved_by_rows(DType::kQ4_1, WeightLayout::kInterleaved, dot_tile<dot_row_q4_1>, w,
                          w_stride, n_w, x, x_stride, n_x, k, y, ldy);
}

// One query head against one key row, in kq_scores's order.
float kq_score(const uint16_t* q, const uint16_t* kr, int64_t dim, int groups) {
  float acc[4][16] = {};
  const int64_t chunk = groups == 1 ? 16 : 64;
  const int64_t n_whole = dim - dim % chunk;
  for (int64_t e = 0; e < n_whole; ++e) {
    const int g = groups == 1 ? 0 : static_cast<int>((e / 16) % 4);
    acc[g][e % 16] = std::fma(fp16_to_fp32(kr[e]), fp16_to_fp32(q[e]), acc[g][e % 16]);
  }
  if (groups != 1) {
    for (int l = 0; l < 16; ++l) {
      acc[0][l] = acc[0][l] + acc[2][l];
      acc[1][l] = acc[1][l] + acc[3][l];
    }
    for (int l = 0; l < 16; ++l) acc[0][l] = acc[0][l] + acc[1][l];
  }
  double sum = lane_tree_sum16(acc[0]);
  for (int64_t e = n_whole; e < dim; ++e) {
    sum += static_cast<double>(fp16_to_fp32(kr[e]) * fp16_to_fp32(q[e]));
  }
  return static_cast<float>(sum);
}

void kq_scores(const uint16_t* q, int64_t n_q, const uint16_t* const* segments, int64_t n_keys,
               int64_t dim, int groups, float* out, int64_t ld_out) {
  for (int64_t h = 0; h < n_q; ++h) {
    for (int64_t t = 0; t < n_keys; ++t) {
      out[h * ld_out + t] = kq_score(q + h * dim, segments[t / 16] + t % 16 * dim, dim, groups);
    }
  }
}

void kqv_sum(const float* p, int64_t ld_p, int64_t n_q, const uint16_t* const* segments,
             int64_t n_keys, int64_t dim, int groups, float* out) {
  for (int64_t h = 0; h < n_q; ++h) {
    for (int64_t d = 0; d < dim; ++d) {
      out[h * dim + d] = kqv_sum_at(p + h * ld_p, segments, n_keys, dim, groups, d);
    }
  }
}

double softmax_exp(const float* x, int64_t n, float max, float* y) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; i += 16) {
    float chunk[16] = {};
    for (int64_t l = 0; l < 16 && i + l < n; ++l) chunk[l] = y[i + l] = ggml_expf(x[i + l] - max);
    sum += static_cast<double>(lane_tree_sum16(chunk));
  }
  return sum;
}

void dot_f32_lanes(const float* w, int64_t n_w, const float* x, int64_t k, int groups, float* y) {
  const int64_t chunk = groups == 1 ? 16 : 64;
  const int64_t n_whole = k - k % chunk;
  for (int64_t j = 0; j < n_w; ++j) {
    const float* row = w + j * k;
    float acc[4][16] = {};
    for (int64_t e = 0; e < n_whole; ++e) {
      const int g = groups == 1 ? 0 : static_cast<int>((e / 16) % 4);
      acc[g][e % 16] = std::fma(row[e], x[e], acc[g][e % 16]);
    }
    if (groups != 1) {
      for (int l = 0; l < 16; ++l) acc[0][l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    float sum = lane_tree_sum16(acc[0]);
    for (int64_t e = n_whole; e < k; ++e) sum = std::fma(row[e], x[e], sum);
    y[j] = sum;
  }
}

void silu_mul(const float* x, const float* g, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / (1.0f + ggml_expf(-x[i])) * g[i];
}

void scale_round_f16(float* x, int64_t n, float factor) {
  for (int64_t i = 0; i < n; ++i) x[i] = fp16_to_fp32(fp32_to_fp16(x[i] * factor));
}

constexpr KernelTable kScalarTable = {
    .isa = Isa::kScalar,
    .quantize_q8_0 = quantize_row_q8_0,
    .quantize_q8_1 = quantize_row_q8_1,
    .quantize_q8_k = quantize_row_q8_k,
    .convert_f16 = convert_row_f16,
    .convert_bf16 = convert_row_bf16,
    .dot_f32 = dot_tile<dot_row_f32>,
    .dot_f16 = dot_tile<dot_row_f16>,
    .dot_q8_0 = dot_tile<dot_row_q8_0>,
    .dot_q4_0 = dot_tile<dot_row_q4_0>,
    .dot_q4_1 = dot_tile<dot_row_q4_1>,
    .dot_q5_0 = dot_tile<dot_row_q5_0>,
    .dot_bf16 = dot_tile<dot_row_bf16>,
    .dot_q4_k = dot_tile<dot_row_q4_k>,
    .dot_q5_k = dot_tile<dot_row_q5_k>,
    .dot_q6_k = dot_tile<dot_row_q6_k>,
    .dot_q4_0x8 = dot_q4_0x8,
    .interleave_q4_0 = false,
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
    .kq_scores = kq_scores,
    .kqv_sum = kqv_sum,
    .softmax_exp = softmax_exp,
    .dot_f32_lanes = dot_f32_lanes,
    .silu_mul = silu_mul,
    .scale_round_f16 = scale_round_f16,
};

}  // namespace

const KernelTable& scalar_kernel_table() { return kScalarTable; }

}  // namespace duet::cpu

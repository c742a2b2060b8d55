#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/error.h"
#include "common/format.h"
#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/quantize_rows_inl.h"

namespace duet::cpu {
void quantize_row_q8_0(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kQuantBlock == 0);
  quantize_rows_q8_0_inl(x, out, n);
}

void quantize_row_q8_1(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kQuantBlock == 0);
  quantize_rows_q8_1_inl(x, out, n);
}

void quantize_row_q8_k(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kSuperBlock == 0);
  quantize_rows_q8_k_inl(x, out, n);
}

namespace {

// The block's value of largest magnitude, with its sign (the first of equals).
float largest_magnitude(const float* xb) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQuantBlock; ++j) {
    if (std::fabs(xb[j]) > amax) {
      amax = std::fabs(xb[j]);
      max = xb[j];
    }
  }
  return max;
}

}  // namespace

void quantize_row_q4_0(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kQuantBlock == 0);
  auto* blocks = static_cast<BlockQ4_0*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    const float max = largest_magnitude(xb);
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = fp32_to_fp16(d);
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      const int lo = std::min(15, static_cast<int>(xb[j] * id + 8.5f));
      const int hi = std::min(15, static_cast<int>(xb[j + 16] * id + 8.5f));
      blocks[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

// llama.cpp's quantize_row_q5_0_ref: d = (the value of largest magnitude) / -16.
void quantize_row_q5_0(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kQuantBlock == 0);
  auto* blocks = static_cast<BlockQ5_0*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    const float max = largest_magnitude(xb);
    const float d = max / -16.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = fp32_to_fp16(d);
    uint32_t qh = 0;
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      const int lo = std::min(31, static_cast<int>(static_cast<int8_t>(xb[j] * id + 16.5f)));
      const int hi = std::min(31, static_cast<int>(static_cast<int8_t>(xb[j + 16] * id + 16.5f)));
      blocks[b].qs[j] = static_cast<uint8_t>((lo & 0x0f) | (hi & 0x0f) << 4);
      qh |= static_cast<uint32_t>((lo & 0x10) >> 4) << j;
      qh |= static_cast<uint32_t>((hi & 0x10) >> 4) << (j + 16);
    }
    std::memcpy(blocks[b].qh, &qh, sizeof qh);
  }
}

void quantize_row_q4_1(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kQuantBlock == 0);
  auto* blocks = static_cast<BlockQ4_1*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    const auto [lo_it, hi_it] = std::minmax_element(xb, xb + kQuantBlock);
    const float min = *lo_it, max = *hi_it;
    const float d = (max - min) / 15.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    blocks[b].d = fp32_to_fp16(d);
    blocks[b].m = fp32_to_fp16(min);
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      const int lo = std::min(15, static_cast<int>((xb[j] - min) * id + 0.5f));
      const int hi = std::min(15, static_cast<int>((xb[j + 16] - min) * id + 0.5f));
      blocks[b].qs[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

namespace {

inline int nearest_int(float x) { return static_cast<int>(std::nearbyint(x)); }

// The 6-bit sub-block scales and mins of ggml's quantize_row_q4_K_ref, packed.
void pack_q4_k_scales(const uint8_t* ls, const uint8_t* lm, uint8_t* scales) {
  for (int s = 0; s < 12; ++s) scales[s] = 0;
  for (int s = 0; s < 8; ++s) {
    if (s < 4) {
      scales[s] = ls[s];
      scales[s + 4] = lm[s];
    } else {
      scales[s + 4] = static_cast<uint8_t>((ls[s] & 15) | ((lm[s] & 15) << 4));
      scales[s - 4] |= static_cast<uint8_t>((ls[s] >> 4) << 6);
      scales[s] |= static_cast<uint8_t>((lm[s] >> 4) << 6);
    }
  }
}

}  // namespace

// ggml's quantize_row_q4_K_ref without its search for the best scale and min
// per sub-block: each sub-block of 32 takes scale (max - min) / max_q and min
// min(0, smallest), then both are quantized to 6 bits against the largest.
// Fills the block's d, dmin and scales and q (256 codes, 0..max_q).
namespace {

template <typename Block>
void quantize_k_block(const float* xb, int max_q, Block& y, uint8_t* q) {
  float scales[8], mins[8], max_scale = 0.0f, max_min = 0.0f;
  for (int s = 0; s < 8; ++s) {
    const auto [lo_it, hi_it] = std::minmax_element(xb + 32 * s, xb + 32 * s + 32);
    const float lo = std::min(0.0f, *lo_it);
    scales[s] = (*hi_it - lo) / static_cast<float>(max_q);
    mins[s] = -lo;
    max_scale = std::max(max_scale, scales[s]);
    max_min = std::max(max_min, mins[s]);
  }
  const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
  uint8_t ls[8], lm[8];
  for (int s = 0; s < 8; ++s) {
    ls[s] = static_cast<uint8_t>(std::min(63, nearest_int(inv_scale * scales[s])));
    lm[s] = static_cast<uint8_t>(std::min(63, nearest_int(inv_min * mins[s])));
  }
  pack_q4_k_scales(ls, lm, y.scales);
  y.d = fp32_to_fp16(max_scale / 63.0f);
  y.dmin = fp32_to_fp16(max_min / 63.0f);
  std::fill(q, q + kSuperBlock, uint8_t{0});
  for (int s = 0; s < 8; ++s) {
    uint8_t sc = 0, m = 0;
    q4_k_scale_min(y.scales, s, &sc, &m);
    const float d = fp16_to_fp32(y.d) * sc;
    if (d == 0.0f) continue;
    const float dm = fp16_to_fp32(y.dmin) * m;
    for (int e = 32 * s; e < 32 * s + 32; ++e) {
      q[e] = static_cast<uint8_t>(std::clamp(nearest_int((xb[e] + dm) / d), 0, max_q));
    }
  }
}

}  // namespace

void quantize_row_q4_k(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kSuperBlock == 0);
  auto* blocks = static_cast<BlockQ4_K*>(out);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    BlockQ4_K& y = blocks[b];
    uint8_t q[kSuperBlock];
    quantize_k_block(x + b * kSuperBlock, 15, y, q);
    for (int g = 0; g < 4; ++g) {
      for (int l = 0; l < 32; ++l) {
        y.qs[32 * g + l] = static_cast<uint8_t>(q[64 * g + l] | (q[64 * g + 32 + l] << 4));
      }
    }
  }
}

// The same with 31 levels; the fifth bit of each q goes to qh.
void quantize_row_q5_k(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kSuperBlock == 0);
  auto* blocks = static_cast<BlockQ5_K*>(out);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    BlockQ5_K& y = blocks[b];
    y = BlockQ5_K{};
    uint8_t q[kSuperBlock];
    quantize_k_block(x + b * kSuperBlock, 31, y, q);
    for (int e = 0; e < kSuperBlock; ++e) {
      const int g = e / 64, r = e % 64;
      const auto low = static_cast<uint8_t>(q[e] & 15);
      y.qs[32 * g + r % 32] |= r < 32 ? low : static_cast<uint8_t>(low << 4);
      y.qh[e % 32] |= static_cast<uint8_t>((q[e] >> 4) << (e / 32));
    }
  }
}

// ggml's quantize_row_q6_K_ref with the plain rounding of make_qx_quants
// (rmse_type 0) per sub-block of 16: the element of largest magnitude maps
// to -32; the sub-block scales are quantized to int8 against the largest.
void quantize_row_q6_k(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kSuperBlock == 0);
  auto* blocks = static_cast<BlockQ6_K*>(out);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const float* xb = x + b * kSuperBlock;
    BlockQ6_K& y = blocks[b];
    y = BlockQ6_K{};
    float scales[16], max_scale = 0.0f, max_abs_scale = 0.0f;
    for (int s = 0; s < 16; ++s) {
      float max = 0.0f, amax = 0.0f;
      for (int e = 16 * s; e < 16 * s + 16; ++e) {
        if (std::fabs(xb[e]) > amax) {
          amax = std::fabs(xb[e]);
          max = xb[e];
        }
      }
      scales[s] = amax > 0.0f ? max / -32.0f : 0.0f;
      if (std::fabs(scales[s]) > max_abs_scale) {
        max_abs_scale = std::fabs(scales[s]);
        max_scale = scales[s];
      }
    }
    if (max_abs_scale < 1e-15f) continue;  // all (near) zero: d = 0
    const float iscale = -128.0f / max_scale;
    y.d = fp32_to_fp16(1.0f / iscale);
    uint8_t q[kSuperBlock];
    for (int s = 0; s < 16; ++s) {
      y.scales[s] = static_cast<int8_t>(std::min(127, nearest_int(iscale * scales[s])));
      const float d = fp16_to_fp32(y.d) * y.scales[s];
      for (int e = 16 * s; e < 16 * s + 16; ++e) {
        const int l = d == 0.0f ? 0 : std::clamp(nearest_int(xb[e] / d), -32, 31);
        q[e] = static_cast<uint8_t>(l + 32);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const uint8_t* qs = q + 128 * h;
      for (int l = 0; l < 32; ++l) {
        y.ql[64 * h + l] = static_cast<uint8_t>((qs[l] & 15) | ((qs[l + 64] & 15) << 4));
        y.ql[64 * h + 32 + l] = static_cast<uint8_t>((qs[l + 32] & 15) | ((qs[l + 96] & 15) << 4));
        y.qh[32 * h + l] =
            static_cast<uint8_t>((qs[l] >> 4) | ((qs[l + 32] >> 4) << 2) |
                                 ((qs[l + 64] >> 4) << 4) | ((qs[l + 96] >> 4) << 6));
      }
    }
  }
}

void convert_row_f16(const float* x, void* out, int64_t n) {
  auto* h = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(x[i]);
}

void convert_row_bf16(const float* x, void* out, int64_t n) {
  auto* h = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(x[i]);
}

namespace {

// Q4_K's and Q5_K's dequantization: each 64-element group g of a block takes
// sub-blocks 2g (low nibbles) and 2g + 1 (high nibbles); `high(block, l, bit)`
// is the value's fifth bit (Q5_K) as 16, or 0.
template <typename Block, typename High>
void dequantize_q45_k(const Block* blocks, int64_t n, float* out, High high) {
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const float d = fp16_to_fp32(blocks[b].d);
    const float min = fp16_to_fp32(blocks[b].dmin);
    float* o = out + b * kSuperBlock;
    for (int g = 0; g < 4; ++g) {
      const uint8_t* q = blocks[b].qs + 32 * g;
      uint8_t sc = 0, m = 0;
      q4_k_scale_min(blocks[b].scales, 2 * g, &sc, &m);
      const float d1 = d * sc, m1 = min * m;
      q4_k_scale_min(blocks[b].scales, 2 * g + 1, &sc, &m);
      const float d2 = d * sc, m2 = min * m;
      for (int l = 0; l < 32; ++l) {
        const int value = (q[l] & 15) + high(blocks[b], l, 2 * g);
        o[64 * g + l] = d1 * static_cast<float>(value) - m1;
      }
      for (int l = 0; l < 32; ++l) {
        const int value = (q[l] >> 4) + high(blocks[b], l, 2 * g + 1);
        o[64 * g + 32 + l] = d2 * static_cast<float>(value) - m2;
      }
    }
  }
}

}  // namespace

void dequantize_row(DType type, const void* row, float* out, int64_t n) {
  switch (type) {
    case DType::kF32: {
      std::copy_n(static_cast<const float*>(row), n, out);
      return;
    }
    case DType::kF16: {
      const auto* h = static_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_fp32(h[i]);
      return;
    }
    case DType::kBF16: {
      const auto* h = static_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_fp32(h[i]);
      return;
    }
    case DType::kQ4_0: {
      const auto* blocks = static_cast<const BlockQ4_0*>(row);
      for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = fp16_to_fp32(blocks[b].d);
        float* o = out + b * kQuantBlock;
        for (int j = 0; j < kQuantBlock / 2; ++j) {
          o[j] = static_cast<float>((blocks[b].qs[j] & 0x0f) - 8) * d;
          o[j + 16] = static_cast<float>((blocks[b].qs[j] >> 4) - 8) * d;
        }
      }
      return;
    }
    case DType::kQ5_0: {
      const auto* blocks = static_cast<const BlockQ5_0*>(row);
      for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = fp16_to_fp32(blocks[b].d);
        uint32_t qh;
        std::memcpy(&qh, blocks[b].qh, sizeof qh);
        float* o = out + b * kQuantBlock;
        for (int j = 0; j < kQuantBlock / 2; ++j) {
          const int lo = (blocks[b].qs[j] & 0x0f) | static_cast<int>((qh >> j) & 1) << 4;
          const int hi = (blocks[b].qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
          o[j] = static_cast<float>(lo - 16) * d;
          o[j + 16] = static_cast<float>(hi - 16) * d;
        }
      }
      return;
    }
    case DType::kQ4_1: {
      const auto* blocks = static_cast<const BlockQ4_1*>(row);
      for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = fp16_to_fp32(blocks[b].d);
        const float m = fp16_to_fp32(blocks[b].m);
        float* o = out + b * kQuantBlock;
        for (int j = 0; j < kQuantBlock / 2; ++j) {
          o[j] = static_cast<float>(blocks[b].qs[j] & 0x0f) * d + m;
          o[j + 16] = static_cast<float>(blocks[b].qs[j] >> 4) * d + m;
        }
      }
      return;
    }
    case DType::kQ8_0: {
      const auto* blocks = static_cast<const BlockQ8_0*>(row);
      for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = fp16_to_fp32(blocks[b].d);
        for (int j = 0; j < kQuantBlock; ++j) out[b * kQuantBlock + j] = blocks[b].qs[j] * d;
      }
      return;
    }
    case DType::kQ8_1: {
      const auto* blocks = static_cast<const BlockQ8_1*>(row);
      for (int64_t b = 0; b < n / kQuantBlock; ++b) {
        const float d = fp16_to_fp32(blocks[b].d);
        for (int j = 0; j < kQuantBlock; ++j) out[b * kQuantBlock + j] = blocks[b].qs[j] * d;
      }
      return;
    }
    case DType::kQ4_K:  // ggml's dequantize_row_q4_K
      dequantize_q45_k(static_cast<const BlockQ4_K*>(row), n, out,
                       [](const BlockQ4_K&, int, int) { return 0; });
      return;
    case DType::kQ5_K:  // ggml's dequantize_row_q5_K: the fifth bit, bit 2g (low) or 2g + 1 (high)
                        // of qh[l]
      dequantize_q45_k(
          static_cast<const BlockQ5_K*>(row), n, out,
          [](const BlockQ5_K& b, int l, int bit) { return ((b.qh[l] >> bit) & 1) << 4; });
      return;
    case DType::kQ6_K: {  // ggml's dequantize_row_q6_K
      const auto* blocks = static_cast<const BlockQ6_K*>(row);
      for (int64_t b = 0; b < n / kSuperBlock; ++b) {
        const float d = fp16_to_fp32(blocks[b].d);
        float* o = out + b * kSuperBlock;
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = blocks[b].ql + 64 * h;
          const uint8_t* qh = blocks[b].qh + 32 * h;
          const int8_t* sc = blocks[b].scales + 8 * h;
          for (int l = 0; l < 32; ++l) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            o[128 * h + l] = d * static_cast<float>(sc[is]) * static_cast<float>(q1);
            o[128 * h + l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
            o[128 * h + l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
            o[128 * h + l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
          }
        }
      }
      return;
    }
    case DType::kQ8_K: {
      const auto* blocks = static_cast<const BlockQ8_K*>(row);
      for (int64_t b = 0; b < n / kSuperBlock; ++b) {
        for (int j = 0; j < kSuperBlock; ++j) {
          out[b * kSuperBlock + j] = blocks[b].d * static_cast<float>(blocks[b].qs[j]);
        }
      }
      return;
    }
    default:
      throw Error(ErrorKind::kUnsupported,
                  duet::format("cannot dequantize {} rows", dtype_name(type)));
  }
}

void quantize_row(DType type, const float* x, void* out, int64_t n) {
  switch (type) {
    case DType::kF32:
      std::copy_n(x, n, static_cast<float*>(out));
      return;
    case DType::kF16:
      convert_row_f16(x, out, n);
      return;
    case DType::kBF16:
      convert_row_bf16(x, out, n);
      return;
    case DType::kQ4_0:
      quantize_row_q4_0(x, out, n);
      return;
    case DType::kQ4_1:
      quantize_row_q4_1(x, out, n);
      return;
    case DType::kQ5_0:
      quantize_row_q5_0(x, out, n);
      return;
    case DType::kQ8_0:
      quantize_row_q8_0(x, out, n);
      return;
    case DType::kQ8_1:
      quantize_row_q8_1(x, out, n);
      return;
    case DType::kQ4_K:
      quantize_row_q4_k(x, out, n);
      return;
    case DType::kQ5_K:
      quantize_row_q5_k(x, out, n);
      return;
    case DType::kQ6_K:
      quantize_row_q6_k(x, out, n);
      return;
    case DType::kQ8_K:
      quantize_row_q8_k(x, out, n);
      return;
    default:
      throw Error(ErrorKind::kUnsupported, duet::format("cannot quantize to {}", dtype_name(type)));
  }
}

}  // namespace duet::cpu

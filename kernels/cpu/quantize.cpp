#include "kernels/cpu/quantize.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/fp16.h"
#include "common/quant_blocks.h"
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

void quantize_row_q4_0(const float* x, void* out, int64_t n) {
  DUET_ASSERT(n % kQuantBlock == 0);
  auto* blocks = static_cast<BlockQ4_0*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQuantBlock; ++j) {
      if (std::fabs(xb[j]) > amax) {
        amax = std::fabs(xb[j]);
        max = xb[j];
      }
    }
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

void convert_row_f16(const float* x, void* out, int64_t n) {
  auto* h = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(x[i]);
}

void convert_row_bf16(const float* x, void* out, int64_t n) {
  auto* h = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(x[i]);
}

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
    default:
      throw Error(ErrorKind::kUnsupported,
                  fmt::format("cannot dequantize {} rows", dtype_name(type)));
  }
}

void quantize_row(DType type, const float* x, void* out, int64_t n) {
  switch (type) {
    case DType::kF32: std::copy_n(x, n, static_cast<float*>(out)); return;
    case DType::kF16: convert_row_f16(x, out, n); return;
    case DType::kBF16: convert_row_bf16(x, out, n); return;
    case DType::kQ4_0: quantize_row_q4_0(x, out, n); return;
    case DType::kQ4_1: quantize_row_q4_1(x, out, n); return;
    case DType::kQ8_0: quantize_row_q8_0(x, out, n); return;
    case DType::kQ8_1: quantize_row_q8_1(x, out, n); return;
    default:
      throw Error(ErrorKind::kUnsupported, fmt::format("cannot quantize to {}", dtype_name(type)));
  }
}

}  // namespace duet::cpu

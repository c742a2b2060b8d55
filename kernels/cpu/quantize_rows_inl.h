// Activation quantizers and converters shared by every ISA path. Included into
// each path's translation unit (internal linkage) so that the compiler
// vectorizes them with that unit's instruction set; the arithmetic is exact
// apart from the scale computation, which is the same expression everywhere,
// so every path quantizes a row bit-identically.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"

namespace duet::cpu {
namespace {

// Returns the block scale; writes 32 values and their integer sum.
inline float quantize_block_q8_inl(const float* x, int8_t* qs, int32_t* sum) {
  float amax = 0.0f;
  for (int j = 0; j < kQuantBlock; ++j) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  const float d = amax / 127.0f;
  // 127 / amax (not 1 / d: as ggml rounds it); a block so small that this
  // overflows quantizes to zeros instead of converting infinities to int.
  const float id = amax > 127.0f / FLT_MAX ? 127.0f / amax : 0.0f;
  int32_t total = 0;
  for (int j = 0; j < kQuantBlock; ++j) {
    const int32_t q = static_cast<int32_t>(std::nearbyint(x[j] * id));
    qs[j] = static_cast<int8_t>(q);
    total += q;
  }
  *sum = total;
  return d;
}

inline void quantize_rows_q8_0_inl(const float* x, void* out, int64_t n) {
  auto* blocks = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    int32_t sum = 0;
    blocks[b].d = fp32_to_fp16(quantize_block_q8_inl(x + b * kQuantBlock, blocks[b].qs, &sum));
  }
}

inline void quantize_rows_q8_1_inl(const float* x, void* out, int64_t n) {
  auto* blocks = static_cast<BlockQ8_1*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    int32_t sum = 0;
    const float d = quantize_block_q8_inl(x + b * kQuantBlock, blocks[b].qs, &sum);
    blocks[b].d = fp32_to_fp16(d);
    blocks[b].s = fp32_to_fp16(d * static_cast<float>(sum));
  }
}

// llama.cpp's quantize_row_q8_K_ref (which its x86 CPU backend uses): the
// element of largest magnitude, `max`, maps to -127 (iscale = -127 / max, so
// d = 1 / iscale is negative when max is positive), values round half to even
// (ggml's nearest_int), and an all-zero block stores d = 0 (and zero sums).
inline void quantize_rows_q8_k_inl(const float* x, void* out, int64_t n) {
  auto* blocks = static_cast<BlockQ8_K*>(out);
  for (int64_t b = 0; b < n / kSuperBlock; ++b) {
    const float* xb = x + b * kSuperBlock;
    BlockQ8_K& y = blocks[b];
    float max = 0.0f, amax = 0.0f;
    for (int j = 0; j < kSuperBlock; ++j) {
      const float a = std::fabs(xb[j]);
      if (a > amax) {
        amax = a;
        max = xb[j];
      }
    }
    if (amax == 0.0f) {
      y = BlockQ8_K{};
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < kSuperBlock; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(iscale * xb[j]));
      y.qs[j] = static_cast<int8_t>(q < 127 ? q : 127);
    }
    for (int s = 0; s < kSuperBlock / 16; ++s) {
      int32_t sum = 0;
      for (int j = 0; j < 16; ++j) sum += y.qs[16 * s + j];
      y.bsums[s] = static_cast<int16_t>(sum);
    }
    y.d = 1.0f / iscale;
  }
}

inline void convert_rows_bf16_inl(const float* x, void* out, int64_t n) {
  auto* h = static_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_bf16(x[i]);
}

}  // namespace
}  // namespace duet::cpu

// Activation quantizers shared by every ISA path. Included into each path's
// translation unit (internal linkage) so that the compiler vectorizes them with
// that unit's instruction set; the arithmetic is exact apart from the scale
// computation, which is the same expression everywhere, so every path
// quantizes a row bit-identically.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "common/fp16.h"
#include "common/quant_blocks.h"

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

}  // namespace
}  // namespace duet::cpu

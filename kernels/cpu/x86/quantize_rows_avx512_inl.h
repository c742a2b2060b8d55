// Q8_0 and Q8_1 activation quantizers with 512-bit registers, a block of 32
// values in two registers. Included into the AVX-512 translation unit only.
//
// The same values as quantize_rows_inl.h's (which the compiler vectorizes only
// in part): amax is exact in any order; q = x * (127 / amax) rounded to
// nearest even, which cvtps2dq does under the default rounding mode as
// nearbyint does; the sum of the q is exact; the scales go to half with the
// same rounding. (NaN inputs aside, which no path gives meaning to.)
#pragma once

#include <immintrin.h>

#include <cfloat>
#include <cstdint>

#include "common/model/quant_blocks.h"

namespace duet::cpu {
namespace {

// Returns the block scale; writes 32 values and their integer sum.
inline float quantize_block_q8_avx512(const float* x, int8_t* qs, int32_t* sum) {
  const __m512 x0 = _mm512_loadu_ps(x);
  const __m512 x1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
  const float d = amax / 127.0f;
  const float id = amax > 127.0f / FLT_MAX ? 127.0f / amax : 0.0f;
  const __m512 scale = _mm512_set1_ps(id);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, scale));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, scale));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qs), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qs + 16), _mm512_cvtepi32_epi8(q1));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return d;
}

inline uint16_t float_to_half(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

void quantize_rows_q8_0_avx512(const float* x, void* out, int64_t n) {
  auto* blocks = static_cast<BlockQ8_0*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    int32_t sum = 0;
    blocks[b].d = float_to_half(quantize_block_q8_avx512(x + b * kQuantBlock, blocks[b].qs, &sum));
  }
}

void quantize_rows_q8_1_avx512(const float* x, void* out, int64_t n) {
  auto* blocks = static_cast<BlockQ8_1*>(out);
  for (int64_t b = 0; b < n / kQuantBlock; ++b) {
    int32_t sum = 0;
    const float d = quantize_block_q8_avx512(x + b * kQuantBlock, blocks[b].qs, &sum);
    blocks[b].d = float_to_half(d);
    blocks[b].s = float_to_half(d * static_cast<float>(sum));
  }
}

}  // namespace
}  // namespace duet::cpu

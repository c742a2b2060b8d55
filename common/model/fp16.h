// IEEE half and bfloat16 conversions (round to nearest even).
//
// Internal linkage on purpose: the ISA-specific kernel files include this with
// wider instruction sets, and a shared out-of-line copy could be picked by the
// linker for the portable path.
#pragma once

#include <bit>
#include <cstdint>

namespace duet {

static inline float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: renormalize
      const float value = static_cast<float>(mantissa) * 0x1p-24f;
      bits = sign | std::bit_cast<uint32_t>(value);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(bits);
}

// Round to nearest even, with overflow to infinity and NaN kept NaN.
static inline uint16_t fp32_to_fp16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow to inf
  if (abs < 0x38800000u) {                                    // subnormal or zero in half precision
    const float value = std::bit_cast<float>(abs) * 0x1p24f;  // exact scale into integer range
    // Round to nearest even through the FPU's default rounding.
    const float rounded = value + 0x1p23f - 0x1p23f;
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(rounded));
  }
  const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

static inline float bf16_to_fp32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

static inline uint16_t fp32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 64u);  // quiet NaN
  return static_cast<uint16_t>((x + (0x7fffu + ((x >> 16) & 1u))) >> 16);
}

}  // namespace duet

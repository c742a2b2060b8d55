// Byte layouts of the block-quantized types, as GGUF stores them.
//
// In Q4_0 and Q4_1, byte j of `qs` holds element j in its low nibble and
// element j + 16 in its high nibble. Scales are IEEE half (bits in uint16_t).
// Q8_1 is the activation format for Q4_1 dot products: `s` = d * sum(qs).
#pragma once

#include <cstdint>

namespace duet {

inline constexpr int kQuantBlock = 32;  // elements per Q4_0/Q4_1/Q8_0/Q8_1 block

struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kQuantBlock / 2];
};

struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[kQuantBlock / 2];
};

struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kQuantBlock];
};

struct BlockQ8_1 {
  uint16_t d;
  uint16_t s;
  int8_t qs[kQuantBlock];
};

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);

}  // namespace duet

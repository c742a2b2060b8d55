// Byte layouts of the block-quantized types, as GGUF stores them (ggml's
// block_q4_0 ... block_q8_K). Scales are IEEE half (bits in uint16_t) unless
// a field says otherwise. Q4_0, Q4_1, Q5_0, Q8_0 and Q8_1 blocks hold kQuantBlock
// elements; K-quants a super-block of kSuperBlock, so their rows must be
// multiples of 256. Each struct states how its bytes hold the elements.
#pragma once

#include <cstdint>

namespace duet {

inline constexpr int kQuantBlock = 32;  // elements per Q4_0/Q4_1/Q8_0/Q8_1 block

// Byte j of `qs` holds element j in its low nibble and element j + 16 in its
// high nibble (Q4_1 alike).
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

// Element j's low 4 bits as in Q4_0 (byte j of `qs` for j < 16, the high
// nibble of byte j - 16 after that), its fifth bit bit j of `qh` (little
// endian); the value is d * (those 5 bits - 16).
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[kQuantBlock / 2];
};

// The activation format for Q4_1 dot products: `s` = d * sum(qs).
struct BlockQ8_1 {
  uint16_t d;
  uint16_t s;
  int8_t qs[kQuantBlock];
};

inline constexpr int kSuperBlock = 256;  // elements per K-quant block

// 8 sub-blocks of 32, value = d * sc[s] * q - dmin * m[s], q in 0..15. Byte
// l of the 32-byte group g (g < 4) of `qs` holds element 64g + l in its low
// nibble and 64g + 32 + l in its high one, so sub-blocks 2g and 2g + 1.
// `scales` packs the 6-bit sc[s] and m[s] (q4_k_scale_min unpacks them).
struct BlockQ4_K {
  uint16_t d;     // half: scale of the sub-block scales
  uint16_t dmin;  // half: scale of the sub-block mins
  uint8_t scales[12];
  uint8_t qs[kSuperBlock / 2];
};

// Q4_K's layout (scales, mins and low nibbles alike) and a fifth bit per
// element: bit s of qh[l] is the top bit (value 16) of element 32s + l, so
// q in 0..31 and value = d * sc[s] * q - dmin * m[s].
struct BlockQ5_K {
  uint16_t d;     // half: scale of the sub-block scales
  uint16_t dmin;  // half: scale of the sub-block mins
  uint8_t scales[12];
  uint8_t qh[kSuperBlock / 8];
  uint8_t qs[kSuperBlock / 2];
};

// 16 sub-blocks of 16, value = d * scales[e / 16] * (q - 32), q in 0..63. In
// each half h (128 elements) byte l < 32 of ql[64h..] holds the low 4 bits of
// element 128h + l (low nibble) and 128h + 64 + l (high nibble), byte 32 + l
// those of 128h + 32 + l and 128h + 96 + l; byte l of qh[32h..] holds the top
// 2 bits of 128h + l, +32, +64, +96 (bits 0-1, 2-3, 4-5, 6-7). `d` comes last.
struct BlockQ6_K {
  uint8_t ql[kSuperBlock / 2];
  uint8_t qh[kSuperBlock / 4];
  int8_t scales[kSuperBlock / 16];
  uint16_t d;  // half
};

// The activation format of Q4_K and Q6_K dot products: value = d * qs[e]
// (d a float), and bsums[b] = the sum of qs[16b .. 16b + 15].
struct BlockQ8_K {
  float d;
  int8_t qs[kSuperBlock];
  int16_t bsums[kSuperBlock / 16];
};

// The 6-bit scale and min of Q4_K sub-block s (< 8) from the packed `scales`.
// Internal linkage: the ISA kernel files include this with wider instruction
// sets, and a shared out-of-line copy could be picked for the portable path.
static inline void q4_k_scale_min(const uint8_t* scales, int s, uint8_t* sc, uint8_t* m) {
  if (s < 4) {
    *sc = scales[s] & 63;
    *m = scales[s + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((scales[s + 4] & 15) | ((scales[s - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((scales[s + 4] >> 4) | ((scales[s] >> 6) << 4));
  }
}

static_assert(sizeof(BlockQ4_0) == 18);
static_assert(sizeof(BlockQ5_0) == 22);
static_assert(sizeof(BlockQ4_1) == 20);
static_assert(sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ8_1) == 36);
static_assert(sizeof(BlockQ4_K) == 144);
static_assert(sizeof(BlockQ5_K) == 176);
static_assert(sizeof(BlockQ6_K) == 210);
static_assert(sizeof(BlockQ8_K) == 292);

}  // namespace duet

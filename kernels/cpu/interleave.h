// Q4_0 matrices interleaved by 8 rows (AVX2) or 16 (AVX-512), Q4_K, Q6_K,
// Q8_0 and Q4_1 by 16: the layouts decode streams.
//
// A decode step reads every weight once per token, and one row at a time
// (GGUF's order) leaves the kernel one dependent FMA chain and scattered
// scale conversions per 32 weights. Groups of 8 rows stored block by block
// (BlockQ4_0x8) are one sequential stream with 8 independent chains, the 8
// scales converted by one instruction, and two rows' 32 weights in one
// 32-byte load, each row's in element order in its own nibble (a mask gives
// one row, a shift the other, with no shuffle). Groups of 16 rows hold a
// 4-byte word of every row side by side, so that a 512-bit register's 16
// int32 lanes are the group's 16 rows.
//
// The layout changes no arithmetic: every kernel computes each (row,
// activation) pair exactly as it does on GGUF rows. Matrices whose row count
// is not a multiple of the group's (8 or 16) keep GGUF's layout. The file's
// bytes are the same in number (8 blocks of 18 bytes = 144; 16 of 18, 144,
// 210, 34 or 20), so an interleaved copy replaces the mapped rows rather than
// adding to them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/model/dtype.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/kernel_table.h"

namespace duet::cpu {

// How a matrix's rows are stored.
enum class WeightLayout : uint8_t {
  kRows,           // row after row, as in GGUF files
  kInterleaved,    // the type's groups: Q4_0 of 8 rows, Q4_K, Q6_K, Q8_0 and Q4_1 of 16
  kInterleaved16,  // Q4_0 in groups of 16 rows (BlockQ4_0x16)
};

constexpr int kInterleavedRows = 8;  // Q4_0 for AVX2

// Block b of rows 8g .. 8g + 7: their scales, then 4 pairs of rows, each pair
// 32 bytes: byte e holds element e of row 2p in its low nibble and element e
// of row 2p + 1 in its high one (GGUF holds element e < 16 of a row in the
// low nibble of byte e, element e + 16 in its high nibble).
struct BlockQ4_0x8 {
  uint16_t d[kInterleavedRows];
  uint8_t qs[kInterleavedRows / 2][2 * kQuantBlock / 2];
};
static_assert(sizeof(BlockQ4_0x8) == kInterleavedRows * sizeof(BlockQ4_0));

// Q4_K matrices interleaved by 16 rows: super-block b of rows 16g .. 16g + 15
// holds their 16 scales d and mins dmin, then word i of each row's 12 packed
// scale bytes (i < 3), then word m of each row's 32-byte nibble group q (q <
// 4, m < 8), row after row: a 512-bit register's 16 int32 lanes are the 16
// rows. The same bytes as 16 GGUF blocks (16 x 144 = 2304).
constexpr int kInterleavedRowsQ4_K = 16;
struct BlockQ4_Kx16 {
  static constexpr int64_t kElements = kSuperBlock;
  uint16_t d[kInterleavedRowsQ4_K];
  uint16_t dmin[kInterleavedRowsQ4_K];
  uint32_t scales[3][kInterleavedRowsQ4_K];
  uint32_t qs[4][8][kInterleavedRowsQ4_K];
};
static_assert(sizeof(BlockQ4_Kx16) == kInterleavedRowsQ4_K * sizeof(BlockQ4_K));

// Q6_K matrices interleaved by 16 rows: super-block b of rows 16g .. 16g + 15
// holds word m of each row's 32-byte low-bit group ql[64h + 32p ..] (h, p <
// 2, m < 8), then word m of each row's high-bit group qh[32h ..], then each
// row's 16 sub-block scales as sub-block after sub-block (16 bytes, one per
// row), then the 16 scales d. The same bytes as 16 GGUF blocks (16 x 210).
constexpr int kInterleavedRowsQ6_K = 16;
struct BlockQ6_Kx16 {
  static constexpr int64_t kElements = kSuperBlock;
  uint32_t ql[2][2][8][kInterleavedRowsQ6_K];
  uint32_t qh[2][8][kInterleavedRowsQ6_K];
  int8_t scales[kSuperBlock / 16][kInterleavedRowsQ6_K];
  uint16_t d[kInterleavedRowsQ6_K];
};
static_assert(sizeof(BlockQ6_Kx16) == kInterleavedRowsQ6_K * sizeof(BlockQ6_K));

// Q4_0 matrices interleaved by 16 rows (the AVX-512 path's layout): block b
// of rows 16g .. 16g + 15 holds their 16 scales d, then word m of each row's
// 16 nibble bytes (m < 4: elements 4m .. 4m + 3 in its low nibbles, 16 + 4m
// .. in its high ones), row after row. The same bytes as 16 GGUF blocks (16
// x 18 = 288).
constexpr int kInterleavedRowsQ4_0x16 = 16;
struct BlockQ4_0x16 {
  static constexpr int64_t kElements = kQuantBlock;
  uint16_t d[kInterleavedRowsQ4_0x16];
  uint32_t qs[kQuantBlock / 8][kInterleavedRowsQ4_0x16];
};
static_assert(sizeof(BlockQ4_0x16) == kInterleavedRowsQ4_0x16 * sizeof(BlockQ4_0));

// Q8_0 matrices interleaved by 16 rows: block b of rows 16g .. 16g + 15
// holds word m (bytes 4m .. 4m + 3: 4 weights in element order) of each row
// (m < 8), row after row, then the 16 scales d. The same bytes as 16 GGUF
// blocks (16 x 34 = 544).
constexpr int kInterleavedRowsQ8_0 = 16;
struct BlockQ8_0x16 {
  static constexpr int64_t kElements = kQuantBlock;
  uint32_t qs[kQuantBlock / 4][kInterleavedRowsQ8_0];
  uint16_t d[kInterleavedRowsQ8_0];
};
static_assert(sizeof(BlockQ8_0x16) == kInterleavedRowsQ8_0 * sizeof(BlockQ8_0));

// Q4_1 matrices interleaved by 16 rows: block b of rows 16g .. 16g + 15 holds
// their 16 scales d and mins m, then word m of each row's 16 nibble bytes (m
// < 4: elements 4m .. 4m + 3 in its low nibbles, 16 + 4m .. in its high
// ones), row after row. The same bytes as 16 GGUF blocks (16 x 20 = 320).
constexpr int kInterleavedRowsQ4_1 = 16;
struct BlockQ4_1x16 {
  static constexpr int64_t kElements = kQuantBlock;
  uint16_t d[kInterleavedRowsQ4_1];
  uint16_t m[kInterleavedRowsQ4_1];
  uint32_t qs[kQuantBlock / 8][kInterleavedRowsQ4_1];
};
static_assert(sizeof(BlockQ4_1x16) == kInterleavedRowsQ4_1 * sizeof(BlockQ4_1));

// Whether a Q4_0 matrix of n_out rows can be interleaved.
inline bool can_interleave_q4_0(int64_t n_out) { return n_out % kInterleavedRows == 0; }

// n_out GGUF rows of k elements (18-byte blocks) -> the interleaved layout,
// the same number of bytes. n_out must be a multiple of 8.
void interleave_q4_0(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);

// Rows [row0, row0 + n_rows) of an interleaved matrix of k-element rows back
// into GGUF rows.
void deinterleave_q4_0(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows);

// The same for Q4_K (groups of 16 rows, k a multiple of 256).
inline bool can_interleave_q4_k(int64_t n_out) { return n_out % kInterleavedRowsQ4_K == 0; }
void interleave_q4_k(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);
void deinterleave_q4_k(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows);

// The same for Q6_K (groups of 16 rows, k a multiple of 256).
inline bool can_interleave_q6_k(int64_t n_out) { return n_out % kInterleavedRowsQ6_K == 0; }
void interleave_q6_k(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);
void deinterleave_q6_k(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows);

// The same for Q4_0 by 16, Q8_0 and Q4_1 (groups of 16 rows, k a multiple of 32).
void interleave_q4_0x16(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);
void deinterleave_q4_0x16(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                          uint8_t* rows);
void interleave_q8_0(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);
void deinterleave_q8_0(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows);
void interleave_q4_1(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);
void deinterleave_q4_1(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows);

// The rows of a group of `type` (Q4_0, Q4_K, Q6_K, Q8_0 or Q4_1) in `layout`
// (not kRows), and its interleave and deinterleave.
int64_t interleaved_group_rows(DType type, WeightLayout layout);
void interleave(DType type, WeightLayout layout, const uint8_t* rows, int64_t n_out, int64_t k,
                uint8_t* out);
void deinterleave(DType type, WeightLayout layout, const uint8_t* interleaved, int64_t k,
                  int64_t row0, int64_t n_rows, uint8_t* rows);

// The DotTileFn contract for weights of `type` in `layout` (`w_stride` is a
// GGUF row's bytes, n_w a multiple of the group's rows, `w` at a group's
// start) by a kernel of GGUF rows: groups are turned back into rows, a few
// dozen at a time, and `dot_rows` runs on them. Results are those of
// `dot_rows`, bit for bit.
void dot_interleaved_by_rows(DType type, WeightLayout layout, DotTileFn dot_rows, const uint8_t* w,
                             size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                             int64_t n_x, int64_t k, float* y, int64_t ldy);

}  // namespace duet::cpu

// Q4_0 matrices interleaved by 8 rows: the layout decode streams.
//
// A decode step reads every weight once per token, and one row at a time
// (GGUF's order) leaves the kernel one dependent FMA chain and scattered
// scale conversions per 32 weights. Groups of 8 rows stored block by block
// (BlockQ4_0x8) are one sequential stream with 8 independent chains, the 8
// scales converted by one instruction, and two rows' 32 weights in one
// 32-byte load, each row's in element order in its own nibble (a mask gives
// one row, a shift the other, with no shuffle).
//
// The layout changes no arithmetic: every kernel computes each (row,
// activation) pair exactly as it does on GGUF rows. Matrices whose row count
// is not a multiple of 8 keep GGUF's layout. The file's bytes are the same in
// number (8 blocks of 18 bytes = 144), so an interleaved copy replaces the
// mapped rows rather than adding to them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/model/quant_blocks.h"
#include "kernels/cpu/kernel_table.h"

namespace duet::cpu {

constexpr int kInterleavedRows = 8;

// Block b of rows 8g .. 8g + 7: their scales, then 4 pairs of rows, each pair
// 32 bytes: byte e holds element e of row 2p in its low nibble and element e
// of row 2p + 1 in its high one (GGUF holds element e < 16 of a row in the
// low nibble of byte e, element e + 16 in its high nibble).
struct BlockQ4_0x8 {
  uint16_t d[kInterleavedRows];
  uint8_t qs[kInterleavedRows / 2][2 * kQuantBlock / 2];
};
static_assert(sizeof(BlockQ4_0x8) == kInterleavedRows * sizeof(BlockQ4_0));

// Whether a Q4_0 matrix of n_out rows can be interleaved.
inline bool can_interleave_q4_0(int64_t n_out) { return n_out % kInterleavedRows == 0; }

// n_out GGUF rows of k elements (18-byte blocks) -> the interleaved layout,
// the same number of bytes. n_out must be a multiple of 8.
void interleave_q4_0(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out);

// Rows [row0, row0 + n_rows) of an interleaved matrix of k-element rows back
// into GGUF rows.
void deinterleave_q4_0(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows);

// The DotTileFn contract for interleaved Q4_0 weights (`w_stride` is a GGUF
// row's bytes, n_w a multiple of 8, `w` at a group's start) by a kernel of
// GGUF rows: groups are turned back into rows, a few dozen at a time, and
// `dot_rows` runs on them. Results are those of `dot_rows`, bit for bit.
void dot_interleaved_by_rows(DotTileFn dot_rows, const uint8_t* w, size_t w_stride, int64_t n_w,
                             const uint8_t* x, size_t x_stride, int64_t n_x, int64_t k, float* y,
                             int64_t ldy);

}  // namespace duet::cpu

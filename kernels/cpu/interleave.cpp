#include "kernels/cpu/interleave.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error.h"

namespace duet::cpu {
namespace {

// Rows turned back at once by dot_interleaved_by_rows: about half of a core's
// L2, so that the kernel re-reads them from there for every activation tile.
constexpr size_t kRowsBudgetBytes = 256 << 10;
constexpr int64_t kMaxRowsAtOnce = 64;

}  // namespace

void interleave_q4_0(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out) {
  DUET_ASSERT(can_interleave_q4_0(n_out) && k % kQuantBlock == 0,
              "interleave_q4_0: {} rows of {} elements", n_out, k);
  const int64_t nb = k / kQuantBlock;
  const auto* src = reinterpret_cast<const BlockQ4_0*>(rows);
  auto* dst = reinterpret_cast<BlockQ4_0x8*>(out);
  for (int64_t g = 0; g < n_out / kInterleavedRows; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      BlockQ4_0x8& block = dst[g * nb + b];
      for (int r = 0; r < kInterleavedRows; ++r) {
        const BlockQ4_0& from = src[(g * kInterleavedRows + r) * nb + b];
        block.d[r] = from.d;
        std::memcpy(block.qs[r / 2] + (r % 2) * sizeof(from.qs), from.qs, sizeof(from.qs));
      }
    }
  }
}

void deinterleave_q4_0(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows) {
  const int64_t nb = k / kQuantBlock;
  auto* dst = reinterpret_cast<BlockQ4_0*>(rows);
  for (int64_t row = row0; row < row0 + n_rows; ++row) {
    const auto* src =
        reinterpret_cast<const BlockQ4_0x8*>(interleaved) + row / kInterleavedRows * nb;
    const int64_t r = row % kInterleavedRows;
    for (int64_t b = 0; b < nb; ++b) {
      BlockQ4_0& to = dst[(row - row0) * nb + b];
      to.d = src[b].d[r];
      std::memcpy(to.qs, src[b].qs[r / 2] + (r % 2) * sizeof(to.qs), sizeof(to.qs));
    }
  }
}

void dot_interleaved_by_rows(DotTileFn dot_rows, const uint8_t* w, size_t w_stride, int64_t n_w,
                             const uint8_t* x, size_t x_stride, int64_t n_x, int64_t k, float* y,
                             int64_t ldy) {
  DUET_ASSERT(n_w % kInterleavedRows == 0, "interleaved weights in groups of 8 rows, got {}", n_w);
  const auto fit = static_cast<int64_t>(kRowsBudgetBytes / w_stride) / kInterleavedRows;
  const int64_t at_once =
      std::clamp<int64_t>(fit * kInterleavedRows, kInterleavedRows, kMaxRowsAtOnce);
  thread_local std::vector<uint8_t> rows;
  rows.resize(static_cast<size_t>(at_once) * w_stride);
  for (int64_t j0 = 0; j0 < n_w; j0 += at_once) {
    const int64_t n_j = std::min(at_once, n_w - j0);
    deinterleave_q4_0(w, k, j0, n_j, rows.data());
    dot_rows(rows.data(), w_stride, n_j, x, x_stride, n_x, k, y + j0, ldy);
  }
}

}  // namespace duet::cpu

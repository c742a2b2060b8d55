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
      for (int p = 0; p < kInterleavedRows / 2; ++p) {
        const BlockQ4_0& even = src[(g * kInterleavedRows + 2 * p) * nb + b];
        const BlockQ4_0& odd = src[(g * kInterleavedRows + 2 * p + 1) * nb + b];
        block.d[2 * p] = even.d;
        block.d[2 * p + 1] = odd.d;
        uint8_t* pair = block.qs[p];
        for (int e = 0; e < kQuantBlock / 2; ++e) {  // elements e and e + 16 of both rows
          pair[e] = static_cast<uint8_t>((even.qs[e] & 0x0f) | (odd.qs[e] & 0x0f) << 4);
          pair[e + kQuantBlock / 2] = static_cast<uint8_t>(even.qs[e] >> 4 | (odd.qs[e] & 0xf0));
        }
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
      const uint8_t* pair = src[b].qs[r / 2];
      for (int e = 0; e < kQuantBlock / 2; ++e) {
        const uint8_t low = pair[e], high = pair[e + kQuantBlock / 2];
        to.qs[e] =
            static_cast<uint8_t>(r % 2 == 0 ? (low & 0x0f) | high << 4 : low >> 4 | (high & 0xf0));
      }
    }
  }
}

namespace {

// The 16-row layouts, both ways: place(in the layout, in row r's GGUF block,
// bytes) for every piece of row r's block (a super-block for the K-quants),
// the one statement of where each piece goes.
struct Q4KPieces {
  template <typename X16, typename Row, typename Place>
  void operator()(X16& x16, Row& row, int r, Place place) const {
    place(&x16.d[r], &row.d, 2);
    place(&x16.dmin[r], &row.dmin, 2);
    for (int i = 0; i < 3; ++i) place(&x16.scales[i][r], row.scales + 4 * i, 4);
    for (int q = 0; q < 4; ++q)
      for (int m = 0; m < 8; ++m) place(&x16.qs[q][m][r], row.qs + 32 * q + 4 * m, 4);
  }
};

struct Q6KPieces {
  template <typename X16, typename Row, typename Place>
  void operator()(X16& x16, Row& row, int r, Place place) const {
    for (int h = 0; h < 2; ++h) {
      for (int m = 0; m < 8; ++m) {
        for (int p = 0; p < 2; ++p) place(&x16.ql[h][p][m][r], row.ql + 64 * h + 32 * p + 4 * m, 4);
        place(&x16.qh[h][m][r], row.qh + 32 * h + 4 * m, 4);
      }
    }
    for (int s = 0; s < kSuperBlock / 16; ++s) place(&x16.scales[s][r], &row.scales[s], 1);
    place(&x16.d[r], &row.d, 2);
  }
};

struct Q4_0Pieces {
  template <typename X16, typename Row, typename Place>
  void operator()(X16& x16, Row& row, int r, Place place) const {
    place(&x16.d[r], &row.d, 2);
    for (int m = 0; m < kQuantBlock / 8; ++m) place(&x16.qs[m][r], row.qs + 4 * m, 4);
  }
};

struct Q8_0Pieces {
  template <typename X16, typename Row, typename Place>
  void operator()(X16& x16, Row& row, int r, Place place) const {
    for (int m = 0; m < kQuantBlock / 4; ++m) place(&x16.qs[m][r], row.qs + 4 * m, 4);
    place(&x16.d[r], &row.d, 2);
  }
};

struct Q4_1Pieces {
  template <typename X16, typename Row, typename Place>
  void operator()(X16& x16, Row& row, int r, Place place) const {
    place(&x16.d[r], &row.d, 2);
    place(&x16.m[r], &row.m, 2);
    for (int m = 0; m < kQuantBlock / 8; ++m) place(&x16.qs[m][r], row.qs + 4 * m, 4);
  }
};

constexpr int kRowsX16 = 16;

template <typename X16, typename Row, typename Pieces>
void interleave_x16(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out, Pieces pieces) {
  DUET_ASSERT(n_out % kRowsX16 == 0 && k % X16::kElements == 0,
              "interleave by 16: {} rows of {} elements", n_out, k);
  const int64_t nb = k / X16::kElements;
  const auto* src = reinterpret_cast<const Row*>(rows);
  auto* dst = reinterpret_cast<X16*>(out);
  for (int64_t g = 0; g < n_out / kRowsX16; ++g) {
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < kRowsX16; ++r) {
        pieces(dst[g * nb + b], src[(g * kRowsX16 + r) * nb + b], r,
               [](void* to, const void* from, size_t n) { std::memcpy(to, from, n); });
      }
    }
  }
}

template <typename X16, typename Row, typename Pieces>
void deinterleave_x16(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                      uint8_t* rows, Pieces pieces) {
  const int64_t nb = k / X16::kElements;
  auto* dst = reinterpret_cast<Row*>(rows);
  for (int64_t row = row0; row < row0 + n_rows; ++row) {
    const auto* src = reinterpret_cast<const X16*>(interleaved) + row / kRowsX16 * nb;
    for (int64_t b = 0; b < nb; ++b) {
      pieces(src[b], dst[(row - row0) * nb + b], static_cast<int>(row % kRowsX16),
             [](const void* from, void* to, size_t n) { std::memcpy(to, from, n); });
    }
  }
}

static_assert(kInterleavedRowsQ4_K == kRowsX16 && kInterleavedRowsQ6_K == kRowsX16 &&
              kInterleavedRowsQ8_0 == kRowsX16 && kInterleavedRowsQ4_1 == kRowsX16 &&
              kInterleavedRowsQ4_0x16 == kRowsX16);

}  // namespace

void interleave_q4_k(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out) {
  interleave_x16<BlockQ4_Kx16, BlockQ4_K>(rows, n_out, k, out, Q4KPieces{});
}

void deinterleave_q4_k(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows) {
  deinterleave_x16<BlockQ4_Kx16, BlockQ4_K>(interleaved, k, row0, n_rows, rows, Q4KPieces{});
}

void interleave_q6_k(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out) {
  interleave_x16<BlockQ6_Kx16, BlockQ6_K>(rows, n_out, k, out, Q6KPieces{});
}

void deinterleave_q6_k(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows) {
  deinterleave_x16<BlockQ6_Kx16, BlockQ6_K>(interleaved, k, row0, n_rows, rows, Q6KPieces{});
}

void interleave_q4_0x16(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out) {
  interleave_x16<BlockQ4_0x16, BlockQ4_0>(rows, n_out, k, out, Q4_0Pieces{});
}

void deinterleave_q4_0x16(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                          uint8_t* rows) {
  deinterleave_x16<BlockQ4_0x16, BlockQ4_0>(interleaved, k, row0, n_rows, rows, Q4_0Pieces{});
}

void interleave_q8_0(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out) {
  interleave_x16<BlockQ8_0x16, BlockQ8_0>(rows, n_out, k, out, Q8_0Pieces{});
}

void deinterleave_q8_0(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows) {
  deinterleave_x16<BlockQ8_0x16, BlockQ8_0>(interleaved, k, row0, n_rows, rows, Q8_0Pieces{});
}

void interleave_q4_1(const uint8_t* rows, int64_t n_out, int64_t k, uint8_t* out) {
  interleave_x16<BlockQ4_1x16, BlockQ4_1>(rows, n_out, k, out, Q4_1Pieces{});
}

void deinterleave_q4_1(const uint8_t* interleaved, int64_t k, int64_t row0, int64_t n_rows,
                       uint8_t* rows) {
  deinterleave_x16<BlockQ4_1x16, BlockQ4_1>(interleaved, k, row0, n_rows, rows, Q4_1Pieces{});
}

int64_t interleaved_group_rows(DType type, WeightLayout layout) {
  DUET_ASSERT(layout != WeightLayout::kRows, "{} rows are not interleaved", dtype_name(type));
  switch (type) {
    case DType::kQ4_0:
      return layout == WeightLayout::kInterleaved16 ? kInterleavedRowsQ4_0x16 : kInterleavedRows;
    case DType::kQ4_K:
      return kInterleavedRowsQ4_K;
    case DType::kQ6_K:
      return kInterleavedRowsQ6_K;
    case DType::kQ8_0:
      return kInterleavedRowsQ8_0;
    case DType::kQ4_1:
      return kInterleavedRowsQ4_1;
    default:
      DUET_ASSERT(false, "no interleaved layout for {}", dtype_name(type));
  }
  return 0;
}

void interleave(DType type, WeightLayout layout, const uint8_t* rows, int64_t n_out, int64_t k,
                uint8_t* out) {
  DUET_ASSERT(layout == WeightLayout::kInterleaved ||
                  (layout == WeightLayout::kInterleaved16 && type == DType::kQ4_0),
              "no such layout for {}", dtype_name(type));
  if (layout == WeightLayout::kInterleaved16) return interleave_q4_0x16(rows, n_out, k, out);
  switch (type) {
    case DType::kQ4_K:
      return interleave_q4_k(rows, n_out, k, out);
    case DType::kQ6_K:
      return interleave_q6_k(rows, n_out, k, out);
    case DType::kQ8_0:
      return interleave_q8_0(rows, n_out, k, out);
    case DType::kQ4_1:
      return interleave_q4_1(rows, n_out, k, out);
    default:
      DUET_ASSERT(type == DType::kQ4_0, "no interleaved layout for {}", dtype_name(type));
      return interleave_q4_0(rows, n_out, k, out);
  }
}

void deinterleave(DType type, WeightLayout layout, const uint8_t* interleaved, int64_t k,
                  int64_t row0, int64_t n_rows, uint8_t* rows) {
  DUET_ASSERT(layout == WeightLayout::kInterleaved ||
                  (layout == WeightLayout::kInterleaved16 && type == DType::kQ4_0),
              "no such layout for {}", dtype_name(type));
  if (layout == WeightLayout::kInterleaved16) {
    return deinterleave_q4_0x16(interleaved, k, row0, n_rows, rows);
  }
  switch (type) {
    case DType::kQ4_K:
      return deinterleave_q4_k(interleaved, k, row0, n_rows, rows);
    case DType::kQ6_K:
      return deinterleave_q6_k(interleaved, k, row0, n_rows, rows);
    case DType::kQ8_0:
      return deinterleave_q8_0(interleaved, k, row0, n_rows, rows);
    case DType::kQ4_1:
      return deinterleave_q4_1(interleaved, k, row0, n_rows, rows);
    default:
      DUET_ASSERT(type == DType::kQ4_0, "no interleaved layout for {}", dtype_name(type));
      return deinterleave_q4_0(interleaved, k, row0, n_rows, rows);
  }
}

void dot_interleaved_by_rows(DType type, WeightLayout layout, DotTileFn dot_rows, const uint8_t* w,
                             size_t w_stride, int64_t n_w, const uint8_t* x, size_t x_stride,
                             int64_t n_x, int64_t k, float* y, int64_t ldy) {
  const int64_t group = interleaved_group_rows(type, layout);
  DUET_ASSERT(n_w % group == 0, "interleaved weights in groups of {} rows, got {}", group, n_w);
  const auto fit = static_cast<int64_t>(kRowsBudgetBytes / w_stride) / group;
  const int64_t at_once = std::clamp<int64_t>(fit * group, group, kMaxRowsAtOnce);
  thread_local std::vector<uint8_t> rows;
  rows.resize(static_cast<size_t>(at_once) * w_stride);
  for (int64_t j0 = 0; j0 < n_w; j0 += at_once) {
    const int64_t n_j = std::min(at_once, n_w - j0);
    deinterleave(type, layout, w, k, j0, n_j, rows.data());
    dot_rows(rows.data(), w_stride, n_j, x, x_stride, n_x, k, y + j0, ldy);
  }
}

}  // namespace duet::cpu

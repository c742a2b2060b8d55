// The checks the matrix-kernel tests run for each weight type, on every ISA
// path this CPU runs: agreement with a double reference and with the scalar
// path, batch invariance, and tile splits of the dot functions. Each check
// reports through gtest; call it under ASSERT_NO_FATAL_FAILURE so a failed
// assertion stops the test as it would inline.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/model/dtype.h"
#include "kernels/cpu/interleave.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/cpu/matmul_reference.h"

namespace duet::cpu::test_support {

inline bool bitwise_equal(const float* a, const float* b, size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

inline std::string shape_name(DType type, int64_t k, int64_t n_out, int64_t n_x) {
  return std::string(dtype_name(type)) + " k=" + std::to_string(k) +
         " n_out=" + std::to_string(n_out) + " n_x=" + std::to_string(n_x);
}

// The test name of a weight-type parameter.
inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

inline double max_abs(const std::vector<double>& values) {
  double m = 0.0;
  for (double v : values) m = std::max(m, std::fabs(v));
  return m;
}

// Runs matmul for x (n_x, k) into a fresh (n_x, n_out) buffer.
inline std::vector<float> run_matmul(const KernelTable& kernels, const WeightMatrix& w,
                                     const std::vector<float>& x, int64_t n_x, ThreadPool& pool) {
  PackedActivations packed;
  packed.pack(kernels, x.data(), n_x, w.k, {w.type}, pool);
  std::vector<float> y(static_cast<size_t>(n_x * w.n_out), NAN);
  matmul(kernels, w, packed, y.data(), w.n_out, pool);
  return y;
}

// x (n_x, w.k) packed and multiplied by w on every ISA path: each path packs
// exactly as `scalar_packed` (the scalar path's packing, which `ref` was
// computed from), lands within 1e-5 of ref's largest magnitude, and, when
// `bit_identical`, writes the scalar path's bits.
inline void check_matches_reference_on_every_isa(const Weights& w, const std::vector<float>& x,
                                                 int64_t n_x,
                                                 const PackedActivations& scalar_packed,
                                                 const std::vector<double>& ref, bool bit_identical,
                                                 ThreadPool& pool) {
  const double ref_max = max_abs(ref);
  ASSERT_GT(ref_max, 0.0);
  std::vector<float> scalar_y;
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string(isa_name(isa)));
    const KernelTable& kernels = kernel_table(isa);
    PackedActivations packed;
    packed.pack(kernels, x.data(), n_x, w.k, {w.type}, pool);
    size_t rb = 0, scalar_rb = 0;
    const uint8_t* rows = packed.rows(w.type, &rb);
    const uint8_t* scalar_rows = scalar_packed.rows(w.type, &scalar_rb);
    ASSERT_EQ(rb, scalar_rb);
    ASSERT_EQ(std::memcmp(rows, scalar_rows, rb * n_x), 0) << "packed activations differ";

    std::vector<float> y(static_cast<size_t>(n_x * w.n_out), NAN);
    matmul(kernels, w.matrix(), packed, y.data(), w.n_out, pool);
    double max_diff = 0.0;
    for (size_t e = 0; e < y.size(); ++e) {
      max_diff = std::max(max_diff, std::fabs(static_cast<double>(y[e]) - ref[e]));
    }
    EXPECT_LT(max_diff / ref_max, 1e-5) << "max |diff| " << max_diff << " max |ref| " << ref_max;
    if (isa == Isa::kScalar) {
      scalar_y = y;
    } else if (bit_identical) {
      for (size_t e = 0; e < y.size(); ++e) {
        ASSERT_EQ(std::bit_cast<uint32_t>(y[e]), std::bit_cast<uint32_t>(scalar_y[e]))
            << "differs from the scalar path at row " << e / w.n_out << " column " << e % w.n_out
            << ": " << y[e] << " vs " << scalar_y[e];
      }
    }
  }
}

// Where a row of the batch goes and how the weight rows are split.
struct BatchLayouts {
  std::vector<int64_t> sub_batch_sizes;  // each taken at every start, and last
  std::vector<int64_t> starts;
  std::vector<int64_t> weight_splits;  // first range's row count
};

// On `kernels`: row i of x (n_x, w.k) times w is bitwise the row of the
// whole batch's product when computed alone, in each sub-batch of `layouts`,
// or in the batch reversed, with 1, 2 or 3 threads; and the weight rows
// computed as two ranges, written into the full output with ldy, give the
// same columns.
inline void check_batch_invariance_on(const KernelTable& kernels, const Weights& w,
                                      const std::vector<float>& x, int64_t n_x,
                                      const BatchLayouts& layouts) {
  const int64_t k = w.k, n_out = w.n_out;
  ThreadPool pool1(1), pool2(2), pool3(3);
  ThreadPool* pools[] = {&pool1, &pool2, &pool3};
  const std::vector<float> full = run_matmul(kernels, w.matrix(), x, n_x, pool1);

  // Each row alone (decode shape), with every pool.
  for (ThreadPool* pool : pools) {
    for (int64_t i = 0; i < n_x; ++i) {
      const std::vector<float> xi(x.begin() + i * k, x.begin() + (i + 1) * k);
      const std::vector<float> yi = run_matmul(kernels, w.matrix(), xi, 1, *pool);
      ASSERT_TRUE(bitwise_equal(yi.data(), full.data() + i * n_out, n_out))
          << "row " << i << " alone, " << pool->size() << " threads";
    }
  }
  for (int64_t n : layouts.sub_batch_sizes) {
    std::vector<int64_t> starts = layouts.starts;
    starts.push_back(n_x - n);
    for (int64_t start : starts) {
      const std::vector<float> xs(x.begin() + start * k, x.begin() + (start + n) * k);
      for (ThreadPool* pool : pools) {
        const std::vector<float> ys = run_matmul(kernels, w.matrix(), xs, n, *pool);
        ASSERT_TRUE(bitwise_equal(ys.data(), full.data() + start * n_out, n * n_out))
            << "rows [" << start << ", " << start + n << "), " << pool->size() << " threads";
      }
    }
  }
  // The whole batch reversed: every row at another position.
  std::vector<float> reversed(x.size());
  for (int64_t i = 0; i < n_x; ++i) {
    std::copy_n(x.begin() + i * k, k, reversed.begin() + (n_x - 1 - i) * k);
  }
  for (ThreadPool* pool : pools) {
    const std::vector<float> yr = run_matmul(kernels, w.matrix(), reversed, n_x, *pool);
    for (int64_t i = 0; i < n_x; ++i) {
      ASSERT_TRUE(bitwise_equal(yr.data() + (n_x - 1 - i) * n_out, full.data() + i * n_out, n_out))
          << "row " << i << " at position " << n_x - 1 - i << ", " << pool->size() << " threads";
    }
  }
  for (int64_t split : layouts.weight_splits) {
    PackedActivations packed;
    packed.pack(kernels, x.data(), n_x, k, {w.type}, pool2);
    std::vector<float> y(full.size(), NAN);
    matmul(kernels, w.rows(0, split), packed, y.data(), n_out, pool2);
    matmul(kernels, w.rows(split, n_out - split), packed, y.data() + split, n_out, pool3);
    ASSERT_TRUE(bitwise_equal(y.data(), full.data(), full.size())) << "split at " << split;
  }
}

// check_batch_invariance_on every ISA path.
inline void check_batch_invariance(const Weights& w, const std::vector<float>& x, int64_t n_x,
                                   const BatchLayouts& layouts) {
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string(isa_name(isa)) + " " + shape_name(w.type, w.k, w.n_out, n_x));
    ASSERT_NO_FATAL_FAILURE(check_batch_invariance_on(kernel_table(isa), w, x, n_x, layouts));
  }
}

// The dot tile function of `kernels` for w.type called directly: every tiling
// of the weight rows by `tile_ws` and the activation rows by `tile_xs` writes
// the bits of one whole call, and nothing past n_w.
inline void check_dot_tile_splits_on(const KernelTable& kernels, const Weights& w,
                                     const std::vector<float>& x, int64_t n_x,
                                     const std::vector<int64_t>& tile_ws,
                                     const std::vector<int64_t>& tile_xs, ThreadPool& pool) {
  const int64_t k = w.k, n_out = w.n_out;
  const DotTileFn dot = dot_tile_fn(kernels, w.type);
  PackedActivations packed;
  packed.pack(kernels, x.data(), n_x, k, {w.type}, pool);
  size_t x_stride = 0;
  const uint8_t* xr = packed.rows(w.type, &x_stride);
  const int64_t ldy = n_out + 5;  // a padded output stride
  std::vector<float> whole(static_cast<size_t>(n_x * ldy), NAN);
  dot(w.bytes.data(), w.row_bytes, n_out, xr, x_stride, n_x, k, whole.data(), ldy);
  for (int64_t tile_w : tile_ws) {
    for (int64_t tile_x : tile_xs) {
      std::vector<float> y(whole.size(), NAN);
      for (int64_t j0 = 0; j0 < n_out; j0 += tile_w) {
        for (int64_t i0 = 0; i0 < n_x; i0 += tile_x) {
          const int64_t nw = std::min(tile_w, n_out - j0), nx = std::min(tile_x, n_x - i0);
          dot(w.bytes.data() + j0 * w.row_bytes, w.row_bytes, nw, xr + i0 * x_stride, x_stride, nx,
              k, y.data() + i0 * ldy + j0, ldy);
        }
      }
      for (int64_t i = 0; i < n_x; ++i) {
        ASSERT_TRUE(bitwise_equal(y.data() + i * ldy, whole.data() + i * ldy, n_out))
            << "tiles of " << tile_w << " weight rows x " << tile_x << " activation rows, row "
            << i;
        for (int64_t j = n_out; j < ldy; ++j) {
          ASSERT_TRUE(std::isnan(y[i * ldy + j])) << "wrote past n_w at row " << i;
        }
      }
    }
  }
}

// check_dot_tile_splits_on every ISA path.
inline void check_dot_tile_splits(const Weights& w, const std::vector<float>& x, int64_t n_x,
                                  const std::vector<int64_t>& tile_ws,
                                  const std::vector<int64_t>& tile_xs, ThreadPool& pool) {
  for (Isa isa : supported_isas()) {
    SCOPED_TRACE(std::string(isa_name(isa)) + " " + shape_name(w.type, w.k, w.n_out, n_x));
    ASSERT_NO_FATAL_FAILURE(
        check_dot_tile_splits_on(kernel_table(isa), w, x, n_x, tile_ws, tile_xs, pool));
  }
}

// On `isa`: matmul of w with `shared`, a pack made for several weight types,
// writes the bits a pack made for w alone gives.
inline void expect_shared_pack_serves(Isa isa, const Weights& w, const PackedActivations& shared,
                                      const std::vector<float>& x, int64_t n_x, ThreadPool& pool) {
  const KernelTable& kernels = kernel_table(isa);
  std::vector<float> y(static_cast<size_t>(n_x * w.n_out));
  matmul(kernels, w.matrix(), shared, y.data(), w.n_out, pool);
  const std::vector<float> alone = run_matmul(kernels, w.matrix(), x, n_x, pool);
  EXPECT_TRUE(bitwise_equal(y.data(), alone.data(), y.size()))
      << isa_name(isa) << " " << dtype_name(w.type);
}

// w (rows of a type with a layout) laid out in `layout`: deinterleaving gives the rows
// back, rows dequantize alike, and every ISA path, on 1 and 2 threads, gives
// the scalar path's bits on the rows for each activation count in n_xs.
inline void check_interleaved_matches_rows(const Weights& w, const std::vector<int64_t>& n_xs,
                                           std::mt19937& rng,
                                           WeightLayout layout = WeightLayout::kInterleaved) {
  ThreadPool one(1), two(2);
  const WeightMatrix rows = w.matrix();
  std::vector<uint8_t> bytes(rows.row_bytes * static_cast<size_t>(w.n_out));
  const WeightMatrix interleaved = interleave(rows, layout, bytes.data());
  ASSERT_EQ(interleaved.layout, layout);
  std::vector<uint8_t> back(bytes.size());
  deinterleave(w.type, layout, bytes.data(), w.k, 0, w.n_out, back.data());
  EXPECT_EQ(0, std::memcmp(back.data(), rows.data, back.size()));
  std::vector<float> row_a(static_cast<size_t>(w.k)), row_b(static_cast<size_t>(w.k));
  for (int64_t j : {int64_t{0}, int64_t{5}, w.n_out - 1}) {
    dequantize_weight_row(rows, j, row_a.data());
    dequantize_weight_row(interleaved, j, row_b.data());
    EXPECT_TRUE(bitwise_equal(row_a.data(), row_b.data(), row_a.size())) << "row " << j;
  }
  for (int64_t n_x : n_xs) {
    SCOPED_TRACE(shape_name(w.type, w.k, w.n_out, n_x));
    const std::vector<float> x = random_activations(n_x, w.k, rng);
    const std::vector<float> scalar = run_matmul(scalar_kernel_table(), rows, x, n_x, one);
    for (Isa isa : supported_isas()) {
      for (ThreadPool* pool : {&one, &two}) {
        const std::vector<float> y = run_matmul(kernel_table(isa), interleaved, x, n_x, *pool);
        EXPECT_TRUE(bitwise_equal(y.data(), scalar.data(), y.size()))
            << isa_name(isa) << ", " << pool->size() << " threads";
      }
    }
  }
}

}  // namespace duet::cpu::test_support

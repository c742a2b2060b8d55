// Shared by the matrix-kernel tests: random activations, the activations a
// kernel actually sees (packed, then dequantized), and a double-precision
// reference product.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantize.h"

namespace duet::cpu::test_support {

// Weights stored in `type` by the scalar reference quantizers, and their
// dequantized values (what the kernel multiplies by).
struct Weights {
  DType type = DType::kF32;
  int64_t k = 0;
  int64_t n_out = 0;
  size_t row_bytes = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> values;  // (n_out, k), dequantized

  WeightMatrix matrix() const { return make_weight_matrix(type, bytes.data(), k, n_out); }
  // Rows [j0, j0 + n) as a matrix of their own.
  WeightMatrix rows(int64_t j0, int64_t n) const {
    return make_weight_matrix(type, bytes.data() + j0 * row_bytes, k, n);
  }
};

// Zeroed bytes and values of the right sizes, for the caller to fill.
inline Weights zeroed_weights(DType type, int64_t k, int64_t n_out) {
  Weights w;
  w.type = type;
  w.k = k;
  w.n_out = n_out;
  w.row_bytes = dtype_row_bytes(type, k);
  w.bytes.resize(w.row_bytes * n_out);
  w.values.resize(static_cast<size_t>(k * n_out));
  return w;
}

// fill_row(j, row) writes the k float values of weight row j before quantization.
inline Weights make_weights_with(
    DType type, int64_t k, int64_t n_out,
    const std::function<void(int64_t, std::vector<float>&)>& fill_row) {
  Weights w = zeroed_weights(type, k, n_out);
  std::vector<float> row(static_cast<size_t>(k));
  for (int64_t j = 0; j < n_out; ++j) {
    fill_row(j, row);
    quantize_row(type, row.data(), w.bytes.data() + j * w.row_bytes, k);
    dequantize_row(type, w.bytes.data() + j * w.row_bytes, w.values.data() + j * k, k);
  }
  return w;
}

inline std::vector<float> random_activations(int64_t n_x, int64_t k, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n_x * k));
  for (float& v : x) v = normal(rng);
  return x;
}

// The packed activation rows for `w_type`, dequantized: (n_x, k).
inline std::vector<float> packed_values(const PackedActivations& packed, DType w_type) {
  size_t row_bytes = 0;
  const uint8_t* rows = packed.rows(w_type, &row_bytes);
  const int64_t k = packed.k();
  std::vector<float> out(static_cast<size_t>(packed.n_rows() * k));
  for (int64_t i = 0; i < packed.n_rows(); ++i) {
    dequantize_row(activation_type(w_type), rows + i * row_bytes, out.data() + i * k, k);
  }
  return out;
}

// y (n_x, n_out) = x (n_x, k) . w (n_out, k)^T in double.
inline std::vector<double> reference_matmul(const std::vector<float>& w,
                                            const std::vector<float>& x, int64_t k, int64_t n_out,
                                            int64_t n_x) {
  std::vector<double> y(static_cast<size_t>(n_x * n_out));
  for (int64_t i = 0; i < n_x; ++i) {
    for (int64_t j = 0; j < n_out; ++j) {
      double sum = 0.0;
      const float* wr = w.data() + j * k;
      const float* xr = x.data() + i * k;
      for (int64_t e = 0; e < k; ++e) sum += static_cast<double>(wr[e]) * xr[e];
      y[i * n_out + j] = sum;
    }
  }
  return y;
}

// The reference for exactly what a kernel multiplies: w's dequantized values
// by the packed activations, dequantized. (packed.n_rows(), w.n_out)
inline std::vector<double> reference_matmul(const Weights& w, const PackedActivations& packed) {
  return reference_matmul(w.values, packed_values(packed, w.type), w.k, w.n_out, packed.n_rows());
}

}  // namespace duet::cpu::test_support

// Non-negative least squares, the solver under a profile's fits: a few dozen
// unknowns at most, so a dense Lawson–Hanson active set over Householder QR.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace duet::sim {

// A dense matrix, row-major: element (r, c) at values[r * n_cols + c].
struct DenseMatrix {
  int64_t n_rows = 0;
  int64_t n_cols = 0;
  std::vector<double> values;

  DenseMatrix(int64_t rows, int64_t cols);
  double& operator()(int64_t r, int64_t c) { return values[r * n_cols + c]; }
  double operator()(int64_t r, int64_t c) const { return values[r * n_cols + c]; }
};

// The x >= 0 that minimises ||a x - b|| (a: (n_rows, n_cols), b: n_rows),
// by Lawson and Hanson's active-set method.
//
// Robustness: each column is scaled to unit norm before solving (and the
// result scaled back), so unknowns of very different magnitudes (seconds per
// token beside seconds per attention pair) weigh alike; a column that is all
// zero carries no signal and gets 0. Every least-squares subproblem is solved
// by Householder QR of the passive columns stacked over kRidge times the
// identity, a ridge far below what the data resolves that keeps collinear
// columns (samples that cannot tell two terms apart) from blowing up: among
// equally good fits it picks the one of least norm.
// Throws duet::Error (kInvalidArgument) when b's length is not n_rows or an
// entry is not finite.
std::vector<double> nonnegative_least_squares(const DenseMatrix& a, std::span<const double> b);

}  // namespace duet::sim

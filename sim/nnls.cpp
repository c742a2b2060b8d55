#include "sim/nnls.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/error.h"

namespace duet::sim {
namespace {

// The ridge under every subproblem, in units of a unit-norm column: squared,
// 1e-18 of a column's weight, far below double rounding of a fit's residual,
// yet it keeps R's diagonal away from zero when columns are collinear.
constexpr double kRidge = 1e-9;

// The least-squares solution over the columns `cols` of `a` (unit-norm
// columns), with the ridge: QR of [a_cols; kRidge * I], then back substitution.
std::vector<double> solve_passive(const DenseMatrix& a, std::span<const double> b,
                                  const std::vector<int64_t>& cols) {
  const int64_t m = a.n_rows;
  const int64_t p = static_cast<int64_t>(cols.size());
  const int64_t rows = m + p;
  DenseMatrix q(rows, p);  // overwritten by R above the diagonal
  std::vector<double> rhs(rows, 0.0);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < p; ++c) q(r, c) = a(r, cols[c]);
    rhs[r] = b[r];
  }
  for (int64_t c = 0; c < p; ++c) q(m + c, c) = kRidge;

  // Householder: column k's entries from row k down become (alpha, 0, ...).
  std::vector<double> v(rows);
  for (int64_t k = 0; k < p; ++k) {
    double norm2 = 0;
    for (int64_t r = k; r < rows; ++r) norm2 += q(r, k) * q(r, k);
    const double norm = std::sqrt(norm2);
    if (norm == 0) continue;
    const double alpha = q(k, k) > 0 ? -norm : norm;
    for (int64_t r = k; r < rows; ++r) v[r] = q(r, k);
    v[k] -= alpha;
    double v2 = 0;
    for (int64_t r = k; r < rows; ++r) v2 += v[r] * v[r];
    if (v2 == 0) continue;
    auto reflect = [&](auto&& at) {
      double dot = 0;
      for (int64_t r = k; r < rows; ++r) dot += v[r] * at(r);
      const double f = 2 * dot / v2;
      for (int64_t r = k; r < rows; ++r) at(r) -= f * v[r];
    };
    for (int64_t c = k; c < p; ++c) reflect([&](int64_t r) -> double& { return q(r, c); });
    reflect([&](int64_t r) -> double& { return rhs[r]; });
  }
  std::vector<double> z(p, 0.0);
  for (int64_t k = p - 1; k >= 0; --k) {
    double s = rhs[k];
    for (int64_t c = k + 1; c < p; ++c) s -= q(k, c) * z[c];
    z[k] = q(k, k) != 0 ? s / q(k, k) : 0.0;
  }
  return z;
}

// w = a^T (b - a x).
std::vector<double> gradient(const DenseMatrix& a, std::span<const double> b,
                             const std::vector<double>& x) {
  std::vector<double> w(a.n_cols, 0.0);
  for (int64_t r = 0; r < a.n_rows; ++r) {
    double residual = b[r];
    for (int64_t c = 0; c < a.n_cols; ++c) residual -= a(r, c) * x[c];
    for (int64_t c = 0; c < a.n_cols; ++c) w[c] += a(r, c) * residual;
  }
  return w;
}

}  // namespace

DenseMatrix::DenseMatrix(int64_t rows, int64_t cols)
    : n_rows(rows), n_cols(cols), values(static_cast<size_t>(rows * cols), 0.0) {
  DUET_REQUIRE(rows >= 0 && cols >= 0, "a matrix of {} x {}", rows, cols);
}

std::vector<double> nonnegative_least_squares(const DenseMatrix& a_in, std::span<const double> b) {
  DUET_REQUIRE(static_cast<int64_t>(b.size()) == a_in.n_rows,
               "least squares: {} targets for {} rows", b.size(), a_in.n_rows);
  const int64_t m = a_in.n_rows;
  const int64_t n = a_in.n_cols;
  for (double value : a_in.values)
    DUET_REQUIRE(std::isfinite(value), "least squares: a non-finite entry");
  double b_norm2 = 0;
  for (double value : b) {
    DUET_REQUIRE(std::isfinite(value), "least squares: a non-finite target");
    b_norm2 += value * value;
  }

  // Unit-norm columns; an all-zero column stays out of the solve.
  DenseMatrix a = a_in;
  std::vector<double> scale(n, 0.0);
  for (int64_t c = 0; c < n; ++c) {
    double norm2 = 0;
    for (int64_t r = 0; r < m; ++r) norm2 += a(r, c) * a(r, c);
    scale[c] = std::sqrt(norm2);
    if (scale[c] > 0)
      for (int64_t r = 0; r < m; ++r) a(r, c) /= scale[c];
  }

  std::vector<double> x(n, 0.0);
  if (b_norm2 == 0) return x;
  const double tol = 10 * std::numeric_limits<double>::epsilon() *
                     static_cast<double>(std::max(m, n)) * std::sqrt(b_norm2);
  std::vector<bool> passive(n, false);
  // A column whose entry at once went non-positive (rounding near the
  // optimum); kept out until x moves, so the method cannot cycle on it.
  std::vector<bool> blocked(n, false);

  const int64_t max_iterations = 10 * n + 10;
  for (int64_t iteration = 0; iteration < max_iterations; ++iteration) {
    const std::vector<double> w = gradient(a, b, x);
    int64_t best = -1;
    for (int64_t c = 0; c < n; ++c) {
      if (passive[c] || blocked[c] || scale[c] == 0) continue;
      if (w[c] > tol && (best < 0 || w[c] > w[best])) best = c;
    }
    if (best < 0) break;
    passive[best] = true;

    bool first = true;
    for (int64_t inner = 0; inner <= n; ++inner) {
      std::vector<int64_t> cols;
      for (int64_t c = 0; c < n; ++c)
        if (passive[c]) cols.push_back(c);
      if (cols.empty()) break;
      const std::vector<double> z = solve_passive(a, b, cols);
      if (std::all_of(z.begin(), z.end(), [](double v) { return v > 0; })) {
        std::fill(x.begin(), x.end(), 0.0);
        for (size_t i = 0; i < cols.size(); ++i) x[cols[i]] = z[i];
        std::fill(blocked.begin(), blocked.end(), false);
        break;
      }
      if (first) {
        const auto it = std::find(cols.begin(), cols.end(), best);
        if (z[it - cols.begin()] <= 0) {
          passive[best] = false;
          blocked[best] = true;
          break;
        }
      }
      first = false;
      // Step from x towards z as far as every passive entry stays >= 0; the
      // entry that stops the step (and any at or below 0) leaves the set.
      double alpha = std::numeric_limits<double>::infinity();
      size_t stop = 0;
      for (size_t i = 0; i < cols.size(); ++i) {
        if (z[i] > 0) continue;
        const double gap = x[cols[i]] - z[i];
        const double reach = gap > 0 ? x[cols[i]] / gap : 0.0;
        if (reach < alpha) alpha = reach, stop = i;
      }
      for (size_t i = 0; i < cols.size(); ++i) {
        double& xi = x[cols[i]];
        xi += alpha * (z[i] - xi);
        if (i == stop || xi <= 0) {
          xi = 0;
          passive[cols[i]] = false;
        }
      }
      std::fill(blocked.begin(), blocked.end(), false);
    }
  }
  for (int64_t c = 0; c < n; ++c) x[c] = scale[c] > 0 ? x[c] / scale[c] : 0.0;
  return x;
}

}  // namespace duet::sim

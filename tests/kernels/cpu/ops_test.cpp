// Row-wise and element-wise operations against double-precision references,
// and the thread pool the kernels run on.
//
// TODO(cleanup): the ThreadPool tests belong in their own thread_pool_test.cpp
// (one concept per file); they sit here until that file is added.
#include "kernels/cpu/ops.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"

namespace duet::cpu {
namespace {

std::vector<float> random_floats(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// ---------------------------------------------------------------------------
// rms_norm

TEST(RmsNorm, MatchesDoubleReference) {
  std::mt19937 rng(31);
  for (int64_t dim : {1, 7, 64, 576, 4096}) {
    const int64_t n_rows = 5;
    std::vector<float> x = random_floats(static_cast<size_t>(n_rows * dim), 3.0f, rng);
    for (int64_t i = 0; i < dim; ++i) x[4 * dim + i] *= 1e-4f;  // a row of tiny values: eps matters
    const std::vector<float> weight = random_floats(static_cast<size_t>(dim), 1.0f, rng);
    const float eps = 1e-5f;
    std::vector<float> out(x.size());
    rms_norm(x.data(), weight.data(), out.data(), n_rows, dim, eps);
    for (int64_t r = 0; r < n_rows; ++r) {
      double sum = 0.0;
      for (int64_t i = 0; i < dim; ++i) sum += static_cast<double>(x[r * dim + i]) * x[r * dim + i];
      const double scale = 1.0 / std::sqrt(sum / static_cast<double>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) {
        const double ref = x[r * dim + i] * scale * weight[i];
        ASSERT_NEAR(out[r * dim + i], ref, 1e-6 * std::fabs(ref) + 1e-30)
            << "dim " << dim << " row " << r << " element " << i;
      }
    }
    // In place gives the same bits.
    std::vector<float> in_place = x;
    rms_norm(in_place.data(), weight.data(), in_place.data(), n_rows, dim, eps);
    EXPECT_EQ(in_place, out);
  }
}

// ---------------------------------------------------------------------------
// rope

struct RopeReference {
  RopeStyle style;
  int64_t n_rot;
  double freq_base;
  double freq_scale = 1.0;
  const float* freq_factors = nullptr;
};

// Rotates one head in double by angle_i = freq_scale * pos * base^(-2i / n_rot)
// / factor_i; also returns, per element, an error bound for the float version,
// which builds theta_i by i repeated float multiplications by a rounded ratio
// (a relative error up to about (3i + 4) 2^-24 in the angle).
void reference_rope(const float* in, double* out, double* bound, int64_t head_dim, int32_t pos,
                    const RopeReference& p) {
  const int64_t half = p.n_rot / 2;
  for (int64_t d = 0; d < head_dim; ++d) {
    out[d] = in[d];
    bound[d] = 0.0;
  }
  for (int64_t i = 0; i < half; ++i) {
    const double factor = p.freq_factors != nullptr ? p.freq_factors[i] : 1.0;
    const double theta = p.freq_scale * pos *
                         std::pow(p.freq_base, -2.0 * static_cast<double>(i) / p.n_rot) / factor;
    const int64_t a = p.style == RopeStyle::kAdjacentPairs ? 2 * i : i;
    const int64_t b = p.style == RopeStyle::kAdjacentPairs ? 2 * i + 1 : i + half;
    const double x0 = in[a], x1 = in[b];
    out[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
    out[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
    const double angle_error = theta * static_cast<double>(3 * i + 6) * 0x1p-24;
    bound[a] = bound[b] = (std::fabs(x0) + std::fabs(x1)) * (angle_error + 1e-6);
  }
}

TEST(Rope, BothStylesMatchDoubleReference) {
  std::mt19937 rng(32);
  const int64_t n_heads = 3, head_dim = 64;
  const std::vector<int32_t> positions = {0, 1, 17, 4000};
  const auto n_rows = static_cast<int64_t>(positions.size());
  double worst_relative = 0.0;
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalves}) {
    for (float freq_base : {10000.0f, 100000.0f}) {
      for (int64_t n_rot : {head_dim, head_dim / 2}) {  // full and partial rotation
        SCOPED_TRACE(std::string(style == RopeStyle::kHalves ? "halves" : "adjacent pairs") +
                     " base " + std::to_string(freq_base) + " n_rot " + std::to_string(n_rot));
        const std::vector<float> x =
            random_floats(static_cast<size_t>(n_rows * n_heads * head_dim), 1.0f, rng);
        std::vector<float> y = x;
        RopeParams params;
        params.style = style;
        params.n_rot = n_rot;
        params.freq_base = freq_base;
        rope(y.data(), n_rows, n_heads, head_dim, positions.data(), params);
        std::vector<double> ref(static_cast<size_t>(head_dim)), bound(ref.size());
        for (int64_t r = 0; r < n_rows; ++r) {
          for (int64_t h = 0; h < n_heads; ++h) {
            const int64_t off = (r * n_heads + h) * head_dim;
            reference_rope(x.data() + off, ref.data(), bound.data(), head_dim, positions[r],
                           {style, n_rot, freq_base});
            double norm = 0.0;
            for (int64_t d = 0; d < head_dim; ++d) norm = std::max(norm, std::fabs(ref[d]));
            for (int64_t d = 0; d < head_dim; ++d) {
              const double diff = std::fabs(y[off + d] - ref[d]);
              worst_relative = std::max(worst_relative, diff / norm);
              ASSERT_LE(diff, bound[d] + 1e-7 * norm)
                  << "position " << positions[r] << " head " << h << " dim " << d;
              if (d >= n_rot) {
                ASSERT_EQ(y[off + d], x[off + d]) << "dim " << d << " must not rotate";
              }
            }
          }
        }
      }
    }
  }
  // The brief's ~1e-4 relative tolerance, against each head's largest element.
  EXPECT_LT(worst_relative, 2e-4);
  std::printf("  rope: worst error relative to the head's max |x| %.3g\n", worst_relative);
}

TEST(Rope, FrequencyScaleAndFactors) {
  std::mt19937 rng(37);
  const int64_t n_heads = 2, head_dim = 64;
  const std::vector<int32_t> positions = {3, 250, 8191};
  std::uniform_real_distribution<float> uniform(1.0f, 8.0f);
  std::vector<float> factors(head_dim / 2);
  for (float& f : factors) f = uniform(rng);
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalves}) {
    const std::vector<float> x =
        random_floats(static_cast<size_t>(3 * n_heads * head_dim), 1.0f, rng);
    std::vector<float> y = x;
    RopeParams params;
    params.style = style;
    params.n_rot = head_dim;
    params.freq_base = 500000.0f;
    params.freq_scale = 0.25f;
    params.freq_factors = factors.data();
    rope(y.data(), 3, n_heads, head_dim, positions.data(), params);
    std::vector<double> ref(static_cast<size_t>(head_dim)), bound(ref.size());
    for (int64_t r = 0; r < 3; ++r) {
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t off = (r * n_heads + h) * head_dim;
        reference_rope(x.data() + off, ref.data(), bound.data(), head_dim, positions[r],
                       {style, head_dim, 500000.0, 0.25, factors.data()});
        for (int64_t d = 0; d < head_dim; ++d) {
          ASSERT_LE(std::fabs(y[off + d] - ref[d]), bound[d] + 1e-7)
              << "position " << positions[r] << " dim " << d;
        }
      }
    }
  }
}

TEST(Rope, PositionZeroIsTheIdentity) {
  std::mt19937 rng(33);
  const int64_t n_rows = 4, n_heads = 2, head_dim = 64;
  const std::vector<int32_t> positions(n_rows, 0);
  for (RopeStyle style : {RopeStyle::kAdjacentPairs, RopeStyle::kHalves}) {
    const std::vector<float> x =
        random_floats(static_cast<size_t>(n_rows * n_heads * head_dim), 1.0f, rng);
    std::vector<float> y = x;
    RopeParams params;
    params.style = style;
    params.n_rot = head_dim;
    rope(y.data(), n_rows, n_heads, head_dim, positions.data(), params);
    EXPECT_EQ(y, x);
  }
}

TEST(Rope, PreservesEachPairsNorm) {
  std::mt19937 rng(34);
  const int64_t head_dim = 128;
  const std::vector<int32_t> positions = {5, 123, 4095, 32767};
  std::vector<float> x = random_floats(static_cast<size_t>(4 * head_dim), 1.0f, rng);
  std::vector<float> y = x;
  RopeParams params;
  params.style = RopeStyle::kHalves;
  params.n_rot = head_dim;
  params.freq_base = 500000.0f;
  rope(y.data(), 4, 1, head_dim, positions.data(), params);
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t i = 0; i < head_dim / 2; ++i) {
      const float* a = x.data() + r * head_dim;
      const float* b = y.data() + r * head_dim;
      const double before = std::hypot(a[i], a[i + head_dim / 2]);
      const double after = std::hypot(b[i], b[i + head_dim / 2]);
      EXPECT_NEAR(after, before, 1e-6 * (before + 1e-3)) << "row " << r << " pair " << i;
    }
  }
}

// ---------------------------------------------------------------------------
// silu_mul, add_in_place, softmax_in_place

TEST(SiluMul, MatchesDoubleReferenceAndIsBitIdenticalOnEveryIsa) {
  std::mt19937 rng(35);
  const int64_t n = 4096 + 7;  // a scalar tail after the vector lanes
  std::vector<float> gate = random_floats(n, 4.0f, rng);
  const std::vector<float> up = random_floats(n, 1.0f, rng);
  gate[0] = -100.0f;  // exp(100) overflows float: silu must still be -0
  gate[1] = 100.0f;
  gate[2] = 0.0f;
  std::vector<float> scalar(n);
  kernel_table(Isa::kScalar).silu_mul(gate.data(), up.data(), scalar.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i];
    const double ref = g / (1.0 + std::exp(-g)) * up[i];
    ASSERT_NEAR(scalar[i], ref, 1e-6 * std::fabs(ref) + 1e-30)
        << "gate " << gate[i] << " up " << up[i];
  }
  for (Isa isa : {Isa::kAvx2, Isa::kAvx512}) {
    if (!cpu_supports(isa)) continue;
    std::vector<float> out(n);
    kernel_table(isa).silu_mul(gate.data(), up.data(), out.data(), n);
    ASSERT_EQ(0, std::memcmp(out.data(), scalar.data(), n * sizeof(float))) << isa_name(isa);
    std::vector<float> aliased = gate;
    kernel_table(isa).silu_mul(aliased.data(), up.data(), aliased.data(), n);
    EXPECT_EQ(0, std::memcmp(aliased.data(), scalar.data(), n * sizeof(float))) << isa_name(isa);
  }
}

// GELU as llama.cpp's CPU build computes it: within F16 rounding (twice) of
// the tanh form in double, cut off at |x| >= 10, and the same bits whatever
// the threads.
TEST(GeluMul, MatchesTanhGeluToF16AndIgnoresThreads) {
  auto reference = [](double x) {
    return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)));
  };
  for (float x = -12.0f; x <= 12.0f; x += 0.0137f) {
    const double want = x <= -10.0f ? 0.0 : x >= 10.0f ? x : reference(x);
    // F16 rounding of x moves gelu by up to 2^-11 |x| |gelu'(x)| (gelu' <= 1.13), of the result
    // by 2^-11 |gelu|; F16's smallest steps (2^-24) bound both near zero.
    const double bound =
        1.13 * (std::fabs(x) * 0x1p-11 + 0x1p-24) + std::fabs(want) * 0x1p-11 + 0x1p-24;
    EXPECT_NEAR(gelu(x), want, bound) << "x " << x;
  }
  EXPECT_EQ(gelu(-10.0f), 0.0f);
  EXPECT_EQ(gelu(10.0f), 10.0f);
  EXPECT_EQ(gelu(0.0f), 0.0f);

  std::mt19937 rng(9);
  const int64_t rows = 7, width = 300;
  const std::vector<float> gate = random_floats(rows * width, 4.0f, rng);
  const std::vector<float> up = random_floats(rows * width, 1.0f, rng);
  std::vector<float> one(rows * width), three(rows * width);
  ThreadPool pool1(1), pool3(3);
  gelu_mul(gate.data(), up.data(), one.data(), rows, width, pool1);
  gelu_mul(gate.data(), up.data(), three.data(), rows, width, pool3);
  EXPECT_EQ(0, std::memcmp(one.data(), three.data(), one.size() * sizeof(float)));
  for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(one[i], gelu(gate[i]) * up[i]) << i;
}

TEST(Scale, MultipliesEachElement) {
  std::vector<float> x = {1.0f, -2.0f, 0.5f};
  scale(x.data(), 3, 8.0f);
  EXPECT_EQ(x, (std::vector<float>{8.0f, -16.0f, 4.0f}));
}

TEST(AddInPlace, AddsElementWise) {
  std::vector<float> x = {1.0f, 2.0f, -3.0f};
  const std::vector<float> y = {0.5f, -2.0f, 3.0f};
  add_in_place(x.data(), y.data(), 3);
  EXPECT_EQ(x, (std::vector<float>{1.5f, 0.0f, 0.0f}));
}

TEST(SoftmaxInPlace, SumsToOneAndMatchesReference) {
  std::mt19937 rng(36);
  for (int64_t n : {1, 2, 17, 1000, 49152}) {
    std::vector<float> x = random_floats(static_cast<size_t>(n), 10.0f, rng);
    if (n == 17) x[3] += 1000.0f;  // large values must not overflow
    const std::vector<float> in = x;
    softmax_in_place(x.data(), n);
    double max = in[0], sum = 0.0, total = 0.0;
    for (float v : in) max = std::max(max, static_cast<double>(v));
    for (float v : in) sum += std::exp(v - max);
    for (int64_t i = 0; i < n; ++i) {
      const double ref = std::exp(in[i] - max) / sum;
      // x - max is rounded to float first: a relative error of |x - max| 2^-24 in the result.
      const double rel = 1e-6 + std::fabs(in[i] - max) * 0x1p-24;
      ASSERT_NEAR(x[i], ref, rel * ref + 1e-38) << "n " << n << " element " << i;
      ASSERT_GE(x[i], 0.0f);
      total += x[i];
    }
    EXPECT_NEAR(total, 1.0, 1e-5) << "n " << n;
  }
}

// ---------------------------------------------------------------------------
// ThreadPool

TEST(ThreadPool, VisitsEveryTaskExactlyOnce) {
  for (int n_threads = 1; n_threads <= 4; ++n_threads) {
    ThreadPool pool(n_threads);
    EXPECT_EQ(pool.size(), n_threads);
    for (int64_t n_tasks : {0, 1, 5, 1000}) {
      SCOPED_TRACE(std::to_string(n_threads) + " threads, " + std::to_string(n_tasks) + " tasks");
      std::vector<std::atomic<int>> visits(static_cast<size_t>(n_tasks));
      std::vector<std::atomic<int>> in_use(static_cast<size_t>(n_threads));
      std::atomic<int> bad_thread{0}, shared_thread{0};
      pool.parallel_for(n_tasks, [&](int64_t task, int thread) {
        if (thread < 0 || thread >= n_threads) {
          bad_thread.fetch_add(1);
          return;
        }
        // No two concurrently running calls share a thread index.
        if (in_use[thread].exchange(1) != 0) shared_thread.fetch_add(1);
        visits[task].fetch_add(1);
        if (task % 7 == 0) std::this_thread::yield();
        in_use[thread].store(0);
      });
      EXPECT_EQ(bad_thread.load(), 0);
      EXPECT_EQ(shared_thread.load(), 0);
      for (int64_t t = 0; t < n_tasks; ++t) ASSERT_EQ(visits[t].load(), 1) << "task " << t;
    }
  }
}

// Aborts the process (a failure, not a hang) if not cancelled within `limit`.
class Watchdog {
 public:
  Watchdog(std::chrono::seconds limit, std::string what)
      : thread_([this, limit, what = std::move(what)] {
          std::unique_lock lock(mutex_);
          if (!cv_.wait_for(lock, limit, [this] { return done_; })) {
            std::fprintf(stderr, "watchdog: %s did not finish in %lld s\n", what.c_str(),
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

TEST(ThreadPool, ManySmallJobsFinish) {
  for (int n_threads = 1; n_threads <= 4; ++n_threads) {
    ThreadPool pool(n_threads);
    const Watchdog watchdog(std::chrono::seconds(60),
                            "10000 jobs on " + std::to_string(n_threads) + " threads");
    const auto start = std::chrono::steady_clock::now();
    int64_t total = 0;
    for (int job = 0; job < 10000; ++job) {
      const int64_t n_tasks = 1 + job % 8;
      std::atomic<int64_t> sum{0};
      pool.parallel_for(n_tasks, [&](int64_t task, int) { sum.fetch_add(task + 1); });
      ASSERT_EQ(sum.load(), n_tasks * (n_tasks + 1) / 2) << "job " << job;
      total += sum.load();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_GT(total, 0);
    std::printf("  10000 jobs on %d threads: %.3f s\n", n_threads, seconds);
  }
}

TEST(ThreadPool, IdlePoolCanBeDestroyedAndReused) {
  for (int round = 0; round < 20; ++round) {
    ThreadPool pool(1 + round % 4);
    if (round % 2 == 0) {
      std::atomic<int> n{0};
      pool.parallel_for(10, [&](int64_t, int) { n.fetch_add(1); });
      EXPECT_EQ(n.load(), 10);
    }
  }
  // Workers that went to sleep (past the spin) wake for the next job.
  ThreadPool pool(3);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::atomic<int> n{0};
  pool.parallel_for(100, [&](int64_t, int) { n.fetch_add(1); });
  EXPECT_EQ(n.load(), 100);
}

TEST(ThreadPool, RejectsBadThreadCounts) {
  EXPECT_THROW(ThreadPool(0), std::exception);
  EXPECT_THROW(ThreadPool(-1), std::exception);
}

}  // namespace
}  // namespace duet::cpu

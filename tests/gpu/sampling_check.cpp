// cuda::sample_rows against the CPU Sampler (common/sampling.h): for every
// row the same token from the same logits and draw. Greedy must match
// exactly. A sampled token may differ only at a near-tie, as both sum the
// same weights in different orders: where the draw falls within kNearTie of
// the GPU token's interval of the CPU's cumulative distribution, or where the
// top-p cut is that close (the CPU picks the GPU's token with top_p moved by
// one float step). Such rows are printed and counted, and more than
// kMaxNearTies of them fail the check.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <span>
#include <vector>

#include "common/sampling.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/sampling.h"
#include "tests/gpu/backend_check.h"
#include "tests/gpu/gpu_check.h"

namespace duet {
namespace {

constexpr int kPositions = 40;  // draws per logit vector
constexpr double kNearTie = 1e-5;
constexpr double kMaxNearTies = 0.01;  // of the rows

struct Case {
  const char* name;
  SamplingParams params;
};

SamplingParams params(float temperature, int32_t top_k, float top_p) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.seed = 1234;
  return p;
}

// Three kinds of logits: spread out, peaked (a few tokens hold most of the
// mass) and quantized to quarters (many exact ties, a tie for the maximum).
std::vector<std::vector<float>> logit_vectors(int64_t n_vocab, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 2.5f);
  std::vector<std::vector<float>> vectors(3, std::vector<float>(static_cast<size_t>(n_vocab)));
  for (float& x : vectors[0]) x = normal(rng);
  for (float& x : vectors[1]) x = normal(rng) - 4.0f;
  for (int i = 0; i < 6; ++i) vectors[1][rng() % n_vocab] = 9.0f + static_cast<float>(i);
  for (float& x : vectors[2]) x = std::round(normal(rng) * 4.0f) / 4.0f;
  const float max = *std::max_element(vectors[2].begin(), vectors[2].end());
  vectors[2][static_cast<size_t>(n_vocab / 3)] = max;
  vectors[2][static_cast<size_t>(n_vocab - 1)] = max;
  return vectors;
}

// How far u lies outside [lo, hi): 0 inside.
double distance_outside(double u, double lo, double hi) {
  return u < lo ? lo - u : (u >= hi ? u - hi : 0.0);
}

void check_case(const Case& c, int64_t n_vocab, cuda::CudaBackend& backend) {
  std::mt19937 rng(static_cast<uint32_t>(n_vocab));
  const std::vector<std::vector<float>> vectors = logit_vectors(n_vocab, rng);
  const int64_t n_rows = static_cast<int64_t>(vectors.size()) * kPositions;
  std::vector<float> logits(static_cast<size_t>(n_rows * n_vocab));
  std::vector<cuda::RowSampling> rows(static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) {
    const std::vector<float>& v = vectors[static_cast<size_t>(r / kPositions)];
    std::copy(v.begin(), v.end(), logits.begin() + r * n_vocab);
    rows[static_cast<size_t>(r)] = {
        c.params.temperature, c.params.top_k, c.params.top_p,
        uniform_at(c.params.seed, static_cast<uint64_t>(r % kPositions))};
  }
  cuda::DeviceBuffer d_logits(logits.size() * sizeof(float));
  cuda::DeviceBuffer d_rows(rows.size() * sizeof(cuda::RowSampling));
  cuda::DeviceBuffer d_tokens(static_cast<size_t>(n_rows) * sizeof(int32_t));
  backend.upload(d_logits.data(), logits.data(), logits.size() * sizeof(float));
  backend.upload(d_rows.data(), rows.data(), rows.size() * sizeof(cuda::RowSampling));
  cuda::sample_rows(d_logits.as<float>(), n_rows, n_vocab, d_rows.as<cuda::RowSampling>(),
                    d_tokens.as<int32_t>(), backend);
  std::vector<int32_t> tokens(static_cast<size_t>(n_rows));
  backend.download(tokens.data(), d_tokens.data(), tokens.size() * sizeof(int32_t));
  backend.synchronize();

  int64_t matches = 0, near_ties = 0, mismatches = 0;
  for (int64_t r = 0; r < n_rows; ++r) {
    const std::vector<float>& v = vectors[static_cast<size_t>(r / kPositions)];
    const uint64_t position = static_cast<uint64_t>(r % kPositions);
    Sampler sampler(c.params);
    const int32_t want = sampler.sample(v, position);
    const int32_t got = tokens[static_cast<size_t>(r)];
    if (got == want) {
      ++matches;
      continue;
    }
    double distance = INFINITY, lo = 0.0, hi = 0.0;
    const double u = uniform_at(c.params.seed, position);
    if (c.params.temperature > 0.0f && got >= 0 && got < n_vocab) {
      const std::vector<double> p = sampler.distribution(v);
      for (int32_t i = 0; i < got; ++i) lo += p[static_cast<size_t>(i)];
      hi = lo + p[static_cast<size_t>(got)];
      distance = distance_outside(u, lo, hi);
    }
    bool near_tie = distance <= kNearTie;
    if (!near_tie && c.params.top_p < 1.0f) {
      for (const float top_p : {std::nextafter(c.params.top_p, 0.0f),
                                std::min(std::nextafter(c.params.top_p, 2.0f), 1.0f)}) {
        SamplingParams moved = c.params;
        moved.top_p = top_p;
        near_tie = near_tie || Sampler(moved).sample(v, position) == got;
      }
    }
    (near_tie ? near_ties : mismatches) += 1;
    std::printf(
        "    %s: row %lld (logits %lld, position %llu): CPU %d, GPU %d; draw %.9f, the "
        "GPU token's CPU interval [%.9f, %.9f)\n",
        near_tie ? "near-tie" : "MISMATCH", static_cast<long long>(r),
        static_cast<long long>(r / kPositions), static_cast<unsigned long long>(position), want,
        got, u, lo, hi);
  }
  std::printf("    vocab %lld: %lld of %lld rows equal, %lld near-ties, %lld mismatches\n",
              static_cast<long long>(n_vocab), static_cast<long long>(matches),
              static_cast<long long>(n_rows), static_cast<long long>(near_ties),
              static_cast<long long>(mismatches));
  if (mismatches > 0)
    gpu_check::fail("%lld rows chose another token", static_cast<long long>(mismatches));
  if (static_cast<double>(near_ties) > kMaxNearTies * static_cast<double>(n_rows)) {
    gpu_check::fail("%lld near-ties in %lld rows", static_cast<long long>(near_ties),
                    static_cast<long long>(n_rows));
  }
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  return gpu_check::run_on_backend([](cuda::CudaBackend& backend) {
    const Case cases[] = {
        {"greedy", params(0.0f, 0, 1.0f)},
        {"temperature 1", params(1.0f, 0, 1.0f)},
        {"temperature 0.7", params(0.7f, 0, 1.0f)},
        {"top_k 40", params(1.0f, 40, 1.0f)},
        {"top_k 1000 at temperature 1.3", params(1.3f, 1000, 1.0f)},
        {"top_p 0.9", params(1.0f, 0, 0.9f)},
        {"top_p 0.5 at temperature 1.5", params(1.5f, 0, 0.5f)},
        {"top_k 40 + top_p 0.9 at temperature 0.8", params(0.8f, 40, 0.9f)},
        {"top_k 5000 + top_p 0.95", params(1.0f, 5000, 0.95f)},
        {"top_k above the vocabulary", params(1.0f, 200000, 1.0f)},
    };
    // The default model's vocabulary, a small one, Llama 3's and Qwen2's.
    for (const int64_t n_vocab :
         {int64_t{49152}, int64_t{1000}, int64_t{128256}, int64_t{152064}}) {
      for (const Case& c : cases) {
        char name[128];
        std::snprintf(name, sizeof(name), "%s, vocab %lld", c.name,
                      static_cast<long long>(n_vocab));
        gpu_check::run_case(name, [&] { check_case(c, n_vocab, backend); });
      }
    }
  });
}

#include "common/sampling.h"

#include <cmath>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

// SplitMix64's finalizer: a bijective mix with good avalanche.
uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

double uniform_at(uint64_t seed, uint64_t position) {
  const uint64_t bits = mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ (position * 0xd1b54a32d192ed03ull));
  return static_cast<double>(bits >> 11) * 0x1p-53;
}

int32_t argmax(std::span<const float> logits) {
  DUET_ASSERT(!logits.empty());
  size_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t position) {
  DUET_REQUIRE(params.temperature >= 0.0f && std::isfinite(params.temperature),
               "temperature must be a finite number >= 0, got {}", params.temperature);
  if (params.temperature == 0.0f) return argmax(logits);
  const float max = logits[static_cast<size_t>(argmax(logits))];
  std::vector<double> weights(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp(static_cast<double>(logits[i] - max) / params.temperature);
    total += weights[i];
  }
  const double target = uniform_at(params.seed, position) * total;
  double cumulative = 0.0;
  for (size_t i = 0; i < weights.size(); ++i) {
    cumulative += weights[i];
    if (cumulative > target) return static_cast<int32_t>(i);
  }
  return argmax(logits);  // rounding left target at the very top
}

}  // namespace duet

// Float vectors for the kernel tests: random ones, and bitwise equality
// (NaN payloads and the sign of zero included).
#pragma once

#include <cstring>
#include <random>
#include <vector>

namespace duet::cpu {

inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// n draws of a normal distribution of mean 0.
inline std::vector<float> random_floats(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

}  // namespace duet::cpu

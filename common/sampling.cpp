#include "common/sampling.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"
#include "common/hash.h"

namespace duet {
namespace {

// Top-p buckets the tokens by distance below the top logit, this many buckets
// per unit of logit; the last bucket takes everything further down.
constexpr float kTopPBucketsPerLogit = 16.0f;
constexpr size_t kTopPBuckets = 512;
// Top-k up to this k selects with a heap (partial_sort), beyond it with nth_element.
constexpr size_t kTopKHeapMax = 256;

}  // namespace

void validate_sampling_params(const SamplingParams& p) {
  DUET_REQUIRE(std::isfinite(p.temperature) && p.temperature >= 0.0f,
               "temperature must be a finite number >= 0, got {}", p.temperature);
  DUET_REQUIRE(p.top_k >= 0, "top_k must be >= 0 (0: off), got {}", p.top_k);
  DUET_REQUIRE(p.top_p > 0.0f && p.top_p <= 1.0f, "top_p must be in (0, 1], got {}", p.top_p);
  DUET_REQUIRE(p.min_p >= 0.0f && p.min_p <= 1.0f, "min_p must be in [0, 1], got {}", p.min_p);
  DUET_REQUIRE(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0.0f,
               "repetition_penalty must be a finite number > 0 (1: off), got {}",
               p.repetition_penalty);
  DUET_REQUIRE(std::isfinite(p.frequency_penalty), "frequency_penalty must be finite, got {}",
               p.frequency_penalty);
  DUET_REQUIRE(std::isfinite(p.presence_penalty), "presence_penalty must be finite, got {}",
               p.presence_penalty);
  DUET_REQUIRE(p.penalty_last_n >= -1,
               "penalty_last_n must be >= -1 (-1: whole sequence, 0: off), got {}",
               p.penalty_last_n);
}

double uniform_at(uint64_t seed, uint64_t position) {
  const uint64_t bits =
      mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ (position * 0xd1b54a32d192ed03ull));
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

Sampler::Sampler(const SamplingParams& params) : params_(params) {
  validate_sampling_params(params_);
  penalties_ = params_.penalties_enabled();
  if (penalties_ && params_.penalty_last_n > 0)
    window_.reserve(static_cast<size_t>(params_.penalty_last_n));
}

void Sampler::accept(int32_t token) {
  DUET_REQUIRE(token >= 0, "token ids are >= 0, got {}", token);
  if (!penalties_) return;
  ++counts_[token];
  if (params_.penalty_last_n < 0) return;  // the whole sequence: counts only
  const size_t capacity = static_cast<size_t>(params_.penalty_last_n);
  if (window_.size() < capacity) {
    window_.push_back(token);
    return;
  }
  int32_t& slot = window_[window_next_];
  const auto evicted = counts_.find(slot);
  if (--evicted->second == 0) counts_.erase(evicted);
  slot = token;
  window_next_ = (window_next_ + 1) % capacity;
}

void Sampler::reset() {
  window_.clear();
  window_next_ = 0;
  counts_.clear();
}

std::span<const float> Sampler::penalize(std::span<const float> logits) {
  if (!penalties_ || counts_.empty()) return logits;
  penalized_.assign(logits.begin(), logits.end());
  for (const auto& [token, count] : counts_) {
    DUET_REQUIRE(static_cast<size_t>(token) < penalized_.size(),
                 "token {} in the penalty window is outside the vocabulary of {}", token,
                 penalized_.size());
    float& logit = penalized_[static_cast<size_t>(token)];
    logit = logit <= 0.0f ? logit * params_.repetition_penalty : logit / params_.repetition_penalty;
    logit -= static_cast<float>(count) * params_.frequency_penalty + params_.presence_penalty;
  }
  return penalized_;
}

double Sampler::weigh(std::span<const float> logits) {
  const size_t n = logits.size();
  for (size_t i = 0; i < n; ++i) {
    DUET_REQUIRE(!std::isnan(logits[i]) && logits[i] != INFINITY, "the logit of token {} is {}", i,
                 logits[i]);
  }
  const float max = logits[static_cast<size_t>(argmax(logits))];
  DUET_REQUIRE(max != -INFINITY, "every logit is -inf: no token can be drawn");
  // The tokens kept by top-k and top-p are a prefix of the total order
  // "higher logit first, then lower id"; `last` is that prefix's last token.
  auto before = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  size_t n_kept = n;
  Candidate last{-INFINITY, INT32_MAX};  // every token precedes it: no prefix cut
  const bool top_k = params_.top_k > 0 && static_cast<size_t>(params_.top_k) < n;
  const bool top_p = params_.top_p < 1.0f;
  if (top_k) {
    candidates_.resize(n);
    for (size_t i = 0; i < n; ++i) candidates_[i] = {logits[i], static_cast<int32_t>(i)};
    n_kept = static_cast<size_t>(params_.top_k);
    const auto kth = candidates_.begin() + static_cast<std::ptrdiff_t>(n_kept);
    if (n_kept <= kTopKHeapMax) {  // a heap of k: about one compare per token
      std::partial_sort(candidates_.begin(), kth, candidates_.end(), before);
    } else {
      std::nth_element(candidates_.begin(), kth - 1, candidates_.end(), before);
    }
    last = *(kth - 1);
  }
  if (top_p) {
    // Probabilities at temperature 1 over the kept tokens (llama.cpp applies
    // the temperature last): keep the shortest most-likely prefix whose
    // cumulative probability reaches top_p. Instead of sorting, bucket the
    // tokens by logit (a bucket's tokens all precede the next bucket's), find
    // the bucket where the mass reaches top_p, and sort only that one.
    auto for_each_kept = [&](auto&& visit) {
      if (top_k) {
        for (size_t i = 0; i < n_kept; ++i) visit(candidates_[i]);
      } else {
        for (size_t i = 0; i < n; ++i) visit(Candidate{logits[i], static_cast<int32_t>(i)});
      }
    };
    auto bucket_of = [max](float logit) {
      const float distance = (max - logit) * kTopPBucketsPerLogit;  // >= 0; +inf for a -inf logit
      return distance < static_cast<float>(kTopPBuckets - 1) ? static_cast<size_t>(distance)
                                                             : kTopPBuckets - 1;
    };
    bucket_mass_.assign(kTopPBuckets, 0.0);
    double z = 0.0;
    for_each_kept([&](const Candidate& c) {
      const double weight = std::exp(static_cast<double>(c.logit - max));
      z += weight;
      bucket_mass_[bucket_of(c.logit)] += weight;
    });
    double cumulative = 0.0;  // of the buckets before `boundary`
    size_t boundary = 0;
    while (boundary < kTopPBuckets && cumulative + bucket_mass_[boundary] / z < params_.top_p) {
      cumulative += bucket_mass_[boundary++] / z;
    }
    if (boundary < kTopPBuckets) {  // else rounding left the mass short of top_p: keep all
      boundary_.clear();
      for_each_kept([&](const Candidate& c) {
        if (bucket_of(c.logit) == boundary) boundary_.push_back(c);
      });
      DUET_ASSERT(!boundary_.empty());  // its mass reached top_p
      std::sort(boundary_.begin(), boundary_.end(), before);
      last = boundary_.back();  // rounding may leave the scan short: the whole bucket
      for (const Candidate& c : boundary_) {
        cumulative += std::exp(static_cast<double>(c.logit - max)) / z;
        if (cumulative >= params_.top_p) {
          last = c;
          break;
        }
      }
    }
  }
  // min-p: probability >= min_p * max probability, i.e. logit >= max + log(min_p).
  const float min_logit = params_.min_p > 0.0f ? max + std::log(params_.min_p) : -INFINITY;

  // The draw's weights, by id (the order the draw walks, whatever the filters).
  weights_.resize(n);
  double total = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const bool kept = !before(last, {logits[i], static_cast<int32_t>(i)}) && logits[i] >= min_logit;
    weights_[i] = kept ? std::exp(static_cast<double>(logits[i] - max) / params_.temperature) : 0.0;
    total += weights_[i];
  }
  return total;
}

int32_t Sampler::sample(std::span<const float> logits, uint64_t position) {
  DUET_REQUIRE(!logits.empty(), "sampling needs at least one logit");
  const std::span<const float> penalized = penalize(logits);
  if (params_.temperature == 0.0f) return argmax(penalized);
  const double total = weigh(penalized);
  const double target = uniform_at(params_.seed, position) * total;
  double cumulative = 0.0;
  for (size_t i = 0; i < weights_.size(); ++i) {
    cumulative += weights_[i];
    if (cumulative > target) return static_cast<int32_t>(i);
  }
  return argmax(penalized);  // rounding left target at the very top
}

std::vector<double> Sampler::distribution(std::span<const float> logits) {
  DUET_REQUIRE(!logits.empty(), "sampling needs at least one logit");
  const std::span<const float> penalized = penalize(logits);
  std::vector<double> probabilities(logits.size(), 0.0);
  if (params_.temperature == 0.0f) {
    probabilities[static_cast<size_t>(argmax(penalized))] = 1.0;
    return probabilities;
  }
  const double total = weigh(penalized);
  for (size_t i = 0; i < probabilities.size(); ++i) probabilities[i] = weights_[i] / total;
  return probabilities;
}

int32_t sample_token(std::span<const float> logits, const SamplingParams& params,
                     uint64_t position) {
  return Sampler(params).sample(logits, position);
}

}  // namespace duet

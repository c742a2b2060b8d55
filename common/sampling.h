// Choosing the next token from logits.
//
// Randomness is counter-based: the draw for a token is a pure function of
// (seed, position), so a sequence gives the same text with the same seed
// wherever and in whatever batch it runs.
#pragma once

#include <cstdint>
#include <span>

namespace duet {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  uint64_t seed = 0;
};

// A uniform double in [0, 1) determined by (seed, position).
double uniform_at(uint64_t seed, uint64_t position);

// Index of the largest logit (the lowest index among equal ones).
int32_t argmax(std::span<const float> logits);

// Greedy at temperature 0, else a draw from softmax(logits / temperature).
// `position` is the position the chosen token will occupy in its sequence.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params, uint64_t position);

}  // namespace duet

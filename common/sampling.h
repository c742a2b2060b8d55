// Choosing the next token from logits.
//
// The controls and their order are llama.cpp's usual chain:
//   penalties -> top-k -> top-p -> min-p -> temperature -> draw,
// greedy (argmax of the penalized logits, the lowest id on ties) when the
// temperature is 0. Every control defaults to off, leaving pure temperature
// sampling.
//
// Randomness is counter-based: the draw for the token at position p is a pure
// function of (seed, p) and the (penalized) logits, so a sequence gives the
// same text with the same seed wherever and in whatever batch it runs.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace duet {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy
  uint64_t seed = 0;
  int32_t top_k = 0;   // keep the k most likely tokens; 0: off
  float top_p = 1.0f;  // keep the smallest most-likely set with probability >= top_p; 1: off
  float min_p = 0.0f;  // keep tokens with probability >= min_p * the top one's; 0: off
  // CTRL / llama.cpp style: a positive logit is divided by it, a negative one
  // multiplied, for every token in the penalty window. 1: off.
  float repetition_penalty = 1.0f;
  // OpenAI style: logit -= count * frequency_penalty + (count > 0) * presence_penalty,
  // count = occurrences in the penalty window. 0: off.
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  // The penalty window: the last penalty_last_n tokens of the sequence (prompt
  // included); -1: the whole sequence, 0: no window (penalties off).
  int32_t penalty_last_n = 64;

  // Whether any penalty can change a logit.
  bool penalties_enabled() const {
    return penalty_last_n != 0 &&
           (repetition_penalty != 1.0f || frequency_penalty != 0.0f || presence_penalty != 0.0f);
  }
};

// Throws duet::Error (kInvalidArgument) naming the first bad field, e.g.
// "top_p must be in (0, 1], got 1.5".
void validate_sampling_params(const SamplingParams& params);

// A uniform double in [0, 1) determined by (seed, position).
double uniform_at(uint64_t seed, uint64_t position);

// Index of the largest logit (the lowest index among equal ones).
int32_t argmax(std::span<const float> logits);

// The sampler of one sequence: its parameters, the penalty window of the
// tokens seen so far, and scratch buffers reused from call to call (so a
// 49,152-token vocabulary costs sample() a few linear passes and, once warm,
// no allocation; top-k is a heap selection or an nth_element, top-p buckets the
// tokens by logit and sorts only the bucket where the mass reaches top_p).
//
// Feed it every token of the sequence in order with accept() (the prompt's
// too: llama.cpp penalizes repeats of prompt tokens), and call sample() with
// the logits predicting the token at `position`. One per sequence; not
// thread-safe (owned by the thread that runs the sequence).
class Sampler {
 public:
  // Validates `params` (see validate_sampling_params).
  explicit Sampler(const SamplingParams& params);

  const SamplingParams& params() const { return params_; }

  // Appends `token` to the sequence's history (the penalty window).
  void accept(int32_t token);
  // Forgets the history.
  void reset();

  // The token for `position`, from logits (n_vocab) predicting it.
  int32_t sample(std::span<const float> logits, uint64_t position);

  // The distribution sample() draws from, by token id (n_vocab, summing to 1,
  // zero for tokens the filters removed); one-hot on the argmax when greedy.
  // For tests and log-probabilities.
  std::vector<double> distribution(std::span<const float> logits);

 private:
  // The logits after the penalties: `logits` itself when none applies, else
  // a penalized copy in penalized_.
  std::span<const float> penalize(std::span<const float> logits);
  // Fills weights_ (n_vocab) with the unnormalized probabilities of the draw
  // from penalized logits, zero for filtered-out tokens; returns their sum.
  double weigh(std::span<const float> logits);

  SamplingParams params_;
  bool penalties_ = false;  // params_.penalties_enabled()

  // The penalty window: the last penalty_last_n accepted tokens, a ring
  // (unused when the window is the whole sequence), and their counts.
  std::vector<int32_t> window_;
  size_t window_next_ = 0;  // the ring's slot for the next token once full
  std::unordered_map<int32_t, int32_t> counts_;

  // Scratch, sized to the vocabulary on first use.
  std::vector<float> penalized_;
  struct Candidate {
    float logit;
    int32_t id;
  };
  std::vector<Candidate> candidates_;  // top-k: partly ordered by (logit desc, id asc)
  std::vector<double> bucket_mass_;    // top-p: probability mass by logit bucket
  std::vector<Candidate> boundary_;    // top-p: the bucket where the mass reaches top_p
  std::vector<double> weights_;
};

// One token with no history (so no penalties act): Sampler(params).sample().
// Allocates; a sequence that samples repeatedly should own a Sampler.
int32_t sample_token(std::span<const float> logits, const SamplingParams& params,
                     uint64_t position);

}  // namespace duet

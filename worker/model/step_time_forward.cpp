#include "worker/model/step_time_forward.h"

#include <algorithm>

#include "common/error.h"

namespace duet {

StepShape step_shape(std::span<const ForwardSequence> sequences, int64_t n_logit_rows) {
  StepShape shape;
  shape.n_sequences = static_cast<int64_t>(sequences.size());
  shape.n_logit_rows = n_logit_rows;
  for (const ForwardSequence& s : sequences) {
    shape.n_tokens += s.n_tokens;
    // Row i (0-based) attends to positions [0, pos0 + i].
    const int64_t pairs = s.n_tokens * s.pos0 + s.n_tokens * (s.n_tokens + 1) / 2;
    shape.n_attention += pairs;
    if (s.n_tokens == 1) shape.n_decode_attention += pairs;
  }
  return shape;
}

double LinearStepCost::operator()(const StepShape& shape) const {
  return per_step + per_token * static_cast<double>(shape.n_tokens) +
         per_sequence * static_cast<double>(shape.n_sequences) +
         per_attention * static_cast<double>(shape.n_attention) +
         per_logit_row * static_cast<double>(shape.n_logit_rows);
}

StepTimeForward::StepTimeForward(StepCostModel cost, int64_t n_vocab, int32_t token)
    : cost_(std::move(cost)), n_vocab_(n_vocab), token_(token) {
  DUET_REQUIRE(cost_ != nullptr, "a step-time forward needs a cost model");
  DUET_REQUIRE(token >= 0 && token < n_vocab, "token {} is outside the vocabulary (0..{})", token,
               n_vocab - 1);
}

void StepTimeForward::run(std::span<const int32_t>, std::span<const ForwardSequence> sequences,
                          KvCache&, std::span<const int64_t> logit_rows, float* logits,
                          const LayerStored& layer_stored) {
  const double seconds = cost_(step_shape(sequences, static_cast<int64_t>(logit_rows.size())));
  DUET_REQUIRE(seconds >= 0.0, "the cost model gave a step {} seconds", seconds);
  last_step_ = seconds;
  elapsed_ += seconds;
  ++steps_;
  if (layer_stored) {
    for (int64_t layer = 0; layer < n_layers_; ++layer) layer_stored(layer);
  }
  if (logits == nullptr) return;
  const size_t n = logit_rows.size() * static_cast<size_t>(n_vocab_);
  std::fill(logits, logits + n, 0.0f);
  for (size_t row = 0; row < logit_rows.size(); ++row)
    logits[row * static_cast<size_t>(n_vocab_) + static_cast<size_t>(token_)] = 1.0f;
}

void StepTimeForward::sample(std::span<const DeviceSampling>, std::span<int32_t> tokens) {
  std::fill(tokens.begin(), tokens.end(), token_);
}

}  // namespace duet

// A forward pass that computes nothing and takes the time a cost model says.
//
// What a cluster simulator puts under a real Engine (with KvMemory::kNone):
// the engine's scheduling, admission, preemption and KV import run unchanged,
// with no weights and no KV memory, and each step costs the seconds its
// shape is modeled to take. The seconds accumulate on a clock the simulator
// reads after every step.
//
// Every sampled row gets one token, `token`: a simulated request ends by its
// max_tokens (submit it with ignore_eos, or keep `token` out of the engine's
// end_of_generation).
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "worker/model/model_forward.h"

namespace duet {

// What one forward step computes, as a cost model reads it.
struct StepShape {
  int64_t n_tokens = 0;     // rows through the weights
  int64_t n_sequences = 0;  // sequences in the batch
  int64_t n_attention = 0;  // (query row, key position) pairs attention visits
  // Of n_attention, the pairs of sequences with one row in the step (decode
  // rows: each key's KV is read for one query row, a memory-bound visit).
  int64_t n_decode_attention = 0;
  int64_t n_logit_rows = 0;  // rows through the output head
};

StepShape step_shape(std::span<const ForwardSequence> sequences, int64_t n_logit_rows);

// Seconds a step of a shape takes.
using StepCostModel = std::function<double(const StepShape&)>;

// A cost linear in the shape's terms, in seconds.
struct LinearStepCost {
  double per_step = 0.0;
  double per_token = 0.0;
  double per_sequence = 0.0;
  double per_attention = 0.0;
  double per_logit_row = 0.0;

  double operator()(const StepShape& shape) const;
};

class StepTimeForward final : public ModelForward {
 public:
  // `n_vocab`: the length of a logit row (written only when the engine
  // samples on the host).
  StepTimeForward(StepCostModel cost, int64_t n_vocab, int32_t token = 0);

  // Stores nothing; adds the step's modeled seconds to the clock. Logit
  // rows, when asked for, favour `token` alone. `layer_stored` is called for
  // every layer of `n_layers` (set_layers), as a real forward would.
  void run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
           KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
           const LayerStored& layer_stored = {}) override;
  bool samples_on_device() const override { return true; }
  void sample(std::span<const DeviceSampling> rows, std::span<int32_t> tokens) override;

  // The layers run() reports to `layer_stored` (default 1), so that an
  // exporting engine hands out each layer as it would on a model.
  void set_layers(int64_t n_layers) { n_layers_ = n_layers; }

  double elapsed_seconds() const { return elapsed_; }
  double last_step_seconds() const { return last_step_; }
  int64_t steps() const { return steps_; }

 private:
  StepCostModel cost_;
  int64_t n_vocab_;
  int32_t token_;
  int64_t n_layers_ = 1;
  double elapsed_ = 0.0;
  double last_step_ = 0.0;
  int64_t steps_ = 0;
};

}  // namespace duet

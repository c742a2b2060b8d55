#include "worker/model/forward_plan.h"

#include <algorithm>
#include <cmath>

#include "common/error.h"

namespace duet {

RopeParams rope_params(const ModelConfig& c, const float* freq_factors, bool windowed) {
  RopeParams rope;
  rope.style = c.rope_neox ? RopeStyle::kHalves : RopeStyle::kAdjacentPairs;
  rope.n_rot = c.n_rot;
  rope.freq_base = windowed ? c.rope_freq_base_swa : c.rope_freq_base;
  rope.freq_scale = windowed ? c.rope_freq_scale_swa : c.rope_freq_scale;
  rope.freq_factors = freq_factors;
  return rope;
}

AttentionShape attention_shape(const ModelConfig& c, const TpShard& shard, bool windowed) {
  AttentionShape shape;
  shape.n_heads = shard.n_heads();
  shape.n_kv_heads = shard.n_kv_heads();
  shape.head_dim = c.head_dim;
  shape.scale = c.q_scale != 0.0f ? 1.0f : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  shape.window = windowed ? c.sliding_window : 0;
  return shape;
}

int64_t widest_part(std::span<const int64_t> parts) {
  return parts.empty() ? 0 : *std::max_element(parts.begin(), parts.end());
}

ForwardPlan::ForwardPlan(const LlamaModel& model) : model_(model) {
  const ModelConfig& c = model.config();
  const int size = model.shard().size;
  for (int rank = 0; rank < size; ++rank) {
    const TpShard s = make_tp_shard(c, rank, size);
    q_parts_.push_back(s.n_heads() * c.head_dim);
    ff_parts_.push_back(s.n_ff());
    embd_parts_.push_back(s.n_embd());
  }
}

const ForwardStep& ForwardPlan::stage(std::span<const int32_t> tokens,
                                      std::span<const ForwardSequence> sequences,
                                      std::span<const int64_t> logit_rows) {
  const ModelConfig& c = model_.config();
  const auto n = static_cast<int64_t>(tokens.size());
  int64_t rows_in_sequences = 0;
  for (const ForwardSequence& s : sequences) rows_in_sequences += s.n_tokens;
  DUET_ASSERT(rows_in_sequences == n, "sequences cover {} rows of a {}-row batch",
              rows_in_sequences, n);
  ForwardStep& step = step_;
  step.tokens = tokens;
  step.logit_rows = logit_rows;
  step.n_rows = n;
  step.n_out = n == 0 ? 0 : static_cast<int64_t>(logit_rows.size());
  step.positions.resize(static_cast<size_t>(n));
  step.sequences.clear();
  step.one_row_per_sequence = true;
  step.logit_rows_are_all = step.n_out == n;
  if (n == 0) return step;

  for (int32_t id : tokens) {
    DUET_REQUIRE(id >= 0 && id < c.n_vocab, "token id {} is outside the vocabulary (0..{})", id,
                 c.n_vocab - 1);
  }
  int64_t row = 0;
  for (const ForwardSequence& s : sequences) {
    for (int64_t t = 0; t < s.n_tokens; ++t) {
      step.positions[static_cast<size_t>(row + t)] = static_cast<int32_t>(s.pos0 + t);
    }
    step.sequences.push_back({s.block_table, s.pos0, s.n_tokens, row, s.one_token_from});
    step.one_row_per_sequence = step.one_row_per_sequence && s.n_tokens == 1;
    row += s.n_tokens;
  }
  for (int64_t i = 0; i < step.n_out; ++i) {
    const int64_t r = logit_rows[static_cast<size_t>(i)];
    DUET_ASSERT(r >= 0 && r < n, "logit row {} outside the batch of {}", r, n);
    step.logit_rows_are_all = step.logit_rows_are_all && r == i;
  }
  return step;
}

int64_t ForwardPlan::floats(ForwardTensor t, int64_t n_rows, int64_t n_out) const {
  const ModelConfig& c = model_.config();
  const TpShard& s = model_.shard();
  // Tensor parallelism's tensors: none for a whole model.
  const int64_t tp = s.whole() ? 0 : 1;
  switch (t) {
    case ForwardTensor::kX:
    case ForwardTensor::kNorm:
    case ForwardTensor::kAttnOut:
    case ForwardTensor::kFfnOut:
      return n_rows * c.n_embd;
    case ForwardTensor::kQ:
      return n_rows * s.n_heads() * c.head_dim;
    case ForwardTensor::kK:
    case ForwardTensor::kV:
      return n_rows * s.n_kv_heads() * c.head_dim;
    // attn and gate are sent whole by an all-gather: as wide as the widest rank's part.
    case ForwardTensor::kAttn:
      return n_rows * widest_part(q_parts_);
    // gate and up hold an expert's rows in a mixture of experts.
    case ForwardTensor::kGate:
      return n_rows * (c.is_moe() ? c.n_ff_exp : widest_part(ff_parts_));
    case ForwardTensor::kUp:
      return n_rows * (c.is_moe() ? c.n_ff_exp : s.n_ff());
    case ForwardTensor::kHeadIn:
      return n_out * c.n_embd;
    case ForwardTensor::kLogitSlice:
      return tp * n_out * s.vocab_stride;
    case ForwardTensor::kLogitSlices:
      return tp * n_out * s.vocab_stride * s.size;
    case ForwardTensor::kWholeIn:
      return tp * n_rows * std::max(c.n_heads * c.head_dim, c.is_moe() ? 0 : c.n_ff);
    case ForwardTensor::kOutRows:
      return tp * n_rows * widest_part(embd_parts_);
    case ForwardTensor::kGathered:
      return tp * n_rows * s.size *
             std::max({widest_part(q_parts_), c.is_moe() ? 0 : widest_part(ff_parts_),
                       widest_part(embd_parts_)});
    // A mixture of experts' (none for a dense model).
    case ForwardTensor::kRouterLogits:
      return n_rows * c.n_experts;
    case ForwardTensor::kRouteWeights:
      return n_rows * c.n_experts_used;
    case ForwardTensor::kExpertIn:
    case ForwardTensor::kExpertOut:
      return c.is_moe() ? n_rows * c.n_embd : 0;
    case ForwardTensor::kPicks:
      return n_rows * c.n_experts_used * c.n_embd;
  }
  DUET_ASSERT(false, "tensor {} is not a ForwardTensor", static_cast<int>(t));
  return 0;
}

}  // namespace duet

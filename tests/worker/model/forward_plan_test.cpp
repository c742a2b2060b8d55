// The forward plan's staging and tensor sizes, before any op runs: what the
// CPU and the CUDA forwards both take from it (the rows' positions and
// sequences, the decode shape, the tensors a tensor-parallel gather reads).
// The ops themselves run in the model, golden and TP tests.
#include "worker/model/forward_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "common/error.h"
#include "tests/test_paths.h"
#include "worker/model/llama_model.h"
#include "worker/model/tp_shard.h"

namespace duet {
namespace {

// 4 heads of 16 dimensions, 4 KV heads, n_ff 128, n_embd 64, 299 tokens.
std::filesystem::path tiny_model() {
  return testing::fixture_path("fixtures/tiny/tiny_q8_0_mha_untied.gguf");
}

TEST(ForwardPlanTest, StagesRowsSequenceAfterSequence) {
  const auto model = LlamaModel::load(tiny_model());
  ForwardPlan plan(*model);
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  const std::vector<int32_t> table_a = {0, 1};
  const std::vector<int32_t> table_b = {2};
  const std::vector<ForwardSequence> sequences = {{table_a, 5, 3, 6}, {table_b, 0, 1}};
  const std::vector<int64_t> logit_rows = {2, 3};
  const ForwardStep& step = plan.stage(tokens, sequences, logit_rows);
  EXPECT_EQ(step.n_rows, 4);
  EXPECT_EQ(step.n_out, 2);
  EXPECT_EQ(step.positions, (std::vector<int32_t>{5, 6, 7, 0}));
  ASSERT_EQ(step.sequences.size(), 2u);
  EXPECT_EQ(step.sequences[0].block_table.data(), table_a.data());
  EXPECT_EQ(step.sequences[0].pos0, 5);
  EXPECT_EQ(step.sequences[0].n_q, 3);
  EXPECT_EQ(step.sequences[0].row, 0);
  EXPECT_EQ(step.sequences[0].one_token_from, 6);
  EXPECT_EQ(step.sequences[1].block_table.data(), table_b.data());
  EXPECT_EQ(step.sequences[1].row, 3);
  EXPECT_EQ(step.sequences[1].one_token_from, kNoOneTokenRows);
  EXPECT_FALSE(step.one_row_per_sequence);
  EXPECT_FALSE(step.logit_rows_are_all);
}

TEST(ForwardPlanTest, ADecodeStepIsOneRowPerSequenceEverySampledInOrder) {
  const auto model = LlamaModel::load(tiny_model());
  ForwardPlan plan(*model);
  const std::vector<int32_t> tokens = {7, 8};
  const std::vector<int32_t> table_a = {0};
  const std::vector<int32_t> table_b = {1};
  const std::vector<ForwardSequence> sequences = {{table_a, 9, 1}, {table_b, 4, 1}};
  const std::vector<int64_t> in_order = {0, 1};
  const ForwardStep& decode = plan.stage(tokens, sequences, in_order);
  EXPECT_TRUE(decode.one_row_per_sequence);
  EXPECT_TRUE(decode.logit_rows_are_all);
  EXPECT_EQ(decode.positions, (std::vector<int32_t>{9, 4}));
  // The same rows in another order are not the rows in place.
  const std::vector<int64_t> swapped = {1, 0};
  EXPECT_FALSE(plan.stage(tokens, sequences, swapped).logit_rows_are_all);
  const std::vector<int64_t> one = {1};
  EXPECT_FALSE(plan.stage(tokens, sequences, one).logit_rows_are_all);
}

TEST(ForwardPlanTest, RefusesATokenOutsideTheVocabulary) {
  const auto model = LlamaModel::load(tiny_model());
  ForwardPlan plan(*model);
  const std::vector<int32_t> table = {0};
  const ForwardSequence sequence{table, 0, 2};
  const int64_t last = 1;
  for (int32_t bad : {-1, static_cast<int32_t>(model->config().n_vocab)}) {
    const std::vector<int32_t> tokens = {3, bad};
    try {
      plan.stage(tokens, {&sequence, 1}, {&last, 1});
      FAIL() << "token " << bad << " staged";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    }
  }
  // An empty batch stages nothing, whatever rows it names.
  const ForwardStep& empty = plan.stage({}, {}, {&last, 1});
  EXPECT_EQ(empty.n_rows, 0);
  EXPECT_EQ(empty.n_out, 0);
  EXPECT_TRUE(empty.sequences.empty());
}

TEST(ForwardPlanTest, AWholeModelKeepsNoGatherTensors) {
  const auto model = LlamaModel::load(tiny_model());
  const ModelConfig& c = model->config();
  const ForwardPlan plan(*model);
  const int64_t n = 8;
  const int64_t n_out = 2;
  EXPECT_EQ(plan.floats(ForwardTensor::kX, n, n_out), n * c.n_embd);
  EXPECT_EQ(plan.floats(ForwardTensor::kAttn, n, n_out), n * c.n_heads * c.head_dim);
  EXPECT_EQ(plan.floats(ForwardTensor::kGate, n, n_out), n * c.n_ff);
  EXPECT_EQ(plan.floats(ForwardTensor::kHeadIn, n, n_out), n_out * c.n_embd);
  for (ForwardTensor t :
       {ForwardTensor::kLogitSlice, ForwardTensor::kLogitSlices, ForwardTensor::kWholeIn,
        ForwardTensor::kOutRows, ForwardTensor::kGathered}) {
    EXPECT_EQ(plan.floats(t, n, n_out), 0) << static_cast<int>(t);
  }
}

// A gather reads the widest rank's part from every rank (NCCL and MPI send
// equal slots): a narrower rank's tensors are as wide as the widest's.
TEST(ForwardPlanTest, EveryShardSizesItsGatheredTensorsForTheWidestRank) {
  const std::unique_ptr<LlamaModel> whole = LlamaModel::load(tiny_model());
  const ModelConfig& c = whole->config();
  const int size = 3;  // KV heads 2 + 1 + 1: query dims 32, 16, 16
  int64_t widest_q = 0;
  int64_t widest_ff = 0;
  int64_t widest_embd = 0;
  for (int r = 0; r < size; ++r) {
    const TpShard s = make_tp_shard(c, r, size);
    widest_q = std::max(widest_q, s.n_heads() * c.head_dim);
    widest_ff = std::max(widest_ff, s.n_ff());
    widest_embd = std::max(widest_embd, s.n_embd());
  }
  const int64_t n = 5;
  const int64_t n_out = 2;
  for (int rank = 0; rank < size; ++rank) {
    SCOPED_TRACE(rank);
    const std::unique_ptr<LlamaModel> shard = LlamaModel::load(tiny_model(), {rank, size});
    const TpShard& s = shard->shard();
    const ForwardPlan plan(*shard);
    EXPECT_EQ(plan.floats(ForwardTensor::kQ, n, n_out), n * s.n_heads() * c.head_dim);
    EXPECT_EQ(plan.floats(ForwardTensor::kAttn, n, n_out), n * widest_q);
    EXPECT_EQ(plan.floats(ForwardTensor::kUp, n, n_out), n * s.n_ff());
    EXPECT_EQ(plan.floats(ForwardTensor::kGate, n, n_out), n * widest_ff);
    EXPECT_EQ(plan.floats(ForwardTensor::kOutRows, n, n_out), n * widest_embd);
    EXPECT_EQ(plan.floats(ForwardTensor::kWholeIn, n, n_out),
              n * std::max(c.n_heads * c.head_dim, c.n_ff));
    EXPECT_EQ(plan.floats(ForwardTensor::kGathered, n, n_out),
              n * size * std::max({widest_q, widest_ff, widest_embd}));
    EXPECT_EQ(plan.floats(ForwardTensor::kLogitSlice, n, n_out), n_out * s.vocab_stride);
    EXPECT_EQ(plan.floats(ForwardTensor::kLogitSlices, n, n_out), n_out * s.vocab_stride * size);
  }
  EXPECT_LT(make_tp_shard(c, size - 1, size).n_heads() * c.head_dim, widest_q);
}

}  // namespace
}  // namespace duet

// The engine with a step-time model instead of a forward pass (what the
// cluster simulator instantiates): it schedules every step exactly as the
// same engine on a real model does, including chunked prefill, preemption
// and recompute, and KV export and import; it holds no KV memory, so an
// engine of an 8B model's shape with a million blocks costs nothing; and its
// clock is the sum of its steps' modeled times.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "tests/worker/model_test.h"
#include "worker/engine.h"
#include "worker/model/step_time_forward.h"

namespace duet {
namespace {

// One sequence's rows in a step, as the engine hands them to the forward.
struct ScheduledRows {
  int64_t id = 0;
  int64_t pos0 = 0;
  int64_t n_tokens = 0;
  int64_t one_token_from = 0;
  bool operator==(const ScheduledRows&) const = default;
};

struct StepRecord {
  std::vector<ScheduledRows> rows;
  std::vector<int64_t> logit_rows;
  std::vector<std::pair<int64_t, int64_t>> exports;  // (pos0, n)
  StepShape shape;
  bool operator==(const StepRecord& o) const {
    return rows == o.rows && logit_rows == o.logit_rows && exports == o.exports;
  }
};

// Records every batch the engine runs. The sequences of a batch appear in
// the order the scheduler put them, each with its engine-assigned id.
void record_steps(Engine& engine, std::vector<StepRecord>& steps) {
  engine.set_before_forward([&steps](const ForwardBatch& batch) {
    StepRecord record;
    // Ids are not in ForwardSequence; they are in the export list only. The
    // row layout identifies each sequence by its place and positions.
    for (size_t i = 0; i < batch.sequences.size(); ++i) {
      const ForwardSequence& s = batch.sequences[i];
      record.rows.push_back({static_cast<int64_t>(i), s.pos0, s.n_tokens, s.one_token_from});
    }
    record.logit_rows.assign(batch.logit_rows.begin(), batch.logit_rows.end());
    for (const ForwardBatch::Export& e : batch.exports) record.exports.emplace_back(e.pos0, e.n);
    record.shape = step_shape(batch.sequences, static_cast<int64_t>(batch.logit_rows.size()));
    steps.push_back(std::move(record));
  });
}

EngineBackend step_time_backend(const ModelConfig& config, StepTimeForward** forward,
                                StepCostModel cost = LinearStepCost{.per_step = 1e-3}) {
  auto f = std::make_unique<StepTimeForward>(std::move(cost), config.n_vocab);
  f->set_layers(config.n_layers);
  *forward = f.get();
  return {std::move(f), make_kv_layout(config, 1), KvMemory::kNone, config.n_vocab,
          config.n_ctx_train};
}

struct Outcome {
  std::vector<StepRecord> steps;
  std::vector<std::vector<int64_t>> positions;  // of each request's tokens
  EngineStats stats;
  int64_t free_blocks_after = 0;
  int64_t n_blocks = 0;
};

// Runs the requests (each ignoring end-of-generation, so lengths do not
// depend on which tokens come out) to completion on `engine`.
Outcome run(Engine& engine, const std::vector<std::vector<int32_t>>& prompts,
            const std::vector<int64_t>& max_tokens) {
  Outcome out;
  record_steps(engine, out.steps);
  out.positions.resize(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    RequestOptions options{.max_tokens = max_tokens[i], .ignore_eos = true};
    options.sampling.temperature = i % 2 == 0 ? 0.0f : 0.8f;
    options.sampling.seed = i;
    engine.submit(prompts[i], options, [&out, i](const TokenEvent& e) {
      if (e.token >= 0) out.positions[i].push_back(e.position);
    });
  }
  engine.run_until_idle();
  out.stats = engine.stats();
  out.free_blocks_after = engine.n_free_kv_blocks();
  out.n_blocks = engine.n_kv_blocks();
  return out;
}

class EngineCostModelTest : public testing::ModelTest {};

TEST_P(EngineCostModelTest, SchedulesEveryStepAsTheModelsEngine) {
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<int64_t> max_tokens;
  for (int i = 0; i < 12; ++i) {
    prompts.push_back(random_prompt(rng, 1 + static_cast<int64_t>(rng() % 120)));
    max_tokens.push_back(1 + static_cast<int64_t>(rng() % 40));
  }
  // Few blocks and a small step budget: chunked prefill and preemption.
  EngineConfig config;
  config.n_kv_blocks = 24;
  config.scheduler = {.max_step_tokens = 48, .max_running = 8};

  Engine real(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config);
  const Outcome expected = run(real, prompts, max_tokens);
  StepTimeForward* forward = nullptr;
  Engine simulated(step_time_backend(model_->config(), &forward), config);
  const Outcome got = run(simulated, prompts, max_tokens);

  ASSERT_GT(expected.stats.preemptions, 0) << "the workload should preempt";
  ASSERT_EQ(got.steps.size(), expected.steps.size());
  for (size_t s = 0; s < got.steps.size(); ++s) EXPECT_EQ(got.steps[s], expected.steps[s]) << s;
  EXPECT_EQ(got.positions, expected.positions);
  EXPECT_EQ(got.stats.steps, expected.stats.steps);
  EXPECT_EQ(got.stats.computed_tokens, expected.stats.computed_tokens);
  EXPECT_EQ(got.stats.preemptions, expected.stats.preemptions);
  EXPECT_EQ(got.free_blocks_after, got.n_blocks) << "KV blocks leaked";
  EXPECT_EQ(simulated.cache().data(), nullptr);
  EXPECT_EQ(forward->steps(), got.stats.steps);
}

TEST_P(EngineCostModelTest, ExportsAndImportsRunWithoutKvMemory) {
  std::mt19937 rng(3);
  const std::vector<int32_t> prompt = random_prompt(rng, 70);
  EngineConfig config;
  config.n_kv_blocks = 32;
  StepTimeForward* prefill_forward = nullptr;
  StepTimeForward* decode_forward = nullptr;
  Engine prefill(step_time_backend(model_->config(), &prefill_forward), config);
  Engine decode(step_time_backend(model_->config(), &decode_forward), config);

  std::vector<int64_t> layers;
  std::optional<int32_t> first;
  ExportSink sink;
  sink.layer = [&](SequenceId, int64_t layer, int64_t pos0, int64_t n, std::span<const int32_t>,
                   const KvCache& cache) {
    EXPECT_EQ(cache.data(), nullptr);
    EXPECT_EQ(pos0 + n, 70);
    layers.push_back(layer);
  };
  sink.done = [&](SequenceId, int32_t token, int64_t) { first = token; };
  prefill.submit_export(prompt, {.max_tokens = 1}, 0, std::move(sink));
  prefill.run_until_idle();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(static_cast<int64_t>(layers.size()), model_->config().n_layers);

  std::vector<int64_t> positions;
  ImportHooks hooks;
  bool reserved = false;
  hooks.reserved = [&](SequenceId, int64_t cached, std::span<const int32_t> table) {
    EXPECT_EQ(cached, 0);
    EXPECT_EQ(static_cast<int64_t>(table.size()), (70 + 15) / 16);
    reserved = true;
  };
  const SequenceId id = decode.submit_import(
      prompt, {.max_tokens = 5, .ignore_eos = true},
      [&](const TokenEvent& e) { positions.push_back(e.position); }, std::move(hooks));
  ASSERT_TRUE(reserved);
  decode.complete_import(id, *first);
  decode.run_until_idle();
  EXPECT_EQ(positions, (std::vector<int64_t>{70, 71, 72, 73, 74}));
  EXPECT_EQ(decode_forward->steps(), 4);  // the first token came with the import
  EXPECT_EQ(decode.n_free_kv_blocks(), decode.n_kv_blocks());
  EXPECT_EQ(prefill.n_free_kv_blocks(), prefill.n_kv_blocks());
}

TEST_P(EngineCostModelTest, AnImportWaitingForASlotIsReservedByTheStepThatFreesIt) {
  // One running slot, taken; an import waits for it. The step that ends the
  // running sequence must reserve the import: after it the engine is idle
  // and would run no further step to do so (found by the cluster simulator:
  // a decode instance's last import waited forever).
  std::mt19937 rng(5);
  EngineConfig config;
  config.n_kv_blocks = 32;
  config.scheduler.max_running = 1;
  StepTimeForward* forward = nullptr;
  Engine engine(step_time_backend(model_->config(), &forward), config);
  engine.submit(random_prompt(rng, 8), {.max_tokens = 2, .ignore_eos = true}, nullptr);
  ASSERT_TRUE(engine.step());  // admitted and prefilled: the slot is taken
  bool reserved = false;
  ImportHooks hooks;
  hooks.reserved = [&](SequenceId, int64_t, std::span<const int32_t>) { reserved = true; };
  engine.submit_import(random_prompt(rng, 8), {.max_tokens = 2, .ignore_eos = true}, nullptr,
                       std::move(hooks));
  EXPECT_FALSE(reserved);
  ASSERT_TRUE(engine.step());  // the running sequence's last token
  EXPECT_TRUE(engine.idle());
  EXPECT_TRUE(reserved);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineCostModelTest,
                         ::testing::Values("tiny_q4_1_gqa_tied.gguf", "tiny_q8_0_mha_untied.gguf"),
                         testing::model_param_name);

TEST(StepShape, CountsRowsSequencesAndAttentionPairs) {
  const std::vector<int32_t> table{0, 1, 2};
  // A 3-row prefill chunk from position 4 (rows see 5, 6, 7 positions) and a
  // decode row at position 9 (sees 10).
  const std::vector<ForwardSequence> batch{{table, 4, 3}, {table, 9, 1}};
  const StepShape shape = step_shape(batch, 2);
  EXPECT_EQ(shape.n_tokens, 4);
  EXPECT_EQ(shape.n_sequences, 2);
  EXPECT_EQ(shape.n_attention, 5 + 6 + 7 + 10);
  EXPECT_EQ(shape.n_logit_rows, 2);
  const LinearStepCost cost{.per_step = 1.0,
                            .per_token = 0.5,
                            .per_sequence = 0.25,
                            .per_attention = 0.125,
                            .per_logit_row = 2.0};
  EXPECT_DOUBLE_EQ(cost(shape), 1.0 + 2.0 + 0.5 + 3.5 + 4.0);
}

// Llama-3-8B's shape: 32 layers, 8 KV heads of 128.
ModelConfig eight_b_shape() {
  ModelConfig c;
  c.n_layers = 32;
  c.n_kv_heads = 8;
  c.n_heads = 32;
  c.head_dim = 128;
  c.n_embd = 4096;
  c.n_vocab = 128256;
  c.n_ctx_train = 8192;
  return c;
}

TEST(EngineCostModel, AnEightBShapedEngineWithAMillionBlocksHoldsNoKv) {
  // 1,000,000 blocks of 16 tokens of this shape would be 2 TiB of F16 KV.
  EngineConfig config;
  config.n_kv_blocks = 1'000'000;
  StepTimeForward* forward = nullptr;
  const LinearStepCost cost{.per_step = 0.01, .per_token = 1e-4, .per_attention = 1e-8};
  Engine engine(step_time_backend(eight_b_shape(), &forward, cost), config);
  EXPECT_EQ(engine.cache().data(), nullptr);
  EXPECT_EQ(engine.cache().layout().total_elems(), int64_t{1'000'000} * 16 * 32 * 2 * 8 * 128);

  std::vector<StepRecord> steps;
  record_steps(engine, steps);
  std::vector<int32_t> prompt(3000, 17);
  std::vector<int64_t> positions;
  engine.submit(prompt, {.max_tokens = 10, .ignore_eos = true},
                [&](const TokenEvent& e) { positions.push_back(e.position); });
  engine.run_until_idle();
  ASSERT_EQ(positions.size(), 10u);
  EXPECT_EQ(positions.front(), 3000);

  // The clock is the sum of the steps' modeled times.
  double expected = 0.0;
  for (const StepRecord& s : steps) expected += cost(s.shape);
  EXPECT_EQ(forward->steps(), static_cast<int64_t>(steps.size()));
  EXPECT_DOUBLE_EQ(forward->elapsed_seconds(), expected);
  EXPECT_GT(forward->elapsed_seconds(), 0.01 * static_cast<double>(steps.size()));
}

TEST(EngineCostModel, RefusesANegativeStepTime) {
  StepTimeForward* forward = nullptr;
  Engine engine(step_time_backend(eight_b_shape(), &forward, [](const StepShape&) { return -1.0; }),
                EngineConfig{});
  engine.submit({1, 2, 3}, {.max_tokens = 2}, {});
  EXPECT_THROW(engine.step(), Error);
}

}  // namespace
}  // namespace duet

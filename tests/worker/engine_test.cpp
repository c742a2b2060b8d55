// The batching engine end to end on real models: a request's tokens are the
// same alone, among 32 mixed others, after preemption and recompute, and with
// a prefix-cache hit; cancel frees blocks at once; nothing leaks.
#include "worker/engine.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "tests/worker/model_test.h"

namespace duet {
namespace {

class EngineTest : public testing::ModelTest {
 protected:
  // Runs the requests to completion; returns each one's generated tokens.
  std::vector<std::vector<int32_t>> run(const std::vector<std::vector<int32_t>>& prompts,
                                        const std::vector<RequestOptions>& options,
                                        EngineConfig config, EngineStats* stats = nullptr) {
    Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config);
    std::vector<std::vector<int32_t>> out(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      engine.submit(prompts[i], options[i], [&out, i](const TokenEvent& e) {
        if (e.token >= 0) out[i].push_back(e.token);
      });
    }
    engine.run_until_idle();
    EXPECT_EQ(engine.n_free_kv_blocks(), engine.n_kv_blocks()) << "KV blocks leaked";
    if (stats != nullptr) *stats = engine.stats();
    return out;
  }
};

RequestOptions sampled(uint64_t seed, int64_t max_tokens) {
  RequestOptions o;
  o.max_tokens = max_tokens;
  o.sampling.temperature = 0.9f;
  o.sampling.top_k = 40;
  o.sampling.seed = seed;
  return o;
}

TEST_P(EngineTest, TokensAreTheSameAloneAndAmongThirtyTwoOthers) {
  std::mt19937 rng(1);
  const std::vector<int32_t> target = random_prompt(rng, 37);
  const RequestOptions target_options = sampled(99, 24);
  EngineConfig config;
  config.n_kv_blocks = 512;
  config.scheduler = {.max_step_tokens = 256, .max_running = 64};
  const auto alone = run({target}, {target_options}, config);

  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestOptions> options;
  for (int i = 0; i < 32; ++i) {
    prompts.push_back(random_prompt(rng, 1 + rng() % 90));
    options.push_back(i % 2 == 0 ? sampled(i, 1 + rng() % 30) : RequestOptions{.max_tokens = 10});
    if (i == 13) {
      prompts.push_back(target);
      options.push_back(target_options);
    }
  }
  const auto together = run(prompts, options, config);
  EXPECT_EQ(together[14], alone[0]);
}

TEST_P(EngineTest, PreemptionAndRecomputeChangeNoToken) {
  std::mt19937 rng(2);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestOptions> options;
  for (int i = 0; i < 6; ++i) {
    prompts.push_back(random_prompt(rng, 20 + 7 * i));
    options.push_back(sampled(100 + i, 40));
  }
  EngineConfig roomy;
  roomy.n_kv_blocks = 256;
  EngineConfig tight = roomy;
  tight.n_kv_blocks = 12;  // 192 tokens for six sequences of up to 95: preemption guaranteed
  EngineStats stats;
  const auto reference = run(prompts, options, roomy);
  const auto preempted = run(prompts, options, tight, &stats);
  EXPECT_GT(stats.preemptions, 0);
  EXPECT_EQ(preempted, reference);
}

TEST_P(EngineTest, PrefixCacheHitSkipsWorkAndChangesNoToken) {
  std::mt19937 rng(3);
  const std::vector<int32_t> system = random_prompt(rng, 48);
  std::vector<int32_t> question = system;
  for (int32_t t : random_prompt(rng, 9)) question.push_back(t);
  EngineConfig config;
  config.n_kv_blocks = 64;
  const RequestOptions options = sampled(5, 12);
  const auto cold = run({question}, {options}, config);

  Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config);
  engine.submit(system, RequestOptions{.max_tokens = 1}, nullptr);
  engine.run_until_idle();
  std::vector<int32_t> warm;
  engine.submit(question, options, [&](const TokenEvent& e) { warm.push_back(e.token); });
  engine.run_until_idle();
  EXPECT_EQ(warm, cold[0]);
  EXPECT_EQ(engine.stats().prefix_hit_tokens, 48);  // three full blocks of the system prompt
}

TEST_P(EngineTest, CancelFreesBlocksAtOnce) {
  std::mt19937 rng(4);
  EngineConfig config;
  config.n_kv_blocks = 64;
  Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config);
  bool finished = false;
  FinishReason reason = FinishReason::kLength;
  const SequenceId id = engine.submit(random_prompt(rng, 40), RequestOptions{.max_tokens = 100},
                                      [&](const TokenEvent& e) {
                                        if (e.finished) {
                                          finished = true;
                                          reason = e.reason;
                                        }
                                      });
  engine.step();
  engine.step();
  EXPECT_LT(engine.n_free_kv_blocks(), engine.n_kv_blocks());
  engine.cancel(id);
  EXPECT_TRUE(finished);
  EXPECT_EQ(reason, FinishReason::kCancelled);
  EXPECT_EQ(engine.n_free_kv_blocks(), engine.n_kv_blocks());
  EXPECT_FALSE(engine.step());
}

TEST_P(EngineTest, IgnoreEosGeneratesExactlyMaxTokens) {
  std::mt19937 rng(5);
  const std::vector<int32_t> prompt = random_prompt(rng, 20);
  // Every sampled token counts as an end of generation: without ignore_eos
  // a request ends after one token, with it after max_tokens.
  EngineConfig config;
  for (int32_t id = 0; id < model_->config().n_vocab; ++id) config.end_of_generation.push_back(id);
  RequestOptions options = sampled(7, 9);
  EXPECT_EQ(run({prompt}, {options}, config)[0].size(), 1u);
  options.ignore_eos = true;
  EXPECT_EQ(run({prompt}, {options}, config)[0].size(), 9u);
}

TEST_P(EngineTest, AdmissionIsReportedOnceWithThePrefixCacheHit) {
  std::mt19937 rng(6);
  const std::vector<int32_t> prompt = random_prompt(rng, 40);  // two full blocks and a bit
  Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, EngineConfig{});
  std::vector<int64_t> admitted;
  auto on_admitted = [&](SequenceId, int64_t cached) { admitted.push_back(cached); };
  engine.submit(
      prompt, sampled(1, 4), [](const TokenEvent&) {}, on_admitted);
  engine.run_until_idle();
  engine.submit(
      prompt, sampled(1, 4), [](const TokenEvent&) {}, on_admitted);
  engine.run_until_idle();
  EXPECT_EQ(admitted, (std::vector<int64_t>{0, 32}));
}

TEST_P(EngineTest, RefusesRequestsThatCannotFit) {
  EngineConfig config;
  config.n_kv_blocks = 4;
  Engine engine(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config);
  EXPECT_THROW(engine.submit({}, RequestOptions{}, nullptr), Error);
  EXPECT_THROW(
      engine.submit(std::vector<int32_t>(60, 5), RequestOptions{.max_tokens = 10}, nullptr), Error);
  EXPECT_THROW(
      engine.submit({static_cast<int32_t>(model_->config().n_vocab)}, RequestOptions{}, nullptr),
      Error);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineTest,
                         ::testing::Values("tiny_q4_1_gqa_tied.gguf", "tiny_q8_0_mha_untied.gguf",
                                           "default"),
                         testing::model_param_name);

}  // namespace
}  // namespace duet

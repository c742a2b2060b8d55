// The generator with the full sampler on a tiny random model: sampled
// generation is reproducible (the same seed and options give the same tokens
// on every run and thread count), and the stop conditions hold.
#include "worker/generator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"

namespace duet {
namespace {

const char* const kModel = "fixtures/tiny/tiny_q4_1_gqa_tied.gguf";

// The golden file's prompt for the model: random ids from its vocabulary.
std::vector<int32_t> prompt_ids() {
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/tiny_models.json"));
  for (const auto& m : golden["models"]) {
    if (m["file"] == "tiny_q4_1_gqa_tied.gguf") {
      const auto ids = m["ids"].get<std::vector<int32_t>>();
      return {ids.begin(), ids.begin() + 8};
    }
  }
  throw std::runtime_error("tiny_q4_1_gqa_tied.gguf is not in tiny_models.json");
}

GenerateOptions sampled_options() {
  GenerateOptions options;
  options.max_tokens = 24;
  options.sampling.temperature = 0.9f;
  options.sampling.seed = 1234;
  options.sampling.top_k = 40;
  options.sampling.top_p = 0.95f;
  options.sampling.min_p = 0.02f;
  options.sampling.repetition_penalty = 1.1f;
  options.sampling.frequency_penalty = 0.1f;
  options.sampling.presence_penalty = 0.1f;
  options.sampling.penalty_last_n = 16;
  return options;
}

bool never(int32_t) { return false; }
bool always(int32_t) { return true; }

class GeneratorTest : public ::testing::Test {
 protected:
  void SetUp() override { model_ = LlamaModel::load(testing::fixture_path(kModel)); }

  GenerateResult run(const GenerateOptions& options, int n_threads,
                     const std::function<bool(int32_t)>& on_token = always,
                     const std::function<bool(int32_t)>& is_end = never) {
    cpu::ThreadPool pool(n_threads);
    Generator generator(*model_, cpu::kernel_table(cpu::best_isa()), pool);
    return generator.generate(prompt_ids(), options, on_token, is_end);
  }

  std::unique_ptr<LlamaModel> model_;
};

TEST_F(GeneratorTest, SameSeedGivesTheSameTokensAcrossRunsAndThreadCounts) {
  const GenerateOptions options = sampled_options();
  const GenerateResult first = run(options, 1);
  const GenerateResult again = run(options, 1);
  const GenerateResult two_threads = run(options, 2);
  ASSERT_EQ(first.tokens.size(), 24u);
  EXPECT_EQ(first.tokens, again.tokens);
  EXPECT_EQ(first.tokens, two_threads.tokens);
  for (const int32_t token : first.tokens) {
    EXPECT_GE(token, 0);
    EXPECT_LT(token, model_->config().n_vocab);
  }
  EXPECT_GT(std::set<int32_t>(first.tokens.begin(), first.tokens.end()).size(), 4u)
      << "the draws should vary";
}

TEST_F(GeneratorTest, ADifferentSeedGivesDifferentTokens) {
  GenerateOptions options = sampled_options();
  const GenerateResult a = run(options, 1);
  options.sampling.seed = 99;
  const GenerateResult b = run(options, 1);
  EXPECT_NE(a.tokens, b.tokens);
}

TEST_F(GeneratorTest, KvCacheOnAndOffSampleTheSameTokens) {
  GenerateOptions options = sampled_options();
  options.max_tokens = 12;
  const GenerateResult on = run(options, 1);
  options.use_kv_cache = false;
  const GenerateResult off = run(options, 1);
  EXPECT_EQ(on.tokens, off.tokens);
}

TEST_F(GeneratorTest, FiltersDoNotChangeGreedy) {
  GenerateOptions greedy;
  greedy.max_tokens = 16;
  GenerateOptions filtered = greedy;
  filtered.sampling.seed = 7;
  filtered.sampling.top_k = 3;
  filtered.sampling.top_p = 0.5f;
  filtered.sampling.min_p = 0.3f;
  EXPECT_EQ(run(greedy, 1).tokens, run(filtered, 1).tokens);
}

// Teacher-forced with the prompt's length, the generated tokens are computed
// as generation computes them: each row's argmax is the greedy token, and a
// row's logits do not depend on how many tokens follow it.
TEST_F(GeneratorTest, TeacherForcedLogitsOfGeneratedTokensFollowTheGreedyPath) {
  GenerateOptions greedy;
  greedy.max_tokens = 16;
  const GenerateResult result = run(greedy, 2);
  ASSERT_EQ(result.tokens.size(), 16u);
  const std::vector<int32_t> prompt = prompt_ids();
  std::vector<int32_t> path = prompt;
  path.insert(path.end(), result.tokens.begin(), result.tokens.end() - 1);
  cpu::ThreadPool pool(2);
  Generator generator(*model_, cpu::kernel_table(cpu::best_isa()), pool);
  const auto n_prompt = static_cast<int64_t>(prompt.size());
  const std::vector<float> logits = generator.logits_all(path, n_prompt);
  const int64_t n_vocab = model_->config().n_vocab;
  for (size_t i = 0; i < result.tokens.size(); ++i) {
    const float* row = logits.data() + (prompt.size() - 1 + i) * static_cast<size_t>(n_vocab);
    EXPECT_EQ(std::max_element(row, row + n_vocab) - row, result.tokens[i]) << "token " << i;
  }
  const std::vector<float> shorter =
      generator.logits_all(std::span<const int32_t>(path).first(path.size() - 6), n_prompt);
  EXPECT_TRUE(std::equal(shorter.begin(), shorter.end(), logits.begin()));
}

TEST_F(GeneratorTest, MaxTokensIsHonoured) {
  GenerateOptions options = sampled_options();
  for (const int64_t max_tokens : {0, 1, 5, 17}) {
    options.max_tokens = max_tokens;
    const GenerateResult result = run(options, 2);
    EXPECT_EQ(static_cast<int64_t>(result.tokens.size()), max_tokens);
    EXPECT_EQ(result.finish, FinishReason::kLength);
  }
}

TEST_F(GeneratorTest, OnTokenReturningFalseStops) {
  const GenerateOptions options = sampled_options();
  const GenerateResult full = run(options, 1);
  int n_seen = 0;
  const GenerateResult stopped = run(options, 1, [&](int32_t) { return ++n_seen < 3; });
  ASSERT_EQ(stopped.tokens.size(), 3u);
  EXPECT_EQ(stopped.finish, FinishReason::kCancelled);
  EXPECT_TRUE(std::equal(stopped.tokens.begin(), stopped.tokens.end(), full.tokens.begin()));
}

TEST_F(GeneratorTest, EndOfGenerationTokenIsEmittedThenStops) {
  const GenerateOptions options = sampled_options();
  const GenerateResult full = run(options, 1);
  const int32_t end = full.tokens[5];
  const GenerateResult ended = run(options, 1, always, [&](int32_t token) { return token == end; });
  const auto first_end = std::find(full.tokens.begin(), full.tokens.end(), end);
  const std::vector<int32_t> expected(full.tokens.begin(), first_end + 1);
  EXPECT_EQ(ended.tokens, expected);
  EXPECT_EQ(ended.finish, FinishReason::kEndOfGeneration);
}

TEST_F(GeneratorTest, BadSamplingParametersAreRejected) {
  GenerateOptions options = sampled_options();
  options.sampling.top_p = 1.5f;
  try {
    run(options, 1);
    FAIL() << "expected duet::Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_STREQ(e.what(), "top_p must be in (0, 1], got 1.5");
  }
}

}  // namespace
}  // namespace duet

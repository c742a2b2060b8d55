// The default model against llama.cpp (tests/golden/make_model_golden.py):
// teacher-forced logits on the reference's tokens, and free-running greedy
// text. The reference runs only when fixtures are made, never here.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "common/text/tokenizer_gguf.h"
#include "kernels/cpu/isa.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"
#include "worker/generator.h"

namespace duet {
namespace {

constexpr float kMarginThreshold = 0.05f;  // below: a near tie, either argmax is right
constexpr float kLogitTolerance = 0.1f;    // max |our logit - reference logit|

class GoldenModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto path = testing::default_model_path();
    if (!path) return;
    model_ = LlamaModel::load(*path).release();
    pool_ = new cpu::ThreadPool(2);
  }
  static void TearDownTestSuite() {
    delete pool_;
    delete model_;
    pool_ = nullptr;
    model_ = nullptr;
  }
  void SetUp() override {
    if (model_ == nullptr)
      GTEST_SKIP() << "default model not found: run launch/setup.sh to fetch it";
    if (const char* isa = std::getenv("DUET_ISA")) {
      const auto parsed = cpu::parse_isa(isa);
      if (parsed && !cpu::cpu_supports(*parsed))
        GTEST_SKIP() << "this CPU cannot run DUET_ISA=" << isa;
    }
    golden_ = testing::read_golden(testing::fixture_path("golden/smollm2_greedy.json"));
  }

  static LlamaModel* model_;
  static cpu::ThreadPool* pool_;
  nlohmann::json golden_;
};

LlamaModel* GoldenModelTest::model_ = nullptr;
cpu::ThreadPool* GoldenModelTest::pool_ = nullptr;

TEST_F(GoldenModelTest, TeacherForcedLogitsMatchReference) {
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  Generator generator(*model_, kernels, *pool_);
  const int64_t n_vocab = model_->config().n_vocab;
  float worst = 0.0f;
  for (const auto& c : golden_["cases"]) {
    std::vector<int32_t> tokens = c["prompt_ids"].get<std::vector<int32_t>>();
    for (int32_t id : c["generated_ids"]) tokens.push_back(id);
    const std::vector<float> logits = generator.logits_all(tokens);
    float case_worst = 0.0f;
    int n_checked = 0, n_near_ties = 0;
    for (const auto& p : c["positions"]) {
      const int64_t pos = p["pos"];
      const float* row = logits.data() + pos * n_vocab;
      for (const char* ids_key : {"top_ids", "sample_ids"}) {
        const std::string logits_key =
            std::string(ids_key) == "top_ids" ? "top_logits" : "sample_logits";
        const auto ids = p[ids_key].get<std::vector<int32_t>>();
        const auto ref = p[logits_key].get<std::vector<float>>();
        for (size_t i = 0; i < ids.size(); ++i) {
          case_worst = std::max(case_worst, std::fabs(row[ids[i]] - ref[i]));
        }
      }
      const int32_t ours = static_cast<int32_t>(std::max_element(row, row + n_vocab) - row);
      if (p["margin"].get<float>() > kMarginThreshold) {
        EXPECT_EQ(ours, p["top_ids"][0].get<int32_t>())
            << c["name"] << " position " << pos << " (reference margin " << p["margin"] << ")";
        ++n_checked;
      } else {
        ++n_near_ties;
      }
    }
    std::printf("  %-16s %3d positions checked, %d near ties, max |dlogit| %.4f\n",
                c["name"].get<std::string>().c_str(), n_checked, n_near_ties, case_worst);
    EXPECT_LE(case_worst, kLogitTolerance) << c["name"];
    worst = std::max(worst, case_worst);
  }
  std::printf("  max |dlogit| over all cases: %.4f (tolerance %.2f)\n", worst, kLogitTolerance);
}

TEST_F(GoldenModelTest, FreeRunningGreedyMatchesReference) {
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  Generator generator(*model_, kernels, *pool_);
  const Tokenizer tokenizer = tokenizer_from_gguf(model_->file());
  int identical = 0, total = 0;
  for (const auto& c : golden_["cases"]) {
    const auto prompt = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto expected = c["generated_ids"].get<std::vector<int32_t>>();
    GenerateOptions options;
    options.max_tokens = static_cast<int64_t>(expected.size());
    const GenerateResult result = generator.generate(
        prompt, options, [](int32_t) { return true; },
        [&](int32_t id) { return tokenizer.is_end_of_generation(id); });
    ++total;
    if (result.tokens == expected) {
      ++identical;
      std::printf("  %-16s identical (%zu tokens)\n", c["name"].get<std::string>().c_str(),
                  expected.size());
      continue;
    }
    const size_t n = std::min(result.tokens.size(), expected.size());
    size_t first = 0;
    while (first < n && result.tokens[first] == expected[first]) ++first;
    // Divergence is allowed only where the reference itself was near a tie.
    const int64_t pos = static_cast<int64_t>(prompt.size() + first) - 1;
    float margin = -1.0f;
    for (const auto& p : c["positions"]) {
      if (p["pos"].get<int64_t>() == pos) margin = p["margin"];
    }
    std::printf("  %-16s diverges at generated token %zu (position %lld): reference margin %.4f\n",
                c["name"].get<std::string>().c_str(), first, static_cast<long long>(pos), margin);
    EXPECT_GE(margin, 0.0f) << "no reference logits at the divergence";
    EXPECT_LT(margin, kMarginThreshold) << c["name"] << " diverged where the reference was sure";
  }
  std::printf("  identical greedy output on %d of %d prompts\n", identical, total);
  EXPECT_GE(identical, total - 1);
}

}  // namespace
}  // namespace duet

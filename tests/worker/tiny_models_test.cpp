// Tiny random models of every supported weight type and both head layouts
// (GQA and MHA, tied and separate output head) against llama.cpp's logits
// (tests/golden/make_tiny_models.py), on every ISA path this CPU runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "kernels/cpu/isa.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"
#include "worker/generator.h"

namespace duet {
namespace {

constexpr float kLogitTolerance = 0.02f;

TEST(TinyModels, TeacherForcedLogitsMatchReferenceOnEveryIsa) {
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/tiny_models.json"));
  const std::filesystem::path dir = testing::source_dir() / golden["model_dir"].get<std::string>();
  cpu::ThreadPool pool(2);
  for (const auto& m : golden["models"]) {
    const std::string file = m["file"];
    auto model = LlamaModel::load(dir / file);
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    const auto ref = m["logits"].get<std::vector<std::vector<float>>>();
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      const std::vector<float> logits = generator.logits_all(ids);
      const int64_t n_vocab = model->config().n_vocab;
      float worst = 0.0f;
      for (size_t pos = 0; pos < ref.size(); ++pos) {
        ASSERT_EQ(static_cast<int64_t>(ref[pos].size()), n_vocab);
        for (int64_t v = 0; v < n_vocab; ++v) {
          worst = std::max(worst, std::fabs(logits[pos * n_vocab + v] - ref[pos][v]));
        }
      }
      std::printf("  %-28s %-7s max |dlogit| %.5f\n", file.c_str(),
                  std::string(cpu::isa_name(isa)).c_str(), worst);
      EXPECT_LE(worst, kLogitTolerance) << file << " on " << cpu::isa_name(isa);
    }
  }
}

TEST(TinyModels, GreedyContinuationMatchesReference) {
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/tiny_models.json"));
  const std::filesystem::path dir = testing::source_dir() / golden["model_dir"].get<std::string>();
  cpu::ThreadPool pool(2);
  for (const auto& m : golden["models"]) {
    auto model = LlamaModel::load(dir / m["file"].get<std::string>());
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    const size_t prefix = m["greedy_prefix_len"];
    const auto expected = m["greedy"].get<std::vector<int32_t>>();
    const auto margins = m["greedy_margins"].get<std::vector<float>>();
    Generator generator(*model, cpu::kernel_table(cpu::best_isa()), pool);
    GenerateOptions options;
    options.max_tokens = static_cast<int64_t>(expected.size());
    const GenerateResult result = generator.generate(
        std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(prefix)),
        options, [](int32_t) { return true; }, [](int32_t) { return false; });
    ASSERT_EQ(result.tokens.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      if (result.tokens[i] != expected[i]) {
        EXPECT_LT(margins[i], 0.05f)
            << m["file"] << ": token " << i << " differs where the reference was sure";
        break;  // later tokens follow a different context
      }
    }
  }
}

}  // namespace
}  // namespace duet

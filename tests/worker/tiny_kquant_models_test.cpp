// Tiny random models with BF16, Q4_K and Q6_K weights (and a mix of them with
// Q8_0) against llama.cpp's logits (tests/golden/make_tiny_kquant_models.py),
// on every ISA path this CPU runs. The reference ran llama.cpp with its tiled
// K-quant kernels and repacked layouts off, so it used the dot products whose
// order Duet follows; where its default run differs, that is checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "kernels/cpu/isa.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"
#include "worker/generator.h"

namespace duet {
namespace {

constexpr float kLogitTolerance = 0.02f;

float max_abs_diff(const std::vector<float>& logits, const nlohmann::json& ref, int64_t n_vocab) {
  float worst = 0.0f;
  for (size_t pos = 0; pos < ref.size(); ++pos) {
    const auto row = ref[pos].get<std::vector<float>>();
    EXPECT_EQ(static_cast<int64_t>(row.size()), n_vocab);
    for (int64_t v = 0; v < n_vocab && v < static_cast<int64_t>(row.size()); ++v) {
      worst = std::max(worst, std::fabs(logits[pos * n_vocab + v] - row[v]));
    }
  }
  return worst;
}

nlohmann::json golden() {
  return testing::read_golden(testing::fixture_path("golden/tiny_kquant_models.json"));
}

TEST(TinyKQuantModels, TeacherForcedLogitsMatchReferenceOnEveryIsa) {
  const nlohmann::json g = golden();
  const std::filesystem::path dir = testing::source_dir() / g["model_dir"].get<std::string>();
  cpu::ThreadPool pool(2);
  for (const auto& m : g["models"]) {
    const std::string file = m["file"];
    auto model = LlamaModel::load(dir / file);
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    const int64_t n_vocab = model->config().n_vocab;
    std::vector<float> first;
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      const std::vector<float> logits = generator.logits_all(ids);
      const float worst = max_abs_diff(logits, m["logits"], n_vocab);
      std::printf("  %-26s %-7s max |dlogit| %.5f", file.c_str(),
                  std::string(cpu::isa_name(isa)).c_str(), worst);
      if (m.contains("logits_default")) {
        const float worst_default = max_abs_diff(logits, m["logits_default"], n_vocab);
        std::printf("  (llama.cpp's default run %.5f)", worst_default);
        EXPECT_LE(worst_default, kLogitTolerance)
            << file << " (default run) on " << cpu::isa_name(isa);
      }
      std::printf("\n");
      EXPECT_LE(worst, kLogitTolerance) << file << " on " << cpu::isa_name(isa);
      // The kernels are bit-identical across paths, so the whole forward is.
      if (first.empty()) {
        first = logits;
      } else {
        ASSERT_EQ(logits.size(), first.size());
        EXPECT_EQ(std::memcmp(logits.data(), first.data(), logits.size() * sizeof(float)), 0)
            << file << ": " << cpu::isa_name(isa) << " differs from "
            << cpu::isa_name(cpu::supported_isas()[0]);
      }
    }
  }
}

TEST(TinyKQuantModels, GreedyContinuationMatchesReference) {
  const nlohmann::json g = golden();
  const std::filesystem::path dir = testing::source_dir() / g["model_dir"].get<std::string>();
  cpu::ThreadPool pool(2);
  for (const auto& m : g["models"]) {
    auto model = LlamaModel::load(dir / m["file"].get<std::string>());
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    const size_t prefix = m["greedy_prefix_len"];
    const auto expected = m["greedy"].get<std::vector<int32_t>>();
    const auto margins = m["greedy_margins"].get<std::vector<float>>();
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      GenerateOptions options;
      options.max_tokens = static_cast<int64_t>(expected.size());
      const GenerateResult result = generator.generate(
          std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(prefix)),
          options, [](int32_t) { return true; }, [](int32_t) { return false; });
      ASSERT_EQ(result.tokens.size(), expected.size());
      for (size_t i = 0; i < expected.size(); ++i) {
        if (result.tokens[i] != expected[i]) {
          ADD_FAILURE() << m["file"] << " on " << cpu::isa_name(isa) << ": token " << i << " is "
                        << result.tokens[i] << ", llama.cpp chose " << expected[i] << " (margin "
                        << margins[i] << ")";
          break;  // later tokens follow a different context
        }
      }
    }
  }
}

}  // namespace
}  // namespace duet

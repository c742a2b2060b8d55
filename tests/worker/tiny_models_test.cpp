// Tiny random models of every supported weight type and both head layouts
// (GQA and MHA, tied and separate output head) against llama.cpp's logits
// (tests/golden/make_tiny_models.py), on every ISA path this CPU runs.
#include <gtest/gtest.h>

#include <cstdio>

#include "kernels/cpu/isa.h"
#include "tests/worker/tiny_model_golden.h"
#include "worker/generator.h"

namespace duet {
namespace {

constexpr float kLogitTolerance = 0.02f;

TEST(TinyModels, TeacherForcedLogitsMatchReferenceOnEveryIsa) {
  const testing::TinyModelGolden golden = testing::read_tiny_model_golden("tiny_models.json");
  cpu::ThreadPool pool(2);
  for (const auto& m : golden.json["models"]) {
    const std::string file = m["file"];
    auto model = LlamaModel::load(golden.model_dir / file);
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      const float worst =
          testing::max_logit_diff(generator.logits_all(ids), m["logits"], model->config().n_vocab);
      std::printf("  %-28s %-7s max |dlogit| %.5f\n", file.c_str(),
                  std::string(cpu::isa_name(isa)).c_str(), worst);
      EXPECT_LE(worst, kLogitTolerance) << file << " on " << cpu::isa_name(isa);
    }
  }
}

TEST(TinyModels, GreedyContinuationMatchesReference) {
  const testing::TinyModelGolden golden = testing::read_tiny_model_golden("tiny_models.json");
  cpu::ThreadPool pool(2);
  for (const auto& m : golden.json["models"]) {
    auto model = LlamaModel::load(golden.model_dir / m["file"].get<std::string>());
    const auto expected = m["greedy"].get<std::vector<int32_t>>();
    const auto margins = m["greedy_margins"].get<std::vector<float>>();
    Generator generator(*model, cpu::kernel_table(cpu::best_isa()), pool);
    const std::vector<int32_t> tokens = testing::greedy_continuation(generator, m);
    ASSERT_EQ(tokens.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      if (tokens[i] != expected[i]) {
        EXPECT_LT(margins[i], 0.05f)
            << m["file"] << ": token " << i << " differs where the reference was sure";
        break;  // later tokens follow a different context
      }
    }
  }
}

}  // namespace
}  // namespace duet

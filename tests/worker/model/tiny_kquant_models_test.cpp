// Tiny random models with BF16, Q4_K and Q6_K weights (and a mix of them with
// Q8_0) against llama.cpp's logits (tests/golden/make_tiny_kquant_models.py),
// on every ISA path this CPU runs. Models with K-quant matrices are checked
// against llama.cpp's run with every K-quant product in its tiled kernels
// (logits_tiled), whose order Duet's K-quants follow. Its vec_dot run (logits)
// and default run (logits_default) are checked too, within the tolerance plus
// what llama.cpp's own orders differ by: the Q4_K model's products cancel by
// factors of thousands, and its tiled and vec_dot runs differ by 0.05.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "kernels/cpu/isa.h"
#include "tests/worker/model/tiny_model_golden.h"
#include "worker/generator.h"

namespace duet {
namespace {

constexpr float kLogitTolerance = 0.02f;

testing::TinyModelGolden golden() {
  return testing::read_tiny_model_golden("tiny_kquant_models.json");
}

TEST(TinyKQuantModels, TeacherForcedLogitsMatchReferenceOnEveryIsa) {
  const testing::TinyModelGolden g = golden();
  cpu::ThreadPool pool(2);
  for (const auto& m : g.json["models"]) {
    const std::string file = m["file"];
    auto model = LlamaModel::load(g.model_dir / file);
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    const int64_t n_vocab = model->config().n_vocab;
    // llama.cpp's orders differ among themselves by this much on this model.
    const float spread = m.value("tiled_run_max_abs_logit_diff", 0.0f);
    std::vector<float> first;
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      const std::vector<float> logits = generator.logits_all(ids);
      const float worst = testing::max_logit_diff(logits, m["logits"], n_vocab);
      std::printf("  %-26s %-7s max |dlogit| %.5f", file.c_str(),
                  std::string(cpu::isa_name(isa)).c_str(), worst);
      if (m.contains("logits_tiled")) {
        const float worst_tiled = testing::max_logit_diff(logits, m["logits_tiled"], n_vocab);
        std::printf("  (tiled run %.5f)", worst_tiled);
        EXPECT_LE(worst_tiled, kLogitTolerance) << file << " (tiled run) on " << cpu::isa_name(isa);
      }
      if (m.contains("logits_default")) {
        const float worst_default = testing::max_logit_diff(logits, m["logits_default"], n_vocab);
        std::printf("  (llama.cpp's default run %.5f)", worst_default);
        EXPECT_LE(worst_default, kLogitTolerance + spread)
            << file << " (default run) on " << cpu::isa_name(isa);
      }
      std::printf("\n");
      EXPECT_LE(worst, kLogitTolerance + spread) << file << " on " << cpu::isa_name(isa);
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

// Q4_K matrices laid out by 16 rows at load (interleave.h) give every ISA
// path the same logits, bit for bit, as the file's rows.
TEST(TinyKQuantModels, InterleavedQ4_KChangesNoBit) {
  const int n_interleaved =
      testing::expect_interleaving_changes_no_bit(golden(), [](cpu::KernelTable& kernels) {
        testing::lay_out_nothing(kernels);
        kernels.interleave_q4_k = true;
      });
  EXPECT_GT(n_interleaved, 0) << "no tiny model has Q4_K matrices to interleave";
}

// Q6_K likewise (the tiny models' vocabulary of 299 rows keeps their heads in
// the file's rows; KQuantInterleaved covers rows looked up from the layout).
TEST(TinyKQuantModels, InterleavedQ6_KChangesNoBit) {
  const int n_interleaved =
      testing::expect_interleaving_changes_no_bit(golden(), [](cpu::KernelTable& kernels) {
        testing::lay_out_nothing(kernels);
        kernels.interleave_q6_k = true;
      });
  EXPECT_GT(n_interleaved, 0) << "no tiny model has Q6_K matrices to interleave";
}

TEST(TinyKQuantModels, GreedyContinuationMatchesReference) {
  const testing::TinyModelGolden g = golden();
  cpu::ThreadPool pool(2);
  for (const auto& m : g.json["models"]) {
    auto model = LlamaModel::load(g.model_dir / m["file"].get<std::string>());
    const auto expected = m["greedy"].get<std::vector<int32_t>>();
    const auto margins = m["greedy_margins"].get<std::vector<float>>();
    for (cpu::Isa isa : cpu::supported_isas()) {
      Generator generator(*model, cpu::kernel_table(isa), pool);
      const std::vector<int32_t> tokens = testing::greedy_continuation(generator, m);
      ASSERT_EQ(tokens.size(), expected.size());
      for (size_t i = 0; i < expected.size(); ++i) {
        if (tokens[i] != expected[i]) {
          ADD_FAILURE() << m["file"] << " on " << cpu::isa_name(isa) << ": token " << i << " is "
                        << tokens[i] << ", llama.cpp chose " << expected[i] << " (margin "
                        << margins[i] << ")";
          break;  // later tokens follow a different context
        }
      }
    }
  }
}

}  // namespace
}  // namespace duet

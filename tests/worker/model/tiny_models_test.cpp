// Tiny random models of every supported weight type and both head layouts
// (GQA and MHA, tied and separate output head) against llama.cpp's logits
// (tests/golden/make_tiny_models.py), on every ISA path this CPU runs.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>

#include "kernels/cpu/isa.h"
#include "tests/worker/model/tiny_model_golden.h"
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

// Q4_0 matrices laid out for the kernels at load (interleaved by 8 rows; the
// tiny models' vocabulary of 299 rows keeps their embedding tables in the
// file's rows) give every logit bit for bit as the file's rows do on the same
// path, on every path: forced on where a path would not ask for it.
TEST(TinyModels, InterleavedWeightsChangeNoBit) {
  const int n_interleaved = testing::expect_interleaving_changes_no_bit(
      testing::read_tiny_model_golden("tiny_models.json"), [](cpu::KernelTable& kernels) {
        testing::lay_out_nothing(kernels);
        kernels.interleave_q4_0 = true;
      });
  EXPECT_GT(n_interleaved, 0) << "no tiny model has Q4_0 matrices to interleave";
}

// The same for Q4_0 by 16 rows (the AVX-512 path's layout), on every path.
TEST(TinyModels, InterleavedQ4_0By16ChangesNoBit) {
  const int n_interleaved = testing::expect_interleaving_changes_no_bit(
      testing::read_tiny_model_golden("tiny_models.json"), [](cpu::KernelTable& kernels) {
        testing::lay_out_nothing(kernels);
        kernels.interleave_q4_0_by_16 = true;
      });
  EXPECT_GT(n_interleaved, 0) << "no tiny model has Q4_0 matrices to interleave";
}

// Q8_0 and Q4_1 matrices laid out by 16 rows (the AVX-512 path's layout),
// the same on every path.
TEST(TinyModels, InterleavedQ8_0AndQ4_1ChangeNoBit) {
  const int n_interleaved = testing::expect_interleaving_changes_no_bit(
      testing::read_tiny_model_golden("tiny_models.json"), [](cpu::KernelTable& kernels) {
        testing::lay_out_nothing(kernels);
        kernels.interleave_q8_0 = kernels.interleave_q4_1 = true;
      });
  EXPECT_GT(n_interleaved, 0) << "no tiny model has Q8_0 or Q4_1 matrices to interleave";
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

// The golden files of the tiny random models (tests/golden/make_tiny_*.py):
// where their models are, and the comparisons the tiny-model tests make
// against llama.cpp's logits and greedy tokens.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/golden_file.h"
#include "tests/test_paths.h"
#include "worker/generator.h"

namespace duet::testing {

// A golden file of tests/golden/ and the folder its models are in.
struct TinyModelGolden {
  nlohmann::json json;
  std::filesystem::path model_dir;
};

inline TinyModelGolden read_tiny_model_golden(const std::string& file_name) {
  TinyModelGolden golden;
  golden.json = read_golden(fixture_path("golden/" + file_name));
  golden.model_dir = source_dir() / golden.json["model_dir"].get<std::string>();
  return golden;
}

// The largest |logits - ref| over the positions ref holds. logits:
// (positions, n_vocab); a row of ref that is not n_vocab long fails the test.
inline float max_logit_diff(const std::vector<float>& logits, const nlohmann::json& ref,
                            int64_t n_vocab) {
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

// A golden model's first greedy_prefix_len ids continued greedily for as many
// tokens as the reference's "greedy" holds.
inline std::vector<int32_t> greedy_continuation(Generator& generator, const nlohmann::json& m) {
  const auto ids = m["ids"].get<std::vector<int32_t>>();
  const size_t prefix = m["greedy_prefix_len"];
  GenerateOptions options;
  options.max_tokens = static_cast<int64_t>(m["greedy"].size());
  return generator
      .generate(
          std::vector<int32_t>(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(prefix)),
          options, [](int32_t) { return true; }, [](int32_t) { return false; })
      .tokens;
}

// `kernels` asking for no layout at all: a test then turns on the one it checks.
inline void lay_out_nothing(cpu::KernelTable& kernels) {
  kernels.interleave_q4_0 = kernels.interleave_q4_0_by_16 = false;
  kernels.interleave_q4_k = kernels.interleave_q6_k = false;
  kernels.interleave_q8_0 = kernels.interleave_q4_1 = false;
}

// For every model and ISA path: logits with the models loaded for kernels
// that `prefer` laid-out weights equal, bit for bit, those of the file's rows.
// Returns how many loads laid out any matrix.
template <typename Prefer>
int expect_interleaving_changes_no_bit(const TinyModelGolden& golden, Prefer prefer) {
  cpu::ThreadPool pool(2);
  int n_interleaved = 0;
  for (const auto& m : golden.json["models"]) {
    const std::string file = m["file"];
    const auto ids = m["ids"].get<std::vector<int32_t>>();
    auto rows = LlamaModel::load(golden.model_dir / file);
    for (cpu::Isa isa : cpu::supported_isas()) {
      const std::vector<float> expected =
          Generator(*rows, cpu::kernel_table(isa), pool).logits_all(ids);
      cpu::KernelTable kernels = cpu::kernel_table(isa);
      prefer(kernels);
      auto model = LlamaModel::load(golden.model_dir / file, {}, &kernels);
      if (model->interleaved_weight_bytes() > 0) ++n_interleaved;
      const std::vector<float> logits = Generator(*model, kernels, pool).logits_all(ids);
      EXPECT_EQ(logits.size(), expected.size());
      EXPECT_EQ(0, std::memcmp(logits.data(), expected.data(),
                               std::min(logits.size(), expected.size()) * sizeof(float)))
          << file << " on " << cpu::isa_name(isa);
    }
  }
  return n_interleaved;
}

}  // namespace duet::testing

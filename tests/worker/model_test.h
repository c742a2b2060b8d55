// A test fixture parameterized by model: "default" (the fetched default
// model; the test skips, saying why, when it is absent) or the name of a tiny
// model in tests/fixtures/tiny/. It holds the model, a 2-thread pool, and
// draws random prompts from the model's vocabulary.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/thread_pool.h"
#include "tests/test_paths.h"
#include "worker/model/llama_model.h"

namespace duet::testing {

class ModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const auto path = model_for_param(GetParam());
    if (!path) GTEST_SKIP() << "default model not found: run launch/setup.sh to fetch it";
    model_ = LlamaModel::load(*path);
    pool_ = std::make_unique<cpu::ThreadPool>(2);
  }

  // n token ids drawn uniformly from [5, n_vocab).
  std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t n) const {
    std::uniform_int_distribution<int32_t> token(
        5, static_cast<int32_t>(model_->config().n_vocab - 1));
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& t : p) t = token(rng);
    return p;
  }

  std::unique_ptr<LlamaModel> model_;
  std::unique_ptr<cpu::ThreadPool> pool_;
};

// The test name of a model parameter: the file name without its extension.
inline std::string model_param_name(const ::testing::TestParamInfo<std::string>& info) {
  return info.param.substr(0, info.param.find('.'));
}

}  // namespace duet::testing

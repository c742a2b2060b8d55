// The F32 twin (tests/f32_twin.h) that the GPU checks measure both devices
// against: it must be the quantized model's exact values in F32, with the
// same metadata, and load and run as a model of its own.
#include "tests/f32_twin.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "common/stats.h"
#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"
#include "worker/generator.h"

namespace duet {
namespace {

std::vector<std::filesystem::path> quantized_fixtures() {
  std::vector<std::filesystem::path> paths;
  for (const char* dir : {"fixtures/tiny_gpu", "fixtures/tiny_kquant"}) {
    for (const auto& entry : std::filesystem::directory_iterator(testing::fixture_path(dir)))
      if (entry.path().extension() == ".gguf") paths.push_back(entry.path());
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

double normalized_error(std::span<const float> got, std::span<const float> want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff += (static_cast<double>(got[i]) - want[i]) * (static_cast<double>(got[i]) - want[i]);
    norm += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

TEST(F32Twin, HoldsTheDequantizedValuesAndTheSameMetadata) {
  for (const auto& path : quantized_fixtures()) {
    SCOPED_TRACE(path.filename().string());
    const GgufFile source = GgufFile::open(path);
    const testing::F32Twin twin(source);
    const GgufFile copy = GgufFile::open(twin.path());

    ASSERT_EQ(copy.metadata().size(), source.metadata().size());
    for (size_t i = 0; i < source.metadata().size(); ++i) {
      const GgufKeyValue& a = source.metadata()[i];
      const GgufKeyValue& b = copy.metadata()[i];
      EXPECT_EQ(b.key, a.key);
      if (a.key == "general.file_type") {
        EXPECT_EQ(copy.get_u32(a.key), 0u);
        continue;
      }
      ASSERT_EQ(b.value.type(), a.value.type()) << a.key;
      if (a.value.type() == GgufType::kString) {
        EXPECT_EQ(b.value.as_string(), a.value.as_string());
      }
      if (a.value.is_array()) {
        ASSERT_EQ(b.value.size(), a.value.size()) << a.key;
        if (a.value.element_type() == GgufType::kString) {
          EXPECT_EQ(b.value.strings(), a.value.strings()) << a.key;
        } else if (a.value.element_type() != GgufType::kArray) {
          EXPECT_TRUE(std::ranges::equal(b.value.element_bytes(), a.value.element_bytes()))
              << a.key;
        }
      }
      if (a.value.is_integer()) {
        EXPECT_EQ(b.value.integer_as<int64_t>(), a.value.integer_as<int64_t>()) << a.key;
      }
    }

    ASSERT_EQ(copy.tensors().size(), source.tensors().size());
    for (size_t i = 0; i < source.tensors().size(); ++i) {
      const GgufTensorInfo& a = source.tensors()[i];
      const GgufTensorInfo& b = copy.tensors()[i];
      EXPECT_EQ(b.name, a.name);
      EXPECT_EQ(b.ne, a.ne);
      EXPECT_EQ(b.type, DType::kF32);
      std::vector<float> want(static_cast<size_t>(a.n_elements()));
      cpu::dequantize_row(a.type, a.data, want.data(), a.n_elements());
      ASSERT_EQ(b.n_bytes, want.size() * sizeof(float)) << a.name;
      EXPECT_EQ(std::memcmp(b.data, want.data(), b.n_bytes), 0) << a.name << ": not the same bits";
    }
  }
}

// The twin runs as a model, and its logits differ from the quantized model's
// by no more than the activations' 8-bit rounding: this prints that
// distance, the yardstick for the GPU checks' comparisons.
TEST(F32Twin, RunsAsAModelCloseToTheQuantizedOne) {
  cpu::ThreadPool pool(2);
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::best_isa());
  for (const auto& path : quantized_fixtures()) {
    SCOPED_TRACE(path.filename().string());
    auto model = LlamaModel::load(path);
    const testing::F32Twin twin(model->file());
    auto reference = LlamaModel::load(twin.path());
    const int64_t n_vocab = model->config().n_vocab;
    std::vector<int32_t> ids;
    for (int32_t i = 0; i < 24; ++i) ids.push_back((i * 37 + 5) % static_cast<int32_t>(n_vocab));
    const std::vector<float> quantized = Generator(*model, kernels, pool).logits_all(ids);
    const std::vector<float> exact = Generator(*reference, kernels, pool).logits_all(ids);
    ASSERT_EQ(quantized.size(), exact.size());
    std::vector<double> errors;
    for (size_t r = 0; r < ids.size(); ++r) {
      const size_t at = r * static_cast<size_t>(n_vocab);
      errors.push_back(normalized_error({quantized.data() + at, static_cast<size_t>(n_vocab)},
                                        {exact.data() + at, static_cast<size_t>(n_vocab)}));
    }
    const double worst = *std::max_element(errors.begin(), errors.end());
    std::printf("  %-28s CPU against its F32 twin: normalized error median %.3g max %.3g\n",
                path.filename().c_str(), median(errors), worst);
    EXPECT_LT(worst, 0.1);
  }
}

}  // namespace
}  // namespace duet

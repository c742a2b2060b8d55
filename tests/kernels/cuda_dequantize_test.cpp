// The GPU dequantization against the CPU one, for every weight type. Runs only
// where a CUDA device exists (ctest label `gpu`); elsewhere it says why it skips.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kernels/cpu/quantize.h"
#include "kernels/cuda/dequantize.h"
#include "kernels/cuda/device.h"

namespace duet {
namespace {

TEST(CudaDequantize, LibrariesLinkAndReportVersions) {
  const std::string versions = cuda::library_versions();
  EXPECT_NE(versions.find("NCCL"), std::string::npos) << versions;
  std::printf("  %s\n", versions.c_str());
}

TEST(CudaDequantize, MatchesCpuForEveryWeightType) {
  if (cuda::list_devices().empty()) GTEST_SKIP() << "no CUDA device on this machine";
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t n_rows = 5, k = 96;
  std::vector<float> source(static_cast<size_t>(n_rows * k));
  for (float& v : source) v = normal(rng);
  for (DType type : {DType::kF32, DType::kF16, DType::kQ8_0, DType::kQ4_0, DType::kQ4_1}) {
    const size_t row_bytes = dtype_row_bytes(type, k);
    std::vector<uint8_t> stored(row_bytes * n_rows);
    std::vector<float> cpu(source.size()), gpu(source.size());
    for (int64_t r = 0; r < n_rows; ++r) {
      cpu::quantize_row(type, source.data() + r * k, stored.data() + r * row_bytes, k);
      cpu::dequantize_row(type, stored.data() + r * row_bytes, cpu.data() + r * k, k);
    }
    cuda::dequantize_rows(type, stored.data(), n_rows, k, gpu.data());
    for (size_t i = 0; i < cpu.size(); ++i)
      ASSERT_EQ(cpu[i], gpu[i]) << dtype_name(type) << " element " << i;
  }
}

}  // namespace
}  // namespace duet

// The CUDA matrix products (kernels/cuda/matmul.h) against the exact product
// of the dequantized weights (double sums) and against their CPU twin,
// cpu::matmul, for every weight type, on both paths: the fused GEMV (batches
// of 1 to 8, and in passes above) and the dequantized-tile cuBLAS GEMM.
//
// The GEMV's warps take 1, 2 or 4 output rows by the matrix's height: the
// tall cases cover the last two, with a last warp short of rows.
// Tolerances (normalized error): the GEMV keeps activations in F32, so it
// matches the exact product to F32 rounding (1e-5); the GEMM rounds
// activations to F16 (2e-3). The CPU rounds activations to 8-bit blocks, so
// the twins agree to about 1e-2. Types the GPU converts to F16 at upload
// (F32, BF16, Q4_K, Q6_K) carry that rounding too (2e-3).
#include <random>
#include <string>

#include "common/model/dtype.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/cuda/matmul.h"
#include "tests/gpu/backend_check.h"
#include "tests/gpu/device_vector.h"
#include "tests/gpu/gpu_check.h"

namespace duet {
namespace {

using gpu_check::expect_close;
using gpu_check::to_device;
using gpu_check::to_host;

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

struct Case {
  DType type;
  int64_t k;
  int64_t n_out;
};

void check_type(const Case& c, cuda::CudaBackend& backend, cpu::ThreadPool& pool) {
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::best_isa());
  const std::vector<float> source = random_floats(static_cast<size_t>(c.k * c.n_out), 11);
  const size_t row_bytes = dtype_row_bytes(c.type, c.k);
  std::vector<uint8_t> stored(row_bytes * static_cast<size_t>(c.n_out));
  std::vector<float> dequantized(source.size());
  for (int64_t r = 0; r < c.n_out; ++r) {
    cpu::quantize_row(c.type, source.data() + r * c.k, stored.data() + r * row_bytes, c.k);
    cpu::dequantize_row(c.type, stored.data() + r * row_bytes, dequantized.data() + r * c.k, c.k);
  }
  const cpu::WeightMatrix host = cpu::make_weight_matrix(c.type, stored.data(), c.k, c.n_out);
  const cuda::DeviceWeight weight = cuda::upload_weight(host, backend);
  const bool native = c.type == DType::kF16 || c.type == DType::kQ8_0 || c.type == DType::kQ4_0 ||
                      c.type == DType::kQ4_1;

  for (int64_t n_x : {1, 2, 5, 8, 9, 64, 300}) {
    const std::vector<float> x = random_floats(static_cast<size_t>(n_x * c.k), 12 + n_x);
    // The exact product of the stored weights.
    std::vector<float> exact(static_cast<size_t>(n_x * c.n_out));
    for (int64_t i = 0; i < n_x; ++i) {
      for (int64_t j = 0; j < c.n_out; ++j) {
        double sum = 0;
        for (int64_t e = 0; e < c.k; ++e)
          sum += static_cast<double>(x[i * c.k + e]) * dequantized[j * c.k + e];
        exact[i * c.n_out + j] = static_cast<float>(sum);
      }
    }
    // The CPU twin.
    std::vector<float> twin(exact.size());
    cpu::PackedActivations packed;
    packed.pack(kernels, x.data(), n_x, c.k, {c.type}, pool);
    cpu::matmul(kernels, host, packed, twin.data(), c.n_out, pool);

    const cuda::DeviceBuffer d_x = to_device(x, backend);
    cuda::DeviceBuffer d_y(exact.size() * sizeof(float));
    cuda::matmul(weight, d_x.as<float>(), n_x, d_y.as<float>(), c.n_out, backend);
    const std::vector<float> got = to_host<float>(d_y, exact.size(), backend);
    const bool gemv = n_x <= cuda::kGemvMaxRows;
    const double tolerance = !native ? 2e-3 : gemv ? 1e-5 : 2e-3;
    const std::string what = std::string(dtype_name(c.type)) + " " + std::to_string(c.n_out) + "x" +
                             std::to_string(c.k) + " n_x " + std::to_string(n_x) +
                             (gemv ? " gemv" : " gemm");
    expect_close((what + " vs exact").c_str(), got, exact, tolerance);
    expect_close((what + " vs cpu").c_str(), got, twin, 2e-2);
    if (n_x == 9) {
      // The GEMV in two passes against the GEMM, same batch.
      cuda::matmul_gemv(weight, d_x.as<float>(), n_x, d_y.as<float>(), c.n_out, backend);
      expect_close((what + " gemv passes vs exact").c_str(),
                   to_host<float>(d_y, exact.size(), backend), exact, native ? 1e-5 : 2e-3);
    }
  }
}

}  // namespace
}  // namespace duet

int main() {
  using namespace duet;
  return gpu_check::run_on_backend([](cuda::CudaBackend& backend) {
    cpu::ThreadPool pool(4);
    const Case cases[] = {
        {DType::kQ4_0, 576, 1536},
        {DType::kQ4_1, 576, 1536},
        {DType::kQ8_0, 1536, 576},
        {DType::kF16, 576, 1000},
        {DType::kQ4_1, 4096, 256},
        {DType::kF32, 256, 300},
        {DType::kBF16, 256, 300},
        {DType::kQ4_K, 512, 300},
        {DType::kQ6_K, 512, 300},
        // Tall matrices, whose GEMV warps take 4 and 2 output rows each, and
        // a last warp short of rows.
        {DType::kQ4_0, 256, 8195},
        {DType::kQ4_1, 256, 8194},
        {DType::kQ8_0, 256, 4099},
        {DType::kF16, 256, 8193},
    };
    for (const Case& c : cases) {
      const std::string name = std::string("matmul ") + std::string(dtype_name(c.type));
      gpu_check::run_case(name.c_str(), [&] { check_type(c, backend, pool); });
    }
  });
}

#include "bench/cuda/synthetic.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/model/dtype.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/weights.h"

namespace duet::cuda_bench {
namespace {

// ---------------------------------------------------------------------------
// Synthetic data

// Llama-3-8B's layer: n_embd 4096, 32 query and 8 KV heads of 128, FFN 14336:
// (n_out, k) of q, k, v, o, gate, up, down.
constexpr int64_t kLayer8b[][2] = {{4096, 4096},  {1024, 4096},  {1024, 4096}, {4096, 4096},
                                   {14336, 4096}, {14336, 4096}, {4096, 14336}};
constexpr int64_t kMaxDim = 14336;     // the widest k and n_out above
constexpr int64_t kDistinctRows = 64;  // random rows quantized; the rest repeat them
constexpr int kLayersPerGraph = 8;     // GEMV: 8 layers (~1 GB of Q4_0) per timed launch
constexpr DType kGemvTypes[] = {DType::kQ4_0, DType::kQ4_1, DType::kQ8_0, DType::kF16};

// kDistinctRows rows of kMaxDim normal floats (sigma `scale`).
std::vector<float> random_rows(uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> rows(static_cast<size_t>(kDistinctRows * kMaxDim));
  for (float& v : rows) v = normal(rng);
  return rows;
}

// A random (n_out, k) weight of `type` on the device. The values do not
// change the timing, so only kDistinctRows rows are quantized and repeated.
cuda::DeviceWeight random_weight(DType type, int64_t n_out, int64_t k,
                                 const std::vector<float>& source, cuda::CudaBackend& backend) {
  const size_t row_bytes = dtype_row_bytes(type, k);
  std::vector<uint8_t> stored(row_bytes * static_cast<size_t>(n_out));
  const int64_t distinct = std::min(n_out, kDistinctRows);
  for (int64_t r = 0; r < distinct; ++r)
    cpu::quantize_row(type, source.data() + r * kMaxDim, stored.data() + r * row_bytes, k);
  for (int64_t r = distinct; r < n_out; ++r)
    std::memcpy(stored.data() + r * row_bytes, stored.data() + (r % distinct) * row_bytes,
                row_bytes);
  return cuda::upload_weight(cpu::make_weight_matrix(type, stored.data(), k, n_out), backend);
}

// n floats on the device, cycling through `source`.
cuda::DeviceBuffer device_floats(size_t n, const std::vector<float>& source,
                                 cuda::CudaBackend& backend) {
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = source[i % source.size()];
  cuda::DeviceBuffer buffer(n * sizeof(float));
  backend.upload(buffer.data(), host.data(), n * sizeof(float));
  backend.synchronize();  // `host` goes away
  return buffer;
}

// One synthetic layer's 7 weights of one type, in kLayer8b's order.
struct SyntheticLayer {
  DType type = DType::kQ4_0;
  std::vector<cuda::DeviceWeight> weights;
  size_t bytes = 0;          // device bytes of all of them
  double flops_per_row = 0;  // 2 * sum(n_out * k)
};

SyntheticLayer make_layer(DType type, const std::vector<float>& source,
                          cuda::CudaBackend& backend) {
  SyntheticLayer layer;
  layer.type = type;
  for (const auto& [n_out, k] : kLayer8b) {
    layer.weights.push_back(random_weight(type, n_out, k, source, backend));
    layer.bytes += layer.weights.back().bytes();
    layer.flops_per_row += 2.0 * static_cast<double>(n_out) * static_cast<double>(k);
  }
  return layer;
}

// Queues the layer's 7 products of n_x rows. x holds (n_x, kMaxDim) floats
// (each product reads its first n_x * k), y (n_x, kMaxDim).
void run_layer(const SyntheticLayer& layer, const cuda::DeviceBuffer& x, int64_t n_x,
               const cuda::DeviceBuffer& y, cuda::CudaBackend& backend) {
  for (const cuda::DeviceWeight& w : layer.weights)
    cuda::matmul(w, x.as<float>(), n_x, y.as<float>(), w.n_out, backend);
}

// ---------------------------------------------------------------------------
// 1. Rooflines. Each measurement prints its figures and records them in `json`.

// Returns the copy bandwidth counted as read + write bytes: the memory roofline.
double measure_copy(cuda::CudaBackend& backend, Reps reps, JsonWriter& json) {
  const size_t bytes = size_t{1} << 30;
  const cuda::DeviceBuffer from(bytes), to(bytes);
  const double seconds =
      time_median(backend, reps, [&] { backend.copy(to.data(), from.data(), bytes); });
  const double gbps = 2.0 * static_cast<double>(bytes) / seconds / kGiga;
  std::printf("== device-to-device copy of 1 GiB (the memory roofline) ==\n");
  std::printf("  copy GB/s (read+write)       %9.1f   (%.3f ms)\n", gbps, seconds * 1e3);
  std::printf("  copy GB/s (read only, = /2)  %9.1f\n\n", gbps / 2);
  json.integer("copy_bytes", static_cast<int64_t>(bytes));
  json.number("copy_gbps", gbps);
  json.number("copy_read_only_gbps", gbps / 2);
  return gbps;
}

// cuBLAS F16 through matmul_gemm on an F16 weight (its tile "dequantization"
// is a copy, and the activations are converted to F16 first: both counted).
// Returns TFLOP/s: the GEMM roofline.
double measure_gemm(const std::vector<float>& source, cuda::CudaBackend& backend, Reps reps,
                    JsonWriter& json) {
  const int64_t n_x = 4096, k = 4096, n_out = 14336;
  const cuda::DeviceWeight w = random_weight(DType::kF16, n_out, k, source, backend);
  const cuda::DeviceBuffer x = device_floats(static_cast<size_t>(n_x * k), source, backend);
  const cuda::DeviceBuffer y(static_cast<size_t>(n_x * n_out) * sizeof(float));
  const double seconds = time_median(backend, reps, [&] {
    cuda::matmul_gemm(w, x.as<float>(), n_x, y.as<float>(), n_out, backend);
  });
  const double tflops =
      2.0 * static_cast<double>(n_x * k) * static_cast<double>(n_out) / seconds / kTera;
  std::printf("== cuBLAS F16 GEMM via matmul_gemm: x (4096, 4096) . W^T, W (14336, 4096) ==\n");
  std::printf("  TFLOP/s (the GEMM roofline)  %9.1f   (%.3f ms)\n\n", tflops, seconds * 1e3);
  json.number("gemm_tflops", tflops);
  json.open("gemm_shape", '{');
  json.integer("n_x", n_x);
  json.integer("k", k);
  json.integer("n_out", n_out);
  json.close('}');
  return tflops;
}

// ---------------------------------------------------------------------------
// 2. Synthetic 8B layers (matmuls only: no attention, no norms)

// The layer's 7 GEMVs, kLayersPerGraph times over in one CUDA graph (as a
// decode step replays its layers), so that launch gaps do not count and the
// bytes read between two reads of one weight (> 120 MB) exceed the L2.
// One row of the table, one object of the "gemv" array.
void measure_gemv(const SyntheticLayer& layer, int64_t n_x, double copy_gbps,
                  const cuda::DeviceBuffer& x, const cuda::DeviceBuffer& y,
                  cuda::CudaBackend& backend, Reps reps, JsonWriter& json) {
  run_layer(layer, x, n_x, y, backend);  // first launches outside the capture
  backend.synchronize();
  backend.begin_capture();
  try {
    for (int i = 0; i < kLayersPerGraph; ++i) run_layer(layer, x, n_x, y, backend);
  } catch (...) {
    backend.end_capture();
    throw;
  }
  const cuda::Graph graph = backend.end_capture();
  const double seconds =
      time_median(backend, reps, [&] { backend.launch(graph); }) / kLayersPerGraph;
  const double gbps = static_cast<double>(layer.bytes) / seconds / kGiga;
  const std::string type(dtype_name(layer.type));
  std::printf("  %-5s %4ld %10.1f %10.2f %9.1f %8.3f\n", type.c_str(), static_cast<long>(n_x),
              static_cast<double>(layer.bytes) / 1e6, seconds * 1e6, gbps, gbps / copy_gbps);
  std::fflush(stdout);
  json.open({}, '{');
  json.string("type", type);
  json.integer("n_x", n_x);
  json.integer("layer_bytes", static_cast<int64_t>(layer.bytes));
  json.number("us_per_layer", seconds * 1e6);
  json.number("gbps", gbps);
  json.number("ratio_to_copy", gbps / copy_gbps);
  json.close('}');
}

// n_x rows through the layer's 7 products (the GEMM path).
void measure_prefill(const SyntheticLayer& layer, int64_t n_x, double gemm_tflops,
                     const std::vector<float>& source, cuda::CudaBackend& backend, Reps reps,
                     JsonWriter& json) {
  const cuda::DeviceBuffer x = device_floats(static_cast<size_t>(n_x * kMaxDim), source, backend);
  const cuda::DeviceBuffer y(static_cast<size_t>(n_x * kMaxDim) * sizeof(float));
  const double seconds = time_median(backend, reps, [&] { run_layer(layer, x, n_x, y, backend); });
  const double tokens_per_s = static_cast<double>(n_x) / seconds;
  const double tflops = layer.flops_per_row * static_cast<double>(n_x) / seconds / kTera;
  const std::string type(dtype_name(layer.type));
  std::printf("\n== prefill: a %s 8B layer's 7 matmuls, %ld rows, GEMM path ==\n", type.c_str(),
              static_cast<long>(n_x));
  std::printf("  (attention is not part of this synthetic: matmuls only)\n");
  std::printf("  ms/layer %.3f   tokens/s per layer %.0f   TFLOP/s %.1f   vs GEMM %.3f\n\n",
              seconds * 1e3, tokens_per_s, tflops, tflops / gemm_tflops);
  json.open("prefill_synthetic", '{');
  json.string("type", type);
  json.integer("n_x", n_x);
  json.boolean("attention_included", false);
  json.number("ms_per_layer", seconds * 1e3);
  json.number("tokens_per_s_per_layer", tokens_per_s);
  json.number("tflops", tflops);
  json.number("ratio_to_gemm", tflops / gemm_tflops);
  json.close('}');
}

}  // namespace

Rooflines measure_synthetic(const Plan& plan, JsonWriter& json) {
  cuda::CudaBackend backend(0);
  std::printf("device: %s\n%s\n\n", backend.name().c_str(), cuda::library_versions().c_str());
  json.string("device", backend.name());
  json.string("libraries", cuda::library_versions());
  const double copy_gbps = measure_copy(backend, plan.copy, json);
  const std::vector<float> weight_rows = random_rows(1, 0.05f);
  const std::vector<float> activation_rows = random_rows(2, 1.0f);
  const double gemm_tflops = measure_gemm(weight_rows, backend, plan.gemm, json);
  std::fflush(stdout);

  std::printf("== decode GEMV: one Llama-3-8B layer's 7 matmuls (no attention), cuda::matmul ==\n");
  std::printf("  %-5s %4s %10s %10s %9s %8s\n", "type", "n_x", "layer MB", "us/layer", "GB/s",
              "vs copy");
  const auto gemv_rows = static_cast<size_t>(cuda::kGemvMaxRows * kMaxDim);
  const cuda::DeviceBuffer x = device_floats(gemv_rows, activation_rows, backend);
  const cuda::DeviceBuffer y(gemv_rows * sizeof(float));
  const SyntheticLayer q4_0 = make_layer(DType::kQ4_0, weight_rows, backend);  // kept for prefill
  json.open("gemv", '[');
  for (const DType type : kGemvTypes) {
    SyntheticLayer other;
    if (type != q4_0.type) other = make_layer(type, weight_rows, backend);
    const SyntheticLayer& layer = type == q4_0.type ? q4_0 : other;
    for (const int64_t n_x : {int64_t{1}, cuda::kGemvMaxRows})
      measure_gemv(layer, n_x, copy_gbps, x, y, backend, plan.gemv, json);
  }
  json.close(']');
  measure_prefill(q4_0, plan.prefill_rows, gemm_tflops, activation_rows, backend, plan.prefill,
                  json);
  std::fflush(stdout);
  return {copy_gbps, gemm_tflops};
}

}  // namespace duet::cuda_bench

// Throughput of the CPU matrix products, for each ISA path this CPU runs, 1
// and 2 threads, decode (n_x = 1), batched decode (n_x = 8, 32: one row per
// sequence; 2, 4 and 8 too at the 8B gate shape) and prefill (n_x = 512), at
// two sets of shapes:
// - the default model's (SmolLM2-135M: hidden 576, FFN 1536, vocabulary
//   49152), whose weights stay in cache;
// - Llama-3-8B's feed-forward (hidden 4096, FFN 14336), 33 MB a matrix at
//   Q4_0, which streams from memory as served models do (names start
//   `matmul8b/`; `Q4_0x8` is Q4_0 interleaved by 8 rows, as loaded for
//   AVX2, `Q4_0x16`, `Q4_Kx16`, `Q6_Kx16`, `Q8_0x16` and `Q4_1x16` those
//   types interleaved by 16, as loaded for AVX-512).
//
// Reports tokens/s as items/s (n_x activation rows per iteration) and bytes/s
// as weight bytes read per second. The timed loop is the matrix product
// alone: activations are packed once outside it, as the forward pass packs an
// input once for every weight that shares it (Q, K and V; gate and up).
//
// `ceiling/` cases bound what the AVX2 GEMM can reach (gemm_ceiling.cpp).
//
//   duet-matmul-bench --benchmark_filter='avx512/Q4_1/.*n_x:1/'
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench/gemm_ceiling.h"
#include "bench/kernel_bench.h"
#include "common/model/dtype.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cpu/thread_pool.h"

namespace duet::cpu {
namespace {

struct MatmulCase {
  Isa isa;
  DType type;
  int64_t k;
  int64_t n_out;
  int64_t n_x;
  int n_threads;
  WeightLayout layout = WeightLayout::kRows;  // the loader's (interleave.h), or the file's
};

void bench_matmul(benchmark::State& state, MatmulCase c) {
  const KernelTable& kernels = kernel_table(c.isa);
  ThreadPool pool(c.n_threads);
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);

  const size_t row_bytes = dtype_row_bytes(c.type, c.k);
  std::vector<uint8_t> weights(row_bytes * static_cast<size_t>(c.n_out));
  std::vector<float> row(static_cast<size_t>(c.k));
  for (int64_t j = 0; j < c.n_out; ++j) {
    for (float& v : row) v = normal(rng) * 0.05f;
    quantize_row(c.type, row.data(), weights.data() + j * row_bytes, c.k);
  }
  WeightMatrix w = make_weight_matrix(c.type, weights.data(), c.k, c.n_out);
  std::vector<uint8_t> interleaved;
  if (c.layout != WeightLayout::kRows) {
    interleaved.resize(weights.size());
    w = interleave(w, c.layout, interleaved.data());
  }

  std::vector<float> x(static_cast<size_t>(c.n_x * c.k));
  for (float& v : x) v = normal(rng);
  PackedActivations packed;
  packed.pack(kernels, x.data(), c.n_x, c.k, {c.type}, pool);
  std::vector<float> y(static_cast<size_t>(c.n_x * c.n_out));

  for (auto _ : state) {
    matmul(kernels, w, packed, y.data(), c.n_out, pool);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * c.n_x);  // tokens
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(weights.size()));
  state.counters["FLOP"] = benchmark::Counter(
      2.0 * static_cast<double>(c.k * c.n_out * c.n_x) * static_cast<double>(state.iterations()),
      benchmark::Counter::kIsRate);
}

struct Shape {
  int64_t k;
  int64_t n_out;
  std::vector<DType> types;
  std::vector<int64_t> n_xs;
};

void register_benchmarks() {
  const std::vector<Shape> shapes = {
      {576, 1536, {DType::kQ4_1, DType::kQ8_0}, {1, 4, 8, 32, 512}},  // FFN gate and up
      {576, 576, {DType::kQ4_1, DType::kQ8_0}, {1, 8, 32, 512}},      // attention Q and output
      {576, 192, {DType::kQ4_1}, {32}},                               // attention K and V
      {1536, 576, {DType::kQ4_1, DType::kQ8_0}, {1, 8, 32, 512}},     // FFN down
      // The output head (Q8_0 in the default model). Prefill computes logits
      // for the last token only, so it runs at decode shape; batched decode
      // computes them for every sequence.
      {576, 49152, {DType::kQ8_0}, {1, 32}},
  };
  const std::vector<DType> all_types = {DType::kQ4_0, DType::kQ4_1, DType::kQ5_0,
                                        DType::kQ8_0, DType::kQ4_K, DType::kQ6_K};
  const std::vector<Shape> shapes_8b = {
      {4096, 14336, all_types, {1, 2, 4, 8, 16, 32, 512}},  // FFN gate and up
      {14336, 4096, all_types, {1, 32, 512}},               // FFN down
  };
  auto register_shapes = [](const std::string& prefix, const std::vector<Shape>& set, Isa isa) {
    for (const Shape& shape : set) {
      for (DType type : shape.types) {
        for (int64_t n_x : shape.n_xs) {
          for (int n_threads : {1, 2}) {
            const MatmulCase c{isa, type, shape.k, shape.n_out, n_x, n_threads};
            const std::string name =
                prefix + "/" + std::string(isa_name(isa)) + "/" + std::string(dtype_name(type)) +
                "/k:" + std::to_string(shape.k) + "/n_out:" + std::to_string(shape.n_out) +
                "/n_x:" + std::to_string(n_x) + "/threads:" + std::to_string(n_threads);
            register_kernel_bench(name, bench_matmul, c);
            if (type == DType::kQ5_0 || prefix != "matmul8b") continue;
            auto add_layout = [&](WeightLayout layout, const char* suffix) {
              MatmulCase grouped = c;
              grouped.layout = layout;
              std::string from = "/", to;
              from.append(dtype_name(type));
              to = from;
              from.append("/");
              to.append(suffix);
              std::string grouped_name = name;
              grouped_name.replace(grouped_name.find(from), from.size(), to);
              register_kernel_bench(grouped_name, bench_matmul, grouped);
            };
            add_layout(WeightLayout::kInterleaved, type == DType::kQ4_0 ? "x8/" : "x16/");
            if (type == DType::kQ4_0) add_layout(WeightLayout::kInterleaved16, "x16/");
          }
        }
      }
    }
  };
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (!cpu_supports(isa)) continue;
    register_shapes("matmul", shapes, isa);
    // The scalar reference takes minutes at these sizes.
    if (isa != Isa::kScalar) register_shapes("matmul8b", shapes_8b, isa);
  }
  register_gemm_ceiling_benchmarks();
}

}  // namespace
}  // namespace duet::cpu

int main(int argc, char** argv) {
  return duet::cpu::kernel_bench_main(argc, argv, duet::cpu::register_benchmarks);
}

// What the CPU kernel micro-benchmarks (duet-matmul-bench,
// duet-attention-bench) share around Google Benchmark: how a case is timed
// and reported, and main().
#pragma once

#include <benchmark/benchmark.h>

#include <string>

namespace duet::cpu {

// Registers `bench(state, c)` as `name`, timed by the wall clock (the
// kernels run on a thread pool) and reported in microseconds.
template <typename Case>
void register_kernel_bench(const std::string& name, void (*bench)(benchmark::State&, Case),
                           const Case& c) {
  benchmark::RegisterBenchmark(name.c_str(), bench, c)
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

// A kernel benchmark's main(): Google Benchmark's flags, then the cases
// `register_benchmarks` registers, then the run.
inline int kernel_bench_main(int argc, char** argv, void (*register_benchmarks)()) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace duet::cpu

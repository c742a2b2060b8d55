// The AVX2 GEMM's arithmetic ceiling (gemm_ceiling.cpp), registered into
// duet-matmul-bench as `ceiling/...`.
#pragma once

#include <benchmark/benchmark.h>

namespace duet::cpu {

// Registers the ceiling cases when this CPU runs AVX2 (none otherwise).
void register_gemm_ceiling_benchmarks();

}  // namespace duet::cpu

// duet-cuda-bench's sections 1 and 2: the rooflines (device-to-device copy
// bandwidth, the cuBLAS F16 GEMM rate) and one synthetic Llama-3-8B layer's
// matmuls (random weights; no attention, no norms) by weight type: decode
// GEMV weight-read GB/s, and prefill TFLOP/s on the GEMM path.
#pragma once

#include "bench/cuda/rig.h"

namespace duet::cuda_bench {

// Both sections on a backend of their own, freed before the model loads;
// prints the tables and records the figures in `json`. Returns the rooflines
// the model's figures are set against.
Rooflines measure_synthetic(const Plan& plan, JsonWriter& json);

}  // namespace duet::cuda_bench

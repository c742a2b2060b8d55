// duet-cuda-bench's section 3: the real model on the GPU. Decode tokens/s at
// batch 1 and 64, with and without CUDA graphs, the weight bytes per token and
// the weight-read GB/s they imply against the copy bandwidth, and the prefill
// rate of one 512-token prompt.
#pragma once

#include <string>

#include "bench/cuda/rig.h"

namespace duet::cuda_bench {

// Loads the GGUF model at `path` onto device 0, prints the tables and
// records the figures in `json`.
void measure_model(const std::string& path, double copy_gbps, const Plan& plan, JsonWriter& json);

}  // namespace duet::cuda_bench

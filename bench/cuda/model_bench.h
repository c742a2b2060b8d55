// duet-cuda-bench's section 3: the real model on the GPU. Decode tokens/s at
// batch 1 and 64, with and without CUDA graphs, the weight bytes per token and
// the weight-read GB/s they imply against the copy bandwidth, and the prefill
// rate of one prompt (512 tokens unless told) in model TFLOP/s against the
// GEMM rate.
#pragma once

#include <string>

#include "bench/cuda/rig.h"

namespace duet::cuda_bench {

// Loads the GGUF model at `path` onto device 0, prints the tables and
// records the figures in `json`.
// The prefill prompt has `prefill_tokens` tokens, at most kMaxPrefillTokens.
inline constexpr int64_t kMaxPrefillTokens = 16384;  // the model's KV cache: 64 sequences of 256
void measure_model(const std::string& path, Rooflines rooflines, const Plan& plan,
                   int64_t prefill_tokens, JsonWriter& json);

}  // namespace duet::cuda_bench

// Choosing tokens on the GPU, twin of common/sampling.h for the controls a
// GPU batch samples with: greedy, and temperature with top-k and top-p.
// (Penalties and min-p stay on the CPU sampler: the engine downloads the
// logits of such rows.) The uniform draw comes from the host
// (duet::uniform_at(seed, position)), so the GPU picks the token the CPU
// Sampler picks from the same logits: greedy always, and a draw except where
// it (or top-p's cumulative probability) falls within rounding of a boundary
// between two tokens, as the two sum the same weights in different orders.
// Where the CPU refuses to draw (a NaN or +inf logit, or none above -inf) the
// GPU still picks a token (see sampling.cu).
#pragma once

#include <cstdint>

#include "kernels/cuda/backend.h"

namespace duet::cuda {

// One row's controls, as SamplingParams says them.
struct RowSampling {
  float temperature = 0.0f;  // 0: greedy (argmax, lowest id on ties)
  int32_t top_k = 0;         // 0: off
  float top_p = 1.0f;        // 1: off
  double uniform = 0.0;      // the draw in [0, 1): uniform_at(seed, position)
};

// tokens[r] for r < n_rows from logits (n_rows, n_vocab), all device
// pointers; `rows` is device memory holding n_rows RowSampling.
void sample_rows(const float* logits, int64_t n_rows, int64_t n_vocab, const RowSampling* rows,
                 int32_t* tokens, CudaBackend& backend);

}  // namespace duet::cuda

// The parameters the forward pass's ops take alike on every device: the CPU
// kernels (kernels/cpu/) and their CUDA twins (kernels/cuda/) both include
// this header, so a twin's signature names the same types as its CPU op's
// and neither side reaches into the other. Values only; pointers in them
// point into the memory of the device whose op reads them.
#pragma once

#include <climits>
#include <cstdint>
#include <span>

namespace duet {

enum class RopeStyle {
  kAdjacentPairs,  // (x[2i], x[2i+1]) rotate together: GGUF `llama` (converter permuted Q/K)
  kHalves,         // (x[i], x[i + n_rot/2]) rotate together: NeoX, GGUF `qwen2`
};

struct RopeParams {
  RopeStyle style = RopeStyle::kAdjacentPairs;
  int64_t n_rot = 0;  // leading dims of each head that rotate
  float freq_base = 10000.0f;
  float freq_scale = 1.0f;  // linear position scaling (1 = none)
  // Optional (n_rot / 2) divisors (Llama 3.1 rope_freqs), in the memory the
  // op reads: host for the CPU's, device for the GPU's.
  const float* freq_factors = nullptr;
};

// The heads of one rank's attention.
struct AttentionShape {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // query head h reads KV head h / (n_heads / n_kv_heads)
  int64_t head_dim = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  // A query at position p attends to positions max(0, p - window + 1) .. p; 0: to 0 .. p.
  int64_t window = 0;
};

// A mixture of experts' router: for each row, a softmax of its n_experts logits, the n_used
// most probable experts in decreasing probability (ties: the lower index), and their
// probabilities divided by their sum (at least 2^-14, as llama.cpp clamps it).
struct RouterShape {
  int64_t n_experts = 0;
  int64_t n_used = 0;
};

// A position no row reaches: every row in the multi-token order.
inline constexpr int64_t kNoOneTokenRows = INT64_MAX;

// One sequence's query rows in a batched attention call (and its K/V rows in
// the store before it).
struct AttentionSequence {
  std::span<const int32_t> block_table;
  int64_t pos0 = 0;  // position of its first query row
  int64_t n_q = 0;   // its query rows
  int64_t row = 0;   // index of its first row in q and out
  // Rows at positions >= this reduce in the one-token order, the others in
  // the multi-token order (the engine's rule: common/model/token_order.h;
  // the CPU's attention only: the GPU's has one order).
  int64_t one_token_from = kNoOneTokenRows;
};

}  // namespace duet

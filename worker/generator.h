// Generation of one prompt at a time, through the batching engine: a thin
// client of Engine (worker/engine.h), so that `duet generate` computes every
// token exactly as `duet serve` does, alone or batched. With the KV cache off
// the engine recomputes the whole context every step (to show what the cache
// buys), and gives the same tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/sampling.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_forward.h"
#include "worker/sequence.h"

namespace duet {

class Engine;

// A plain value. Stop strings are not here: the generator works on token ids,
// and the caller that detokenizes (a CLI, a server) matches them and returns
// false from on_token (see common/text/stop_matcher.h).
struct GenerateOptions {
  int64_t max_tokens = 128;
  SamplingParams sampling;  // temperature, seed, top-k/p, min-p, penalties
  bool use_kv_cache = true;
  int64_t step_tokens = 512;  // the engine's token budget per step (prompt chunks)
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated tokens, including an end-of-generation one
  FinishReason finish = FinishReason::kLength;
  int64_t n_prompt = 0;
  double prompt_seconds = 0.0;    // prefill, up to the first token
  double generate_seconds = 0.0;  // every later step
};

class Generator final {
 public:
  // device: -1 for the CPU, else the CUDA device index (throws kUnsupported
  // where there is no such GPU).
  Generator(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
            int device = -1);
  ~Generator();

  // Generates up to options.max_tokens tokens after `prompt`. on_token is
  // called with each new token; returning false ends generation (kCancelled).
  // is_end tells the end-of-generation tokens (they are emitted, then stop).
  // Sampling follows options.sampling, whose penalty window covers the prompt
  // and the generated tokens; the draw for position p is keyed by (seed, p),
  // so the same options give the same tokens on any thread count.
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                          const std::function<bool(int32_t)>& on_token,
                          const std::function<bool(int32_t)>& is_end);

  // Teacher-forced logits of every position of `tokens` in one forward pass:
  // (tokens.size(), n_vocab), row i predicting token i + 1. Every row takes
  // the multi-token order, as llama.cpp evaluates a prompt; with n_prompt
  // set, the tokens past the first n_prompt are computed as generated ones
  // (common/model/token_order.h), bit for bit as generate() computes them.
  std::vector<float> logits_all(std::span<const int32_t> tokens,
                                std::optional<int64_t> n_prompt = std::nullopt);

 private:
  const LlamaModel& model_;
  const cpu::KernelTable& kernels_;
  cpu::ThreadPool& pool_;
  const int device_;
  // The engine of the last generate(), kept while its capacity and mode fit
  // (a GPU engine uploads the weights once).
  std::unique_ptr<Engine> engine_;
  int64_t engine_blocks_ = 0;
  int64_t engine_step_tokens_ = 0;
  bool engine_recompute_ = false;
  std::unique_ptr<ModelForward> forward_;  // logits_all's, made on first use
};

}  // namespace duet

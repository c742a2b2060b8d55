#include "worker/generator.h"

#include <chrono>
#include <numeric>

#include "common/error.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A cache for one sequence of up to n_tokens, blocks in order 0, 1, 2, ...
struct SequenceCache {
  SequenceCache(const ModelConfig& config, int64_t n_tokens)
      : cache(make_kv_layout(
            config, (n_tokens + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize)),
        block_table(static_cast<size_t>(cache.layout().n_blocks)) {
    std::iota(block_table.begin(), block_table.end(), 0);
  }
  KvCache cache;
  std::vector<int32_t> block_table;
};

}  // namespace

Generator::Generator(const LlamaModel& model, const cpu::KernelTable& kernels,
                     cpu::ThreadPool& pool, int device)
    : model_(model),
      forward_(make_forward(model, kernels, pool, {device, cpu::AttentionOrder::kLlamaCpp})) {}

GenerateResult Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                   const std::function<bool(int32_t)>& on_token,
                                   const std::function<bool(int32_t)>& is_end) {
  const ModelConfig& c = model_.config();
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  DUET_REQUIRE(n_prompt > 0, "the prompt is empty");
  DUET_REQUIRE(options.max_tokens >= 0, "max_tokens must be >= 0, got {}", options.max_tokens);
  DUET_REQUIRE(n_prompt < c.n_ctx_train, "the prompt has {} tokens; the model's context holds {}",
               n_prompt, c.n_ctx_train);
  const int64_t max_tokens = std::min(options.max_tokens, c.n_ctx_train - n_prompt);

  Sampler sampler(options.sampling);  // validates the sampling parameters
  GenerateResult result;
  result.n_prompt = n_prompt;
  if (max_tokens == 0) return result;
  for (const int32_t token : prompt) sampler.accept(token);

  SequenceCache seq(c, n_prompt + max_tokens);
  std::vector<int32_t> context(prompt.begin(), prompt.end());
  std::vector<float> logits(static_cast<size_t>(c.n_vocab));

  auto step = [&](int64_t pos0, std::span<const int32_t> tokens) {
    const ForwardSequence fs{seq.block_table, pos0, static_cast<int64_t>(tokens.size())};
    const int64_t last = static_cast<int64_t>(tokens.size()) - 1;
    forward_->run(tokens, {&fs, 1}, seq.cache, {&last, 1}, logits.data());
  };

  const auto start = Clock::now();
  step(0, context);
  result.prompt_seconds = seconds_since(start);
  const auto decode_start = Clock::now();
  result.finish = FinishReason::kLength;
  for (int64_t i = 0; i < max_tokens; ++i) {
    const int64_t position = static_cast<int64_t>(context.size());
    const int32_t token = sampler.sample(logits, static_cast<uint64_t>(position));
    sampler.accept(token);
    result.tokens.push_back(token);
    context.push_back(token);
    if (!on_token(token)) {
      result.finish = FinishReason::kStopped;
      break;
    }
    if (is_end(token)) {
      result.finish = FinishReason::kEndOfGeneration;
      break;
    }
    if (i + 1 == max_tokens) break;
    if (options.use_kv_cache) {
      step(position, {&context.back(), 1});
    } else {
      step(0, context);  // the whole context again: nothing is reused
    }
  }
  result.generate_seconds = seconds_since(decode_start);
  return result;
}

std::vector<float> Generator::logits_all(std::span<const int32_t> tokens) {
  const ModelConfig& c = model_.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  DUET_REQUIRE(n > 0 && n <= c.n_ctx_train, "logits_all needs 1..{} tokens, got {}", c.n_ctx_train,
               n);
  SequenceCache seq(c, n);
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> logits(static_cast<size_t>(n * c.n_vocab));
  const ForwardSequence fs{seq.block_table, 0, n};
  forward_->run(tokens, {&fs, 1}, seq.cache, rows, logits.data());
  return logits;
}

}  // namespace duet

#include "worker/generator.h"

#include <algorithm>
#include <chrono>
#include <numeric>

#include "common/error.h"
#include "common/model/token_order.h"
#include "worker/engine.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

Generator::Generator(const LlamaModel& model, const cpu::KernelTable& kernels,
                     cpu::ThreadPool& pool, int device)
    : model_(model), kernels_(kernels), pool_(pool), device_(device) {
  require_device(device);
}

Generator::~Generator() = default;

GenerateResult Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                   const std::function<bool(int32_t)>& on_token,
                                   const std::function<bool(int32_t)>& is_end) {
  const ModelConfig& c = model_.config();
  const int64_t n_prompt = static_cast<int64_t>(prompt.size());
  DUET_REQUIRE(n_prompt > 0, "the prompt is empty");
  DUET_REQUIRE(options.max_tokens >= 0, "max_tokens must be >= 0, got {}", options.max_tokens);
  DUET_REQUIRE(n_prompt < c.n_ctx_train, "the prompt has {} tokens; the model's context holds {}",
               n_prompt, c.n_ctx_train);
  DUET_REQUIRE(options.step_tokens >= 1, "the step token budget must be >= 1, got {}",
               options.step_tokens);
  validate_sampling_params(options.sampling);
  const int64_t max_tokens = std::min(options.max_tokens, c.n_ctx_train - n_prompt);
  GenerateResult result;
  result.n_prompt = n_prompt;
  if (max_tokens == 0) return result;

  // One sequence: a KV cache of just its blocks (one spare for the token
  // that the last step reserves).
  const int64_t block = KvLayout::kDefaultBlockSize;
  const int64_t n_blocks = (n_prompt + max_tokens + block - 1) / block + 1;
  const bool recompute = !options.use_kv_cache;
  if (!engine_ || engine_blocks_ < n_blocks || engine_step_tokens_ != options.step_tokens ||
      engine_recompute_ != recompute) {
    engine_.reset();  // a GPU engine's memory goes before the next one takes its own
    EngineConfig config;
    config.n_kv_blocks = n_blocks;
    config.scheduler.max_running = 1;
    config.scheduler.max_step_tokens = options.step_tokens;
    config.scheduler.recompute = recompute;
    config.device = device_;
    engine_ = std::make_unique<Engine>(model_, kernels_, pool_, config);
    engine_blocks_ = n_blocks;
    engine_step_tokens_ = options.step_tokens;
    engine_recompute_ = recompute;
  }

  RequestOptions request;
  request.max_tokens = max_tokens;
  request.sampling = options.sampling;
  request.ignore_eos = true;  // is_end decides, below
  const auto start = Clock::now();
  auto last = start;
  SequenceId id;
  bool done = false;
  id = engine_->submit(
      std::vector<int32_t>(prompt.begin(), prompt.end()), request, [&](const TokenEvent& event) {
        if (event.token < 0 || done) return;  // the final event of our own cancel
        const auto now = Clock::now();
        (result.tokens.empty() ? result.prompt_seconds : result.generate_seconds) +=
            seconds_between(last, now);
        last = now;
        result.tokens.push_back(event.token);
        if (!on_token(event.token)) {
          result.finish = FinishReason::kCancelled;
        } else if (is_end(event.token)) {
          result.finish = FinishReason::kEndOfGeneration;
        } else if (event.finished) {
          result.finish = FinishReason::kLength;
        } else {
          return;
        }
        done = true;
        if (!event.finished) engine_->cancel(id);
      });
  engine_->run_until_idle();
  return result;
}

std::vector<float> Generator::logits_all(std::span<const int32_t> tokens,
                                         std::optional<int64_t> n_prompt) {
  const ModelConfig& c = model_.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  DUET_REQUIRE(n > 0 && n <= c.n_ctx_train, "logits_all needs 1..{} tokens, got {}", c.n_ctx_train,
               n);
  if (!forward_) forward_ = make_forward(model_, kernels_, pool_, {device_});
  KvCache cache(
      model_.kv_layout((n + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize));
  std::vector<int32_t> table(static_cast<size_t>(cache.layout().n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::vector<int64_t> rows(static_cast<size_t>(n));
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> logits(static_cast<size_t>(n * c.n_vocab));
  const ForwardSequence fs{table, 0, n, n_prompt ? one_token_from(*n_prompt) : kNoOneTokenRows};
  forward_->run(tokens, {&fs, 1}, cache, rows, logits.data());
  return logits;
}

}  // namespace duet

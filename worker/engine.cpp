#include "worker/engine.h"

#include <algorithm>

#include "common/error.h"

namespace duet {

Engine::Engine(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
               EngineConfig config)
    : model_(model),
      pool_(config.n_kv_blocks),
      kv_(pool_, KvLayout::kDefaultBlockSize),
      scheduler_(kv_, config.scheduler),
      cache_(make_kv_layout(model.config(), config.n_kv_blocks)),
      forward_(model, kernels, pool, cpu::AttentionOrder::kBatchInvariant),
      end_of_generation_(std::move(config.end_of_generation)) {}

SequenceId Engine::submit(std::vector<int32_t> prompt, const RequestOptions& options,
                          TokenSink sink, AdmitSink on_admitted) {
  const ModelConfig& c = model_.config();
  DUET_REQUIRE(!prompt.empty(), "the prompt is empty");
  DUET_REQUIRE(options.max_tokens >= 1, "max_tokens must be >= 1, got {}", options.max_tokens);
  for (int32_t id : prompt) {
    DUET_REQUIRE(id >= 0 && id < c.n_vocab, "token id {} is outside the vocabulary (0..{})", id,
                 c.n_vocab - 1);
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_tokens;
  DUET_REQUIRE(total <= c.n_ctx_train,
               "the prompt ({} tokens) plus max_tokens ({}) exceeds the model's context of {}",
               prompt.size(), options.max_tokens, c.n_ctx_train);
  const int64_t capacity = pool_.n_blocks() * kv_.block_size();
  DUET_REQUIRE(total <= capacity,
               "the prompt ({} tokens) plus max_tokens ({}) exceeds the KV cache's {} tokens",
               prompt.size(), options.max_tokens, capacity);
  validate_sampling_params(options.sampling);
  const SequenceId id{next_id_++};
  Live live{
      Sampler(options.sampling), std::move(sink), std::move(on_admitted), options.max_tokens, 0,
      options.ignore_eos};
  for (int32_t token : prompt) live.sampler.accept(token);  // penalties see the prompt
  live_.emplace(id, std::move(live));
  scheduler_.add(id, std::move(prompt), options.max_tokens);
  return id;
}

void Engine::cancel(SequenceId id) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  TokenSink sink = std::move(it->second.sink);
  live_.erase(it);
  scheduler_.finish(id);
  if (sink) sink({id, -1, 0, true, FinishReason::kStopped});
}

bool Engine::step() {
  const StepPlan plan = scheduler_.schedule();
  stats_.preemptions += static_cast<int64_t>(plan.preempted.size());
  if (plan.empty()) return false;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (std::find(plan.admitted.begin(), plan.admitted.end(), chunk.id) == plan.admitted.end())
      continue;
    Live& live = live_.at(chunk.id);
    if (!live.on_admitted) continue;  // readmitted after preemption
    AdmitSink on_admitted = std::move(live.on_admitted);
    live.on_admitted = nullptr;
    on_admitted(chunk.id, chunk.pos0);  // pos0 of a first admission = prefix-cache hit tokens
  }

  batch_tokens_.clear();
  batch_sequences_.clear();
  logit_rows_.clear();
  for (const ScheduledChunk& chunk : plan.chunks) {
    const int64_t n = static_cast<int64_t>(chunk.tokens.size());
    if (chunk.samples) logit_rows_.push_back(static_cast<int64_t>(batch_tokens_.size()) + n - 1);
    batch_tokens_.insert(batch_tokens_.end(), chunk.tokens.begin(), chunk.tokens.end());
    batch_sequences_.push_back({kv_.block_table(chunk.id), chunk.pos0, n});
  }
  const int64_t n_vocab = model_.config().n_vocab;
  logits_.resize(logit_rows_.size() * static_cast<size_t>(n_vocab));
  forward_.run(batch_tokens_, batch_sequences_, cache_, logit_rows_, logits_.data());
  ++stats_.steps;
  stats_.computed_tokens += plan.n_tokens;

  sampled_.clear();
  size_t row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.samples) continue;
    const int64_t position = chunk.pos0 + static_cast<int64_t>(chunk.tokens.size());
    Live& live = live_.at(chunk.id);
    const std::span<const float> logits(logits_.data() + row * n_vocab,
                                        static_cast<size_t>(n_vocab));
    sampled_.push_back(live.sampler.sample(logits, static_cast<uint64_t>(position)));
    ++row;
  }
  scheduler_.complete(plan, sampled_);

  row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.samples) continue;
    const int32_t token = sampled_[row++];
    auto it = live_.find(chunk.id);
    if (it == live_.end()) continue;  // cancelled by a sink earlier in this loop
    Live& live = it->second;
    live.sampler.accept(token);
    ++live.n_generated;
    ++stats_.generated_tokens;
    const bool end = !live.ignore_eos &&
                     std::find(end_of_generation_.begin(), end_of_generation_.end(), token) !=
                         end_of_generation_.end();
    const bool length = live.n_generated >= live.max_tokens;
    TokenEvent event{chunk.id, token, chunk.pos0 + static_cast<int64_t>(chunk.tokens.size()),
                     end || length, end ? FinishReason::kEndOfGeneration : FinishReason::kLength};
    if (event.finished) {
      TokenSink sink = std::move(live.sink);
      live_.erase(it);
      scheduler_.finish(chunk.id);  // frees its blocks now (a no-op if the length already did)
      if (sink) sink(event);
    } else if (live.sink) {
      live.sink(event);  // may cancel sequences; `live` is not used after this
    }
  }
  return true;
}

void Engine::run_until_idle() {
  while (step()) {
  }
}

EngineStats Engine::stats() const {
  EngineStats s = stats_;
  s.prompt_tokens = kv_.n_prompt_tokens();
  s.prefix_hit_tokens = kv_.n_prefix_hit_tokens();
  return s;
}

}  // namespace duet

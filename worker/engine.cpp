#include "worker/engine.h"

#include <algorithm>

#include "common/error.h"
#include "common/model/token_order.h"

namespace duet {

namespace {

KvLayout with_blocks(KvLayout layout, int64_t n_blocks) {
  layout.n_blocks = n_blocks;
  return layout;
}

}  // namespace

EngineBackend model_backend(const LlamaModel& model, const cpu::KernelTable& kernels,
                            cpu::ThreadPool& pool, const ForwardPlacement& placement) {
  return {make_forward(model, kernels, pool, placement), model.kv_layout(1), KvMemory::kHost,
          model.config().n_vocab, model.config().n_ctx_train};
}

Engine::Engine(EngineBackend backend, EngineConfig config)
    : n_vocab_(backend.n_vocab),
      n_ctx_(backend.n_ctx),
      pool_(config.n_kv_blocks),
      kv_(pool_, backend.kv_layout.block_size, /*prefix_caching=*/!config.scheduler.recompute),
      scheduler_(kv_, config.scheduler),
      cache_(with_blocks(backend.kv_layout, config.n_kv_blocks), backend.kv_memory),
      forward_(std::move(backend.forward)),
      max_running_(config.scheduler.max_running),
      end_of_generation_(std::move(config.end_of_generation)) {
  DUET_ASSERT(forward_ != nullptr, "an engine without a forward pass");
  cache_.set_device_copy(forward_->device_kv(cache_.layout()));
}

Engine::Engine(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
               EngineConfig config, Collective* collective, DeviceCollective* device_collective)
    : Engine(model_backend(model, kernels, pool, {config.device, collective, device_collective}),
             std::move(config)) {}

void Engine::validate(std::span<const int32_t> prompt, const RequestOptions& options) const {
  DUET_REQUIRE(!prompt.empty(), "the prompt is empty");
  DUET_REQUIRE(options.max_tokens >= 1, "max_tokens must be >= 1, got {}", options.max_tokens);
  for (int32_t id : prompt) {
    DUET_REQUIRE(id >= 0 && id < n_vocab_, "token id {} is outside the vocabulary (0..{})", id,
                 n_vocab_ - 1);
  }
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_tokens;
  DUET_REQUIRE(total <= n_ctx_,
               "the prompt ({} tokens) plus max_tokens ({}) exceeds the model's context of {}",
               prompt.size(), options.max_tokens, n_ctx_);
  const int64_t capacity = pool_.n_blocks() * kv_.block_size();
  DUET_REQUIRE(total <= capacity,
               "the prompt ({} tokens) plus max_tokens ({}) exceeds the KV cache's {} tokens",
               prompt.size(), options.max_tokens, capacity);
  validate_sampling_params(options.sampling);
}

int64_t Engine::token_order_from(std::span<const int32_t> prompt, const RequestOptions& options) {
  const auto n = static_cast<int64_t>(prompt.size());
  return one_token_from(options.n_prompt > 0 ? std::min(options.n_prompt, n) : n);
}

SequenceId Engine::add_live(std::vector<int32_t>& prompt, const RequestOptions& options,
                            TokenSink sink, AdmitSink on_admitted) {
  const SequenceId id{next_id_++};
  Live live{
      Sampler(options.sampling), std::move(sink), std::move(on_admitted), options.max_tokens, 0,
      options.ignore_eos,        std::nullopt};
  for (int32_t token : prompt) live.sampler.accept(token);  // penalties see the prompt
  live_.emplace(id, std::move(live));
  return id;
}

SequenceId Engine::submit(std::vector<int32_t> prompt, const RequestOptions& options,
                          TokenSink sink, AdmitSink on_admitted) {
  validate(prompt, options);
  const SequenceId id = add_live(prompt, options, std::move(sink), std::move(on_admitted));
  const int64_t order_from = token_order_from(prompt, options);
  scheduler_.add(id, std::move(prompt), options.max_tokens, order_from);
  return id;
}

SequenceId Engine::submit_export(std::vector<int32_t> prompt, const RequestOptions& options,
                                 int64_t send_from, ExportSink sink, AdmitSink on_admitted) {
  validate(prompt, options);
  DUET_REQUIRE(send_from >= 0 && send_from < static_cast<int64_t>(prompt.size()),
               "export from position {} of a {}-token prompt", send_from, prompt.size());
  const SequenceId id = add_live(prompt, options, {}, std::move(on_admitted));
  live_.at(id).exporting = Export{std::move(sink), send_from, 0};
  const int64_t order_from = token_order_from(prompt, options);
  scheduler_.add(id, std::move(prompt), 1, order_from);
  return id;
}

SequenceId Engine::submit_import(std::vector<int32_t> prompt, const RequestOptions& options,
                                 TokenSink sink, ImportHooks hooks) {
  validate(prompt, options);
  const SequenceId id = add_live(prompt, options, std::move(sink), {});
  const int64_t order_from = token_order_from(prompt, options);
  imports_.emplace(id, Import{std::move(prompt), order_from, std::move(hooks)});
  import_queue_.push_back(id);
  scheduler_.add_awaiting(id);
  reserve_imports();
  return id;
}

void Engine::reserve_imports() {
  while (!import_queue_.empty()) {
    const SequenceId id = import_queue_.front();
    Import& import = imports_.at(id);
    // Leave each running sequence room for its next block, and the running
    // set within its limit, so that imports never force preemptions.
    const int64_t in_flight = static_cast<int64_t>(imports_.size() - import_queue_.size());
    const int64_t blocks =
        (static_cast<int64_t>(import.prompt.size()) + kv_.block_size()) / kv_.block_size();
    if (scheduler_.n_running() + in_flight >= max_running_) return;
    if (kv_.n_free_blocks() - blocks < scheduler_.n_running()) return;
    const std::optional<int64_t> cached =
        kv_.begin_sequence(id, import.prompt, import.one_token_from);
    if (!cached) return;
    import_queue_.pop_front();
    import.reserved = true;
    import.cached_tokens = *cached;
    if (import.hooks.reserved) import.hooks.reserved(id, *cached, kv_.block_table(id));
  }
}

void Engine::complete_import(SequenceId id, int32_t first_token) {
  auto it = imports_.find(id);
  DUET_REQUIRE(it != imports_.end() && it->second.reserved && !it->second.aborted,
               "sequence {} is not an import in transfer", id.value);
  std::vector<int32_t> prompt = std::move(it->second.prompt);
  const int64_t order_from = it->second.one_token_from;
  const int64_t cached_tokens = it->second.cached_tokens;
  const bool device_rows = it->second.hooks.device_rows;
  imports_.erase(it);
  // Rows that came through the host staging copy go to the device (GPU only).
  if (!device_rows) {
    forward_->kv_from_host(kv_.block_table(id), cached_tokens,
                           static_cast<int64_t>(prompt.size()) - cached_tokens, cache_);
  }
  const int64_t n_committed = kv_.n_tokens(id);
  kv_.commit_tokens(id, std::span<const int32_t>(prompt).subspan(static_cast<size_t>(n_committed)));
  const int64_t position = static_cast<int64_t>(prompt.size());
  Live& live = live_.at(id);
  if (live.max_tokens >= 2) {
    scheduler_.add_running(id, std::move(prompt), first_token, live.max_tokens, order_from);
  } else {
    scheduler_.drop_awaiting(id);
    kv_.free_sequence(id);  // emit() ends it at once: max_tokens 1
  }
  emit(id, first_token, position);
}

void Engine::release_import(SequenceId id) {
  auto it = imports_.find(id);
  if (it == imports_.end()) return;
  const bool reserved = it->second.reserved;
  imports_.erase(it);
  std::erase(import_queue_, id);
  scheduler_.drop_awaiting(id);
  if (reserved && kv_.has_sequence(id)) kv_.free_sequence(id);
  live_.erase(id);
  reserve_imports();  // the freed blocks may be what the next import waits for
}

void Engine::cancel(SequenceId id) {
  auto it = live_.find(id);
  if (it == live_.end()) return;
  TokenSink sink = std::move(it->second.sink);
  live_.erase(it);
  if (auto import = imports_.find(id); import != imports_.end()) {
    scheduler_.drop_awaiting(id);
    if (import->second.reserved) {
      // Rows may still arrive: the blocks wait for release_import.
      import->second.aborted = true;
      if (import->second.hooks.abort) import->second.hooks.abort(id);
    } else {
      imports_.erase(import);
      std::erase(import_queue_, id);
    }
  } else {
    scheduler_.finish(id);
  }
  if (sink) sink({id, -1, 0, true, FinishReason::kCancelled});
}

uint64_t Engine::kv_checksum(SequenceId id, int64_t n) {
  DUET_REQUIRE(kv_.has_sequence(id) && n <= kv_.n_reserved_tokens(id),
               "sequence {} holds no KV for {} positions", id.value, n);
  DUET_REQUIRE(cache_.data() != nullptr, "this engine's KV cache holds no memory");
  forward_->kv_to_host(-1, kv_.block_table(id), 0, n, cache_);
  return kv_rows_checksum(cache_.layout(), cache_.data(), kv_.block_table(id), 0, n);
}

void Engine::export_layer(int64_t layer) {
  for (const ForwardBatch::Export& rows : export_rows_) {
    const Live& live = live_.at(rows.id);
    if (!live.exporting->sink.device_rows)
      forward_->kv_to_host(layer, kv_.block_table(rows.id), rows.pos0, rows.n, cache_);
    live.exporting->sink.layer(rows.id, layer, rows.pos0, rows.n, kv_.block_table(rows.id), cache_);
  }
}

void Engine::emit(SequenceId id, int32_t token, int64_t position) {
  auto it = live_.find(id);
  if (it == live_.end()) return;  // cancelled by a sink earlier in this step
  Live& live = it->second;
  live.sampler.accept(token);
  ++live.n_generated;
  ++stats_.generated_tokens;
  const bool end =
      !live.ignore_eos && std::find(end_of_generation_.begin(), end_of_generation_.end(), token) !=
                              end_of_generation_.end();
  const bool length = live.n_generated >= live.max_tokens;
  TokenEvent event{id, token, position, end || length,
                   end ? FinishReason::kEndOfGeneration : FinishReason::kLength};
  if (event.finished) {
    TokenSink sink = std::move(live.sink);
    live_.erase(it);
    scheduler_.finish(id);  // frees its blocks now (a no-op if the length already did)
    if (sink) sink(event);
  } else if (live.sink) {
    live.sink(event);  // may cancel sequences; `live` is not used after this
  }
}

bool Engine::step() {
  reserve_imports();
  const StepPlan plan = scheduler_.schedule();
  stats_.preemptions += static_cast<int64_t>(plan.preempted.size());
  if (plan.empty()) return false;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (std::find(plan.admitted.begin(), plan.admitted.end(), chunk.id) == plan.admitted.end())
      continue;
    Live& live = live_.at(chunk.id);
    if (live.exporting && !live.exporting->admitted) {
      live.exporting->admitted = true;
      live.exporting->cached_tokens = chunk.pos0;
    }
    if (!live.on_admitted) continue;  // readmitted after preemption
    AdmitSink on_admitted = std::move(live.on_admitted);
    live.on_admitted = nullptr;
    on_admitted(chunk.id, chunk.pos0);  // pos0 of a first admission = prefix-cache hit tokens
  }

  batch_tokens_.clear();
  batch_sequences_.clear();
  logit_rows_.clear();
  export_rows_.clear();
  for (const ScheduledChunk& chunk : plan.chunks) {
    const int64_t n = static_cast<int64_t>(chunk.tokens.size());
    if (chunk.samples) logit_rows_.push_back(static_cast<int64_t>(batch_tokens_.size()) + n - 1);
    batch_tokens_.insert(batch_tokens_.end(), chunk.tokens.begin(), chunk.tokens.end());
    batch_sequences_.push_back({kv_.block_table(chunk.id), chunk.pos0, n, chunk.one_token_from});
    // An export ships every row it has not shipped yet: on its first chunk
    // that includes rows the prefix cache supplied (beyond what the receiver
    // holds); a recomputed chunk after a preemption ships nothing twice.
    Live& live = live_.at(chunk.id);
    if (live.exporting && chunk.pos0 + n > live.exporting->sent_until) {
      export_rows_.push_back({chunk.id, batch_sequences_.size() - 1, live.exporting->sent_until,
                              chunk.pos0 + n - live.exporting->sent_until});
      live.exporting->sent_until = chunk.pos0 + n;
    }
  }
  if (before_forward_)
    before_forward_({batch_tokens_, batch_sequences_, logit_rows_, export_rows_});
  // Rows sampled on the device leave their logits there.
  const bool on_device = samples_on_device(plan);
  if (!on_device) logits_.resize(logit_rows_.size() * static_cast<size_t>(n_vocab_));
  // A step with prompt rows may take seconds: its layers count as progress.
  // (Decode steps pass no callback: a GPU forward replays them as one graph.)
  ModelForward::LayerStored layer_stored;
  if (!export_rows_.empty()) {
    layer_stored = [this](int64_t layer) {
      export_layer(layer);
      progress_.fetch_add(1, std::memory_order_relaxed);
    };
  } else if (plan.n_tokens > static_cast<int64_t>(plan.chunks.size())) {
    layer_stored = [this](int64_t) { progress_.fetch_add(1, std::memory_order_relaxed); };
  }
  forward_->run(batch_tokens_, batch_sequences_, cache_, logit_rows_,
                on_device ? nullptr : logits_.data(), layer_stored);
  progress_.fetch_add(1, std::memory_order_relaxed);
  ++stats_.steps;
  stats_.computed_tokens += plan.n_tokens;
  sample(plan, on_device);
  scheduler_.complete(plan, sampled_);

  size_t row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.samples) continue;
    const int32_t token = sampled_[row++];
    const int64_t position = chunk.pos0 + static_cast<int64_t>(chunk.tokens.size());
    auto it = live_.find(chunk.id);
    if (it != live_.end() && it->second.exporting) {
      // The prompt is exported: hand over its first token and end it here.
      ++stats_.generated_tokens;
      ExportSink sink = std::move(it->second.exporting->sink);
      const int64_t cached_tokens = it->second.exporting->cached_tokens;
      live_.erase(it);
      scheduler_.finish(chunk.id);
      if (sink.done) sink.done(chunk.id, token, cached_tokens);
      continue;
    }
    emit(chunk.id, token, position);
  }
  // The blocks and running slots the finished sequences freed may be what a
  // queued import waits for: reserved now, it does not wait for a next step
  // that an otherwise idle engine would never run.
  reserve_imports();
  return true;
}

bool Engine::samples_on_device(const StepPlan& plan) const {
  if (!forward_->samples_on_device()) return false;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.samples) continue;
    const SamplingParams& p = live_.at(chunk.id).sampler.params();
    if (p.penalties_enabled() || p.min_p > 0.0f) return false;
  }
  return true;
}

void Engine::sample(const StepPlan& plan, bool on_device) {
  sampled_.clear();
  device_sampling_.clear();
  const int64_t n_vocab = n_vocab_;
  size_t row = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    if (!chunk.samples) continue;
    const auto position =
        static_cast<uint64_t>(chunk.pos0 + static_cast<int64_t>(chunk.tokens.size()));
    Sampler& sampler = live_.at(chunk.id).sampler;
    if (on_device) {
      const SamplingParams& p = sampler.params();
      device_sampling_.push_back({p.temperature, p.top_k, p.top_p, uniform_at(p.seed, position)});
      continue;
    }
    const std::span<const float> logits(logits_.data() + row * n_vocab,
                                        static_cast<size_t>(n_vocab));
    sampled_.push_back(sampler.sample(logits, position));
    ++row;
  }
  if (on_device) {
    sampled_.resize(device_sampling_.size());
    forward_->sample(device_sampling_, sampled_);
  }
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

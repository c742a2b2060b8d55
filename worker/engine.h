// The in-process batching engine: requests in, token streams out.
//
// One engine owns a paged KV cache, its block pool and manager, the
// scheduler and a batch-invariant forward pass. step() runs one iteration:
// the scheduler's plan becomes one forward batch (every weight read once for
// all sequences), each sequence that completes a step samples its next token
// with its own sampler, and sinks receive the tokens. Because attention is
// batch-invariant and draws are keyed by (seed, position), a request's tokens
// do not depend on what else runs, on preemption and recompute, or on prefix
// cache hits. Thread affinity: one thread calls every method (the engine
// thread); sinks run on it.
//
// Disaggregated serving splits a request over two engines: the prefill engine
// exports (submit_export, ExportSink), the decode engine imports (submit_import,
// ImportHooks, complete_import, release_import).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "common/sampling.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/sequence.h"
#include "worker/kv/block_pool.h"
#include "worker/kv/kv_cache.h"
#include "worker/kv/kv_cache_manager.h"
#include "worker/kv/kv_rows.h"
#include "worker/model/model_forward.h"
#include "worker/scheduler.h"

namespace duet {

struct EngineConfig {
  int64_t n_kv_blocks = 256;  // KV cache capacity, in blocks of 16 tokens
  SchedulerConfig scheduler;  // scheduler.recompute: no KV kept between steps (nor prefixes)
  std::vector<int32_t> end_of_generation;  // ids that end a sequence (emitted, then finished)
  int device = -1;                         // -1: the CPU; else the CUDA device index
};

struct RequestOptions {
  int64_t max_tokens = 128;
  SamplingParams sampling;
  bool ignore_eos = false;  // end-of-generation tokens do not end it: exactly max_tokens
  // The prompt's first n_prompt tokens are prompt, the rest were generated
  // earlier (a re-run): they keep the generated tokens' order
  // (common/model/token_order.h). 0: all of it is prompt.
  int64_t n_prompt = 0;
};

struct TokenEvent {
  SequenceId id;
  int32_t token = -1;    // -1 for a finish without a token (cancel)
  int64_t position = 0;  // the token's position in its sequence
  bool finished = false;
  FinishReason reason = FinishReason::kLength;
};

using TokenSink = std::function<void(const TokenEvent&)>;
// Called once, when a request first gets KV and compute (its queueing ends),
// with how many of its prompt tokens the prefix cache held.
using AdmitSink = std::function<void(SequenceId id, int64_t cached_tokens)>;

// The prefill side of a transfer. Both run on the engine thread, inside step().
struct ExportSink {
  // After `layer` is stored: the sequence's rows [pos0, pos0 + n) of that
  // layer are in `cache` under `block_table`, valid until the callback returns
  // (the transfer copies them out while the layers above run).
  std::function<void(SequenceId id, int64_t layer, int64_t pos0, int64_t n,
                     std::span<const int32_t> block_table, const KvCache& cache)>
      layer;
  // Every row is exported; `first_token` is the token a single engine would
  // have sampled after the prompt. The sequence is over (its blocks return
  // to the pool, full ones stay in the prefix cache).
  std::function<void(SequenceId id, int32_t first_token, int64_t cached_tokens)> done;
  // The sink reads the rows from cache.device_copy() (a device transfer between
  // GPUs): a GPU engine does not copy them to the host cache first.
  bool device_rows = false;
};

// The decode side of a transfer. Both run on the engine thread.
struct ImportHooks {
  // The prompt's blocks are reserved: positions [0, prompt) live in
  // `block_table` (copied by the callee); the first `cached_tokens` came from
  // the prefix cache, the rows of [cached_tokens, prompt) are to be written.
  std::function<void(SequenceId id, int64_t cached_tokens, std::span<const int32_t> block_table)>
      reserved;
  // The sequence was cancelled while rows may still be written into its
  // blocks: stop writing, then call release_import(id).
  std::function<void(SequenceId id)> abort;
  // The rows are written into cache().device_copy() (a device transfer between
  // GPUs): complete_import does not upload them from the host cache.
  bool device_rows = false;
};

// One forward batch as the engine hands it to the model: what a
// tensor-parallel leader mirrors on its followers before running its shard.
struct ForwardBatch {
  // Rows [pos0, pos0 + n) of batch sequence `sequence` are exported.
  struct Export {
    SequenceId id;
    size_t sequence = 0;
    int64_t pos0 = 0;
    int64_t n = 0;
  };
  std::span<const int32_t> tokens;
  std::span<const ForwardSequence> sequences;
  std::span<const int64_t> logit_rows;
  std::span<const Export> exports;
};

struct EngineStats {
  int64_t steps = 0;
  int64_t computed_tokens = 0;  // rows run through the model
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  int64_t prompt_tokens = 0;  // as the KV cache manager counts them (prefix-cache lookups)
  int64_t prefix_hit_tokens = 0;
};

// What an engine computes with, apart from its own bookkeeping: a forward
// pass, the shape of the KV it stores (and whether the cache holds memory),
// and the limits requests are checked against. A loaded model gives one
// (model_backend); a step-time model with no weights and no KV memory gives
// another (worker/model/step_time_forward.h), so that a cluster simulator
// runs this engine's scheduling, admission and import code unchanged.
struct EngineBackend {
  std::unique_ptr<ModelForward> forward;
  KvLayout kv_layout;  // its n_blocks is the engine's (EngineConfig::n_kv_blocks)
  KvMemory kv_memory = KvMemory::kHost;
  int64_t n_vocab = 0;  // token ids are in [0, n_vocab); logit rows are this long
  int64_t n_ctx = 0;    // a prompt plus max_tokens fits in this many positions
};

// `model` run by the forward make_forward picks for `placement` (throws as
// make_forward does).
EngineBackend model_backend(const LlamaModel& model, const cpu::KernelTable& kernels,
                            cpu::ThreadPool& pool, const ForwardPlacement& placement);

class Engine final {
 public:
  Engine(EngineBackend backend, EngineConfig config);
  // A loaded model's engine. A sharded `model` (tensor parallelism) needs its
  // instance's `collective` (outlives the engine); the followers must run
  // every batch too (see set_before_forward). config.device >= 0 runs the
  // forward pass on that GPU (throws kUnsupported where there is none); its
  // KV cache then lives in device memory and cache() is the transfers'
  // staging copy.
  Engine(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
         EngineConfig config, Collective* collective = nullptr,
         DeviceCollective* device_collective = nullptr);

  // Called with every batch right before the forward pass, on the engine thread.
  using BeforeForward = std::function<void(const ForwardBatch&)>;
  void set_before_forward(BeforeForward hook) { before_forward_ = std::move(hook); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Throws duet::Error (kInvalidArgument) for an empty
  // prompt, an id outside the vocabulary, or a prompt plus max_tokens longer
  // than the model's context or the KV cache.
  SequenceId submit(std::vector<int32_t> prompt, const RequestOptions& options, TokenSink sink,
                    AdmitSink on_admitted = {});

  // A prompt computed here for another engine: runs like submit() with
  // max_tokens 1, exporting the rows of positions >= send_from (the receiver
  // has the rest) layer by layer. Same validation as submit().
  SequenceId submit_export(std::vector<int32_t> prompt, const RequestOptions& options,
                           int64_t send_from, ExportSink sink, AdmitSink on_admitted = {});

  // A prompt whose KV another engine computes: reserves its blocks when they
  // are free, first come first served (hooks.reserved: the transfer then asks
  // the prefill side and writes the rows into them), then waits for
  // complete_import. `sink` gets the tokens from the first one on, as for
  // submit(). Same validation.
  SequenceId submit_import(std::vector<int32_t> prompt, const RequestOptions& options,
                           TokenSink sink, ImportHooks hooks);
  // The rows of the imported prompt are written; `first_token` was sampled
  // after it by the exporter. Emits it and decodes on from there: the sequence
  // joins the running batch exactly where a single engine would be after its
  // prefill step.
  void complete_import(SequenceId id, int32_t first_token);
  // Frees an imported sequence's blocks once nothing writes them (after
  // hooks.abort, or a transfer that failed); nothing else frees blocks that a
  // transfer may still write. A sequence still live ends without a sink event
  // (its owner reports why). Unknown ids are ignored.
  void release_import(SequenceId id);
  // The KV memory (on a GPU engine, the host staging copy, synchronized for
  // exported and imported rows; none for KvMemory::kNone). A transfer writes imported rows into it
  // from its own thread, only into the blocks of a reserved import, and only
  // until the import completes or is released.
  KvCache& cache() { return cache_; }
  // Whether `id` is an import not yet completed (waiting for blocks or rows).
  bool importing(SequenceId id) const { return imports_.contains(id); }
  // Whether `id` is an import whose blocks are reserved: rows may be written.
  bool import_reserved(SequenceId id) const {
    auto it = imports_.find(id);
    return it != imports_.end() && it->second.reserved;
  }

  // Ends a request at once and frees its KV blocks; its sink gets a final
  // event (reason kCancelled). An import whose rows are in flight keeps its
  // blocks until release_import (hooks.abort is called). Unknown or finished
  // ids are ignored.
  void cancel(SequenceId id);

  // The checksum (worker/kv/kv_rows.h kv_rows_checksum) of a live sequence's KV
  // rows [0, n): to compare a transferred cache with a computed one.
  uint64_t kv_checksum(SequenceId id, int64_t n);

  // Runs one step; false when there was nothing to do.
  bool step();
  // Moves on with every step, and with every layer of a step that computes
  // prompt rows: what a heartbeat shows of a long step that is not stuck
  // (worker/rank_liveness.h). Any thread.
  int64_t progress() const { return progress_.load(std::memory_order_relaxed); }
  void run_until_idle();

  bool idle() const { return scheduler_.idle(); }
  // Where a sequence is (the scheduler's word; kFinished once it is over,
  // even while an aborted import's blocks wait for release_import).
  SequenceState state(SequenceId id) const { return scheduler_.state(id); }
  int64_t n_running() const { return scheduler_.n_running(); }
  // Waiting for compute, or (imports) for blocks or rows.
  int64_t n_waiting() const {
    return scheduler_.n_waiting() + static_cast<int64_t>(imports_.size());
  }
  EngineStats stats() const;
  int64_t n_free_kv_blocks() const { return kv_.n_free_blocks(); }
  int64_t n_kv_blocks_of(SequenceId id) const { return kv_.n_blocks(id); }
  int64_t n_kv_blocks() const { return pool_.n_blocks(); }

 private:
  struct Export {
    ExportSink sink;
    int64_t sent_until = 0;     // rows below this position are exported
    int64_t cached_tokens = 0;  // of its first admission
    bool admitted = false;
  };
  struct Live {
    Sampler sampler;
    TokenSink sink;
    AdmitSink on_admitted;  // emptied once called
    int64_t max_tokens = 0;
    int64_t n_generated = 0;
    bool ignore_eos = false;
    std::optional<Export> exporting;  // submit_export
  };
  struct Import {
    std::vector<int32_t> prompt;
    int64_t one_token_from = 0;  // common/model/token_order.h
    ImportHooks hooks;
    bool reserved = false;
    int64_t cached_tokens = 0;  // prompt rows the prefix cache held (not transferred)
    bool aborted = false;       // cancelled; blocks wait for release_import
  };

  SequenceId add_live(std::vector<int32_t>& prompt, const RequestOptions& options, TokenSink sink,
                      AdmitSink on_admitted);
  void validate(std::span<const int32_t> prompt, const RequestOptions& options) const;
  // Where the one-token order starts for this prompt (its role: options.n_prompt).
  static int64_t token_order_from(std::span<const int32_t> prompt, const RequestOptions& options);
  void reserve_imports();
  void export_layer(int64_t layer);
  // Whether the step's logit rows are sampled on the device: the forward
  // can, and no row needs penalties or min-p (the host sampler's controls).
  bool samples_on_device(const StepPlan& plan) const;
  // Samples every logit row of the step into sampled_.
  void sample(const StepPlan& plan, bool on_device);
  // Emits a sampled token; finishes the sequence when it ends it.
  void emit(SequenceId id, int32_t token, int64_t position);

  const int64_t n_vocab_;
  const int64_t n_ctx_;
  BlockPool pool_;
  KvCacheManager kv_;
  Scheduler scheduler_;
  KvCache cache_;
  std::unique_ptr<ModelForward> forward_;
  const int64_t max_running_;
  std::vector<int32_t> end_of_generation_;
  std::map<SequenceId, Live> live_;
  std::map<SequenceId, Import> imports_;           // submitted imports not yet completed
  std::deque<SequenceId> import_queue_;            // waiting for blocks, first come first served
  std::vector<ForwardBatch::Export> export_rows_;  // of the running step
  int64_t next_id_ = 0;
  EngineStats stats_;
  std::atomic<int64_t> progress_{0};  // written by the engine thread
  BeforeForward before_forward_;
  // Per-step buffers, reused.
  std::vector<int32_t> batch_tokens_;
  std::vector<ForwardSequence> batch_sequences_;
  std::vector<int64_t> logit_rows_;
  std::vector<float> logits_;
  std::vector<int32_t> sampled_;
  std::vector<DeviceSampling> device_sampling_;
};

}  // namespace duet

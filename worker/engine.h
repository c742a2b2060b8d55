// The in-process batching engine: requests in, token streams out.
//
// One engine owns a paged KV cache, its block pool and manager, the
// scheduler and a batch-invariant forward pass. step() runs one iteration:
// the scheduler's plan becomes one forward batch (every weight read once for
// all sequences), each sequence that completes a step samples its next token
// with its own sampler, and sinks receive the tokens. Because attention is
// batch-invariant and draws are keyed by (seed, position), a request's tokens
// do not depend on what else runs, on preemption and recompute, or on prefix
// cache hits. Thread affinity: one thread calls every method (the worker's
// compute thread); sinks run on it.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <vector>

#include "common/sampling.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/block_pool.h"
#include "worker/generator.h"
#include "worker/kv_cache.h"
#include "worker/kv_cache_manager.h"
#include "worker/llama_forward.h"
#include "worker/scheduler.h"

namespace duet {

struct EngineConfig {
  int64_t n_kv_blocks = 256;  // KV cache capacity, in blocks of 16 tokens
  SchedulerConfig scheduler;
  std::vector<int32_t> end_of_generation;  // ids that end a sequence (emitted, then finished)
};

struct RequestOptions {
  int64_t max_tokens = 128;
  SamplingParams sampling;
  bool ignore_eos = false;  // end-of-generation tokens do not end it: exactly max_tokens
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

struct EngineStats {
  int64_t steps = 0;
  int64_t computed_tokens = 0;  // rows run through the model
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
  int64_t prompt_tokens = 0;  // as the KV cache manager counts them (prefix-cache lookups)
  int64_t prefix_hit_tokens = 0;
};

class Engine final {
 public:
  Engine(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
         EngineConfig config);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues a request. Throws duet::Error (kInvalidArgument) for an empty
  // prompt, an id outside the vocabulary, or a prompt plus max_tokens longer
  // than the model's context or the KV cache.
  SequenceId submit(std::vector<int32_t> prompt, const RequestOptions& options, TokenSink sink,
                    AdmitSink on_admitted = {});

  // Ends a request at once and frees its KV blocks; its sink gets a final
  // event (reason kStopped). Unknown or finished ids are ignored.
  void cancel(SequenceId id);

  // Runs one step; false when there was nothing to do.
  bool step();
  void run_until_idle();

  bool idle() const { return scheduler_.idle(); }
  int64_t n_running() const { return scheduler_.n_running(); }
  int64_t n_waiting() const { return scheduler_.n_waiting(); }
  EngineStats stats() const;
  int64_t n_free_kv_blocks() const { return kv_.n_free_blocks(); }
  int64_t n_kv_blocks() const { return pool_.n_blocks(); }

 private:
  struct Live {
    Sampler sampler;
    TokenSink sink;
    AdmitSink on_admitted;  // emptied once called
    int64_t max_tokens = 0;
    int64_t n_generated = 0;
    bool ignore_eos = false;
  };

  const LlamaModel& model_;
  BlockPool pool_;
  KvCacheManager kv_;
  Scheduler scheduler_;
  KvCache cache_;
  LlamaForward forward_;
  std::vector<int32_t> end_of_generation_;
  std::map<SequenceId, Live> live_;
  int64_t next_id_ = 0;
  EngineStats stats_;
  // Per-step buffers, reused.
  std::vector<int32_t> batch_tokens_;
  std::vector<ForwardSequence> batch_sequences_;
  std::vector<int64_t> logit_rows_;
  std::vector<float> logits_;
  std::vector<int32_t> sampled_;
};

}  // namespace duet

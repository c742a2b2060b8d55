// The continuous-batching scheduler: which tokens of which sequences the next
// forward step computes.
//
// Iteration level: every step, running sequences go first, oldest first, each
// with its next token (or its next prefill chunk); then waiting sequences are
// admitted first come, first served while the step's token budget, the
// running limit and the KV cache allow — no later arrival overtakes a waiting
// one, so nobody starves. A long prompt is prefilled in chunks of whatever
// budget the running decodes leave, so it delays them by at most one chunk.
// When a running sequence cannot get a block for its next token, the newest
// running sequence is preempted: its blocks are freed and it goes back to the
// waiting queue, to be recomputed (prompt and generated tokens) when
// readmitted; its full blocks stay in the prefix cache, so recomputing often
// costs little.
//
// Step plans are diffs: a plan names the sequences admitted in it and the
// ones preempted or finished since the last plan, and lists the chunks to
// compute. Thread affinity: one thread (the engine thread).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <span>
#include <vector>

#include "worker/kv/kv_cache_manager.h"
#include "worker/sequence.h"

namespace duet {

struct SchedulerConfig {
  int64_t max_step_tokens = 512;  // token budget of one forward step
  int64_t max_running = 64;       // sequences holding KV at once
  // Keep no KV between steps: after each token a sequence gives its blocks
  // back and its next step recomputes its whole context (what `duet generate
  // --no-kv-cache` shows the cache saves; the KV cache manager must not
  // cache prefixes then). Tokens are the same as with reuse.
  bool recompute = false;
};

struct ScheduledChunk {
  SequenceId id;
  int64_t pos0 = 0;                 // position of the first token computed
  std::span<const int32_t> tokens;  // the tokens to compute, valid until the next schedule()
  bool samples = false;             // the chunk ends at the sequence's last token: sample one
  // The sequence's first position computed in the one-token order
  // (common/model/token_order.h): a chunk's rows keep their tokens' roles.
  int64_t one_token_from = 0;
};

struct StepPlan {
  std::vector<ScheduledChunk> chunks;  // in batch order
  std::vector<SequenceId> admitted;    // new to the running set in this step
  std::vector<SequenceId> preempted;   // lost their KV since the last plan
  std::vector<SequenceId> finished;    // done since the last plan (length, stop or cancel)
  int64_t n_tokens = 0;                // rows of the step
  bool empty() const { return chunks.empty(); }
};

class Scheduler final {
 public:
  Scheduler(KvCacheManager& kv, SchedulerConfig config);
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a request; it generates at most max_tokens tokens. The caller
  // keeps prompt + max_tokens within the KV cache's capacity (a request that
  // can never fit would wait forever).
  // `order_from`: the first position computed in the one-token order
  // (common/model/token_order.h); -1: one_token_from(the prompt's length).
  void add(SequenceId id, std::vector<int32_t> prompt, int64_t max_tokens, int64_t order_from = -1);

  // Adds a sequence whose prompt KV is already written and committed (the KV
  // cache manager holds it under `id`, all of `prompt` committed), with its
  // first generated token: it runs from the next step on, decoding that token.
  // Counts as running; its arrival is now. max_tokens counts the first token.
  // `id` is new, or awaiting its KV (add_awaiting).
  void add_running(SequenceId id, std::vector<int32_t> prompt, int32_t first_token,
                   int64_t max_tokens, int64_t order_from = -1);

  // A sequence whose prompt's KV another engine computes (an import): known
  // here only by its state until add_running takes it, or drop_awaiting
  // forgets it (its blocks are its owner's business).
  void add_awaiting(SequenceId id);
  void drop_awaiting(SequenceId id);

  // Ends a sequence at once (cancelled, or stopped by its caller), freeing its KV.
  void finish(SequenceId id);

  // The next step's work; empty when nothing is waiting or running.
  StepPlan schedule();

  // Records that `plan` ran: its chunks' KV is written, and `sampled` holds
  // one token for each chunk with samples == true, in plan order. Sequences
  // that reach max_tokens finish (listed in the next plan).
  void complete(const StepPlan& plan, std::span<const int32_t> sampled);

  int64_t n_running() const { return static_cast<int64_t>(running_.size()); }
  int64_t n_waiting() const { return static_cast<int64_t>(waiting_.size()); }
  bool idle() const { return running_.empty() && waiting_.empty(); }
  // kFinished for a sequence this scheduler does not hold (any more).
  SequenceState state(SequenceId id) const;
  // Tokens generated so far by a live sequence.
  std::span<const int32_t> generated(SequenceId id) const;

 private:
  struct Sequence {
    SequenceState state = SequenceState::kQueued;
    int64_t arrival = 0;          // FCFS order
    std::vector<int32_t> tokens;  // prompt, then generated tokens
    int64_t n_prompt = 0;
    int64_t one_token_from = 0;  // of n_prompt (common/model/token_order.h)
    int64_t max_tokens = 0;
    int64_t n_computed = 0;  // tokens whose KV is written
  };

  // Frees a running sequence's KV and queues it again at its arrival rank;
  // `report`: listed in the next plan's preempted (not for recompute mode).
  void preempt(SequenceId id, bool report = true);
  void release(SequenceId id);

  KvCacheManager& kv_;
  const SchedulerConfig config_;
  int64_t next_arrival_ = 0;
  std::map<SequenceId, Sequence> sequences_;
  std::vector<SequenceId> running_;  // by arrival, oldest first
  std::deque<SequenceId> waiting_;   // by arrival, oldest first
  std::vector<SequenceId> preempted_since_plan_;
  std::vector<SequenceId> finished_since_plan_;
};

}  // namespace duet

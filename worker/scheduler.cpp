#include "worker/scheduler.h"

#include <algorithm>

#include "common/error.h"
#include "common/model/token_order.h"

namespace duet {

Scheduler::Scheduler(KvCacheManager& kv, SchedulerConfig config) : kv_(kv), config_(config) {
  DUET_REQUIRE(config.max_running >= 1, "max_running must be >= 1, got {}", config.max_running);
  DUET_REQUIRE(config.max_step_tokens >= config.max_running,
               "the step token budget ({}) must cover one token per running sequence ({})",
               config.max_step_tokens, config.max_running);
}

void Scheduler::add(SequenceId id, std::vector<int32_t> prompt, int64_t max_tokens,
                    int64_t order_from) {
  DUET_REQUIRE(!prompt.empty(), "sequence {}: the prompt is empty", id.value);
  DUET_REQUIRE(max_tokens >= 1, "sequence {}: max_tokens must be >= 1, got {}", id.value,
               max_tokens);
  DUET_REQUIRE(!sequences_.contains(id), "sequence {} already exists", id.value);
  Sequence seq;
  seq.arrival = next_arrival_++;
  seq.n_prompt = static_cast<int64_t>(prompt.size());
  seq.one_token_from = order_from >= 0 ? order_from : one_token_from(seq.n_prompt);
  seq.tokens = std::move(prompt);
  seq.max_tokens = max_tokens;
  sequences_.emplace(id, std::move(seq));
  waiting_.push_back(id);
}

void Scheduler::add_running(SequenceId id, std::vector<int32_t> prompt, int32_t first_token,
                            int64_t max_tokens, int64_t order_from) {
  DUET_REQUIRE(!prompt.empty() && max_tokens >= 2,
               "sequence {}: an imported sequence needs a prompt and max_tokens >= 2", id.value);
  DUET_REQUIRE(state(id) == SequenceState::kFinished || state(id) == SequenceState::kAwaitingKv,
               "sequence {} already exists", id.value);
  DUET_REQUIRE(kv_.has_sequence(id) && kv_.n_tokens(id) == static_cast<int64_t>(prompt.size()),
               "sequence {}: its prompt's KV is not committed", id.value);
  Sequence seq;
  seq.arrival = next_arrival_++;
  seq.n_prompt = static_cast<int64_t>(prompt.size());
  seq.one_token_from = order_from >= 0 ? order_from : one_token_from(seq.n_prompt);
  seq.n_computed = seq.n_prompt;
  seq.tokens = std::move(prompt);
  seq.tokens.push_back(first_token);
  seq.max_tokens = max_tokens;
  seq.state = SequenceState::kRunning;
  sequences_.insert_or_assign(id, std::move(seq));
  running_.push_back(id);  // the newest arrival: running_ stays ordered
}

void Scheduler::add_awaiting(SequenceId id) {
  DUET_REQUIRE(!sequences_.contains(id), "sequence {} already exists", id.value);
  Sequence seq;
  seq.state = SequenceState::kAwaitingKv;
  sequences_.emplace(id, std::move(seq));
}

void Scheduler::drop_awaiting(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  DUET_ASSERT(it->second.state == SequenceState::kAwaitingKv,
              "sequence {} is {}, not awaiting its KV", id.value,
              sequence_state_name(it->second.state));
  sequences_.erase(it);
}

SequenceState Scheduler::state(SequenceId id) const {
  auto it = sequences_.find(id);
  return it == sequences_.end() ? SequenceState::kFinished : it->second.state;
}

void Scheduler::release(SequenceId id) {
  if (kv_.has_sequence(id)) kv_.free_sequence(id);
  std::erase(running_, id);
  std::erase(waiting_, id);
  sequences_.erase(id);
  finished_since_plan_.push_back(id);
}

void Scheduler::finish(SequenceId id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return;
  DUET_ASSERT(it->second.state != SequenceState::kAwaitingKv,
              "sequence {} awaits its KV: drop_awaiting, not finish", id.value);
  release(id);
}

void Scheduler::preempt(SequenceId id, bool report) {
  kv_.free_sequence(id);
  std::erase(running_, id);
  Sequence& seq = sequences_.at(id);
  seq.n_computed = 0;
  // Recompute mode hands every sequence back after each token: that is its
  // ordinary life there, not a preemption.
  seq.state = report ? SequenceState::kPreempted : SequenceState::kQueued;
  // Back in the queue at its arrival rank: older than anything that arrived after it.
  auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](SequenceId other) {
    return sequences_.at(other).arrival > seq.arrival;
  });
  waiting_.insert(it, id);
  if (report) preempted_since_plan_.push_back(id);
}

StepPlan Scheduler::schedule() {
  StepPlan plan;
  plan.preempted = std::move(preempted_since_plan_);
  plan.finished = std::move(finished_since_plan_);
  preempted_since_plan_.clear();
  finished_since_plan_.clear();
  int64_t budget = config_.max_step_tokens;

  // Running sequences first, oldest first.
  std::vector<SequenceId> scheduled;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    const SequenceId id = running_[i];
    Sequence& seq = sequences_.at(id);
    const int64_t want = std::min(static_cast<int64_t>(seq.tokens.size()) - seq.n_computed, budget);
    DUET_ASSERT(want > 0, "running sequence {} has nothing to compute", id.value);
    bool self_preempted = false;
    while (!kv_.reserve(id, seq.n_computed + want)) {
      // Out of blocks: preempt the newest running sequence not already in this step.
      auto victim = std::find_if(running_.rbegin(), running_.rend(), [&](SequenceId other) {
        return std::find(scheduled.begin(), scheduled.end(), other) == scheduled.end();
      });
      DUET_ASSERT(victim != running_.rend());
      const SequenceId victim_id = *victim;
      preempt(victim_id);
      if (victim_id == id) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) continue;  // running_[i] is now the next sequence
    plan.chunks.push_back({id,
                           seq.n_computed,
                           {seq.tokens.data() + seq.n_computed, static_cast<size_t>(want)},
                           seq.n_computed + want == static_cast<int64_t>(seq.tokens.size()),
                           seq.one_token_from});
    scheduled.push_back(id);
    budget -= want;
    ++i;
  }

  // Then admissions, first come first served, without skipping anyone.
  while (budget > 0 && !waiting_.empty() &&
         static_cast<int64_t>(running_.size()) < config_.max_running) {
    const SequenceId id = waiting_.front();
    Sequence& seq = sequences_.at(id);
    const std::optional<int64_t> cached = kv_.begin_sequence(id, seq.tokens, seq.one_token_from);
    if (!cached) break;  // the KV cache cannot hold it yet
    seq.n_computed = *cached;
    const int64_t want = std::min(static_cast<int64_t>(seq.tokens.size()) - seq.n_computed, budget);
    waiting_.pop_front();
    seq.state = SequenceState::kRunning;
    running_.push_back(id);
    std::sort(running_.begin(), running_.end(), [&](SequenceId a, SequenceId b) {
      return sequences_.at(a).arrival < sequences_.at(b).arrival;
    });
    plan.admitted.push_back(id);
    plan.chunks.push_back({id,
                           seq.n_computed,
                           {seq.tokens.data() + seq.n_computed, static_cast<size_t>(want)},
                           seq.n_computed + want == static_cast<int64_t>(seq.tokens.size()),
                           seq.one_token_from});
    budget -= want;
  }
  for (const ScheduledChunk& chunk : plan.chunks)
    plan.n_tokens += static_cast<int64_t>(chunk.tokens.size());
  return plan;
}

void Scheduler::complete(const StepPlan& plan, std::span<const int32_t> sampled) {
  size_t next_sample = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    auto it = sequences_.find(chunk.id);
    if (chunk.samples) {
      DUET_ASSERT(next_sample < sampled.size(), "complete(): too few sampled tokens");
      ++next_sample;
    }
    if (it == sequences_.end()) continue;  // finished while the step ran
    Sequence& seq = it->second;
    kv_.commit_tokens(chunk.id, chunk.tokens);
    seq.n_computed += static_cast<int64_t>(chunk.tokens.size());
    if (!chunk.samples) continue;
    seq.tokens.push_back(sampled[next_sample - 1]);
    if (static_cast<int64_t>(seq.tokens.size()) - seq.n_prompt >= seq.max_tokens) {
      release(chunk.id);
    } else if (config_.recompute) {
      preempt(chunk.id, /*report=*/false);
    }
  }
  DUET_ASSERT(next_sample == sampled.size(), "complete(): {} sampled tokens for {} sampling chunks",
              sampled.size(), next_sample);
}

std::span<const int32_t> Scheduler::generated(SequenceId id) const {
  const Sequence& seq = sequences_.at(id);
  return {seq.tokens.data() + seq.n_prompt, seq.tokens.size() - static_cast<size_t>(seq.n_prompt)};
}

}  // namespace duet

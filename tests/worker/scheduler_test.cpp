// The continuous-batching scheduler over a real block pool, without a model:
// budgets, FCFS admission, chunked prefill beside running decodes, preemption
// of the newest sequence and its recompute, prefix-cache hits, and no block
// leaked after any mix of finish, cancel and preemption.
#include "worker/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "common/model/token_order.h"
#include "worker/kv/block_pool.h"

namespace duet {
namespace {

constexpr int64_t kBlock = 16;

std::vector<int32_t> prompt_of(int64_t n, int32_t first) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), first);
  return p;
}

// What a model step would return for `plan`: token 7 for every sampling chunk.
std::vector<int32_t> constant_samples(const StepPlan& plan) {
  std::vector<int32_t> sampled;
  for (const ScheduledChunk& c : plan.chunks) {
    if (c.samples) sampled.push_back(7);
  }
  return sampled;
}

int64_t chunk_tokens(const StepPlan& plan, SequenceId id) {
  for (const ScheduledChunk& c : plan.chunks) {
    if (c.id == id) return static_cast<int64_t>(c.tokens.size());
  }
  return 0;
}

TEST(Scheduler, NeverExceedsTheTokenBudgetAndDecodesEveryRunningSequenceEachStep) {
  BlockPool pool(256);
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 64, .max_running = 8});
  scheduler.add({1}, prompt_of(20, 100), 50);
  scheduler.add({2}, prompt_of(30, 200), 50);
  StepPlan first = scheduler.schedule();
  EXPECT_EQ(first.n_tokens, 50);
  scheduler.complete(first, constant_samples(first));
  scheduler.add({3}, prompt_of(500, 300), 5);  // a long prompt arrives while 1 and 2 decode
  for (int step = 0; step < 12; ++step) {
    const StepPlan plan = scheduler.schedule();
    EXPECT_LE(plan.n_tokens, 64);
    EXPECT_EQ(chunk_tokens(plan, {1}), 1) << "step " << step;  // never stalled by the prefill
    EXPECT_EQ(chunk_tokens(plan, {2}), 1) << "step " << step;
    EXPECT_LE(chunk_tokens(plan, {3}), 62);
    scheduler.complete(plan, constant_samples(plan));
  }
  EXPECT_TRUE(pool.check_invariants());
}

TEST(Scheduler, AdmitsFirstComeFirstServedWithinMaxRunning) {
  BlockPool pool(256);
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 512, .max_running = 2});
  for (int64_t i = 0; i < 4; ++i)
    scheduler.add({i}, prompt_of(10, 10 * static_cast<int32_t>(i)), 3);
  StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.admitted.size(), 2u);
  EXPECT_EQ(plan.admitted[0], SequenceId{0});
  EXPECT_EQ(plan.admitted[1], SequenceId{1});
  std::vector<SequenceId> finished;
  while (!scheduler.idle()) {
    scheduler.complete(plan, constant_samples(plan));
    plan = scheduler.schedule();
    EXPECT_LE(scheduler.n_running(), 2);
    finished.insert(finished.end(), plan.finished.begin(), plan.finished.end());
  }
  EXPECT_EQ(finished, (std::vector<SequenceId>{{0}, {1}, {2}, {3}}));
  EXPECT_EQ(pool.n_available(), pool.n_blocks());
}

TEST(Scheduler, PreemptsTheNewestAndRecomputesItsTokensLater) {
  BlockPool pool(4);  // 64 tokens in all
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 64, .max_running = 4});
  scheduler.add({1}, prompt_of(16, 100), 40);
  scheduler.add({2}, prompt_of(16, 200), 40);
  StepPlan plan = scheduler.schedule();
  ASSERT_EQ(plan.admitted.size(), 2u);
  bool preempted = false, readmitted = false;
  int64_t generated_at_preemption = 0;
  for (int step = 0; step < 200 && !scheduler.idle(); ++step) {
    scheduler.complete(plan, constant_samples(plan));
    plan = scheduler.schedule();
    EXPECT_LE(plan.n_tokens, 64);
    EXPECT_TRUE(pool.check_invariants());
    if (!plan.preempted.empty() && !preempted) {
      preempted = true;
      EXPECT_EQ(plan.preempted[0], SequenceId{2}) << "the newest goes first";
      EXPECT_EQ(chunk_tokens(plan, {2}), 0);
      generated_at_preemption = static_cast<int64_t>(scheduler.generated({2}).size());
    }
    if (preempted && !readmitted &&
        std::find(plan.admitted.begin(), plan.admitted.end(), SequenceId{2}) !=
            plan.admitted.end()) {
      readmitted = true;
      // It recomputes its prompt and everything it had generated (less what the
      // prefix cache still holds), then samples the next token.
      for (const ScheduledChunk& c : plan.chunks) {
        if (c.id != SequenceId{2}) continue;
        EXPECT_EQ(c.pos0 + static_cast<int64_t>(c.tokens.size()), 16 + generated_at_preemption);
        EXPECT_TRUE(c.samples);
      }
    }
  }
  EXPECT_TRUE(readmitted);
  EXPECT_TRUE(preempted);
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(pool.n_available(), pool.n_blocks());
}

TEST(Scheduler, EachSequenceHasOneStateThatOnlyItsLifeChanges) {
  BlockPool pool(4);  // 64 tokens in all
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 64, .max_running = 4});
  scheduler.add({1}, prompt_of(16, 100), 40);
  scheduler.add({2}, prompt_of(16, 200), 40);
  EXPECT_EQ(scheduler.state({1}), SequenceState::kQueued);
  EXPECT_EQ(scheduler.state({9}), SequenceState::kFinished) << "never known";
  StepPlan plan = scheduler.schedule();
  EXPECT_EQ(scheduler.state({1}), SequenceState::kRunning);
  EXPECT_EQ(scheduler.state({2}), SequenceState::kRunning);
  bool saw_preempted = false;
  for (int step = 0; step < 200 && !scheduler.idle(); ++step) {
    scheduler.complete(plan, constant_samples(plan));
    plan = scheduler.schedule();
    for (SequenceId id : plan.preempted) {
      // Still preempted if this very plan did not readmit it.
      if (std::find(plan.admitted.begin(), plan.admitted.end(), id) == plan.admitted.end()) {
        EXPECT_EQ(scheduler.state(id), SequenceState::kPreempted);
        saw_preempted = true;
      }
    }
    for (SequenceId id : plan.admitted) EXPECT_EQ(scheduler.state(id), SequenceState::kRunning);
  }
  EXPECT_TRUE(saw_preempted);
  EXPECT_EQ(scheduler.state({1}), SequenceState::kFinished);
  EXPECT_EQ(scheduler.state({2}), SequenceState::kFinished);

  // An import: awaiting its KV until it runs, or until it is dropped.
  scheduler.add_awaiting({3});
  EXPECT_EQ(scheduler.state({3}), SequenceState::kAwaitingKv);
  EXPECT_TRUE(scheduler.idle()) << "an import awaiting its KV is neither waiting nor running";
  ASSERT_EQ(kv.begin_sequence({3}, prompt_of(16, 300), one_token_from(16)), 0);
  kv.commit_tokens({3}, prompt_of(16, 300));
  scheduler.add_running({3}, prompt_of(16, 300), 7, 4);
  EXPECT_EQ(scheduler.state({3}), SequenceState::kRunning);
  scheduler.finish({3});
  EXPECT_EQ(scheduler.state({3}), SequenceState::kFinished);
  scheduler.add_awaiting({4});
  scheduler.drop_awaiting({4});
  EXPECT_EQ(scheduler.state({4}), SequenceState::kFinished);
  EXPECT_EQ(pool.n_available(), pool.n_blocks());
}

TEST(Scheduler, ReusesCachedPrefixBlocks) {
  BlockPool pool(64);
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 512, .max_running = 4});
  std::vector<int32_t> shared = prompt_of(40, 1000);
  scheduler.add({1}, shared, 1);
  StepPlan plan = scheduler.schedule();
  scheduler.complete(plan, constant_samples(plan));  // finishes after one token
  std::vector<int32_t> longer = shared;
  longer.push_back(5);
  scheduler.add({2}, longer, 1);
  plan = scheduler.schedule();
  ASSERT_EQ(plan.chunks.size(), 1u);
  EXPECT_EQ(plan.chunks[0].pos0, 2 * kBlock) << "two full blocks came from the cache";
  EXPECT_EQ(kv.n_prefix_hit_tokens(), 2 * kBlock);
  scheduler.complete(plan, constant_samples(plan));
}

// Every chunk names where its sequence's one-token rows start (the prompt
// length, or its last token when llama-server's micro-batches of 512 leave
// that alone), whatever the step budget cuts, and after a preemption too.
TEST(Scheduler, ChunksCarryTheirTokensRoles) {
  EXPECT_EQ(one_token_from(1), 0);
  EXPECT_EQ(one_token_from(2), 2);
  EXPECT_EQ(one_token_from(512), 512);
  EXPECT_EQ(one_token_from(513), 512);
  EXPECT_EQ(one_token_from(1025), 1024);
  EXPECT_EQ(n_one_token(0, 16, 20), 0);
  EXPECT_EQ(n_one_token(16, 16, 20), 12);
  EXPECT_EQ(n_one_token(32, 16, 20), 16);

  BlockPool pool(64);
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 100, .max_running = 4});
  scheduler.add({1}, prompt_of(513, 10), 3);
  scheduler.add({2}, prompt_of(40, 2000), 3);
  for (int step = 0; step < 20 && !scheduler.idle(); ++step) {
    const StepPlan plan = scheduler.schedule();
    for (const ScheduledChunk& c : plan.chunks) {
      EXPECT_EQ(c.one_token_from, c.id == SequenceId{1} ? 512 : 40);
    }
    scheduler.complete(plan, constant_samples(plan));
  }
  EXPECT_TRUE(scheduler.idle());
}

// --no-kv-cache: after every token the sequence gives its blocks back and
// recomputes its whole context, with no prefix reused and no preemption reported.
TEST(Scheduler, RecomputeModeComputesTheWholeContextEveryStep) {
  BlockPool pool(16);
  KvCacheManager kv(pool, kBlock, /*prefix_caching=*/false);
  Scheduler scheduler(kv, {.max_step_tokens = 512, .max_running = 1, .recompute = true});
  scheduler.add({1}, prompt_of(20, 10), 4);
  for (int64_t step = 0; step < 4; ++step) {
    const StepPlan plan = scheduler.schedule();
    ASSERT_EQ(plan.chunks.size(), 1u);
    EXPECT_EQ(plan.chunks[0].pos0, 0);
    EXPECT_EQ(static_cast<int64_t>(plan.chunks[0].tokens.size()), 20 + step);
    EXPECT_TRUE(plan.chunks[0].samples);
    EXPECT_TRUE(plan.preempted.empty());
    scheduler.complete(plan, constant_samples(plan));
  }
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(kv.n_prefix_hit_tokens(), 0);
  EXPECT_EQ(pool.n_available(), pool.n_blocks());
}

TEST(Scheduler, NoBlockLeaksAfterRandomFinishCancelAndPreemption) {
  std::mt19937 rng(123);
  BlockPool pool(24);
  KvCacheManager kv(pool, kBlock);
  Scheduler scheduler(kv, {.max_step_tokens = 96, .max_running = 6});
  int64_t next_id = 0;
  std::vector<SequenceId> live;
  for (int step = 0; step < 2000; ++step) {
    if (rng() % 3 == 0 && live.size() < 12) {
      const int64_t n = 1 + rng() % 120;
      const int32_t first = static_cast<int32_t>(rng() % 4) * 1000;  // shared prefixes happen
      scheduler.add({next_id}, prompt_of(n, first), 1 + rng() % 100);
      live.push_back({next_id++});
    }
    if (rng() % 17 == 0 && !live.empty()) {
      const size_t pick = rng() % live.size();
      scheduler.finish(live[pick]);  // cancel
    }
    const StepPlan plan = scheduler.schedule();
    for (SequenceId id : plan.finished) std::erase(live, id);
    ASSERT_LE(plan.n_tokens, 96);
    ASSERT_LE(scheduler.n_running(), 6);
    ASSERT_TRUE(pool.check_invariants());
    scheduler.complete(plan, constant_samples(plan));
  }
  for (SequenceId id : live) scheduler.finish(id);
  EXPECT_TRUE(scheduler.idle());
  EXPECT_EQ(pool.n_available(), pool.n_blocks());
}

}  // namespace
}  // namespace duet

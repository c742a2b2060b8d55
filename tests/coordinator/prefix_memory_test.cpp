// The router's memory of prompts sent to a prefill instance guesses exactly
// the prefix-cache hit the engine finds: the same block keys
// (common/hash.h) at the engine's block size, the same cap (the last prompt
// token is always computed). Checked against the engine's own
// KvCacheManager over a BlockPool, prompt by prompt. No model, no threads.
#include "coordinator/prefix_memory.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "common/error.h"
#include "common/model/kv_layout.h"
#include "worker/kv/block_pool.h"
#include "worker/kv/kv_cache_manager.h"

namespace duet {
namespace {

constexpr int64_t kBlock = KvLayout::kDefaultBlockSize;  // the engine's

std::vector<int32_t> iota_tokens(int64_t n, int32_t start) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

// An engine's prefix cache, as the prefill instance keeps it.
class EngineCache {
 public:
  // Computes `prompt` (its KV is committed, its full blocks cached), then
  // frees the sequence; the blocks stay cached.
  void compute(const std::vector<int32_t>& prompt) {
    const SequenceId id{next_id_++};
    const std::optional<int64_t> cached = kv_.begin_sequence(id, prompt, kPromptOnly);
    ASSERT_TRUE(cached.has_value());
    kv_.commit_tokens(id, std::span<const int32_t>(prompt).subspan(static_cast<size_t>(*cached)));
    kv_.free_sequence(id);
  }
  // The prompt tokens whose KV the engine would find cached; changes nothing cached.
  int64_t hit_tokens(const std::vector<int32_t>& prompt) {
    const SequenceId id{next_id_++};
    const std::optional<int64_t> cached = kv_.begin_sequence(id, prompt, kPromptOnly);
    EXPECT_TRUE(cached.has_value());
    kv_.free_sequence(id);
    return cached.value_or(-1);
  }

 private:
  static constexpr int64_t kPromptOnly = INT64_MAX;  // every position in the prompt order
  BlockPool pool_{256};
  KvCacheManager kv_{pool_, kBlock};
  int64_t next_id_ = 0;
};

TEST(PrefixMemory, GuessesTheHitTheEngineFinds) {
  EngineCache engine;
  PrefixMemory memory(kBlock);
  const std::vector<int32_t> sent = iota_tokens(40, 3);  // two whole blocks and a half
  engine.compute(sent);
  memory.remember(sent);
  EXPECT_EQ(memory.size(), 2u);

  auto with = [&](std::vector<int32_t> tokens, size_t at, int32_t token) {
    tokens[at] = token;
    return tokens;
  };
  auto first = [&](int64_t n) { return std::vector<int32_t>(sent.begin(), sent.begin() + n); };
  std::vector<int32_t> longer = sent;
  for (int32_t t : iota_tokens(30, 100)) longer.push_back(t);
  const std::vector<std::vector<int32_t>> probes = {
      sent,                 // the last token is computed: two blocks hit
      first(32),            // exactly two blocks: the second holds the last token
      first(33),            // two blocks and one token
      first(16),            // one block, its own last token: none
      first(1),             // nothing to share
      longer,               // only the sent prompt's whole blocks
      with(sent, 20, 200),  // differs in block 1: block 0 hits
      with(sent, 0, 200),   // differs in block 0: the chain breaks at once
      iota_tokens(40, 50),  // unrelated
  };
  for (const std::vector<int32_t>& probe : probes) {
    EXPECT_EQ(memory.cached_tokens(probe), engine.hit_tokens(probe))
        << "a prompt of " << probe.size() << " tokens";
  }
  EXPECT_EQ(memory.cached_tokens(sent), 32);
  EXPECT_EQ(memory.cached_tokens(first(32)), 16);
  EXPECT_EQ(memory.cached_tokens({}), 0);
}

TEST(PrefixMemory, ForgetsTheOldestBlocksPastItsCapacity) {
  PrefixMemory memory(kBlock, /*capacity=*/2);
  const std::vector<int32_t> a = iota_tokens(33, 1), b = iota_tokens(33, 200);
  memory.remember(a);
  EXPECT_EQ(memory.cached_tokens(a), 32);
  memory.remember(a);  // known blocks take no room
  EXPECT_EQ(memory.size(), 2u);
  memory.remember(b);
  EXPECT_EQ(memory.size(), 2u);
  EXPECT_EQ(memory.cached_tokens(a), 0);
  EXPECT_EQ(memory.cached_tokens(b), 32);
  EXPECT_THROW(PrefixMemory(0), Error);
}

}  // namespace
}  // namespace duet

// KvCacheManager bookkeeping over a BlockPool: per-sequence block tables,
// all-or-nothing reservation, and prefix caching by chained block hashes.
// No KV memory, no model: the stress test keeps a shadow of what each
// physical block's slots would hold to check that shared blocks are right.
#include "worker/kv/kv_cache_manager.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

// Prompts alone: every position in the multi-token order.
constexpr int64_t kPromptOnly = INT64_MAX;

constexpr int64_t kBs = KvLayout::kDefaultBlockSize;

// Tokens start, start + 1, ... (n of them).
std::vector<int32_t> iota_tokens(int64_t n, int32_t start) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), start);
  return tokens;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<int32_t> head(const std::vector<int32_t>& tokens, int64_t n) {
  return {tokens.begin(), tokens.begin() + n};
}

std::vector<int32_t> table_of(const KvCacheManager& kv, SequenceId id) {
  const std::span<const int32_t> table = kv.block_table(id);
  return {table.begin(), table.end()};
}

// Runs a whole prompt through: begin, then commit the tokens not cached.
int64_t prefill(KvCacheManager& kv, SequenceId id, const std::vector<int32_t>& prompt) {
  const std::optional<int64_t> n_cached = kv.begin_sequence(id, prompt, kPromptOnly);
  EXPECT_TRUE(n_cached.has_value());
  const int64_t n = n_cached.value_or(0);
  kv.commit_tokens(id, std::span<const int32_t>(prompt).subspan(static_cast<size_t>(n)));
  return n;
}

TEST(KvCacheManagerTest, NewSequenceGetsBlocksForItsPrompt) {
  BlockPool pool(8);
  KvCacheManager kv(pool);
  EXPECT_EQ(kv.block_size(), 16);
  const SequenceId a{1};
  EXPECT_EQ(kv.begin_sequence(a, iota_tokens(20, 0), kPromptOnly), 0);
  EXPECT_TRUE(kv.has_sequence(a));
  EXPECT_EQ(kv.n_blocks(a), 2);
  EXPECT_EQ(kv.n_tokens(a), 0);
  EXPECT_EQ(kv.n_reserved_tokens(a), 32);
  EXPECT_EQ(table_of(kv, a), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(kv.n_free_blocks(), 6);
  EXPECT_EQ(kv.n_free_tokens(), 6 * 16);
  kv.free_sequence(a);
  EXPECT_FALSE(kv.has_sequence(a));
  EXPECT_EQ(kv.n_free_blocks(), 8);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, ReserveGrowsTheTableAllOrNothing) {
  BlockPool pool(4);
  KvCacheManager kv(pool);
  const SequenceId a{1};
  ASSERT_EQ(kv.begin_sequence(a, iota_tokens(16, 0), kPromptOnly), 0);
  EXPECT_EQ(kv.n_blocks(a), 1);
  EXPECT_TRUE(kv.reserve(a, 16));  // already held
  EXPECT_EQ(kv.n_blocks(a), 1);
  EXPECT_FALSE(kv.reserve(a, 65));  // 5 blocks: one more than the pool has
  EXPECT_EQ(kv.n_blocks(a), 1);
  EXPECT_EQ(kv.n_free_blocks(), 3);
  EXPECT_TRUE(pool.check_invariants());
  EXPECT_TRUE(kv.reserve(a, 64));
  EXPECT_EQ(kv.n_blocks(a), 4);
  EXPECT_EQ(table_of(kv, a), (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_TRUE(kv.reserve(a, 10));  // never shrinks
  EXPECT_EQ(kv.n_blocks(a), 4);
  EXPECT_FALSE(kv.reserve(a, 65));
  EXPECT_EQ(kv.n_blocks(a), 4);
  kv.free_sequence(a);
  EXPECT_EQ(kv.n_free_blocks(), 4);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, RefusedReserveEvictsNothing) {
  BlockPool pool(4);
  KvCacheManager kv(pool);
  const auto prompt = iota_tokens(33, 0);  // 2 full blocks + 1 token
  prefill(kv, SequenceId{1}, prompt);
  kv.free_sequence(SequenceId{1});
  EXPECT_EQ(pool.n_cached(), 2);
  const SequenceId b{2};
  ASSERT_EQ(kv.begin_sequence(b, iota_tokens(5, 1000), kPromptOnly), 0);
  EXPECT_FALSE(kv.reserve(b, 5 * 16));  // needs 4 more, 3 available
  EXPECT_EQ(pool.n_cached(), 2);
  EXPECT_EQ(pool.n_evictions(), 0);
  EXPECT_TRUE(kv.reserve(b, 4 * 16));  // takes the free block, then evicts both
  EXPECT_EQ(pool.n_cached(), 0);
  EXPECT_EQ(pool.n_evictions(), 2);
  kv.free_sequence(b);
  EXPECT_EQ(kv.begin_sequence(SequenceId{3}, prompt, kPromptOnly), 0);  // the prefix is gone
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, PrefixHitIsTheLongestRunOfFullBlocks) {
  BlockPool pool(16);
  KvCacheManager kv(pool);
  const auto base = iota_tokens(40, 0);  // blocks [0,16) [16,32) full, 8 more
  EXPECT_EQ(prefill(kv, SequenceId{1}, base), 0);
  const std::vector<int32_t> base_table = table_of(kv, SequenceId{1});
  ASSERT_EQ(base_table.size(), 3u);
  EXPECT_TRUE(pool.block_hash(BlockId{base_table[0]}).has_value());
  EXPECT_TRUE(pool.block_hash(BlockId{base_table[1]}).has_value());
  EXPECT_FALSE(pool.block_hash(BlockId{base_table[2]}).has_value());  // 8 of 16
  kv.free_sequence(SequenceId{1});

  // Two blocks: the same 32 tokens, then others.
  const SequenceId two{2};
  EXPECT_EQ(kv.begin_sequence(two, concat(head(base, 32), iota_tokens(9, 500)), kPromptOnly), 32);
  EXPECT_EQ(kv.n_tokens(two), 32);
  const std::vector<int32_t> two_table = table_of(kv, two);
  ASSERT_EQ(two_table.size(), 3u);
  EXPECT_EQ(two_table[0], base_table[0]);
  EXPECT_EQ(two_table[1], base_table[1]);

  // One block: the first 16 tokens agree, the second block differs by one token.
  auto one_prompt = base;
  one_prompt[20] = 999;
  const SequenceId one{3};
  EXPECT_EQ(kv.begin_sequence(one, one_prompt, kPromptOnly), 16);
  EXPECT_EQ(kv.block_table(one)[0], base_table[0]);
  EXPECT_EQ(pool.ref_count(BlockId{base_table[0]}), 2);  // shared by two and one
  EXPECT_EQ(pool.ref_count(BlockId{base_table[1]}), 1);

  // None: the very first token differs.
  auto none_prompt = base;
  none_prompt[0] = 999;
  EXPECT_EQ(kv.begin_sequence(SequenceId{4}, none_prompt, kPromptOnly), 0);

  // Shorter than one block: nothing to share.
  EXPECT_EQ(kv.begin_sequence(SequenceId{5}, head(base, 10), kPromptOnly), 0);

  EXPECT_EQ(kv.n_prompt_tokens(), 40 + 41 + 40 + 40 + 10);
  EXPECT_EQ(kv.n_prefix_hit_tokens(), 32 + 16);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, PromptOfWholeBlocksStillComputesItsLastToken) {
  BlockPool pool(16);
  KvCacheManager kv(pool);
  const auto base = iota_tokens(48, 0);  // exactly 3 full blocks
  prefill(kv, SequenceId{1}, base);
  kv.free_sequence(SequenceId{1});
  EXPECT_EQ(pool.n_cached(), 3);

  // The same 48 tokens: 2 blocks shared, the third recomputed (its last token
  // is needed for logits), in a block of its own.
  const SequenceId a{2};
  EXPECT_EQ(kv.begin_sequence(a, base, kPromptOnly), 32);
  EXPECT_EQ(kv.n_blocks(a), 3);
  EXPECT_EQ(kv.n_tokens(a), 32);
  // The first 16 tokens alone: nothing shared.
  EXPECT_EQ(kv.begin_sequence(SequenceId{3}, head(base, 16), kPromptOnly), 0);
  // One token past the three blocks: all three shared.
  EXPECT_EQ(kv.begin_sequence(SequenceId{4}, concat(base, {7}), kPromptOnly), 48);
  // A one-token prompt never hits.
  EXPECT_EQ(kv.begin_sequence(SequenceId{5}, head(base, 1), kPromptOnly), 0);

  // Committing the recomputed block registers nothing new (its twin is
  // already cached) and frees it plainly.
  kv.commit_tokens(a, std::span<const int32_t>(base).subspan(32));
  const BlockId recomputed{kv.block_table(a)[2]};
  EXPECT_FALSE(pool.block_hash(recomputed).has_value());
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, HashesChainOverTheWholePrefix) {
  BlockPool pool(16);
  KvCacheManager kv(pool);
  const auto x = iota_tokens(16, 0);
  const auto y = iota_tokens(16, 100);
  const auto z = iota_tokens(16, 200);
  prefill(kv, SequenceId{1}, concat(concat(x, y), {1}));
  kv.free_sequence(SequenceId{1});

  // Block y after z is not block y after x.
  EXPECT_EQ(kv.begin_sequence(SequenceId{2}, concat(concat(z, y), {1}), kPromptOnly), 0);
  // Nor is y as the first block.
  EXPECT_EQ(kv.begin_sequence(SequenceId{3}, concat(y, {1}), kPromptOnly), 0);
  // x then y again hits both.
  EXPECT_EQ(kv.begin_sequence(SequenceId{4}, concat(concat(x, y), {1}), kPromptOnly), 32);

  const uint64_t hx = hash_block_tokens(kRootBlockHash, x);
  EXPECT_NE(hash_block_tokens(hx, y), hash_block_tokens(hash_block_tokens(kRootBlockHash, z), y));
  EXPECT_NE(hash_block_tokens(kRootBlockHash, y), hash_block_tokens(hx, y));
  // The same content in another order is another block.
  std::vector<int32_t> x_swapped = x;
  std::swap(x_swapped[0], x_swapped[1]);
  EXPECT_NE(hash_block_tokens(kRootBlockHash, x_swapped), hx);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, SharedPrefixBlocksAreRefCounted) {
  BlockPool pool(8);
  KvCacheManager kv(pool);
  const auto system = iota_tokens(32, 0);
  const SequenceId a{1};
  const SequenceId b{2};
  prefill(kv, a, concat(system, iota_tokens(4, 100)));
  // a is still live: b shares its full blocks while a runs.
  EXPECT_EQ(prefill(kv, b, concat(system, iota_tokens(4, 200))), 32);
  const std::vector<int32_t> ta = table_of(kv, a);
  const std::vector<int32_t> tb = table_of(kv, b);
  EXPECT_EQ(ta[0], tb[0]);
  EXPECT_EQ(ta[1], tb[1]);
  EXPECT_NE(ta[2], tb[2]);
  EXPECT_EQ(pool.ref_count(BlockId{ta[0]}), 2);
  EXPECT_EQ(pool.n_in_use(), 4);
  EXPECT_EQ(kv.n_free_blocks(), 4);

  kv.free_sequence(a);
  EXPECT_EQ(pool.ref_count(BlockId{ta[0]}), 1);  // b still holds the prefix
  EXPECT_EQ(pool.n_in_use(), 3);
  kv.free_sequence(b);
  EXPECT_EQ(pool.n_in_use(), 0);
  EXPECT_EQ(pool.n_cached(), 2);
  EXPECT_EQ(kv.n_free_blocks(), 8);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, DecodeRegistersBlocksAsTheyFill) {
  BlockPool pool(8);
  KvCacheManager kv(pool);
  const SequenceId a{1};
  const auto prompt = iota_tokens(10, 0);
  prefill(kv, a, prompt);
  std::vector<int32_t> all = prompt;
  for (int32_t t = 0; t < 30; ++t) {
    ASSERT_TRUE(kv.reserve(a, kv.n_tokens(a) + 1));
    const std::vector<int32_t> token{50 + t};
    kv.commit_tokens(a, token);
    all.push_back(token[0]);
    const int64_t n = kv.n_tokens(a);
    EXPECT_EQ(kv.n_blocks(a), (n + kBs - 1) / kBs);
    // Exactly the full blocks carry a hash.
    for (int64_t i = 0; i < kv.n_blocks(a); ++i) {
      EXPECT_EQ(pool.block_hash(BlockId{kv.block_table(a)[i]}).has_value(), (i + 1) * kBs <= n);
    }
  }
  // A new request that continues the conversation shares both full blocks.
  EXPECT_EQ(kv.begin_sequence(SequenceId{2}, concat(all, {1, 2, 3}), kPromptOnly), 32);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, RefusedBeginChangesNothing) {
  BlockPool pool(3);
  KvCacheManager kv(pool);
  const auto base = iota_tokens(33, 0);
  prefill(kv, SequenceId{1}, base);
  kv.free_sequence(SequenceId{1});
  ASSERT_EQ(pool.n_cached(), 2);
  ASSERT_EQ(pool.n_free(), 1);

  // Hits 2 cached blocks, but needs 3 more for the rest of its 72 tokens:
  // with the two hits taken off the available 3, only 1 is left.
  const SequenceId b{2};
  EXPECT_FALSE(
      kv.begin_sequence(b, concat(head(base, 32), iota_tokens(40, 500)), kPromptOnly).has_value());
  EXPECT_FALSE(kv.has_sequence(b));
  EXPECT_EQ(pool.n_cached(), 2);
  EXPECT_EQ(pool.n_free(), 1);
  EXPECT_EQ(pool.n_hits(), 0);
  EXPECT_EQ(kv.n_prompt_tokens(), 33);
  EXPECT_EQ(kv.n_prefix_hit_tokens(), 0);
  EXPECT_TRUE(pool.check_invariants());

  // Too long for the pool even with nothing cached.
  EXPECT_FALSE(kv.begin_sequence(b, iota_tokens(49, 900), kPromptOnly).has_value());
  EXPECT_EQ(pool.n_cached(), 2);

  // The same prefix and 1 more token fits: 2 shared, 1 new.
  EXPECT_EQ(kv.begin_sequence(b, head(base, 33), kPromptOnly), 32);
  EXPECT_EQ(kv.n_free_blocks(), 0);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(KvCacheManagerTest, OtherBlockSizes) {
  BlockPool pool(8);
  KvCacheManager kv(pool, 4);
  EXPECT_EQ(kv.block_size(), 4);
  const auto prompt = iota_tokens(10, 0);
  prefill(kv, SequenceId{1}, prompt);
  EXPECT_EQ(kv.n_blocks(SequenceId{1}), 3);
  EXPECT_EQ(kv.begin_sequence(SequenceId{2}, prompt, kPromptOnly), 8);
  EXPECT_EQ(kv.begin_sequence(SequenceId{3}, head(prompt, 8), kPromptOnly), 4);
  EXPECT_THROW(KvCacheManager(pool, 0), Error);
}

TEST(KvCacheManagerTest, CallerBugsAssert) {
  BlockPool pool(4);
  KvCacheManager kv(pool);
  const SequenceId a{1};
  EXPECT_THROW(kv.begin_sequence(a, std::vector<int32_t>{}, kPromptOnly), Error);
  ASSERT_EQ(kv.begin_sequence(a, iota_tokens(3, 0), kPromptOnly), 0);
  EXPECT_THROW(kv.begin_sequence(a, iota_tokens(3, 0), kPromptOnly), Error);  // already live
  EXPECT_THROW(kv.commit_tokens(a, iota_tokens(17, 0)), Error);  // past the reservation
  EXPECT_EQ(kv.n_tokens(a), 0);
  EXPECT_THROW(kv.reserve(SequenceId{9}, 1), Error);
  EXPECT_THROW(kv.block_table(SequenceId{9}), Error);
  EXPECT_THROW(kv.commit_tokens(SequenceId{9}, iota_tokens(1, 0)), Error);
  EXPECT_THROW(kv.free_sequence(SequenceId{9}), Error);
  kv.free_sequence(a);
  EXPECT_THROW(kv.free_sequence(a), Error);
  EXPECT_TRUE(pool.check_invariants());
}

// Many sequences with shared prefixes under memory pressure: begin (some
// continuing an earlier conversation), chunked prefill, decode, preemption
// and free, at random with a fixed seed. A shadow of the KV cache records, per
// physical slot, a fingerprint of the whole context whose KV would be there;
// every prefix hit must find exactly its own context's fingerprints, and KV
// is only ever written into a block that one sequence holds alone.
TEST(KvCacheManagerTest, RandomWorkloadStress) {
  constexpr int64_t kBlocks = 48;
  constexpr int32_t kVocab = 3;  // tiny, so equal blocks after unequal prefixes occur
  BlockPool pool(kBlocks);
  KvCacheManager kv(pool);
  std::mt19937_64 rng(20240611);
  auto uniform = [&](int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };

  std::vector<std::vector<uint64_t>> shadow(kBlocks, std::vector<uint64_t>(kBs, 0));
  auto fingerprint = [](uint64_t prev, int32_t token) {
    uint64_t z = (prev ^ static_cast<uint64_t>(token)) * 0x100000001B3ULL + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 29)) * 0xBF58476D1CE4E5B9ULL;
    return z ^ (z >> 32);
  };

  struct Live {
    std::vector<int32_t> prompt;
    std::vector<int32_t> tokens;  // committed so far
    std::vector<uint64_t> fps;    // fingerprint of tokens[0..p] per position p
  };
  std::map<int64_t, Live> live;
  std::vector<std::vector<int32_t>> history;  // finished conversations
  const std::vector<std::vector<int32_t>> systems = {
      {},
      iota_tokens(16, 0),
      iota_tokens(37, 0),
      concat(iota_tokens(16, 100), iota_tokens(16, 0)),
      iota_tokens(50, 7)};
  const std::vector<std::vector<int32_t>> commons = {iota_tokens(16, 0),
                                                     std::vector<int32_t>(kBs, 1)};
  int64_t next_id = 0;
  int64_t n_refused = 0;
  int64_t n_preempted = 0;

  auto write = [&](SequenceId id, Live& seq, std::span<const int32_t> tokens) {
    for (const int32_t token : tokens) {
      const auto p = static_cast<int64_t>(seq.tokens.size());
      const BlockId block{kv.block_table(id)[static_cast<size_t>(p / kBs)]};
      ASSERT_EQ(pool.ref_count(block), 1) << "KV written into a shared block";
      seq.fps.push_back(fingerprint(p == 0 ? 0 : seq.fps.back(), token));
      shadow[block.value][p % kBs] = seq.fps.back();
      seq.tokens.push_back(token);
    }
    kv.commit_tokens(id, tokens);
  };
  auto free_live = [&](std::map<int64_t, Live>::iterator it) {
    kv.free_sequence(SequenceId{it->first});
    history.push_back(it->second.tokens);
    if (history.size() > 16) history.erase(history.begin());
    live.erase(it);
  };
  auto random_live = [&] {
    auto it = live.begin();
    std::advance(it, uniform(0, static_cast<int64_t>(live.size()) - 1));
    return it;
  };

  for (int step = 0; step < 4000; ++step) {
    const int64_t op = uniform(0, 9);
    if (op < 3 || live.empty()) {
      // A new request: a system prompt or an earlier conversation, then more.
      std::vector<int32_t> prompt;
      if (!history.empty() && uniform(0, 2) == 0) {
        prompt = history[static_cast<size_t>(uniform(0, static_cast<int64_t>(history.size()) - 1))];
      } else {
        prompt = systems[static_cast<size_t>(uniform(0, 4))];
      }
      // Then random tokens and common blocks, aligned or not: the same block
      // content turns up after many different prefixes.
      for (int64_t piece = uniform(prompt.empty() ? 1 : 0, 4); piece > 0; --piece) {
        const int64_t kind = uniform(0, 2);
        if (kind == 0) {
          for (int64_t i = uniform(1, 12); i > 0; --i) {
            prompt.push_back(static_cast<int32_t>(uniform(0, kVocab - 1)));
          }
          continue;
        }
        if (kind == 1) {
          while (static_cast<int64_t>(prompt.size()) % kBs != 0) prompt.push_back(0);
        }
        const auto& common = commons[static_cast<size_t>(uniform(0, 1))];
        prompt.insert(prompt.end(), common.begin(), common.end());
      }
      const SequenceId id{next_id++};
      const int64_t free_before = kv.n_free_blocks();
      const int64_t cached_before = pool.n_cached();
      const std::optional<int64_t> n_cached = kv.begin_sequence(id, prompt, kPromptOnly);
      if (!n_cached) {
        ++n_refused;
        ASSERT_FALSE(kv.has_sequence(id));
        ASSERT_EQ(kv.n_free_blocks(), free_before);
        ASSERT_EQ(pool.n_cached(), cached_before);
        if (!live.empty()) {
          free_live(random_live());  // make room, as a scheduler would
          ++n_preempted;
        }
      } else {
        const int64_t n = *n_cached;
        ASSERT_EQ(n % kBs, 0);
        ASSERT_LT(n, static_cast<int64_t>(prompt.size()));
        ASSERT_EQ(kv.n_tokens(id), n);
        ASSERT_GE(kv.n_reserved_tokens(id), static_cast<int64_t>(prompt.size()));
        Live seq;
        seq.prompt = prompt;
        for (int64_t p = 0; p < n; ++p) {
          seq.fps.push_back(fingerprint(p == 0 ? 0 : seq.fps.back(), prompt[p]));
          const BlockId block{kv.block_table(id)[static_cast<size_t>(p / kBs)]};
          ASSERT_EQ(shadow[block.value][p % kBs], seq.fps.back())
              << "step " << step << ": a prefix hit shares the KV of another context";
        }
        seq.tokens.assign(prompt.begin(), prompt.begin() + n);
        live.emplace(id.value, std::move(seq));
      }
    } else if (op < 8) {
      // One step of a live sequence: a chunk of its prompt, or one decode token.
      const auto it = random_live();
      const SequenceId id{it->first};
      Live& seq = it->second;
      const auto n_done = static_cast<int64_t>(seq.tokens.size());
      const auto n_prompt = static_cast<int64_t>(seq.prompt.size());
      if (n_done < n_prompt) {
        const int64_t chunk = std::min(n_prompt - n_done, uniform(1, 24));
        ASSERT_TRUE(kv.reserve(id, n_done + chunk));  // held since begin_sequence
        write(id, seq, std::span<const int32_t>(seq.prompt).subspan(n_done, chunk));
      } else if (kv.reserve(id, n_done + 1)) {
        const std::vector<int32_t> token{static_cast<int32_t>(uniform(0, kVocab - 1))};
        write(id, seq, token);
      } else {
        ++n_preempted;
        free_live(random_live());
      }
    } else {
      free_live(random_live());
    }

    // Invariants after every step.
    ASSERT_TRUE(pool.check_invariants()) << "step " << step;
    std::map<int32_t, int32_t> refs;
    for (const auto& [raw_id, seq] : live) {
      const SequenceId id{raw_id};
      const std::span<const int32_t> table = kv.block_table(id);
      ASSERT_EQ(static_cast<int64_t>(table.size()), kv.n_blocks(id));
      ASSERT_EQ(kv.n_tokens(id), static_cast<int64_t>(seq.tokens.size()));
      ASSERT_LE(kv.n_tokens(id), kv.n_reserved_tokens(id));
      ASSERT_EQ(std::set<int32_t>(table.begin(), table.end()).size(), table.size());
      for (const int32_t b : table) ++refs[b];
    }
    for (const auto& [b, n_refs] : refs) ASSERT_EQ(pool.ref_count(BlockId{b}), n_refs);
    ASSERT_EQ(pool.n_in_use(), static_cast<int64_t>(refs.size()));
    ASSERT_EQ(kv.n_free_blocks(), kBlocks - static_cast<int64_t>(refs.size()));
    ASSERT_EQ(kv.n_sequences(), static_cast<int64_t>(live.size()));
  }

  while (!live.empty()) free_live(live.begin());
  EXPECT_TRUE(pool.check_invariants());
  EXPECT_EQ(pool.n_in_use(), 0);
  EXPECT_EQ(kv.n_free_blocks(), kBlocks);
  // The workload did exercise what it is meant to.
  EXPECT_GT(kv.n_prefix_hit_tokens(), 0);
  EXPECT_GT(pool.n_evictions(), 0);
  EXPECT_GT(n_refused, 0);
  EXPECT_GT(n_preempted, 0);
  fmt::print("hit {} of {} prompt tokens, {} evictions, {} refused, {} preempted\n",
             kv.n_prefix_hit_tokens(), kv.n_prompt_tokens(), pool.n_evictions(), n_refused,
             n_preempted);
}

// A block's KV depends on how its tokens were computed: generated tokens
// (one-token order) never stand in for the same tokens in a longer prompt
// (multi-token order), but a sequence recomputed after preemption, with the
// same roles, finds all of its own blocks.
TEST(KvCacheManagerTest, BlocksHoldingGeneratedTokensMatchOnlyTheSameRoles) {
  BlockPool pool(16);
  KvCacheManager kv(pool);
  const std::vector<int32_t> prompt = iota_tokens(20, 100);
  const std::vector<int32_t> all = concat(prompt, iota_tokens(13, 500));  // 20 + 13 generated
  const SequenceId a{1};
  ASSERT_EQ(kv.begin_sequence(a, prompt, 20), 0);
  ASSERT_TRUE(kv.reserve(a, 33));
  kv.commit_tokens(a, all);  // blocks 0 (prompt) and 1 (4 prompt + 12 generated) are full
  kv.free_sequence(a);

  // The 33 tokens as a prompt: block 0 is the same computation, block 1 is not.
  EXPECT_EQ(kv.begin_sequence(SequenceId{2}, all, 33), kBs);
  kv.free_sequence(SequenceId{2});
  // The same sequence recomputed (its prompt still 20 tokens): both blocks.
  EXPECT_EQ(kv.begin_sequence(SequenceId{3}, all, 20), 2 * kBs);
  kv.free_sequence(SequenceId{3});
  EXPECT_EQ(hash_block_tokens(7, head(all, 16)), hash_block_tokens(7, head(all, 16), 0));
  EXPECT_NE(hash_block_tokens(7, head(all, 16)), hash_block_tokens(7, head(all, 16), 1));
  EXPECT_TRUE(pool.check_invariants());
}

}  // namespace
}  // namespace duet

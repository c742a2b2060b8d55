// BlockPool bookkeeping: the free list, reference counts, the prefix cache's
// hash map and its LRU eviction order. No KV memory, no model.
#include "worker/kv/block_pool.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "common/error.h"

namespace duet {
namespace {

BlockId take(BlockPool& pool) {
  const std::optional<BlockId> block = pool.allocate();
  EXPECT_TRUE(block.has_value());
  return block.value_or(BlockId{});
}

// A block taken and registered as full under `hash`.
BlockId take_full(BlockPool& pool, uint64_t hash) {
  const BlockId block = take(pool);
  pool.register_full_block(block, hash);
  return block;
}

// A full block under `hash` that nobody holds any more: cached.
BlockId cached_block(BlockPool& pool, uint64_t hash) {
  const BlockId block = take_full(pool, hash);
  pool.release(block);
  return block;
}

TEST(BlockPoolTest, StartsAllFree) {
  BlockPool pool(8);
  EXPECT_EQ(pool.n_blocks(), 8);
  EXPECT_EQ(pool.n_free(), 8);
  EXPECT_EQ(pool.n_cached(), 0);
  EXPECT_EQ(pool.n_in_use(), 0);
  EXPECT_EQ(pool.n_available(), 8);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, RejectsNoBlocks) {
  EXPECT_THROW(BlockPool(0), Error);
  EXPECT_THROW(BlockPool(-3), Error);
}

TEST(BlockPoolTest, AllocatesInOrderUntilEmpty) {
  BlockPool pool(4);
  for (int32_t b = 0; b < 4; ++b) {
    const std::optional<BlockId> block = pool.allocate();
    ASSERT_TRUE(block.has_value());
    EXPECT_EQ(block->value, b);
    EXPECT_EQ(pool.ref_count(*block), 1);
  }
  EXPECT_EQ(pool.n_free(), 0);
  EXPECT_EQ(pool.n_in_use(), 4);
  EXPECT_FALSE(pool.allocate().has_value());
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, ReleasedBlockIsReusedFirst) {
  BlockPool pool(4);
  const BlockId a = take(pool);
  const BlockId b = take(pool);
  pool.release(a);
  EXPECT_EQ(pool.n_free(), 3);
  EXPECT_EQ(pool.n_in_use(), 1);
  EXPECT_EQ(take(pool), a);  // the free list is a stack: warmest block first
  pool.release(a);
  pool.release(b);
  EXPECT_EQ(pool.n_free(), 4);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, RefCountsKeepSharedBlocksInUse) {
  BlockPool pool(2);
  const BlockId a = take(pool);
  pool.retain(a);
  pool.retain(a);
  EXPECT_EQ(pool.ref_count(a), 3);
  pool.release(a);
  pool.release(a);
  EXPECT_EQ(pool.ref_count(a), 1);
  EXPECT_EQ(pool.n_in_use(), 1);
  EXPECT_EQ(pool.n_free(), 1);
  pool.release(a);
  EXPECT_EQ(pool.ref_count(a), 0);
  EXPECT_EQ(pool.n_free(), 2);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, CallerBugsAssert) {
  BlockPool pool(2);
  EXPECT_THROW(pool.release(BlockId{0}), Error);  // a free block
  EXPECT_THROW(pool.retain(BlockId{1}), Error);   // nobody holds it
  EXPECT_THROW(pool.release(BlockId{2}), Error);  // out of range
  EXPECT_THROW(pool.release(BlockId{-1}), Error);
  EXPECT_THROW(pool.register_full_block(BlockId{0}, 7), Error);  // not in use
  const BlockId a = take(pool);
  pool.register_full_block(a, 7);
  pool.register_full_block(a, 7);  // the same hash again: fine
  EXPECT_THROW(pool.register_full_block(a, 8), Error);
  pool.release(a);
  EXPECT_THROW(pool.release(a), Error);  // cached now, still nobody holds it
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, HashedBlockStaysCachedAfterRelease) {
  BlockPool pool(4);
  const BlockId a = take_full(pool, 42);
  EXPECT_EQ(pool.block_hash(a), 42u);
  pool.release(a);
  EXPECT_EQ(pool.n_free(), 3);
  EXPECT_EQ(pool.n_cached(), 1);
  EXPECT_EQ(pool.n_in_use(), 0);
  EXPECT_EQ(pool.n_available(), 4);
  EXPECT_EQ(pool.find(42), a);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, LookupRevivesACachedBlock) {
  BlockPool pool(4);
  const BlockId a = cached_block(pool, 42);
  const std::optional<BlockId> hit = pool.lookup(42);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(*hit, a);
  EXPECT_EQ(pool.ref_count(a), 1);
  EXPECT_EQ(pool.n_cached(), 0);
  EXPECT_EQ(pool.n_in_use(), 1);
  EXPECT_EQ(pool.n_hits(), 1);
  EXPECT_FALSE(pool.lookup(43).has_value());
  EXPECT_EQ(pool.n_misses(), 1);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, LookupSharesABlockInUse) {
  BlockPool pool(4);
  const BlockId a = take_full(pool, 42);
  EXPECT_EQ(pool.lookup(42), a);
  EXPECT_EQ(pool.ref_count(a), 2);
  pool.release(a);
  pool.release(a);
  EXPECT_EQ(pool.n_cached(), 1);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, FreeBlocksGoBeforeCachedOnes) {
  BlockPool pool(3);
  const BlockId a = cached_block(pool, 1);
  const BlockId b = take(pool);
  const BlockId c = take(pool);
  EXPECT_NE(b, a);
  EXPECT_NE(c, a);
  EXPECT_EQ(pool.n_evictions(), 0);
  EXPECT_EQ(pool.find(1), a);
  EXPECT_TRUE(pool.check_invariants());
}

TEST(BlockPoolTest, EvictsLeastRecentlyReleasedFirst) {
  BlockPool pool(4);
  std::vector<BlockId> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(take_full(pool, 100 + i));
  // Release order 2, 0, 3, 1: that is the eviction order.
  for (const int i : {2, 0, 3, 1}) pool.release(blocks[i]);
  EXPECT_EQ(pool.n_cached(), 4);
  EXPECT_EQ(pool.n_free(), 0);
  // Touching 0 (lookup, then release) makes it the most recent.
  ASSERT_EQ(pool.lookup(100), blocks[0]);
  pool.release(blocks[0]);
  for (const int i : {2, 3, 1, 0}) {
    const std::optional<BlockId> block = pool.allocate();
    ASSERT_TRUE(block.has_value());
    EXPECT_EQ(*block, blocks[i]);
    EXPECT_FALSE(pool.block_hash(*block).has_value());  // eviction forgets the hash
    EXPECT_FALSE(pool.find(100 + i).has_value());
    ASSERT_TRUE(pool.check_invariants());
  }
  EXPECT_EQ(pool.n_evictions(), 4);
  EXPECT_FALSE(pool.allocate().has_value());
}

TEST(BlockPoolTest, FirstRegistrationOfAHashWins) {
  BlockPool pool(4);
  const BlockId a = take(pool);
  const BlockId b = take(pool);
  pool.register_full_block(a, 5);
  pool.register_full_block(b, 5);  // same content computed twice
  EXPECT_EQ(pool.find(5), a);
  EXPECT_FALSE(pool.block_hash(b).has_value());
  pool.release(b);
  EXPECT_EQ(pool.n_free(), 3);  // b is plainly free
  pool.release(a);
  EXPECT_EQ(pool.n_cached(), 1);
  EXPECT_TRUE(pool.check_invariants());
}

// Random operations against a simple model of who holds what; the pool's
// invariants hold after every step and nothing leaks.
TEST(BlockPoolTest, RandomOperationsKeepInvariants) {
  constexpr int64_t kBlocks = 32;
  BlockPool pool(kBlocks);
  std::mt19937 rng(1234);
  std::vector<BlockId> held;  // one entry per reference we own
  uint64_t next_hash = 1;
  for (int step = 0; step < 5000; ++step) {
    const int op = static_cast<int>(rng() % 5);
    if (op == 0 || held.empty()) {
      const std::optional<BlockId> block = pool.allocate();
      if (block) {
        held.push_back(*block);
      } else {
        EXPECT_EQ(pool.n_available(), 0);
      }
    } else if (op == 1) {
      const BlockId block = held[rng() % held.size()];
      pool.retain(block);
      held.push_back(block);
    } else if (op == 2) {
      const size_t i = rng() % held.size();
      pool.release(held[i]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (op == 3) {
      const BlockId block = held[rng() % held.size()];
      if (!pool.block_hash(block)) pool.register_full_block(block, next_hash++);
    } else {
      const std::optional<BlockId> block = pool.lookup(1 + rng() % next_hash);
      if (block) held.push_back(*block);
    }
    ASSERT_TRUE(pool.check_invariants()) << "step " << step;
    const std::set<BlockId> distinct(held.begin(), held.end());
    ASSERT_EQ(pool.n_in_use(), static_cast<int64_t>(distinct.size()));
  }
  for (const BlockId block : held) pool.release(block);
  EXPECT_TRUE(pool.check_invariants());
  EXPECT_EQ(pool.n_in_use(), 0);
  EXPECT_EQ(pool.n_available(), kBlocks);
}

}  // namespace
}  // namespace duet

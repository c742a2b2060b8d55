// The physical side of the paged KV cache: which of the n_blocks blocks of a
// KvCache (worker/kv/kv_cache.h) are free, who holds them (reference counts), and
// which full blocks can be reused by the hash of their content (prefix
// caching). Pure bookkeeping: no KV memory is touched here. Which blocks a
// sequence uses, and how block hashes are computed, is the logical side's job
// (worker/kv/kv_cache_manager.h), as vLLM splits block_pool from kv_cache_manager.
//
// Every block is in exactly one state:
//   free    ref count 0, no hash         on the free list
//   cached  ref count 0, a prefix hash   on the LRU list, reusable by lookup()
//                                        until allocate() evicts it
//   in use  ref count > 0 (a hash or not)
//
// Thread affinity: none of its own; the owner (the engine thread)
// calls it from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <unordered_map>
#include <vector>

namespace duet {

// A physical block of the KV cache: an index in [0, n_blocks).
struct BlockId {
  int32_t value = -1;

  friend bool operator==(BlockId, BlockId) = default;
  friend auto operator<=>(BlockId, BlockId) = default;
};

}  // namespace duet

template <>
struct std::hash<duet::BlockId> {
  size_t operator()(duet::BlockId id) const noexcept { return std::hash<int32_t>{}(id.value); }
};

namespace duet {

class BlockPool final {
 public:
  // All n_blocks start free; allocate() hands them out in order 0, 1, 2, ...
  explicit BlockPool(int64_t n_blocks);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Takes a block with ref count 1: a free one if any (the most recently freed
  // first), else evicts the least recently released cached block (its hash is
  // forgotten). nullopt when every block is in use.
  std::optional<BlockId> allocate();

  // One more holder of a block in use (sharing it). Asserts its ref count > 0:
  // to take a cached block back, use lookup().
  void retain(BlockId id);
  // One holder fewer. At ref count 0 the block becomes free, or, if it carries
  // a hash, cached at the most-recent end of the LRU list. Asserts ref count > 0.
  void release(BlockId id);

  // Marks a full block in use as reusable under `hash` (chained over its
  // prefix by the caller). If another block is already registered under the
  // same hash, that one is kept and this block stays unhashed (it is freed
  // normally on release). Re-registering a block under its own hash is a
  // no-op; under a different hash, or a block not in use, asserts.
  void register_full_block(BlockId id, uint64_t hash);

  // The block registered under `hash`, retained for the caller (a cached
  // block is revived off the LRU list), or nullopt. Counts a hit or a miss.
  std::optional<BlockId> lookup(uint64_t hash);
  // The block registered under `hash`, without retaining or counting.
  std::optional<BlockId> find(uint64_t hash) const;

  int64_t n_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t n_free() const { return static_cast<int64_t>(free_list_.size()); }
  int64_t n_cached() const { return n_cached_; }  // ref count 0 with a hash (evictable)
  int64_t n_in_use() const { return n_in_use_; }  // ref count > 0
  // Blocks allocate() can still hand out: free + cached.
  int64_t n_available() const { return n_free() + n_cached(); }
  int64_t n_hits() const { return n_hits_; }      // lookups that found a block
  int64_t n_misses() const { return n_misses_; }  // lookups that did not
  int64_t n_evictions() const { return n_evictions_; }

  int32_t ref_count(BlockId id) const;
  std::optional<uint64_t> block_hash(BlockId id) const;

  // Walks every structure and checks the states above, the hash map and the
  // counters agree. For tests: O(n_blocks).
  bool check_invariants() const;

 private:
  static constexpr int32_t kNone = -1;

  void check_id(BlockId id) const;
  void lru_push_back(int32_t b);
  void lru_remove(int32_t b);

  std::vector<int32_t> ref_counts_;
  std::vector<uint64_t> hashes_;  // valid where has_hash_
  std::vector<uint8_t> has_hash_;
  std::vector<int32_t> free_list_;  // a stack: back() is taken first
  // The cached blocks as an intrusive doubly linked list, least recently
  // released at lru_head_ (evicted first).
  std::vector<int32_t> lru_prev_;
  std::vector<int32_t> lru_next_;
  int32_t lru_head_ = kNone;
  int32_t lru_tail_ = kNone;
  std::unordered_map<uint64_t, int32_t> block_by_hash_;

  int64_t n_cached_ = 0;
  int64_t n_in_use_ = 0;
  int64_t n_hits_ = 0;
  int64_t n_misses_ = 0;
  int64_t n_evictions_ = 0;
};

}  // namespace duet

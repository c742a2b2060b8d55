#include "worker/kv/block_pool.h"

#include <limits>

#include "common/error.h"

namespace duet {

BlockPool::BlockPool(int64_t n_blocks) {
  DUET_REQUIRE(n_blocks > 0 && n_blocks <= std::numeric_limits<int32_t>::max(),
               "a block pool needs 1..2^31-1 blocks, got {}", n_blocks);
  const auto n = static_cast<size_t>(n_blocks);
  ref_counts_.assign(n, 0);
  hashes_.assign(n, 0);
  has_hash_.assign(n, 0);
  lru_prev_.assign(n, kNone);
  lru_next_.assign(n, kNone);
  free_list_.reserve(n);
  for (int64_t b = n_blocks - 1; b >= 0; --b) free_list_.push_back(static_cast<int32_t>(b));
}

void BlockPool::check_id(BlockId id) const {
  DUET_ASSERT(id.value >= 0 && id.value < n_blocks(), "block {} is not in [0, {})", id.value,
              n_blocks());
}

std::optional<BlockId> BlockPool::allocate() {
  int32_t b = kNone;
  if (!free_list_.empty()) {
    b = free_list_.back();
    free_list_.pop_back();
  } else if (lru_head_ != kNone) {
    b = lru_head_;
    lru_remove(b);
    --n_cached_;
    ++n_evictions_;
    const auto it = block_by_hash_.find(hashes_[b]);
    DUET_ASSERT(it != block_by_hash_.end() && it->second == b);
    block_by_hash_.erase(it);
    has_hash_[b] = 0;
  } else {
    return std::nullopt;
  }
  DUET_ASSERT(ref_counts_[b] == 0 && !has_hash_[b]);
  ref_counts_[b] = 1;
  ++n_in_use_;
  return BlockId{b};
}

void BlockPool::retain(BlockId id) {
  check_id(id);
  DUET_ASSERT(ref_counts_[id.value] > 0, "retain of block {} which nobody holds", id.value);
  ++ref_counts_[id.value];
}

void BlockPool::release(BlockId id) {
  check_id(id);
  const int32_t b = id.value;
  DUET_ASSERT(ref_counts_[b] > 0, "release of block {} which nobody holds", b);
  if (--ref_counts_[b] > 0) return;
  --n_in_use_;
  if (has_hash_[b]) {
    lru_push_back(b);
    ++n_cached_;
  } else {
    free_list_.push_back(b);
  }
}

void BlockPool::register_full_block(BlockId id, uint64_t hash) {
  check_id(id);
  const int32_t b = id.value;
  DUET_ASSERT(ref_counts_[b] > 0, "register of block {} which nobody holds", b);
  if (has_hash_[b]) {
    DUET_ASSERT(hashes_[b] == hash, "block {} is already registered under another hash", b);
    return;
  }
  // An equal block registered first stays the one lookups find.
  if (!block_by_hash_.emplace(hash, b).second) return;
  hashes_[b] = hash;
  has_hash_[b] = 1;
}

std::optional<BlockId> BlockPool::lookup(uint64_t hash) {
  const auto it = block_by_hash_.find(hash);
  if (it == block_by_hash_.end()) {
    ++n_misses_;
    return std::nullopt;
  }
  ++n_hits_;
  const int32_t b = it->second;
  if (ref_counts_[b] == 0) {
    lru_remove(b);
    --n_cached_;
    ++n_in_use_;
  }
  ++ref_counts_[b];
  return BlockId{b};
}

std::optional<BlockId> BlockPool::find(uint64_t hash) const {
  const auto it = block_by_hash_.find(hash);
  if (it == block_by_hash_.end()) return std::nullopt;
  return BlockId{it->second};
}

int32_t BlockPool::ref_count(BlockId id) const {
  check_id(id);
  return ref_counts_[id.value];
}

std::optional<uint64_t> BlockPool::block_hash(BlockId id) const {
  check_id(id);
  if (!has_hash_[id.value]) return std::nullopt;
  return hashes_[id.value];
}

void BlockPool::lru_push_back(int32_t b) {
  lru_prev_[b] = lru_tail_;
  lru_next_[b] = kNone;
  if (lru_tail_ != kNone) {
    lru_next_[lru_tail_] = b;
  } else {
    lru_head_ = b;
  }
  lru_tail_ = b;
}

void BlockPool::lru_remove(int32_t b) {
  const int32_t prev = lru_prev_[b];
  const int32_t next = lru_next_[b];
  if (prev != kNone) {
    lru_next_[prev] = next;
  } else {
    DUET_ASSERT(lru_head_ == b);
    lru_head_ = next;
  }
  if (next != kNone) {
    lru_prev_[next] = prev;
  } else {
    DUET_ASSERT(lru_tail_ == b);
    lru_tail_ = prev;
  }
  lru_prev_[b] = kNone;
  lru_next_[b] = kNone;
}

bool BlockPool::check_invariants() const {
  const int64_t n = n_blocks();
  // 0: not seen yet, 1: on the free list, 2: on the LRU list.
  std::vector<uint8_t> seen(static_cast<size_t>(n), 0);
  for (const int32_t b : free_list_) {
    if (b < 0 || b >= n || seen[b] != 0) return false;
    if (ref_counts_[b] != 0 || has_hash_[b]) return false;
    seen[b] = 1;
  }
  int64_t n_lru = 0;
  int32_t prev = kNone;
  for (int32_t b = lru_head_; b != kNone; b = lru_next_[b]) {
    if (b < 0 || b >= n || seen[b] != 0) return false;  // also catches a cycle
    if (lru_prev_[b] != prev) return false;
    if (ref_counts_[b] != 0 || !has_hash_[b]) return false;
    seen[b] = 2;
    prev = b;
    ++n_lru;
  }
  if (lru_tail_ != prev) return false;
  if (n_lru != n_cached_) return false;

  int64_t n_in_use = 0;
  int64_t n_hashed = 0;
  for (int64_t b = 0; b < n; ++b) {
    if (ref_counts_[b] < 0) return false;
    if (ref_counts_[b] > 0) {
      if (seen[b] != 0) return false;
      ++n_in_use;
    } else if (seen[b] == 0) {
      return false;  // a block nobody holds that is on neither list: a leak
    }
    if (has_hash_[b]) {
      ++n_hashed;
      const auto it = block_by_hash_.find(hashes_[b]);
      if (it == block_by_hash_.end() || it->second != b) return false;
    }
  }
  if (n_in_use != n_in_use_) return false;
  if (n_hashed != static_cast<int64_t>(block_by_hash_.size())) return false;
  return n_free() + n_cached_ + n_in_use_ == n;
}

}  // namespace duet

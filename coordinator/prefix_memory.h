// What the router remembers of the prompts it sent to one prefill instance,
// to guess a new prompt's prefix-cache hit there (coordinator/router.h).
//
// It keys whole blocks as the engine's prefix cache does: common/hash.h's
// prompt_block_hashes with the instance's own block size (its stats'
// kv_block_tokens), so a prefix remembered here is one the engine caches
// under the same keys. And it counts a hit as the engine looks one up
// (KvCacheManager::begin_sequence): the longest run of remembered blocks that
// start the prompt, short of the prompt's last token, which is always
// computed. Still a guess: it forgets its oldest blocks past `capacity`, and
// cannot see what the engine evicted.
//
// Thread affinity: none of its own; the router calls it under its lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <span>
#include <unordered_set>
#include <vector>

namespace duet {

class PrefixMemory final {
 public:
  static constexpr size_t kDefaultCapacity = 16384;  // blocks

  // `block_size` > 0: tokens per KV block of the instance.
  explicit PrefixMemory(int64_t block_size, size_t capacity = kDefaultCapacity);

  int64_t block_size() const { return block_size_; }
  size_t size() const { return order_.size(); }  // blocks remembered

  // Leading tokens of `prompt` (whole blocks) that the instance likely holds
  // cached, as its engine would find them.
  int64_t cached_tokens(std::span<const int32_t> prompt) const;
  // The same in two halves, for a router that asks many instances of one
  // block size about one prompt: the prompt's keys hashed once, then looked up.
  std::vector<uint64_t> lookup_keys(std::span<const int32_t> prompt) const;
  int64_t cached_tokens_of(std::span<const uint64_t> lookup_keys) const;
  // Records the whole blocks of `prompt`, which the instance will compute
  // and cache; past `capacity` blocks, forgets the oldest.
  void remember(std::span<const int32_t> prompt);
  // Forgets every block (the instance's cache is no longer a guess to go by).
  void forget_all() {
    blocks_.clear();
    order_.clear();
  }

 private:
  int64_t block_size_;
  size_t capacity_;
  std::unordered_set<uint64_t> blocks_;
  std::deque<uint64_t> order_;  // blocks_, oldest first
};

}  // namespace duet

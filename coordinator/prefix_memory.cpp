#include "coordinator/prefix_memory.h"

#include <vector>

#include "common/error.h"
#include "common/hash.h"

namespace duet {

PrefixMemory::PrefixMemory(int64_t block_size, size_t capacity)
    : block_size_(block_size), capacity_(capacity) {
  DUET_REQUIRE(block_size > 0, "block size must be positive, got {}", block_size);
}

int64_t PrefixMemory::cached_tokens(std::span<const int32_t> prompt) const {
  return cached_tokens_of(lookup_keys(prompt));
}

std::vector<uint64_t> PrefixMemory::lookup_keys(std::span<const int32_t> prompt) const {
  if (prompt.empty()) return {};
  // The engine leaves the last token to compute: its blocks before it only.
  return prompt_block_hashes(prompt.first(prompt.size() - 1), block_size_);
}

int64_t PrefixMemory::cached_tokens_of(std::span<const uint64_t> keys) const {
  int64_t tokens = 0;
  for (const uint64_t key : keys) {
    if (!blocks_.contains(key)) break;
    tokens += block_size_;
  }
  return tokens;
}

void PrefixMemory::remember(std::span<const int32_t> prompt) {
  for (const uint64_t key : prompt_block_hashes(prompt, block_size_)) {
    if (!blocks_.insert(key).second) continue;
    order_.push_back(key);
    if (order_.size() > capacity_) {
      blocks_.erase(order_.front());
      order_.pop_front();
    }
  }
}

}  // namespace duet

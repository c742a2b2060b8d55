#include "worker/kv/kv_cache_manager.h"

#include <utility>

#include "common/error.h"
#include "common/model/token_order.h"

namespace duet {
uint64_t KvCacheManager::block_hash(uint64_t parent, std::span<const int32_t> tokens, int64_t b,
                                    int64_t from) const {
  return hash_block_tokens(parent, tokens.subspan(b * block_size_, block_size_),
                           n_one_token(b * block_size_, block_size_, from));
}

KvCacheManager::KvCacheManager(BlockPool& pool, int64_t block_size, bool prefix_caching)
    : pool_(pool), block_size_(block_size), prefix_caching_(prefix_caching) {
  DUET_REQUIRE(block_size > 0, "block size must be positive, got {}", block_size);
}

KvCacheManager::Sequence& KvCacheManager::sequence(SequenceId id) {
  const auto it = sequences_.find(id);
  DUET_ASSERT(it != sequences_.end(), "sequence {} is not live", id.value);
  return it->second;
}

const KvCacheManager::Sequence& KvCacheManager::sequence(SequenceId id) const {
  const auto it = sequences_.find(id);
  DUET_ASSERT(it != sequences_.end(), "sequence {} is not live", id.value);
  return it->second;
}

std::optional<int64_t> KvCacheManager::begin_sequence(SequenceId id,
                                                      std::span<const int32_t> prompt_tokens,
                                                      int64_t one_token_from) {
  DUET_ASSERT(!prompt_tokens.empty(), "sequence {} has an empty prompt", id.value);
  DUET_ASSERT(!has_sequence(id), "sequence {} is already live", id.value);
  const auto n_prompt = static_cast<int64_t>(prompt_tokens.size());

  // The longest cached run of full blocks, leaving the last token to compute.
  // Only looked at here (find), so a refusal changes nothing.
  const int64_t max_hit_blocks = prefix_caching_ ? (n_prompt - 1) / block_size_ : 0;
  std::vector<uint64_t> hashes;
  std::vector<BlockId> hits;
  int64_t n_revived = 0;  // hits nobody holds: taking them uses up available blocks
  uint64_t parent = kRootBlockHash;
  for (int64_t i = 0; i < max_hit_blocks; ++i) {
    const uint64_t hash = block_hash(parent, prompt_tokens, i, one_token_from);
    const std::optional<BlockId> block = pool_.find(hash);
    if (!block) break;
    hashes.push_back(hash);
    hits.push_back(*block);
    if (pool_.ref_count(*block) == 0) ++n_revived;
    parent = hash;
  }
  const auto n_hit_blocks = static_cast<int64_t>(hits.size());
  const int64_t n_new_blocks = blocks_for(n_prompt) - n_hit_blocks;
  if (n_new_blocks > pool_.n_available() - n_revived) return std::nullopt;

  Sequence seq;
  for (int64_t i = 0; i < n_hit_blocks; ++i) {
    const std::optional<BlockId> block = pool_.lookup(hashes[i]);
    DUET_ASSERT(block == hits[i]);
    seq.blocks.push_back(*block);
  }
  for (int64_t i = 0; i < n_new_blocks; ++i) {
    const std::optional<BlockId> block = pool_.allocate();
    DUET_ASSERT(block.has_value(), "the pool counted a block it could not allocate");
    seq.blocks.push_back(*block);
  }
  seq.table.reserve(seq.blocks.size());
  for (const BlockId block : seq.blocks) seq.table.push_back(block.value);
  const int64_t n_hit_tokens = n_hit_blocks * block_size_;
  seq.tokens.assign(prompt_tokens.begin(), prompt_tokens.begin() + n_hit_tokens);
  seq.block_hashes = std::move(hashes);
  seq.one_token_from = one_token_from;
  sequences_.emplace(id, std::move(seq));

  n_prompt_tokens_ += n_prompt;
  n_prefix_hit_tokens_ += n_hit_tokens;
  return n_hit_tokens;
}

bool KvCacheManager::reserve(SequenceId id, int64_t n_tokens_total) {
  DUET_ASSERT(n_tokens_total >= 0, "reserve of {} tokens", n_tokens_total);
  Sequence& seq = sequence(id);
  const int64_t n_have = static_cast<int64_t>(seq.blocks.size());
  const int64_t n_new_blocks = blocks_for(n_tokens_total) - n_have;
  if (n_new_blocks <= 0) return true;
  // Checked first so that a refusal evicts nothing from the prefix cache.
  if (n_new_blocks > pool_.n_available()) return false;
  for (int64_t i = 0; i < n_new_blocks; ++i) {
    const std::optional<BlockId> block = pool_.allocate();
    if (!block) {
      // Not reached while this manager is the pool's only user; kept so the
      // contract holds if the pool is ever shared.
      while (static_cast<int64_t>(seq.blocks.size()) > n_have) {
        pool_.release(seq.blocks.back());
        seq.blocks.pop_back();
        seq.table.pop_back();
      }
      return false;
    }
    seq.blocks.push_back(*block);
    seq.table.push_back(block->value);
  }
  return true;
}

void KvCacheManager::commit_tokens(SequenceId id, std::span<const int32_t> tokens) {
  Sequence& seq = sequence(id);
  const auto n_after = static_cast<int64_t>(seq.tokens.size() + tokens.size());
  DUET_ASSERT(n_after <= static_cast<int64_t>(seq.blocks.size()) * block_size_,
              "sequence {} commits {} tokens but has room for {}", id.value, n_after,
              seq.blocks.size() * block_size_);
  seq.tokens.insert(seq.tokens.end(), tokens.begin(), tokens.end());
  const int64_t n_full = n_after / block_size_;
  const std::span<const int32_t> all(seq.tokens);
  if (!prefix_caching_) return;
  for (auto b = static_cast<int64_t>(seq.block_hashes.size()); b < n_full; ++b) {
    const uint64_t parent = b == 0 ? kRootBlockHash : seq.block_hashes[b - 1];
    const uint64_t hash = block_hash(parent, all, b, seq.one_token_from);
    seq.block_hashes.push_back(hash);
    pool_.register_full_block(seq.blocks[b], hash);
  }
}

std::span<const int32_t> KvCacheManager::block_table(SequenceId id) const {
  return sequence(id).table;
}

void KvCacheManager::free_sequence(SequenceId id) {
  const auto it = sequences_.find(id);
  DUET_ASSERT(it != sequences_.end(), "free of sequence {} which is not live", id.value);
  const std::vector<BlockId>& blocks = it->second.blocks;
  for (auto block = blocks.rbegin(); block != blocks.rend(); ++block) pool_.release(*block);
  sequences_.erase(it);
}

int64_t KvCacheManager::n_blocks(SequenceId id) const {
  return static_cast<int64_t>(sequence(id).blocks.size());
}

int64_t KvCacheManager::n_tokens(SequenceId id) const {
  return static_cast<int64_t>(sequence(id).tokens.size());
}

int64_t KvCacheManager::n_reserved_tokens(SequenceId id) const {
  return n_blocks(id) * block_size_;
}

}  // namespace duet

// The logical side of the paged KV cache: each sequence's block table over a
// BlockPool (worker/kv/block_pool.h), and prefix caching by chained block hashes.
// Pure bookkeeping: no KV memory is touched here.
//
// A sequence's life: n_cached = begin_sequence(id, prompt) (nullopt: full);
// forward and commit_tokens for prompt[n_cached:]; per decode step
// reserve(id, n_tokens(id) + 1) (false: full, preempt), forward, commit_tokens;
// then free_sequence(id).
//
// A block is full once all its tokens are committed. Its hash chains the
// previous block's, its token ids and how many of them are computed in the
// one-token order (common/model/token_order.h), so equal hashes mean an equal
// prefix computed alike. Only full blocks are registered and shared (read-only),
// so KV is only written into blocks that one sequence holds alone.
// Thread affinity: none of its own; the owner (the engine thread) calls it from one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/hash.h"  // hash_block_tokens, kRootBlockHash: the block keys
#include "common/model/kv_layout.h"
#include "worker/kv/block_pool.h"
#include "worker/sequence.h"

namespace duet {

// Block keys are common/hash.h's hash_block_tokens, chained from
// kRootBlockHash: the router (coordinator/) computes the same keys for the
// prompts it places.
class KvCacheManager final {
 public:
  // `pool` is borrowed and must outlive the manager; the manager assumes it
  // is the pool's only user when it answers n_free_blocks(). Without
  // `prefix_caching`, full blocks are neither registered nor looked up.
  explicit KvCacheManager(BlockPool& pool, int64_t block_size = KvLayout::kDefaultBlockSize,
                          bool prefix_caching = true);
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  // Admits a new sequence with `prompt_tokens` (non-empty; `id` not live),
  // whose positions from `one_token_from` on are computed in the one-token
  // order (common/model/token_order.h; the prompt of a recomputed sequence holds
  // its generated tokens too):
  // shares the longest run of cached full blocks that start the prompt, capped
  // so at least the last prompt token is computed (its logits are needed), and
  // allocates blocks for the rest of the prompt. Returns how many prompt
  // tokens already have their KV (a multiple of block_size, < the prompt
  // length); those count as committed. nullopt, with nothing changed, when the
  // pool cannot hold the whole prompt.
  std::optional<int64_t> begin_sequence(SequenceId id, std::span<const int32_t> prompt_tokens,
                                        int64_t one_token_from);

  // Grows the sequence's blocks so it can hold n_tokens_total tokens in all.
  // All or nothing: false, with nothing changed and no cached block evicted,
  // when the pool has too few blocks. True at once if it already can.
  bool reserve(SequenceId id, int64_t n_tokens_total);

  // Records that the KV of `tokens` (the positions after n_tokens(id)) has
  // been written; they must fit in what is reserved. Every block this fills
  // is registered with the pool under its chained hash.
  void commit_tokens(SequenceId id, std::span<const int32_t> tokens);

  // Physical block ids covering positions [0, n_reserved_tokens(id)), for the
  // forward pass. Valid until the next call that changes this sequence.
  std::span<const int32_t> block_table(SequenceId id) const;

  // Releases all the sequence's blocks, last block first (so the pool evicts
  // a prefix's tail before its head); its full blocks stay cached.
  void free_sequence(SequenceId id);

  bool has_sequence(SequenceId id) const { return sequences_.contains(id); }
  int64_t n_sequences() const { return static_cast<int64_t>(sequences_.size()); }
  int64_t block_size() const { return block_size_; }
  // Blocks a new allocation can still get: free plus evictable cached.
  int64_t n_free_blocks() const { return pool_.n_available(); }
  // Tokens that many blocks hold.
  int64_t n_free_tokens() const { return n_free_blocks() * block_size_; }
  int64_t n_blocks(SequenceId id) const;           // blocks the sequence holds
  int64_t n_tokens(SequenceId id) const;           // committed tokens
  int64_t n_reserved_tokens(SequenceId id) const;  // n_blocks(id) * block_size

  // Metrics over every admitted sequence: prompt tokens, and the part of
  // them whose KV came from the prefix cache.
  int64_t n_prompt_tokens() const { return n_prompt_tokens_; }
  int64_t n_prefix_hit_tokens() const { return n_prefix_hit_tokens_; }

 private:
  struct Sequence {
    std::vector<BlockId> blocks;
    std::vector<int32_t> table;          // blocks as int32_t, for block_table()
    std::vector<int32_t> tokens;         // committed token ids
    std::vector<uint64_t> block_hashes;  // chained hashes of the full blocks
    int64_t one_token_from = 0;          // see begin_sequence
  };
  // The chained hash of block `b` of tokens whose one-token rows start at `from`:
  // a block of generated tokens (one-token order) never stands in for the same
  // tokens of a longer prompt (multi-token order).
  uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens, int64_t b,
                      int64_t from) const;

  Sequence& sequence(SequenceId id);
  const Sequence& sequence(SequenceId id) const;
  int64_t blocks_for(int64_t n_tokens) const { return (n_tokens + block_size_ - 1) / block_size_; }

  BlockPool& pool_;
  int64_t block_size_;
  bool prefix_caching_;
  std::unordered_map<SequenceId, Sequence> sequences_;
  int64_t n_prompt_tokens_ = 0;
  int64_t n_prefix_hit_tokens_ = 0;
};

}  // namespace duet

// The 64-bit hashes Duet keys things by, each defined once. Their values are
// contracts, not details: the seeded sampling stream (common/sampling.h
// uniform_at), the KV rows checksum that crosses the wire
// (worker/kv/kv_rows.h kv_checksum) and the prefix cache's block keys, which
// the router and the engine must compute alike (a prefix the router believes
// cached is one the engine can find). Changing any of them changes results:
// tests/common/hash_test.cpp pins known values.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace duet {

// SplitMix64's finalizer: a bijection in which every input bit reaches every
// output bit (mix64(0) == 0).
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ULL;
inline constexpr uint64_t kFnv1aPrime = 0x100000001b3ULL;

// 64-bit FNV-1a over `size` bytes taken as 8-byte little-endian words, then
// the tail's bytes one by one, from the state `h`. Under 8 bytes it is
// plain FNV-1a ("a" -> 0xaf63dc4c8601ec8c).
uint64_t fnv1a_words(const void* data, size_t size, uint64_t h = kFnv1aOffset);

// The prefix cache's block keys. The chained hash of one full block:
// `parent` is the previous block's hash (kRootBlockHash for block 0),
// `tokens` the block's token ids, the last `n_one_token` of them computed in
// the one-token order (common/model/token_order.h; 0 for prompt tokens).
// An xxhash64-style mix with a splitmix64 finish. Hits are trusted by hash
// alone (no token comparison): a collision among n cached blocks has odds
// ~n^2/2^65.
inline constexpr uint64_t kRootBlockHash = 0x6475657420726f6fULL;
uint64_t hash_block_tokens(uint64_t parent, std::span<const int32_t> tokens,
                           int64_t n_one_token = 0);

// The chained keys of the whole blocks of `block_size` prompt tokens that
// start `tokens` (n_one_token 0), block 0 first: the keys under which an
// engine caches a computed prompt.
std::vector<uint64_t> prompt_block_hashes(std::span<const int32_t> tokens, int64_t block_size);

}  // namespace duet

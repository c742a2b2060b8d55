#include "common/hash.h"

#include <bit>
#include <cstring>

#include "common/error.h"

namespace duet {
namespace {

// xxhash64's primes.
constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t kPrime5 = 0x27D4EB2F165667C5ULL;

}  // namespace

uint64_t fnv1a_words(const void* data, size_t size, uint64_t h) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, bytes + i, 8);
    h = (h ^ word) * kFnv1aPrime;
  }
  for (; i < size; ++i) h = (h ^ bytes[i]) * kFnv1aPrime;
  return h;
}

uint64_t hash_block_tokens(uint64_t parent, std::span<const int32_t> tokens, int64_t n_one_token) {
  uint64_t acc = mix64(parent) + kPrime5;
  for (const int32_t token : tokens) {
    uint64_t k = static_cast<uint64_t>(static_cast<uint32_t>(token)) * kPrime2;
    k = std::rotl(k, 31) * kPrime1;
    acc ^= k;
    acc = std::rotl(acc, 27) * kPrime1 + kPrime4;
  }
  // A block of prompt tokens only hashes as it did before orders were hashed.
  const uint64_t tail =
      static_cast<uint64_t>(tokens.size()) ^ (static_cast<uint64_t>(n_one_token) << 32);
  return mix64(acc ^ tail);
}

std::vector<uint64_t> prompt_block_hashes(std::span<const int32_t> tokens, int64_t block_size) {
  DUET_REQUIRE(block_size > 0, "block size must be positive, got {}", block_size);
  const auto size = static_cast<size_t>(block_size);
  std::vector<uint64_t> hashes;
  hashes.reserve(tokens.size() / size);
  uint64_t parent = kRootBlockHash;
  for (size_t begin = 0; begin + size <= tokens.size(); begin += size) {
    parent = hash_block_tokens(parent, tokens.subspan(begin, size));
    hashes.push_back(parent);
  }
  return hashes;
}

}  // namespace duet

// The hashes of common/hash.h and the sampling stream built on them, against
// known values computed by an independent reference (a few lines of Python
// over the published definitions: SplitMix64's finalizer, FNV-1a, the
// xxhash64 primes). The values are contracts (seeded sampling, prefix cache
// keys): any change here is a change of results, never a refactoring.
#include "common/hash.h"

#include <gtest/gtest.h>

#include <numeric>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/sampling.h"

namespace duet {
namespace {

TEST(Mix64, KnownValues) {
  static_assert(mix64(0) == 0);
  EXPECT_EQ(mix64(1), 0x5692161d100b05e5ULL);
  EXPECT_EQ(mix64(0x0123456789abcdefULL), 0xb2c058e4ebb5112cULL);
  EXPECT_EQ(mix64(~0ULL), 0xb4d055fcf2cbbd7bULL);
}

TEST(Fnv1aWords, PlainFnv1aUnderAWordThenWordByWord) {
  EXPECT_EQ(fnv1a_words(nullptr, 0), kFnv1aOffset);
  const std::string_view a = "a";
  EXPECT_EQ(fnv1a_words(a.data(), a.size()), 0xaf63dc4c8601ec8cULL);  // FNV-1a 64 of "a"
  std::vector<unsigned char> bytes(11);
  std::iota(bytes.begin(), bytes.end(), 0);  // one word, then three tail bytes
  EXPECT_EQ(fnv1a_words(bytes.data(), bytes.size()), 0xde4cb9af7ac3d4baULL);
  // Chained: the state carries over.
  EXPECT_EQ(fnv1a_words(bytes.data() + 8, 3, fnv1a_words(bytes.data(), 8)),
            fnv1a_words(bytes.data(), bytes.size()));
}

TEST(UniformAt, TheSeededStreamKeepsItsValues) {
  EXPECT_DOUBLE_EQ(uniform_at(0, 0), 0.28176129772258496);
  EXPECT_DOUBLE_EQ(uniform_at(42, 7), 0.34529078891276377);
  EXPECT_DOUBLE_EQ(uniform_at(0xdeadbeef, 1000), 0.38598610198646544);
}

TEST(HashBlockTokens, KnownValuesAndChaining) {
  std::vector<int32_t> first(16), second(16);
  std::iota(first.begin(), first.end(), 1);
  std::iota(second.begin(), second.end(), 17);
  const uint64_t h0 = hash_block_tokens(kRootBlockHash, first);
  EXPECT_EQ(h0, 0xcc97b204728e60c6ULL);
  EXPECT_EQ(hash_block_tokens(kRootBlockHash, first, 3), 0x4c688b9dc55be2d9ULL);
  EXPECT_EQ(hash_block_tokens(h0, second), 0x7e166537df46843bULL);
  // Token ids hash as 32-bit unsigned values.
  const std::vector<int32_t> odd = {-1, 0, 49151};
  EXPECT_EQ(hash_block_tokens(kRootBlockHash, odd), 0xc5f49f5a2328038dULL);
}

TEST(PromptBlockHashes, TheChainOfWholeBlocks) {
  std::vector<int32_t> tokens(40);
  std::iota(tokens.begin(), tokens.end(), 1);
  const std::vector<uint64_t> hashes = prompt_block_hashes(tokens, 16);
  ASSERT_EQ(hashes.size(), 2u);  // the last 8 tokens fill no block
  EXPECT_EQ(hashes[0], 0xcc97b204728e60c6ULL);
  EXPECT_EQ(hashes[1], 0x7e166537df46843bULL);
  EXPECT_TRUE(prompt_block_hashes(std::span(tokens).first(15), 16).empty());
  EXPECT_EQ(prompt_block_hashes(tokens, 4).size(), 10u);
  EXPECT_THROW(prompt_block_hashes(tokens, 0), Error);
}

}  // namespace
}  // namespace duet

// The KV rows checksum is a wire format (worker/transfer checks it on
// arrival, on hosts that may run other builds): its values must never
// change. Known values from an independent reference (FNV-1a over 8-byte
// words, a SplitMix64 finish, rows packed as worker/kv/kv_rows.h says).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "worker/kv/kv_rows.h"

namespace duet {
namespace {

TEST(KvChecksum, KnownValues) {
  std::vector<KvElement> elements(11);  // 22 bytes: two words and a tail
  std::iota(elements.begin(), elements.end(), KvElement{0});
  EXPECT_EQ(kv_checksum(elements), 0x730f86a4bd02709aULL);
  EXPECT_EQ(kv_checksum(elements, 7), 0x0043fd52265fd140ULL);
  EXPECT_EQ(kv_checksum({}), 0xf52a15e9a9b5e89bULL);
}

TEST(KvRowsChecksum, KnownValueWhateverTheBlocks) {
  const KvLayout layout{
      .n_layers = 2, .n_kv_heads = 3, .head_dim = 4, .block_size = 4, .n_blocks = 8};
  std::vector<KvElement> cache(static_cast<size_t>(layout.total_elems()));
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<KvElement>(i * 7 + 1);
  const std::vector<int32_t> table = {5, 2, 7};
  EXPECT_EQ(kv_rows_checksum(layout, cache.data(), table, 3, 7), 0x36a6394bdb4f7ef9ULL);
}

}  // namespace
}  // namespace duet

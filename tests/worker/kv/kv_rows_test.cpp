// worker/kv/kv_rows.h: the packed order against a naive reference written
// from its definition (chunk -> K then V -> KV head -> position -> head_dim,
// chunks split at multiples of kKvPackChunk), for block sizes below, equal
// to and above the chunk, partial first and last chunks and head subsets;
// and the runs a transfer gets: one per whole block when every head goes.
#include "worker/kv/kv_rows.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace duet {
namespace {

KvLayout layout_with_blocks_of(int64_t block_size) {
  KvLayout layout;
  layout.n_layers = 2;
  layout.n_kv_heads = 3;
  layout.head_dim = 4;
  layout.block_size = block_size;
  layout.n_blocks = 96 / block_size + 4;
  return layout;
}

std::vector<KvElement> numbered_cache(const KvLayout& layout) {
  std::vector<KvElement> cache(static_cast<size_t>(layout.total_elems()));
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<KvElement>(i * 7 + 1);
  return cache;
}

std::vector<int32_t> shuffled_table(const KvLayout& layout, uint64_t seed) {
  std::vector<int32_t> table(static_cast<size_t>(layout.n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(table.begin(), table.end(), rng);
  return table;
}

// The packed rows, element by element, as the header defines them.
std::vector<KvElement> reference_pack(const KvLayout& layout, const std::vector<KvElement>& cache,
                                      int64_t layer, const std::vector<int32_t>& table,
                                      int64_t pos0, int64_t n, KvHeads heads) {
  std::vector<KvElement> out;
  for (int64_t chunk = pos0; chunk < pos0 + n;) {
    const int64_t end = std::min((chunk / kKvPackChunk + 1) * kKvPackChunk, pos0 + n);
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t head = heads.first; head < heads.first + heads.count; ++head) {
        for (int64_t pos = chunk; pos < end; ++pos) {
          const int64_t block = table[static_cast<size_t>(pos / layout.block_size)];
          const int64_t slot = pos % layout.block_size;
          const int64_t row = kv == 0 ? layout.k_offset(layer, block, head, slot)
                                      : layout.v_offset(layer, block, head, slot);
          for (int64_t d = 0; d < layout.head_dim; ++d)
            out.push_back(cache[static_cast<size_t>(row + d)]);
        }
      }
    }
    chunk = end;
  }
  return out;
}

TEST(KvRowsTest, PackedOrderIsTheReferences) {
  EXPECT_EQ(kKvPackChunk, 16);  // a wire format
  struct Case {
    int64_t block_size, pos0, n;
    KvHeads heads;
  };
  for (const Case& c : {Case{16, 0, 64, {0, 3}}, Case{16, 5, 40, {0, 3}}, Case{16, 21, 3, {1, 2}},
                        Case{4, 3, 37, {0, 3}}, Case{4, 16, 32, {2, 1}}, Case{32, 7, 60, {0, 3}},
                        Case{32, 32, 64, {0, 2}}, Case{16, 0, 0, {0, 3}}}) {
    SCOPED_TRACE(testing::Message()
                 << "block size " << c.block_size << ", rows [" << c.pos0 << ", +" << c.n
                 << "), heads [" << c.heads.first << ", +" << c.heads.count << ")");
    const KvLayout layout = layout_with_blocks_of(c.block_size);
    const std::vector<KvElement> cache = numbered_cache(layout);
    const std::vector<int32_t> table = shuffled_table(layout, 11);
    std::vector<KvElement> packed(static_cast<size_t>(packed_kv_elems(layout, c.n, c.heads)));
    pack_kv_rows(layout, cache.data(), 1, table, c.pos0, c.n, c.heads, packed.data());
    EXPECT_EQ(packed, reference_pack(layout, cache, 1, table, c.pos0, c.n, c.heads));

    // Unpacked into other blocks, the rows pack back to the same.
    const std::vector<int32_t> other = shuffled_table(layout, 12);
    std::vector<KvElement> into(cache.size(), 0);
    unpack_kv_rows(layout, into.data(), 1, other, c.pos0, c.n, c.heads, packed.data());
    EXPECT_EQ(reference_pack(layout, into, 1, other, c.pos0, c.n, c.heads), packed);
  }
}

TEST(KvRowsTest, WholeBlocksWithEveryHeadAreOneRunEach) {
  const KvLayout layout = layout_with_blocks_of(16);
  const std::vector<int32_t> table = {4, 0, 2, 5};  // no two neighbours in a row
  const auto runs = [&](int64_t pos0, int64_t n, KvHeads heads) {
    std::vector<int64_t> sizes;
    for_each_packed_run(layout, 0, table, pos0, n, heads,
                        [&](int64_t, int64_t elems) { sizes.push_back(elems); });
    return sizes;
  };
  const int64_t block = layout.block_elems();
  EXPECT_EQ(runs(0, 64, all_kv_heads(layout)), (std::vector<int64_t>(4, block)));
  // A subset of the heads: its K rows, then its V rows, per block.
  const int64_t two_heads = 2 * layout.head_elems();
  EXPECT_EQ(runs(16, 32, {1, 2}), (std::vector<int64_t>(4, two_heads)));
  // A partial block: one run per K/V and head.
  EXPECT_EQ(runs(2, 3, all_kv_heads(layout)), (std::vector<int64_t>(6, 3 * layout.head_dim)));
  // Neighbouring blocks in the cache are one run.
  const std::vector<int32_t> in_order = {1, 2, 3};
  std::vector<int64_t> merged;
  for_each_packed_run(layout, 1, in_order, 0, 48, all_kv_heads(layout),
                      [&](int64_t, int64_t elems) { merged.push_back(elems); });
  EXPECT_EQ(merged, std::vector<int64_t>{3 * block});
}

}  // namespace
}  // namespace duet

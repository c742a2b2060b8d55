#include "worker/kv/kv_rows.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/hash.h"

namespace duet {
namespace {

// The arguments pack and unpack take from their callers, checked.
void check_rows(const KvLayout& layout, std::span<const int32_t> block_table, int64_t pos0,
                int64_t n, KvHeads heads) {
  DUET_ASSERT(pos0 >= 0 && n >= 0, "bad KV row range [{}, +{})", pos0, n);
  DUET_ASSERT((pos0 + n + layout.block_size - 1) / layout.block_size <=
                  static_cast<int64_t>(block_table.size()),
              "positions [{}, {}) are beyond the block table's {} blocks", pos0, pos0 + n,
              block_table.size());
  DUET_ASSERT(
      heads.first >= 0 && heads.count >= 0 && heads.first + heads.count <= layout.n_kv_heads,
      "KV heads [{}, +{}) of {}", heads.first, heads.count, layout.n_kv_heads);
  for (int64_t i = pos0 / layout.block_size; i * layout.block_size < pos0 + n; ++i) {
    const int32_t block = block_table[static_cast<size_t>(i)];
    DUET_ASSERT(block >= 0 && block < layout.n_blocks, "block {} outside the cache", block);
  }
}

// Calls copy(cache offset, packed rows offset, elements) for each run of the
// packed rows, in order: the one walk pack and unpack share.
template <typename Copy>
void for_each_copy(const KvLayout& layout, int64_t layer, std::span<const int32_t> block_table,
                   int64_t pos0, int64_t n, KvHeads heads, Copy&& copy) {
  check_rows(layout, block_table, pos0, n, heads);
  int64_t rows_at = 0;
  for_each_packed_run(layout, layer, block_table, pos0, n, heads,
                      [&](int64_t cache_at, int64_t elems) {
                        copy(cache_at, rows_at, elems);
                        rows_at += elems;
                      });
}

}  // namespace

void pack_kv_rows(const KvLayout& layout, const KvElement* cache, int64_t layer,
                  std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvElement* out) {
  pack_kv_rows(layout, cache, layer, block_table, pos0, n, all_kv_heads(layout), out);
}

void pack_kv_rows(const KvLayout& layout, const KvElement* cache, int64_t layer,
                  std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvHeads heads,
                  KvElement* out) {
  for_each_copy(layout, layer, block_table, pos0, n, heads,
                [&](int64_t cache_at, int64_t rows_at, int64_t count) {
                  std::memcpy(out + rows_at, cache + cache_at, count * sizeof(KvElement));
                });
}

void unpack_kv_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                    const KvElement* in) {
  unpack_kv_rows(layout, cache, layer, block_table, pos0, n, all_kv_heads(layout), in);
}

void unpack_kv_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvHeads heads,
                    const KvElement* in) {
  for_each_copy(layout, layer, block_table, pos0, n, heads,
                [&](int64_t cache_at, int64_t rows_at, int64_t count) {
                  std::memcpy(cache + cache_at, in + rows_at, count * sizeof(KvElement));
                });
}

uint64_t kv_checksum(std::span<const KvElement> elements, uint64_t seed) {
  // The splitmix64 finish: every input bit reaches every output bit.
  return mix64(fnv1a_words(elements.data(), elements.size_bytes(), kFnv1aOffset ^ seed));
}

uint64_t kv_rows_checksum(const KvLayout& layout, const KvElement* cache,
                          std::span<const int32_t> block_table, int64_t pos0, int64_t n) {
  check_rows(layout, block_table, pos0, n, all_kv_heads(layout));
  std::vector<KvElement> rows(static_cast<size_t>(packed_kv_elems(layout, n)));
  const int64_t d = layout.head_dim;
  uint64_t sum = 0;
  for (int64_t layer = 0; layer < layout.n_layers; ++layer) {
    KvElement* out = rows.data();
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t head = 0; head < layout.n_kv_heads; ++head) {
        for (int64_t pos = pos0; pos < pos0 + n; ++pos, out += d) {
          const int64_t block = block_table[static_cast<size_t>(pos / layout.block_size)];
          const int64_t at = layout.k_offset(layer, block, head, pos % layout.block_size) +
                             (kv == 1 ? layout.kv_elems() : 0);
          std::memcpy(out, cache + at, static_cast<size_t>(d) * sizeof(KvElement));
        }
      }
    }
    sum = kv_checksum(rows, sum);
  }
  return sum;
}

}  // namespace duet

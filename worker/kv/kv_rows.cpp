#include "worker/kv/kv_rows.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "common/hash.h"

namespace duet {
namespace {

// Calls f(block, first slot, position offset from pos0, run length) for each
// run of consecutive positions that lie in one block.
template <typename F>
void for_each_block_run(const KvLayout& layout, std::span<const int32_t> block_table, int64_t pos0,
                        int64_t n, F&& f) {
  DUET_ASSERT(pos0 >= 0 && n >= 0, "bad KV row range [{}, +{})", pos0, n);
  DUET_ASSERT((pos0 + n + layout.block_size - 1) / layout.block_size <=
                  static_cast<int64_t>(block_table.size()),
              "positions [{}, {}) are beyond the block table's {} blocks", pos0, pos0 + n,
              block_table.size());
  for (int64_t done = 0; done < n;) {
    const int64_t pos = pos0 + done;
    const int64_t slot = pos % layout.block_size;
    const int64_t run = std::min(layout.block_size - slot, n - done);
    const int64_t block = block_table[static_cast<size_t>(pos / layout.block_size)];
    DUET_ASSERT(block >= 0 && block < layout.n_blocks, "block {} outside the cache", block);
    f(block, slot, done, run);
    done += run;
  }
}

// Calls copy(cache offset, packed rows offset, elements) once for every
// (K/V, head) run of one block that rows [pos0, pos0 + n) of `heads` of
// `layer` occupy: the one walk pack and unpack share, in opposite directions.
template <typename Copy>
void for_each_head_run(const KvLayout& layout, int64_t layer, std::span<const int32_t> block_table,
                       int64_t pos0, int64_t n, KvHeads heads, Copy&& copy) {
  DUET_ASSERT(
      heads.first >= 0 && heads.count >= 0 && heads.first + heads.count <= layout.n_kv_heads,
      "KV heads [{}, +{}) of {}", heads.first, heads.count, layout.n_kv_heads);
  const int64_t d = layout.head_dim;
  for_each_block_run(layout, block_table, pos0, n,
                     [&](int64_t block, int64_t slot, int64_t at, int64_t run) {
                       for (int64_t h = 0; h < heads.count; ++h) {
                         const int64_t k = layout.k_offset(layer, block, heads.first + h, slot);
                         copy(k, (h * n + at) * d, run * d);
                         copy(k + layout.kv_elems(), ((heads.count + h) * n + at) * d, run * d);
                       }
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
  for_each_head_run(layout, layer, block_table, pos0, n, heads,
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
  for_each_head_run(layout, layer, block_table, pos0, n, heads,
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
  std::vector<KvElement> rows(static_cast<size_t>(packed_kv_elems(layout, n)));
  uint64_t sum = 0;
  for (int64_t layer = 0; layer < layout.n_layers; ++layer) {
    pack_kv_rows(layout, cache, layer, block_table, pos0, n, rows.data());
    sum = kv_checksum(rows, sum);
  }
  return sum;
}

}  // namespace duet

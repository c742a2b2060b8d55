// A sequence's KV rows out of (and into) the paged cache, in a layout that
// does not depend on any block table: how KV travels between instances.
//
// The rows of positions [pos0, pos0 + n) of one layer, packed, are
//   K then V -> KV head -> position -> head_dim          (F16 elements)
// so each (K/V, head) run of one block's slots is one memcpy on both sides,
// and the sender's and receiver's block tables may differ.
//
// Pure functions over caller-owned memory: any thread, as long as nobody
// writes the blocks being read (or reads the blocks being written).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>

#include "common/model/kv_layout.h"

namespace duet {

// Some of a cache's KV heads: [first, first + count) of its own (local)
// heads. With tensor parallelism a cache holds a shard's heads only and KV
// moves between shards of different sizes head range by head range.
struct KvHeads {
  int64_t first = 0;
  int64_t count = 0;
};

inline KvHeads all_kv_heads(const KvLayout& layout) { return {0, layout.n_kv_heads}; }

// Elements of the packed rows of n positions of one layer (of `heads`).
inline int64_t packed_kv_elems(const KvLayout& layout, int64_t n) {
  return 2 * layout.n_kv_heads * n * layout.head_dim;
}
inline int64_t packed_kv_elems(const KvLayout& layout, int64_t n, KvHeads heads) {
  return 2 * heads.count * n * layout.head_dim;
}

// Calls run(cache offset, elements) for each contiguous run of the cache
// that rows [pos0, pos0 + n) of `heads` of `layer` occupy (blocks by
// `block_table`), in the packed order: the packed rows are these runs back
// to back. What a transfer gathers from or scatters into the blocks without
// a packed copy (an iovec, an MPI datatype).
template <typename Run>
void for_each_packed_run(const KvLayout& layout, int64_t layer,
                         std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                         KvHeads heads, Run&& run) {
  for (int64_t kv = 0; kv < 2; ++kv) {
    for (int64_t head = heads.first; head < heads.first + heads.count; ++head) {
      for (int64_t done = 0; done < n;) {
        const int64_t pos = pos0 + done;
        const int64_t slot = pos % layout.block_size;
        const int64_t length = std::min(layout.block_size - slot, n - done);
        const int64_t block = block_table[static_cast<size_t>(pos / layout.block_size)];
        run(layout.k_offset(layer, block, head, slot) + (kv == 1 ? layout.kv_elems() : 0),
            length * layout.head_dim);
        done += length;
      }
    }
  }
}

// Copies the rows of positions [pos0, pos0 + n) of `layer` from `cache`
// (blocks by `block_table`, which covers those positions) into `out`
// (packed_kv_elems(layout, n, heads) elements): every head, or `heads`.
void pack_kv_rows(const KvLayout& layout, const KvElement* cache, int64_t layer,
                  std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvElement* out);
void pack_kv_rows(const KvLayout& layout, const KvElement* cache, int64_t layer,
                  std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvHeads heads,
                  KvElement* out);

// The inverse: writes packed rows into the blocks of `block_table`.
void unpack_kv_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                    const KvElement* in);
void unpack_kv_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvHeads heads,
                    const KvElement* in);

// A 64-bit checksum of bytes (common/hash.h: FNV-1a over 8-byte words from
// the offset basis xor `seed`, then mix64): equal KV gives equal sums on every
// host; a flipped bit almost never does. A wire format: its values never change.
uint64_t kv_checksum(std::span<const KvElement> elements, uint64_t seed = 0);

// The checksum of positions [pos0, pos0 + n) of every layer, layer after
// layer, each packed as above: the same number for the same KV whatever
// blocks hold it.
uint64_t kv_rows_checksum(const KvLayout& layout, const KvElement* cache,
                          std::span<const int32_t> block_table, int64_t pos0, int64_t n);

}  // namespace duet

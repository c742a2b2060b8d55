// A sequence's KV rows out of (and into) the paged cache, in a layout that
// does not depend on any block table: how KV travels between instances.
//
// The rows of positions [pos0, pos0 + n) of one layer, packed, are
//   chunk -> K then V -> KV head -> position -> head_dim   (F16 elements)
// where the chunks split the positions at every multiple of kKvPackChunk
// (the first and last chunk may be partial). A chunk is one block of the
// usual 16-slot cache, and a whole block of one layer is contiguous there
// (common/model/kv_layout.h): with every head, a whole block's rows are one
// run of the cache on both sides, one memcpy, one iovec (12 KiB for the
// default model, where one run per K/V and head would be 2 KiB), however
// the sender's and receiver's block tables differ. A wire format: the
// chunk does not depend on the cache's block size.
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
// to back. Runs that follow each other in the cache are one run. What pack
// and unpack walk, and what a transfer gathers from or scatters into the
// blocks without a packed copy (an iovec, an MPI datatype).
template <typename Run>
void for_each_packed_run(const KvLayout& layout, int64_t layer,
                         std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                         KvHeads heads, Run&& run) {
  int64_t run_at = 0;
  int64_t run_elems = 0;  // none yet
  const auto add = [&](int64_t at, int64_t elems) {
    if (run_elems > 0 && run_at + run_elems == at) {
      run_elems += elems;
      return;
    }
    if (run_elems > 0) run(run_at, run_elems);
    run_at = at;
    run_elems = elems;
  };
  for (int64_t chunk = pos0; chunk < pos0 + n;) {
    const int64_t chunk_end = std::min((chunk / kKvPackChunk + 1) * kKvPackChunk, pos0 + n);
    for (int64_t kv = 0; kv < 2; ++kv) {
      for (int64_t head = heads.first; head < heads.first + heads.count; ++head) {
        for (int64_t pos = chunk; pos < chunk_end;) {  // the chunk's slots, block by block
          const int64_t slot = pos % layout.block_size;
          const int64_t length = std::min(layout.block_size - slot, chunk_end - pos);
          const int64_t block = block_table[static_cast<size_t>(pos / layout.block_size)];
          add(layout.k_offset(layer, block, head, slot) + (kv == 1 ? layout.kv_elems() : 0),
              length * layout.head_dim);
          pos += length;
        }
      }
    }
    chunk = chunk_end;
  }
  if (run_elems > 0) run(run_at, run_elems);
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
// layer, each in the order K then V -> KV head -> position -> head_dim (the
// packed order before chunks; the values stay): the same number for the same
// KV whatever blocks hold it.
uint64_t kv_rows_checksum(const KvLayout& layout, const KvElement* cache,
                          std::span<const int32_t> block_table, int64_t pos0, int64_t n);

}  // namespace duet

// The one definition of how the KV cache is laid out in memory. The block
// allocator, the attention kernels and (later) the KV transfer and tensor
// parallelism all compute addresses through this struct and nothing else.
//
// Elements are F16 (as llama.cpp keeps its cache: half the bytes to move).
// Order, outermost first:
//   layer  -> block (fixed number of token slots) -> K then V
//          -> KV head -> token slot in the block -> head_dim
// So one layer of the whole cache is contiguous (transfer layer by layer), one
// block of one layer is contiguous (K and V side by side), and inside it each
// KV head's rows are contiguous (slice by head for tensor parallelism).
#pragma once

#include <cstddef>
#include <cstdint>

namespace duet {

using KvElement = uint16_t;  // IEEE half bits

// Positions per chunk of the packed rows KV travels in between instances
// (worker/kv/kv_rows.h): a wire format, whatever a cache's block size.
inline constexpr int64_t kKvPackChunk = 16;

struct KvLayout {
  static constexpr int64_t kDefaultBlockSize = 16;

  int64_t n_layers = 0;
  int64_t n_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t block_size = kDefaultBlockSize;  // token slots per block
  int64_t n_blocks = 0;

  // Elements of one KV head's rows in one block (K or V).
  int64_t head_elems() const { return block_size * head_dim; }
  // Elements of K (or of V) for all heads in one block of one layer.
  int64_t kv_elems() const { return n_kv_heads * head_elems(); }
  // Elements of one block of one layer: K then V.
  int64_t block_elems() const { return 2 * kv_elems(); }
  int64_t layer_elems() const { return n_blocks * block_elems(); }
  int64_t total_elems() const { return n_layers * layer_elems(); }

  size_t bytes_per_block_per_layer() const { return block_elems() * sizeof(KvElement); }
  size_t bytes_per_block() const { return n_layers * bytes_per_block_per_layer(); }
  size_t bytes_per_token() const {
    return static_cast<size_t>(n_layers * 2 * n_kv_heads * head_dim) * sizeof(KvElement);
  }
  size_t total_bytes() const { return static_cast<size_t>(total_elems()) * sizeof(KvElement); }

  // Offset of the K row of (layer, block, head, slot); its V row is kv_elems() further.
  int64_t k_offset(int64_t layer, int64_t block, int64_t head, int64_t slot) const {
    return layer * layer_elems() + block * block_elems() + head * head_elems() + slot * head_dim;
  }
  int64_t v_offset(int64_t layer, int64_t block, int64_t head, int64_t slot) const {
    return k_offset(layer, block, head, slot) + kv_elems();
  }
};

}  // namespace duet

// Which part of the model one rank of a tensor-parallel instance holds
// (Megatron-style sharding), decided once at load from the configuration
// and the weight types.
//
// - Attention is split by KV-head groups: a rank owns whole GQA groups, its
//   KV heads and the query heads that share them, so its attention needs no
//   other rank. KV heads that do not divide evenly go one extra to the first
//   ranks (3 KV heads on 2 ranks: 2 + 1). Q/K/V are column-parallel (a rank
//   computes its heads' rows), O is row-parallel (a rank multiplies its
//   heads' columns) and the partial products are summed over the ranks
//   (see TP-invariant sums below).
// - The feed-forward is split by hidden units: gate/up column-parallel,
//   down row-parallel (summed likewise), on boundaries of down's
//   quantization blocks (32 elements, 256 for K-quants) so that every rank's
//   columns are whole blocks.
// - Embeddings and the output head are vocabulary-parallel: a rank holds the
//   rows of its vocabulary slice, looks up the tokens that fall in it (the
//   others are zero) and an all-reduce completes the embeddings; it computes
//   its slice of the logits and an all-gather assembles them on every rank.
//   Replicating them instead would keep a fifth of this model's weights and
//   of its per-token FLOPs (the 49k x 576 tied table) on every rank.
// Norm weights are replicated (a few KB).
//
// TP-invariant sums: a row-parallel product is a sum over column groups
// (O: one group per KV head; down: n_ff_groups equal groups, as many as
// every TP size up to n_kv_heads divides when the blocks allow). Each group's
// partial is computed whole on one rank, and every rank adds all groups'
// partials in group order, so the sum has the same bits for any TP size, TP=1
// included (worker/llama_forward.h).
//
// Values, no MPI.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "common/model_config.h"

namespace duet {

// [begin, end) of part `rank` when `n` units are split in `size` parts: each
// gets n / size, the first n % size get one more.
std::pair<int64_t, int64_t> split_evenly(int64_t n, int rank, int size);

struct TpShard {
  int rank = 0;  // 0 = the instance's leader
  int size = 1;
  int64_t kv_head_begin = 0, kv_head_end = 0;  // KV heads owned
  int64_t head_begin = 0, head_end = 0;        // query heads owned: the same GQA groups
  int64_t ff_begin = 0, ff_end = 0;            // feed-forward hidden units owned
  int64_t vocab_begin = 0, vocab_end = 0;      // embedding and output rows owned
  // Column groups of O and down (see above): the model's count, this rank's.
  int64_t n_o_groups = 1, o_group_begin = 0, o_group_end = 1;
  int64_t n_ff_groups = 1, ff_group_begin = 0, ff_group_end = 1;
  // Vocabulary rows per rank in the logits gather: ceil(n_vocab / size); the
  // last rank's slice may be shorter, padded to this.
  int64_t vocab_stride = 0;

  int64_t n_kv_heads() const { return kv_head_end - kv_head_begin; }
  int64_t n_heads() const { return head_end - head_begin; }
  int64_t n_ff() const { return ff_end - ff_begin; }
  int64_t n_vocab() const { return vocab_end - vocab_begin; }
  bool whole() const { return size == 1; }
};

// Rank `rank` of `size` (0 of 1: the whole model). `o_block` and
// `down_block`: the block sizes (in elements) of the row-parallel weights'
// types and of the activations they take, attn_output and ffn_down (the
// largest over layers). Throws duet::Error (kUnsupported) when the model
// cannot be split so: more ranks than KV heads, or a rank's columns of a
// row-parallel weight that would not be whole column groups of whole blocks.
TpShard make_tp_shard(const ModelConfig& config, int rank, int size, int64_t o_block,
                      int64_t down_block);

// The KV heads rank `index` of a `size`-rank instance owns: [begin, end).
inline std::pair<int64_t, int64_t> kv_heads_of(int64_t n_kv_heads, int index, int size) {
  return split_evenly(n_kv_heads, index, size);
}

// A rank of another instance that shares KV heads with this one.
struct KvPeer {
  int index = 0;  // in the other instance's rank list
  int64_t head_begin = 0;
  int64_t head_end = 0;
};

// How KV is re-sharded between instances of different TP sizes: every rank
// of the other instance (of `other_size` ranks) that owns some of the KV
// heads rank `index` of `size` owns, with the heads they share, in order.
std::vector<KvPeer> kv_peers(int64_t n_kv_heads, int index, int size, int other_size);

}  // namespace duet

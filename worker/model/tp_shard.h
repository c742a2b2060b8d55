// Which part of the model one rank of a tensor-parallel instance holds (Megatron-style),
// decided once at load from the configuration and the weight types. Values, no MPI.
// - Attention by KV-head groups: a rank owns whole GQA groups (its KV heads and the
//   query heads that share them), so its attention needs no other rank; uneven KV
//   heads go one extra to the first ranks (3 on 2 ranks: 2 + 1). Q/K/V are
//   column-parallel (a rank computes its heads' rows).
// - The feed-forward by hidden units: gate/up column-parallel, in runs of 16
//   (SwiGLU's SIMD width, so a slice takes the same vector code as a whole row).
// - O and down by output rows: every rank gathers the whole input, multiplies it by
//   its rows [embd_begin, embd_end), and the outputs are gathered.
// - A mixture of experts by whole experts (expert parallelism on the same ranks: EP = TP):
//   a rank holds experts [expert_begin, expert_end) and computes every token's use of them
//   whole; the router is replicated. The ranks' outputs, each (token, pick) from one rank and
//   zeros from the others, are completed by an all-reduce (exact), then summed in pick order.
// - Embeddings and the output head by vocabulary: an all-reduce completes the
//   embeddings (the other ranks add zeros: exact), an all-gather the logits.
//   Norm weights are replicated.
// TP-invariance: no element is a sum of partials from several ranks; each is computed
// whole on one rank from the same whole-row activations as TP=1, so the logits are the
// same bits for any TP size, TP=1 included (why, and what it costs:
// docs/BENCHMARKS.md, "Tensor parallelism on the CPU").
#pragma once

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "common/model/dtype.h"
#include "common/model/model_config.h"

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
  int64_t embd_begin = 0, embd_end = 0;        // output rows of O and down owned
  int64_t expert_begin = 0, expert_end = 0;    // experts owned (mixture of experts)
  // Vocabulary rows per rank in the logits gather: ceil(n_vocab / size); the
  // last rank's slice may be shorter, padded to this.
  int64_t vocab_stride = 0;

  int64_t n_kv_heads() const { return kv_head_end - kv_head_begin; }
  int64_t n_heads() const { return head_end - head_begin; }
  int64_t n_ff() const { return ff_end - ff_begin; }
  int64_t n_vocab() const { return vocab_end - vocab_begin; }
  int64_t n_embd() const { return embd_end - embd_begin; }
  int64_t n_experts() const { return expert_end - expert_begin; }
  bool whole() const { return size == 1; }
};

// Rank `rank` of `size` (0 of 1: the whole model). Throws duet::Error
// (kUnsupported) when the model cannot be split so: more ranks than KV heads
// or experts.
TpShard make_tp_shard(const ModelConfig& config, int rank, int size);

// The parts of a (rows, sum of parts) matrix that the ranks of an instance
// hold, column slices of the lengths `parts` (rank order), gathered as
// `size` equal slots of slot = max(parts) * rows floats each (rank r's slice
// row-major in slot r): `all` (rows, sum of parts) row-major. What a
// tensor-parallel forward does after every all-gather of a split dimension.
void assemble_slices(const float* gathered, int64_t slot, std::span<const int64_t> parts,
                     int64_t rows, float* all);

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

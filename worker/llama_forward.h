// The Llama forward pass over a batch of tokens from one or more sequences,
// for every architecture LlamaModel loads: `llama` (adjacent-pair RoPE,
// optional rope_freqs divisors) and `qwen2` (Q/K/V biases, NeoX RoPE).
//
// All rows of the batch go through each weight matrix together (one GEMM per
// weight), attention runs per sequence over its blocks of the paged cache.
// Intermediate tensors are named members, per layer overwritten:
//   x (n, n_embd) residual stream, attn_norm/ffn_norm (n, n_embd),
//   q (n, n_heads*head_dim), k/v (n, n_kv_heads*head_dim), attn (n, n_heads*head_dim),
//   attn_out/ffn_out (n, n_embd), gate/up (n, n_ff).
// Shapes are the shard's (LlamaModel::shard): with tensor parallelism every
// rank of the instance runs the same batch through its own heads and hidden
// units; the vocabulary-parallel embeddings are summed over the ranks with an
// all-reduce, the logits assembled with an all-gather.
//
// In the batch-invariant order the row-parallel products (O, down) are sums
// of column groups (worker/tp_shard.h) added in group order, every rank's
// groups brought together by an all-gather: x and the logits are the same
// bits on every rank of an instance and for every TP size, so tensor
// parallelism changes no token. (The kLlamaCpp order, for one whole model
// only, multiplies in one pass as llama.cpp does.)
// Not thread-safe: one forward at a time per object (the compute thread's).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/collective.h"
#include "worker/kv_cache.h"
#include "worker/llama_model.h"
#include "worker/model_forward.h"

namespace duet {

class LlamaForward final : public ModelForward {
 public:
  // attention_order: kLlamaCpp reproduces llama.cpp for one sequence decoded
  // token by token; kBatchInvariant makes every token's result independent of
  // how its sequence's tokens are split into steps (what a batching engine
  // with chunked prefill, preemption and prefix caching needs).
  // `collective`: the instance's ranks when the model is a shard (outlives
  // this object; required then), else null.
  LlamaForward(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
               cpu::AttentionOrder attention_order = cpu::AttentionOrder::kLlamaCpp,
               Collective* collective = nullptr);

  // Time spent in the collectives since construction (tensor parallelism).
  struct CollectiveTime {
    int64_t calls = 0;
    double seconds = 0;
  };
  CollectiveTime collective_time() const { return collective_time_; }

  // Writes K/V of every row into `cache` and the logits of `logit_rows`
  // into `logits` (never null here); layer_stored is where a prefill
  // instance ships each layer (see ModelForward).
  void run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
           KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
           const LayerStored& layer_stored = {}) override;

 private:
  void resize(int64_t n_rows, int64_t n_logit_rows);
  void all_reduce(float* data, int64_t n);  // timed; nothing without a collective
  // out (n, n_embd) = the row-parallel product with packed_: in the
  // kLlamaCpp order `whole` in one pass; else the sum of the model's
  // n_groups column groups in order, this rank holding `groups` from
  // group_begin on.
  void row_parallel(const cpu::WeightMatrix& whole, std::span<const cpu::WeightMatrix> groups,
                    int64_t n_groups, int64_t group_begin, int64_t n, float* out);
  void embed(std::span<const int32_t> tokens);
  void head(int64_t n_out, float* logits);

  const LlamaModel& model_;
  const cpu::KernelTable& kernels_;
  cpu::ThreadPool& pool_;
  const cpu::AttentionOrder attention_order_;
  Collective* const collective_;
  CollectiveTime collective_time_;
  cpu::PackedActivations packed_;
  std::vector<int32_t> positions_;
  std::vector<cpu::AttentionSequence> attention_sequences_;
  std::vector<float> x_, norm_, q_, k_, v_, attn_, attn_out_, gate_, up_, ffn_out_, head_in_;
  // This rank's slice of the logits (n_out, vocab_stride), then every
  // rank's in rank order; tensor parallelism only.
  std::vector<float> logits_slice_, logits_gathered_;
  // Column-group partials of a row-parallel product: this rank's, then
  // every rank's.
  std::vector<float> partials_, partials_gathered_;
};

}  // namespace duet

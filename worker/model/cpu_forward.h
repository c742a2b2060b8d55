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
// all-reduce, the logits assembled with an all-gather; O and down take the
// gathered whole input and give their rows of the output, gathered too
// (worker/model/tp_shard.h). No element is ever a sum over ranks: x and the logits
// are the same bits on every rank of an instance and for every TP size.
//
// Reduction orders: every weight product is one pass of llama.cpp's order
// (the same for any number of rows), and each row's attention reduces in the
// order its sequence names for its position (ForwardSequence::one_token_from),
// so a token's result depends on neither the batch nor the step it is in.
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
#include "worker/kv/kv_cache.h"
#include "worker/model/llama_model.h"
#include "worker/model/model_forward.h"
#include "worker/parallel/collective.h"

namespace duet {

class CpuForward final : public ModelForward {
 public:
  // `collective`: the instance's ranks when the model is a shard (outlives
  // this object; required then), else null.
  CpuForward(const LlamaModel& model, const cpu::KernelTable& kernels, cpu::ThreadPool& pool,
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
  // all (n, sum of parts) = every rank's `mine` (n, parts[rank]), side by
  // side in rank order; timed.
  void gather_columns(const float* mine, std::span<const int64_t> parts, int64_t n, float* all);
  // out (n, n_embd) = in (n, k) . w^T for O or down, whose input is split
  // over the ranks by `in_parts` (this rank's columns in `mine`): the whole
  // input is gathered, this rank multiplies it by its output rows, and the
  // output rows are gathered.
  void split_product(const cpu::WeightMatrix& w, const float* mine,
                     std::span<const int64_t> in_parts, int64_t n, float* out);
  void embed(std::span<const int32_t> tokens);
  void head(int64_t n_out, float* logits);

  const LlamaModel& model_;
  const cpu::KernelTable& kernels_;
  cpu::ThreadPool& pool_;
  Collective* const collective_;
  // Every rank's share, in rank order, of the split dimensions: query dims
  // (n_heads * head_dim), hidden units, output rows of O and down.
  std::vector<int64_t> q_parts_, ff_parts_, embd_parts_;
  CollectiveTime collective_time_;
  cpu::PackedActivations packed_;
  std::vector<int32_t> positions_;
  std::vector<AttentionSequence> attention_sequences_;
  std::vector<float> x_, norm_, q_, k_, v_, attn_, attn_out_, gate_, up_, ffn_out_, head_in_;
  // This rank's slice of the logits (n_out, vocab_stride), then every
  // rank's in rank order; tensor parallelism only.
  std::vector<float> logits_slice_, logits_gathered_;
  // Tensor parallelism: a gathered input (n, k) of O or down, this rank's
  // rows of its output (n, shard n_embd), and an all-gather's send and
  // receive slots.
  std::vector<float> whole_in_, out_rows_, gather_send_, gather_recv_;
};

}  // namespace duet

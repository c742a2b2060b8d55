// Causal self-attention of one sequence over its paged KV cache (F16).
//
// Numerics are those of llama.cpp's CPU build (non-flash path, AVX-512), to
// the bit where we could: Q is rounded to F16 before Q.K; scores are scaled,
// exponentiated with ggml's polynomial and normalized in F32 with a double
// sum; the probabilities are rounded to F16 before they weight V; every dot
// product reduces in the fixed lane orders of kernel_table.h. Which order is
// an AttentionOrder (below); either way a sequence's results never depend on
// the other sequences of a batch. Block sizes must be multiples of 16.
#pragma once

#include <cstdint>
#include <span>

#include "common/kv_layout.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"

namespace duet::cpu {

enum class AttentionOrder {
  // As llama.cpp: a step holding a single query token of the sequence reduces
  // in ggml_vec_dot_f16's order, a step holding several in its GEMM order.
  // Bit-exact with llama.cpp for one sequence run alone, token by token.
  kLlamaCpp,
  // Always the GEMM order (what llama.cpp does for any batch of two or more
  // tokens): a token's result is the same whether it is computed alone, in a
  // prefill chunk of any size, or recomputed after preemption.
  kBatchInvariant,
};

struct AttentionShape {
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;  // query head h reads KV head h / (n_heads / n_kv_heads)
  int64_t head_dim = 0;
  float scale = 1.0f;  // usually 1 / sqrt(head_dim)
  AttentionOrder order = AttentionOrder::kLlamaCpp;
};

// Writes K and V rows of n_tokens tokens at positions [pos0, pos0 + n_tokens)
// into the cache, converting to F16. k, v: (n_tokens, n_kv_heads * head_dim).
void kv_cache_store(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n_tokens,
                    const float* k, const float* v);

// The accumulator groups for a step with n_q query tokens of one sequence.
int attention_groups(int64_t n_q, int64_t head_dim,
                     AttentionOrder order = AttentionOrder::kLlamaCpp);

// q: (n_q, n_heads * head_dim) for the query tokens at positions
// [pos0, pos0 + n_q); the cache must already hold positions [0, pos0 + n_q).
// out: (n_q, n_heads * head_dim). Query token t attends to positions <= pos0 + t.
void attention(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
               int64_t layer, std::span<const int32_t> block_table, const AttentionShape& shape,
               const float* q, int64_t n_q, int64_t pos0, float* out, ThreadPool& pool);

// One sequence's query rows in a batched attention call.
struct AttentionSequence {
  std::span<const int32_t> block_table;
  int64_t pos0 = 0;  // position of its first query row
  int64_t n_q = 0;   // its query rows
  int64_t row = 0;   // index of its first row in q and out
};

// kv_cache_store of every sequence's rows (its n_q rows from `row` on in k and
// v) in one parallel pass over the sequences, converting with the kernel
// path's F16 conversion (the same rounding).
void kv_cache_store_batch(const KernelTable& kernels, const KvLayout& layout, KvElement* cache,
                          int64_t layer, std::span<const AttentionSequence> sequences,
                          const float* k, const float* v, ThreadPool& pool);

// attention() for several sequences in one parallel pass (one task per
// sequence, query token and head); each sequence's result is exactly what
// attention() gives it alone.
void attention_batch(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
                     int64_t layer, std::span<const AttentionSequence> sequences,
                     const AttentionShape& shape, const float* q, float* out, ThreadPool& pool);

}  // namespace duet::cpu

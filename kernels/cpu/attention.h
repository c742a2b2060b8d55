// Causal self-attention of one sequence over its paged KV cache (F16).
//
// Numerics are those of llama.cpp's CPU build (non-flash path, AVX-512), to
// the bit where we could: Q is rounded to F16 before Q.K; scores are scaled,
// exponentiated with ggml's polynomial and normalized in F32 with a double
// sum; the probabilities are rounded to F16 before they weight V; every dot
// product reduces in the fixed lane orders of kernel_table.h. llama.cpp has
// two such orders, and which one a query row takes is the row's own (see
// AttentionSequence::one_token_from, kernels/op_params.h), never the
// batch's: a row's result never depends on the other rows or sequences of a
// batch, nor on how its own sequence is split into steps. Block sizes must
// be multiples of 16.
#pragma once

#include <cstdint>
#include <span>

#include "common/model/kv_layout.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/op_params.h"

namespace duet::cpu {

// Writes K and V rows of n_tokens tokens at positions [pos0, pos0 + n_tokens)
// into the cache, converting to F16. k, v: (n_tokens, n_kv_heads * head_dim).
void kv_cache_store(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n_tokens,
                    const float* k, const float* v);

// The accumulator groups of a query row: 4 in llama.cpp's one-token order
// (ggml_vec_dot_f16, what it runs for a micro-batch of one token), 1 in its
// multi-token order (its GEMM, for micro-batches of two or more), which needs
// whole 16-lane runs of head_dim (else 4 whatever the order).
int attention_groups(bool one_token, int64_t head_dim);

// q: (n_q, n_heads * head_dim) for the query tokens at positions
// [pos0, pos0 + n_q); the cache must already hold positions [0, pos0 + n_q).
// out: (n_q, n_heads * head_dim). Query token t attends to positions <= pos0 + t.
// The rows reduce as llama.cpp's one micro-batch of n_q tokens would: in the
// one-token order when n_q is 1, else in the multi-token order.
void attention(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
               int64_t layer, std::span<const int32_t> block_table, const AttentionShape& shape,
               const float* q, int64_t n_q, int64_t pos0, float* out, ThreadPool& pool);

// kv_cache_store of every sequence's rows (its n_q rows from `row` on in k and
// v) in one parallel pass over the sequences, converting with the kernel
// path's F16 conversion (the same rounding).
void kv_cache_store_batch(const KernelTable& kernels, const KvLayout& layout, KvElement* cache,
                          int64_t layer, std::span<const AttentionSequence> sequences,
                          const float* k, const float* v, ThreadPool& pool);

// attention() for several sequences in one parallel pass (one task per
// sequence, tile of up to 8 consecutive query rows in one order, and run of
// heads: a prefill's rows share one pass over the keys); each sequence's
// result is exactly what attention() gives it alone.
void attention_batch(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
                     int64_t layer, std::span<const AttentionSequence> sequences,
                     const AttentionShape& shape, const float* q, float* out, ThreadPool& pool);

}  // namespace duet::cpu

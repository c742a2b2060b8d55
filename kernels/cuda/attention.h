// GPU twins of kernels/cpu/attention.h: storing K/V rows into the paged F16
// cache and causal attention over it, for a whole batch of sequences.
//
// The batch is described on the device per row (its sequence and position)
// and per sequence (its block table), so a decode step's launches depend on
// the number of rows only and can be captured in a CUDA graph. Attention is
// one pass with an online softmax: no score matrix is ever materialized, for
// decode (one row per sequence) and prefill (many) alike; a batch too small to
// fill the GPU (a few decode rows over long contexts) also splits each row's
// keys across blocks and merges their partial softmaxes. Numerics: K, V and
// Q.K in F16/F32 as stored, accumulation in F32; results agree with the CPU's
// to F16 rounding, not bit for bit.
#pragma once

#include <cstdint>
#include <span>

#include "common/model/kv_layout.h"
#include "kernels/cuda/backend.h"
#include "kernels/op_params.h"

namespace duet::cuda {

// The rows of a batch and the block tables of its sequences, on the device.
// set() packs a CPU batch description (the same spans the CPU ops take) and
// uploads it with one copy; the view stays valid until the next set(). The
// device arrays only move when a batch needs more room than any before, so a
// graph captured over them can be replayed after set() of a batch of as many
// rows and sequences (their offsets in the arrays) while storage() is
// unchanged (set() during a capture must not need more room). set() waits
// for the previous upload (a synchronize()) unless capturing. The first set()
// outside a capture also allocates attention_batch's split-KV scratch (a
// fixed size for the device, never moved after).
class AttentionBatch {
 public:
  void set(std::span<const AttentionSequence> sequences, CudaBackend& backend);

  // Device arrays, for kernels.
  struct View {
    const int32_t* row_sequence = nullptr;  // (n_rows) the row's sequence
    const int32_t* row_position = nullptr;  // (n_rows) the row's position
    const int32_t* table_offset = nullptr;  // (n_sequences) start of its block table in tables
    const int32_t* tables = nullptr;        // every sequence's block table, one after another
    int64_t n_rows = 0;
    int64_t n_sequences = 0;
    int64_t max_position = 0;  // the largest row position (bounds the work per row)
    // Split-KV scratch (partial_floats floats; null until allocated) and the
    // grid size below which attention splits each row's keys across blocks.
    float* partials = nullptr;
    int64_t partial_floats = 0;
    int64_t split_below_blocks = 0;
  };
  const View& view() const { return view_; }
  // Where the device arrays live: a graph captured over view() stays valid
  // (for batches of its shape, as above) while this is unchanged.
  const void* storage() const { return device_.data(); }

 private:
  PinnedBuffer host_;
  DeviceBuffer device_;
  DeviceBuffer partials_;
  int64_t split_below_blocks_ = 0;
  View view_;
};

// Twin of cpu::kv_cache_store_batch: writes every row's K and V (n_rows,
// n_kv_heads * head_dim floats) at its position, rounded to F16.
void kv_cache_store_batch(const KvLayout& layout, KvElement* cache, int64_t layer,
                          const AttentionBatch& batch, const float* k, const float* v,
                          CudaBackend& backend);

// Twin of cpu::attention_batch: out (n_rows, n_heads * head_dim); row r's
// query attends to positions [0, its position] of its sequence (the last
// shape.window of them when that is set). One
// reduction order on the GPU (a sequence's one_token_from is not read). head_dim 64, 128 or 256;
// the cache must be 16-byte aligned. Block tables are not bounds-checked on the device: the
// caller's tables must cover every row's position (as the CPU asserts).
void attention_batch(const KvLayout& layout, const KvElement* cache, int64_t layer,
                     const AttentionBatch& batch, const AttentionShape& shape, const float* q,
                     float* out, CudaBackend& backend);

}  // namespace duet::cuda

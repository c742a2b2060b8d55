#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/quantize.h"

namespace duet::cpu {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGroups = 4;
// Below this many tasks per thread, attention splits the query heads of a KV
// head into separate tasks.
constexpr int64_t kMinTasksPerThread = 4;

// A hint that the line at p will be read soon (into L2; nothing on other CPUs).
inline void prefetch_l2(const char* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);
#else
  (void)p;
#endif
}

// x[i] *= scale for i < n; returns the largest x[i] (NaNs skipped). Eight
// running maxima, so that the loop is not one long chain of dependent
// comparisons; the maximum is the same whatever the order (up to the sign of
// a zero maximum, which exp(x - max) does not see).
float scale_and_max(float* x, int64_t n, float scale) {
  float max[8];
  std::fill(max, max + 8, -INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      x[i + l] *= scale;
      max[l] = std::max(max[l], x[i + l]);
    }
  }
  for (; i < n; ++i) {
    x[i] *= scale;
    max[0] = std::max(max[0], x[i]);
  }
  for (int l = 1; l < 8; ++l) max[0] = std::max(max[0], max[l]);
  return max[0];
}

// K and V rows (n_tokens, n_kv_heads * head_dim) of positions [pos0, pos0 +
// n_tokens) into the cache, each head's row converted to F16 by `convert`.
void store_rows(const KvLayout& layout, KvElement* cache, int64_t layer,
                std::span<const int32_t> block_table, int64_t pos0, int64_t n_tokens,
                const float* k, const float* v, ConvertRowFn convert) {
  const int64_t row = layout.n_kv_heads * layout.head_dim;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t pos = pos0 + t;
    const int64_t logical = pos / layout.block_size;
    DUET_ASSERT(logical < static_cast<int64_t>(block_table.size()),
                "position {} beyond the sequence's {} blocks", pos, block_table.size());
    const int64_t block = block_table[logical];
    const int64_t slot = pos % layout.block_size;
    for (int64_t h = 0; h < layout.n_kv_heads; ++h) {
      const int64_t src = t * row + h * layout.head_dim;
      convert(k + src, cache + layout.k_offset(layer, block, h, slot), layout.head_dim);
      convert(v + src, cache + layout.v_offset(layer, block, h, slot), layout.head_dim);
    }
  }
}

}  // namespace

int attention_groups(bool one_token, int64_t head_dim) {
  if (head_dim % kLanes != 0) return static_cast<int>(kGroups);  // the GEMM order needs whole lanes
  return one_token ? static_cast<int>(kGroups) : 1;
}

void kv_cache_store(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n_tokens,
                    const float* k, const float* v) {
  store_rows(layout, cache, layer, block_table, pos0, n_tokens, k, v, convert_row_f16);
}

void kv_cache_store_batch(const KernelTable& kernels, const KvLayout& layout, KvElement* cache,
                          int64_t layer, std::span<const AttentionSequence> sequences,
                          const float* k, const float* v, ThreadPool& pool) {
  const int64_t row = layout.n_kv_heads * layout.head_dim;
  pool.parallel_for(static_cast<int64_t>(sequences.size()), [&](int64_t i, int) {
    const AttentionSequence& s = sequences[static_cast<size_t>(i)];
    store_rows(layout, cache, layer, s.block_table, s.pos0, s.n_q, k + s.row * row, v + s.row * row,
               kernels.convert_f16);
  });
}

void attention(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
               int64_t layer, std::span<const int32_t> block_table, const AttentionShape& shape,
               const float* q, int64_t n_q, int64_t pos0, float* out, ThreadPool& pool) {
  const AttentionSequence seq{block_table, pos0, n_q, 0, n_q == 1 ? pos0 : kNoOneTokenRows};
  attention_batch(kernels, layout, cache, layer, {&seq, 1}, shape, q, out, pool);
}

void attention_batch(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
                     int64_t layer, std::span<const AttentionSequence> sequences,
                     const AttentionShape& shape, const float* q, float* out, ThreadPool& pool) {
  DUET_ASSERT(shape.n_heads % shape.n_kv_heads == 0);
  DUET_ASSERT(shape.head_dim == layout.head_dim && shape.n_kv_heads == layout.n_kv_heads);
  DUET_ASSERT(layout.block_size % kLanes == 0, "block size {} is not a multiple of {}",
              layout.block_size, kLanes);
  const int64_t head_dim = shape.head_dim;
  const int64_t group = shape.n_heads / shape.n_kv_heads;  // query heads per KV head
  int64_t n_rows = 0, max_ctx = 0;
  for (const AttentionSequence& s : sequences) {
    DUET_ASSERT(s.pos0 + s.n_q <= static_cast<int64_t>(s.block_table.size()) * layout.block_size);
    n_rows += s.n_q;
    max_ctx = std::max(max_ctx, s.pos0 + s.n_q);
  }
  // Tasks are (sequence, query token, run of query heads), sequence after
  // sequence. A run is the `group` heads that read one KV head, so that each
  // key and value is loaded and converted once for them, unless that leaves
  // too few tasks to keep the threads busy (one sequence's decode step): then
  // one head. The results are the same either way.
  const int64_t heads_per_task =
      n_rows * shape.n_kv_heads >= kMinTasksPerThread * pool.size() ? group : 1;
  const int64_t tasks_per_row = shape.n_heads / heads_per_task;
  std::vector<int64_t> first_task(sequences.size() + 1, 0);
  for (size_t i = 0; i < sequences.size(); ++i) {
    first_task[i + 1] = first_task[i] + sequences[i].n_q * tasks_per_row;
  }
  // Per thread: a run's scores (the longest context rounded up to 16, per
  // head), its F16 queries (up to group x head_dim halves), and the K and V
  // segments of one KV head (16 rows each).
  const int64_t n_scores = (max_ctx + kLanes - 1) / kLanes * kLanes;
  const int64_t scratch_per_thread = group * (n_scores + head_dim);
  std::vector<float> scratch(static_cast<size_t>(scratch_per_thread * pool.size()));
  const int64_t n_segments = n_scores / kLanes;
  std::vector<const KvElement*> segments(static_cast<size_t>(2 * n_segments * pool.size()));

  pool.parallel_for(first_task.back(), [&](int64_t task, int thread) {
    const size_t i = static_cast<size_t>(
        std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1);
    const AttentionSequence& seq = sequences[i];
    const std::span<const int32_t> block_table = seq.block_table;
    const int64_t local = task - first_task[i];
    const int64_t t = seq.row + local / tasks_per_row;          // row in q and out
    const int64_t h0 = local % tasks_per_row * heads_per_task;  // the run's first query head
    const int64_t kv_head = h0 / group;
    const int64_t position = seq.pos0 + local / tasks_per_row;
    const int64_t n_keys = position + 1;  // causal
    // 4 accumulator groups: llama.cpp's ggml_vec_dot_f16; 1: its tinyBLAS GEMM.
    const int groups = attention_groups(position >= seq.one_token_from, head_dim);
    float* scores = scratch.data() + thread * scratch_per_thread;  // (heads, n_scores)
    auto* q16 = reinterpret_cast<KvElement*>(scores + heads_per_task * n_scores);
    const KvElement** k_segments = segments.data() + 2 * thread * n_segments;
    const KvElement** v_segments = k_segments + n_segments;

    // Keys and values in 16-token segments; a segment never crosses a block.
    for (int64_t t0 = 0; t0 < n_keys; t0 += kLanes) {
      const int64_t block = block_table[t0 / layout.block_size];
      const int64_t slot = t0 % layout.block_size;
      k_segments[t0 / kLanes] = cache + layout.k_offset(layer, block, kv_head, slot);
      v_segments[t0 / kLanes] = cache + layout.v_offset(layer, block, kv_head, slot);
    }
    // The values are read after the keys and the softmax: ask for them now.
    for (int64_t t0 = 0; t0 < n_keys; t0 += kLanes) {
      const auto* v = reinterpret_cast<const char*>(v_segments[t0 / kLanes]);
      const int64_t bytes = std::min<int64_t>(kLanes, n_keys - t0) * head_dim * sizeof(KvElement);
      for (int64_t b = 0; b < bytes; b += 64) prefetch_l2(v + b);
    }
    kernels.convert_f16(q + (t * shape.n_heads + h0) * head_dim, q16, heads_per_task * head_dim);
    kernels.kq_scores(q16, heads_per_task, k_segments, n_keys, head_dim, groups, scores, n_scores);
    for (int64_t h = 0; h < heads_per_task; ++h) {
      float* p = scores + h * n_scores;
      const float max = scale_and_max(p, n_keys, shape.scale);
      const double sum = kernels.softmax_exp(p, n_keys, max, p);
      const float inv = static_cast<float>(1.0 / sum);
      for (int64_t i = 0; i < n_keys; ++i) p[i] *= inv;
      kernels.round_f16(p, n_keys);
    }
    kernels.kqv_sum(scores, n_scores, heads_per_task, v_segments, n_keys, head_dim, groups,
                    out + (t * shape.n_heads + h0) * head_dim);
  });
}

}  // namespace duet::cpu

#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "common/error.h"
#include "common/fp16.h"
#include "kernels/cpu/lane_math.h"

namespace duet::cpu {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kGroups = 4;

// out[d] = the lane-tree sum over 16 lanes of the groups' accumulators
// (groups 4: (g0 + g2) + (g1 + g3) first). lanes: (kGroups, kLanes, dim).
void reduce_lanes(float* lanes, int groups, int64_t dim, float* out) {
  float* g0 = lanes;
  if (groups != 1) {
    float* g1 = lanes + kLanes * dim;
    const float* g2 = lanes + 2 * kLanes * dim;
    const float* g3 = lanes + 3 * kLanes * dim;
    for (int64_t i = 0; i < kLanes * dim; ++i) {
      g0[i] = g0[i] + g2[i];
      g1[i] = g1[i] + g3[i];
    }
    for (int64_t i = 0; i < kLanes * dim; ++i) g0[i] = g0[i] + g1[i];
  }
  // lane_tree_sum16 for every d at once, row by row: (l, l+8), (l, l+4), (0+2)+(1+3).
  for (int64_t l = 0; l < 8; ++l) {
    for (int64_t d = 0; d < dim; ++d) g0[l * dim + d] = g0[(l + 8) * dim + d] + g0[l * dim + d];
  }
  for (int64_t l = 0; l < 4; ++l) {
    for (int64_t d = 0; d < dim; ++d) g0[l * dim + d] = g0[(l + 4) * dim + d] + g0[l * dim + d];
  }
  for (int64_t d = 0; d < dim; ++d) {
    out[d] = (g0[d] + g0[2 * dim + d]) + (g0[dim + d] + g0[3 * dim + d]);
  }
}

}  // namespace

int attention_groups(int64_t n_q, int64_t head_dim, AttentionOrder order) {
  if (head_dim % kLanes != 0) return static_cast<int>(kGroups);  // the GEMM order needs whole lanes
  return order == AttentionOrder::kLlamaCpp && n_q == 1 ? static_cast<int>(kGroups) : 1;
}

void kv_cache_store(const KvLayout& layout, KvElement* cache, int64_t layer,
                    std::span<const int32_t> block_table, int64_t pos0, int64_t n_tokens,
                    const float* k, const float* v) {
  const int64_t row = layout.n_kv_heads * layout.head_dim;
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t pos = pos0 + t;
    const int64_t logical = pos / layout.block_size;
    DUET_ASSERT(logical < static_cast<int64_t>(block_table.size()),
                "position {} beyond the sequence's {} blocks", pos, block_table.size());
    const int64_t block = block_table[logical];
    const int64_t slot = pos % layout.block_size;
    for (int64_t h = 0; h < layout.n_kv_heads; ++h) {
      KvElement* k_dst = cache + layout.k_offset(layer, block, h, slot);
      KvElement* v_dst = cache + layout.v_offset(layer, block, h, slot);
      const float* k_src = k + t * row + h * layout.head_dim;
      const float* v_src = v + t * row + h * layout.head_dim;
      for (int64_t d = 0; d < layout.head_dim; ++d) {
        k_dst[d] = fp32_to_fp16(k_src[d]);
        v_dst[d] = fp32_to_fp16(v_src[d]);
      }
    }
  }
}

void attention(const KernelTable& kernels, const KvLayout& layout, const KvElement* cache,
               int64_t layer, std::span<const int32_t> block_table, const AttentionShape& shape,
               const float* q, int64_t n_q, int64_t pos0, float* out, ThreadPool& pool) {
  const AttentionSequence seq{block_table, pos0, n_q, 0};
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
  const int64_t group = shape.n_heads / shape.n_kv_heads;
  // Tasks are (sequence, query token, head), sequence after sequence.
  std::vector<int64_t> first_task(sequences.size() + 1, 0);
  int64_t max_ctx = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const AttentionSequence& s = sequences[i];
    DUET_ASSERT(s.pos0 + s.n_q <= static_cast<int64_t>(s.block_table.size()) * layout.block_size);
    first_task[i + 1] = first_task[i] + s.n_q * shape.n_heads;
    max_ctx = std::max(max_ctx, s.pos0 + s.n_q);
  }
  // Per thread: scores (the longest context rounded up to 16), F16 query
  // (head_dim halves), and 4 groups x 16 lanes x head_dim accumulators.
  const int64_t n_scores = (max_ctx + kLanes - 1) / kLanes * kLanes;
  const int64_t lanes_size = kGroups * kLanes * head_dim;
  const int64_t scratch_per_thread = n_scores + head_dim + lanes_size;
  std::vector<float> scratch(static_cast<size_t>(scratch_per_thread * pool.size()));

  pool.parallel_for(first_task.back(), [&](int64_t task, int thread) {
    const size_t i = static_cast<size_t>(
        std::upper_bound(first_task.begin(), first_task.end(), task) - first_task.begin() - 1);
    const AttentionSequence& seq = sequences[i];
    const std::span<const int32_t> block_table = seq.block_table;
    const int64_t local = task - first_task[i];
    const int64_t t = seq.row + local / shape.n_heads;  // row in q and out
    const int64_t h = local % shape.n_heads;
    const int64_t kv_head = h / group;
    const int64_t n_keys = seq.pos0 + local / shape.n_heads + 1;  // causal
    // 4 accumulator groups: llama.cpp's ggml_vec_dot_f16; 1: its tinyBLAS GEMM.
    const int groups = attention_groups(seq.n_q, head_dim, shape.order);
    float* scores = scratch.data() + thread * scratch_per_thread;
    auto* q16 = reinterpret_cast<KvElement*>(scores + n_scores);
    float* lanes = scores + n_scores + head_dim;

    const float* qh = q + (t * shape.n_heads + h) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) q16[d] = fp32_to_fp16(qh[d]);

    // Keys in 16-token segments; a segment never crosses a block.
    for (int64_t t0 = 0; t0 < n_keys; t0 += kLanes) {
      const int64_t block = block_table[t0 / layout.block_size];
      const int64_t rows = std::min<int64_t>(kLanes, n_keys - t0);
      kernels.kq_scores(q16, cache + layout.k_offset(layer, block, kv_head, t0 % layout.block_size),
                        rows, head_dim, groups, scores + t0);
    }
    float max = -INFINITY;
    for (int64_t i = 0; i < n_keys; ++i) {
      scores[i] *= shape.scale;
      max = std::max(max, scores[i]);
    }
    const double sum = kernels.softmax_exp(scores, n_keys, max, scores);
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t i = 0; i < n_keys; ++i) scores[i] *= inv;
    kernels.round_f16(scores, n_keys);

    std::fill(lanes, lanes + groups * kLanes * head_dim, 0.0f);
    for (int64_t t0 = 0; t0 < n_keys; t0 += kLanes) {
      const int64_t block = block_table[t0 / layout.block_size];
      const int64_t rows = std::min<int64_t>(kLanes, n_keys - t0);
      const int64_t g = groups == 1 ? 0 : (t0 / kLanes) % kGroups;
      kernels.kqv_accumulate(scores + t0,
                             cache + layout.v_offset(layer, block, kv_head, t0 % layout.block_size),
                             rows, head_dim, lanes + g * kLanes * head_dim);
    }
    reduce_lanes(lanes, groups, head_dim, out + (t * shape.n_heads + h) * head_dim);
  });
}

}  // namespace duet::cpu

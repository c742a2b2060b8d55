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
// Query rows of one sequence whose scores come from one pass over the keys
// (a prefill's): each key segment is loaded and converted once for them all.
constexpr int64_t kMaxTileRows = 8;
// Keys before a sliding window are skipped in whole runs of this many, from
// key 0: the 16-key segments of kqv_sum's accumulator groups (4 of them) and
// of softmax_exp's chunks line up as if every key were there, so the skipped
// keys, whose probabilities are zeros, change no bit.
constexpr int64_t kSkipAlign = kLanes * kGroups;

// A hint that the line at p will be read soon (into L2; nothing on other CPUs).
inline void prefetch_l2(const char* p) {
#if defined(__GNUC__)
  __builtin_prefetch(p, 0, 2);
#else
  (void)p;
#endif
}

// x[i] *= scale for i < n; returns the largest x[i] (NaNs skipped). Sixteen
// running maxima, so that the loop is not one long chain of dependent
// comparisons; the maximum is the same whatever the order (up to the sign of
// a zero maximum, which exp(x - max) does not see).
// Elementwise and order-free, so every ISA's build of it gives the same
// bits: compiled for each, picked at load time.
#if defined(__GNUC__) && defined(__x86_64__)
#define DUET_ELEMENTWISE [[gnu::target_clones("avx512f", "avx2", "default")]]
#else
#define DUET_ELEMENTWISE
#endif

DUET_ELEMENTWISE float scale_and_max(float* x, int64_t n, float scale) {
  constexpr int kRunning = 16;  // one 512-bit register's worth
  float max[kRunning];
  std::fill(max, max + kRunning, -INFINITY);
  int64_t i = 0;
  for (; i + kRunning <= n; i += kRunning) {
    for (int l = 0; l < kRunning; ++l) {
      x[i + l] *= scale;
      max[l] = std::max(max[l], x[i + l]);
    }
  }
  for (; i < n; ++i) {
    x[i] *= scale;
    max[0] = std::max(max[0], x[i]);
  }
  for (int l = 1; l < kRunning; ++l) max[0] = std::max(max[0], max[l]);
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
  // A task is (sequence, tile of query rows, run of query heads). A run is
  // the `group` heads that read one KV head, so that each key and value is
  // loaded and converted once for them, unless that leaves too few tasks to
  // keep the threads busy (one sequence's decode step): then one head. A
  // tile is up to kMaxTileRows consecutive rows of one sequence in one
  // reduction order (a prefill chunk's), which read the same keys: their
  // scores come from one pass over the keys. Every row still reduces over
  // its own keys alone, in its own order: the results are the same whatever
  // the tiling.
  const int64_t min_tasks = kMinTasksPerThread * pool.size();
  const int64_t heads_per_task = n_rows * shape.n_kv_heads >= min_tasks ? group : 1;
  const int64_t runs_per_row = shape.n_heads / heads_per_task;
  const int64_t tile_rows = std::clamp<int64_t>(n_rows * runs_per_row / min_tasks, 1, kMaxTileRows);
  struct Tile {
    const AttentionSequence* seq;
    int64_t first;  // its first row, counted in the sequence
    int64_t rows;
  };
  std::vector<Tile> tiles;
  for (const AttentionSequence& s : sequences) {
    // The rows of each order apart, the latest (longest) tiles first.
    const int64_t split = std::clamp<int64_t>(s.one_token_from - s.pos0, 0, s.n_q);
    for (const auto& [begin, end] :
         {std::pair{split, s.n_q}, std::pair<int64_t, int64_t>{0, split}}) {
      for (int64_t last = end; last > begin; last -= tile_rows) {
        const int64_t first = std::max(begin, last - tile_rows);
        tiles.push_back({&s, first, last - first});
      }
    }
  }
  // Per thread: a tile's scores (the longest context rounded up to 16, per
  // row and head), its F16 queries, and the K and V segments of one KV head
  // (16 rows each).
  const int64_t n_scores = (max_ctx + kLanes - 1) / kLanes * kLanes;
  const int64_t tile_heads = tile_rows * heads_per_task;
  const int64_t scratch_per_thread = tile_heads * (n_scores + head_dim);
  std::vector<float> scratch(static_cast<size_t>(scratch_per_thread * pool.size()));
  const int64_t n_segments = n_scores / kLanes;
  std::vector<const KvElement*> segments(static_cast<size_t>(2 * n_segments * pool.size()));

  const int64_t n_tasks = static_cast<int64_t>(tiles.size()) * runs_per_row;
  pool.parallel_for(n_tasks, [&](int64_t task, int thread) {
    const Tile& tile = tiles[static_cast<size_t>(task / runs_per_row)];
    const AttentionSequence& seq = *tile.seq;
    const std::span<const int32_t> block_table = seq.block_table;
    const int64_t h0 = task % runs_per_row * heads_per_task;  // the run's first query head
    const int64_t kv_head = h0 / group;
    const int64_t t0 = seq.row + tile.first;  // the tile's first row in q and out
    const int64_t position0 = seq.pos0 + tile.first;
    const int64_t n_keys = position0 + tile.rows;  // causal: the tile's last row's keys
    // With a sliding window the tile reads keys [skip, n_keys) only: its
    // first row's window, from the run of kSkipAlign keys that holds it.
    const int64_t skip = shape.window > 0 && position0 >= shape.window
                             ? (position0 - shape.window + 1) / kSkipAlign * kSkipAlign
                             : 0;
    // 4 accumulator groups: llama.cpp's ggml_vec_dot_f16; 1: its tinyBLAS GEMM.
    const int groups = attention_groups(position0 >= seq.one_token_from, head_dim);
    const int64_t n_heads = tile.rows * heads_per_task;
    float* scores = scratch.data() + thread * scratch_per_thread;  // (row, head, n_scores)
    auto* q16 = reinterpret_cast<KvElement*>(scores + n_heads * n_scores);
    const KvElement** k_segments = segments.data() + 2 * thread * n_segments;
    const KvElement** v_segments = k_segments + n_segments;

    // Keys and values in 16-token segments; a segment never crosses a block.
    for (int64_t k0 = skip; k0 < n_keys; k0 += kLanes) {
      const int64_t block = block_table[k0 / layout.block_size];
      const int64_t slot = k0 % layout.block_size;
      k_segments[k0 / kLanes] = cache + layout.k_offset(layer, block, kv_head, slot);
      v_segments[k0 / kLanes] = cache + layout.v_offset(layer, block, kv_head, slot);
    }
    // The values are read after the keys and the softmax: ask for them now.
    for (int64_t k0 = skip; k0 < n_keys; k0 += kLanes) {
      const auto* v = reinterpret_cast<const char*>(v_segments[k0 / kLanes]);
      const int64_t bytes = std::min<int64_t>(kLanes, n_keys - k0) * head_dim * sizeof(KvElement);
      for (int64_t b = 0; b < bytes; b += 64) prefetch_l2(v + b);
    }
    for (int64_t r = 0; r < tile.rows; ++r) {
      kernels.convert_f16(q + ((t0 + r) * shape.n_heads + h0) * head_dim,
                          q16 + r * heads_per_task * head_dim, heads_per_task * head_dim);
    }
    // Scores, probabilities and values from key `skip` on: index t is key skip + t.
    const KvElement* const* k_from = k_segments + skip / kLanes;
    const KvElement* const* v_from = v_segments + skip / kLanes;
    kernels.kq_scores(q16, n_heads, k_from, n_keys - skip, head_dim, groups, scores, n_scores);
    for (int64_t r = 0; r < tile.rows; ++r) {
      const int64_t row_keys = position0 + r + 1 - skip;  // this row's own keys
      // Keys before the row's window weigh nothing, as under llama.cpp's -inf mask.
      const int64_t masked =
          shape.window > 0 ? std::max<int64_t>(0, position0 + r + 1 - shape.window - skip) : 0;
      for (int64_t h = 0; h < heads_per_task; ++h) {
        float* p = scores + (r * heads_per_task + h) * n_scores;
        std::fill(p, p + masked, -INFINITY);
        const float max = scale_and_max(p, row_keys, shape.scale);
        const double sum = kernels.softmax_exp(p, row_keys, max, p);
        kernels.scale_round_f16(p, row_keys, static_cast<float>(1.0 / sum));
      }
    }
    float* tile_out = out + (t0 * shape.n_heads + h0) * head_dim;
    const int64_t ld_out = shape.n_heads * head_dim;
    if (kernels.kqv_sum_tile != nullptr) {
      kernels.kqv_sum_tile(scores, n_scores, heads_per_task, tile.rows, position0 + 1 - skip,
                           v_from, head_dim, groups, tile_out, ld_out);
      return;
    }
    for (int64_t r = 0; r < tile.rows; ++r) {
      kernels.kqv_sum(scores + r * heads_per_task * n_scores, n_scores, heads_per_task, v_from,
                      position0 + r + 1 - skip, head_dim, groups, tile_out + r * ld_out);
    }
  });
}

}  // namespace duet::cpu

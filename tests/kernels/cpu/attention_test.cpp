// Paged attention against a contiguous double-precision reference; its
// independence from which physical blocks hold the sequence, from the ISA path,
// from the thread count and from how a prefill is split into steps. The
// primitives it is built from: attention_primitives_test.cpp.
#include "kernels/cpu/attention.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/model/fp16.h"
#include "common/model/kv_layout.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/lane_math.h"
#include "kernels/cpu/thread_pool.h"
#include "tests/kernels/cpu/float_vectors.h"

namespace duet::cpu {
namespace {

float round_half(float x) { return fp16_to_fp32(fp32_to_fp16(x)); }

// ---------------------------------------------------------------------------
// Paged attention.

struct AttentionCase {
  int64_t head_dim;
  int64_t block_size;
  int64_t n_ctx;
};

std::string case_name(const AttentionCase& c) {
  return "head_dim " + std::to_string(c.head_dim) + ", block_size " + std::to_string(c.block_size) +
         ", n_ctx " + std::to_string(c.n_ctx);
}

constexpr int64_t kLayers = 2;
constexpr int64_t kKvHeads = 2;
constexpr int64_t kHeads = 6;  // 3 query heads per KV head
constexpr int64_t kBlocks = 12;
constexpr int64_t kLayer = 1;            // the layer under test; layer 0 holds other data
constexpr KvElement kSentinel = 0x7e01;  // a NaN no store writes

// One sequence's K, V (n_ctx, n_kv_heads * head_dim) for both layers, and its
// cache under a given block table.
struct Sequence {
  KvLayout layout;
  AttentionShape shape;
  int64_t n_ctx = 0;
  std::vector<float> k[kLayers], v[kLayers];

  Sequence(const AttentionCase& c, std::mt19937& rng) : n_ctx(c.n_ctx) {
    layout.n_layers = kLayers;
    layout.n_kv_heads = kKvHeads;
    layout.head_dim = c.head_dim;
    layout.block_size = c.block_size;
    layout.n_blocks = kBlocks;
    shape.n_heads = kHeads;
    shape.n_kv_heads = kKvHeads;
    shape.head_dim = c.head_dim;
    shape.scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    for (int64_t l = 0; l < kLayers; ++l) {
      k[l] = random_floats(static_cast<size_t>(n_ctx * kKvHeads * c.head_dim), 1.0f, rng);
      v[l] = random_floats(static_cast<size_t>(n_ctx * kKvHeads * c.head_dim), 1.0f, rng);
    }
  }

  // A block table over a shuffled permutation of the physical blocks.
  std::vector<int32_t> block_table(uint32_t seed) const {
    std::vector<int32_t> blocks(kBlocks);
    std::iota(blocks.begin(), blocks.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(blocks.begin(), blocks.end(), rng);
    blocks.resize(static_cast<size_t>((n_ctx + layout.block_size - 1) / layout.block_size));
    return blocks;
  }

  // Stores every position, in uneven chunks, into a cache filled with kSentinel.
  std::vector<KvElement> store(const std::vector<int32_t>& table) const {
    std::vector<KvElement> cache(static_cast<size_t>(layout.total_elems()), kSentinel);
    const int64_t row = kKvHeads * layout.head_dim;
    for (int64_t l = 0; l < kLayers; ++l) {
      int64_t pos = 0;
      for (int64_t chunk = 1; pos < n_ctx; chunk = chunk * 2 + 1) {
        const int64_t n = std::min(chunk, n_ctx - pos);
        kv_cache_store(layout, cache.data(), l, table, pos, n, k[l].data() + pos * row,
                       v[l].data() + pos * row);
        pos += n;
      }
    }
    return cache;
  }

  // out (n_q, n_heads * head_dim) by softmax(scale q.k) v in double, from the
  // F16-rounded q, K and V of layer kLayer; a window (> 0) keeps each query's
  // last `window` keys.
  std::vector<double> reference(const std::vector<float>& q, int64_t n_q, int64_t pos0,
                                int64_t window = 0) const {
    const int64_t hd = layout.head_dim, row = kKvHeads * hd, group = kHeads / kKvHeads;
    std::vector<double> out(static_cast<size_t>(n_q * kHeads * hd), 0.0);
    for (int64_t t = 0; t < n_q; ++t) {
      const int64_t n_keys = pos0 + t + 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, n_keys - window) : 0;
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t kvh = h / group;
        const float* qh = q.data() + (t * kHeads + h) * hd;
        std::vector<double> p(static_cast<size_t>(n_keys), -INFINITY);
        double max = -INFINITY;
        for (int64_t s = first; s < n_keys; ++s) {
          double dot = 0.0;
          for (int64_t d = 0; d < hd; ++d) {
            dot += static_cast<double>(round_half(qh[d])) *
                   round_half(k[kLayer][s * row + kvh * hd + d]);
          }
          p[s] = dot * shape.scale;
          max = std::max(max, p[s]);
        }
        double sum = 0.0;
        for (double& x : p) sum += (x = std::exp(x - max));
        double* o = out.data() + (t * kHeads + h) * hd;
        for (int64_t s = 0; s < n_keys; ++s) {
          for (int64_t d = 0; d < hd; ++d) {
            o[d] += p[s] / sum * round_half(v[kLayer][s * row + kvh * hd + d]);
          }
        }
      }
    }
    return out;
  }
};

std::vector<float> run_attention(const KernelTable& kernels, const Sequence& seq,
                                 const std::vector<KvElement>& cache,
                                 const std::vector<int32_t>& table, const std::vector<float>& q,
                                 int64_t n_q, int64_t pos0, ThreadPool& pool, int64_t window = 0) {
  std::vector<float> out(static_cast<size_t>(n_q * kHeads * seq.layout.head_dim), NAN);
  AttentionShape shape = seq.shape;
  shape.window = window;
  attention(kernels, seq.layout, cache.data(), kLayer, table, shape, q.data(), n_q, pos0,
            out.data(), pool);
  return out;
}

// The whole prompt's attention (q holds every position's rows) computed in
// steps of `chunk` tokens, never leaving a single-token step, concatenated.
std::vector<float> run_in_chunks(const KernelTable& kernels, const Sequence& seq,
                                 const std::vector<KvElement>& cache,
                                 const std::vector<int32_t>& table, const std::vector<float>& q,
                                 int64_t chunk, ThreadPool& pool, int64_t window = 0) {
  const int64_t row = kHeads * seq.layout.head_dim;
  std::vector<float> pieces;
  for (int64_t pos0 = 0; pos0 < seq.n_ctx;) {
    int64_t n = std::min(chunk, seq.n_ctx - pos0);
    if (seq.n_ctx - pos0 - n == 1) ++n;
    const std::vector<float> qc(q.begin() + pos0 * row, q.begin() + (pos0 + n) * row);
    const std::vector<float> out =
        run_attention(kernels, seq, cache, table, qc, n, pos0, pool, window);
    pieces.insert(pieces.end(), out.begin(), out.end());
    pos0 += n;
  }
  return pieces;
}

// max |out - ref| / max |ref|
double normalized_error(const std::vector<float>& out, const std::vector<double>& ref) {
  double max_diff = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(out[i] - ref[i]));
    max_ref = std::max(max_ref, std::fabs(ref[i]));
  }
  return max_diff / max_ref;
}

const AttentionCase kCases[] = {
    {64, 16, 150}, {64, 32, 300}, {32, 16, 161}, {32, 32, 64}, {80, 16, 97}, {64, 16, 1},
};

TEST(KvCacheStore, WritesEachRowWhereTheLayoutSays) {
  std::mt19937 rng(11);
  for (const AttentionCase& c : kCases) {
    SCOPED_TRACE(case_name(c));
    const Sequence seq(c, rng);
    const std::vector<int32_t> table = seq.block_table(1);
    const std::vector<KvElement> cache = seq.store(table);
    const KvLayout& layout = seq.layout;
    std::vector<bool> written(cache.size(), false);
    const int64_t row = kKvHeads * layout.head_dim;
    for (int64_t l = 0; l < kLayers; ++l) {
      for (int64_t pos = 0; pos < seq.n_ctx; ++pos) {
        const int64_t block = table[pos / layout.block_size], slot = pos % layout.block_size;
        for (int64_t h = 0; h < kKvHeads; ++h) {
          for (int64_t d = 0; d < layout.head_dim; ++d) {
            const int64_t ko = layout.k_offset(l, block, h, slot) + d;
            const int64_t vo = layout.v_offset(l, block, h, slot) + d;
            ASSERT_EQ(cache[ko], fp32_to_fp16(seq.k[l][pos * row + h * layout.head_dim + d]));
            ASSERT_EQ(cache[vo], fp32_to_fp16(seq.v[l][pos * row + h * layout.head_dim + d]));
            written[ko] = written[vo] = true;
          }
        }
      }
    }
    for (size_t i = 0; i < cache.size(); ++i) {
      if (!written[i]) {
        ASSERT_EQ(cache[i], kSentinel) << "stray write at element " << i;
      }
    }
  }
}

TEST(KvCacheStore, BatchWritesWhatOneSequenceAtATimeWrites) {
  std::mt19937 rng(16);
  ThreadPool pool(2);
  const AttentionCase c{64, 16, 40};
  const Sequence seq(c, rng);
  const int64_t row = kKvHeads * c.head_dim;
  // Three sequences of different lengths and positions in one batch.
  const std::vector<int32_t> tables[3] = {{0, 1, 2}, {5, 3}, {11, 7, 9, 4}};
  const int64_t pos0[3] = {0, 17, 30}, n_rows[3] = {19, 2, 21};
  std::vector<AttentionSequence> batch;
  int64_t rows = 0;
  for (int i = 0; i < 3; ++i) {
    batch.push_back({tables[i], pos0[i], n_rows[i], rows});
    rows += n_rows[i];
  }
  const std::vector<float> k = random_floats(static_cast<size_t>(rows * row), 1.0f, rng);
  const std::vector<float> v = random_floats(static_cast<size_t>(rows * row), 1.0f, rng);
  std::vector<KvElement> expected(static_cast<size_t>(seq.layout.total_elems()), kSentinel);
  for (const AttentionSequence& s : batch) {
    kv_cache_store(seq.layout, expected.data(), kLayer, s.block_table, s.pos0, s.n_q,
                   k.data() + s.row * row, v.data() + s.row * row);
  }
  for (Isa isa : supported_isas()) {
    std::vector<KvElement> cache(expected.size(), kSentinel);
    kv_cache_store_batch(kernel_table(isa), seq.layout, cache.data(), kLayer, batch, k.data(),
                         v.data(), pool);
    EXPECT_EQ(cache, expected) << isa_name(isa);
  }
}

TEST(KvCacheStore, RejectsPositionsBeyondTheBlockTable) {
  std::mt19937 rng(16);
  const Sequence seq({64, 16, 40}, rng);  // 3 blocks
  const std::vector<int32_t> table = seq.block_table(7);
  std::vector<KvElement> cache(static_cast<size_t>(seq.layout.total_elems()), kSentinel);
  const std::vector<float> row(static_cast<size_t>(2 * kKvHeads * 64), 0.5f);
  EXPECT_NO_THROW(
      kv_cache_store(seq.layout, cache.data(), 0, table, 47, 1, row.data(), row.data()));
  EXPECT_THROW(kv_cache_store(seq.layout, cache.data(), 0, table, 47, 2, row.data(), row.data()),
               std::exception);
}

TEST(Attention, GroupsFollowTheRowsOrder) {
  EXPECT_EQ(attention_groups(true, 64), 4);
  EXPECT_EQ(attention_groups(false, 64), 1);
  EXPECT_EQ(attention_groups(false, 32), 1);
  EXPECT_EQ(attention_groups(false, 40), 4);  // the GEMM order needs head_dim % 16 == 0
}

TEST(Attention, MatchesReferenceOnEveryIsa) {
  std::mt19937 rng(12);
  ThreadPool pool(2);
  for (const AttentionCase& c : kCases) {
    const Sequence seq(c, rng);
    const std::vector<int32_t> table = seq.block_table(2);
    const std::vector<KvElement> cache = seq.store(table);
    const int64_t hd = c.head_dim;
    // Decode at the last position, a prefill chunk ending there, and the whole prefill.
    const int64_t chunk = std::min<int64_t>(c.n_ctx, 19);
    for (auto [n_q, pos0] :
         {std::pair<int64_t, int64_t>{1, c.n_ctx - 1}, {chunk, c.n_ctx - chunk}, {c.n_ctx, 0}}) {
      SCOPED_TRACE(case_name(c) + ", n_q " + std::to_string(n_q) + ", pos0 " +
                   std::to_string(pos0));
      const std::vector<float> q = random_floats(static_cast<size_t>(n_q * kHeads * hd), 2.0f, rng);
      const std::vector<double> ref = seq.reference(q, n_q, pos0);
      std::vector<float> scalar_out;
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(std::string(isa_name(isa)));
        const std::vector<float> out =
            run_attention(kernel_table(isa), seq, cache, table, q, n_q, pos0, pool);
        EXPECT_LT(normalized_error(out, ref), 2e-3);
        if (isa == Isa::kScalar) {
          scalar_out = out;
        } else {
          EXPECT_TRUE(bitwise_equal(out, scalar_out)) << "differs from the scalar path";
        }
      }
    }
  }
}

TEST(Attention, IndependentOfPhysicalBlocks) {
  std::mt19937 rng(13);
  ThreadPool pool(1);
  for (const AttentionCase& c : kCases) {
    SCOPED_TRACE(case_name(c));
    const Sequence seq(c, rng);
    const std::vector<int32_t> table_a = seq.block_table(3), table_b = seq.block_table(4);
    if (c.n_ctx > c.block_size) {
      ASSERT_NE(table_a, table_b);
    }
    const std::vector<KvElement> cache_a = seq.store(table_a), cache_b = seq.store(table_b);
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)));
      for (int64_t n_q : {int64_t{1}, std::min<int64_t>(c.n_ctx, 21)}) {
        const int64_t pos0 = c.n_ctx - n_q;
        const std::vector<float> q =
            random_floats(static_cast<size_t>(n_q * kHeads * c.head_dim), 2.0f, rng);
        EXPECT_TRUE(bitwise_equal(
            run_attention(kernel_table(isa), seq, cache_a, table_a, q, n_q, pos0, pool),
            run_attention(kernel_table(isa), seq, cache_b, table_b, q, n_q, pos0, pool)))
            << "n_q " << n_q;
      }
    }
  }
}

TEST(Attention, IndependentOfThreadCount) {
  std::mt19937 rng(14);
  ThreadPool pool1(1), pool2(2), pool3(3);
  for (const AttentionCase& c : kCases) {
    SCOPED_TRACE(case_name(c));
    const Sequence seq(c, rng);
    const std::vector<int32_t> table = seq.block_table(5);
    const std::vector<KvElement> cache = seq.store(table);
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)));
      // Decode steps at several positions, and one prefill chunk.
      for (auto [n_q, pos0] : {std::pair<int64_t, int64_t>{1, c.n_ctx - 1},
                               {1, c.n_ctx / 2},
                               {1, 0},
                               {std::min<int64_t>(c.n_ctx, 9), 0}}) {
        const std::vector<float> q =
            random_floats(static_cast<size_t>(n_q * kHeads * c.head_dim), 2.0f, rng);
        const std::vector<float> one =
            run_attention(kernel_table(isa), seq, cache, table, q, n_q, pos0, pool1);
        for (ThreadPool* pool : {&pool2, &pool3}) {
          EXPECT_TRUE(bitwise_equal(
              one, run_attention(kernel_table(isa), seq, cache, table, q, n_q, pos0, *pool)))
              << "n_q " << n_q << " pos0 " << pos0 << ", " << pool->size() << " threads";
        }
      }
    }
  }
}

// Every multi-token step reduces in the same (GEMM) order, so a prefill split
// into chunks of two or more tokens gives the same bits as one big step.
TEST(Attention, PrefillChunksOfTwoOrMoreMatchOneStep) {
  std::mt19937 rng(15);
  ThreadPool pool(2);
  for (const AttentionCase& c : kCases) {
    if (c.n_ctx < 4) continue;
    SCOPED_TRACE(case_name(c));
    const Sequence seq(c, rng);
    const std::vector<int32_t> table = seq.block_table(6);
    const std::vector<KvElement> cache = seq.store(table);
    const int64_t row = kHeads * c.head_dim;
    const std::vector<float> q = random_floats(static_cast<size_t>(c.n_ctx * row), 2.0f, rng);
    for (Isa isa : supported_isas()) {
      SCOPED_TRACE(std::string(isa_name(isa)));
      const std::vector<float> whole =
          run_attention(kernel_table(isa), seq, cache, table, q, c.n_ctx, 0, pool);
      for (int64_t chunk : {2, 3, 7, 16}) {
        EXPECT_TRUE(bitwise_equal(
            run_in_chunks(kernel_table(isa), seq, cache, table, q, chunk, pool), whole))
            << "chunks of " << chunk;
      }
    }
  }
}

// A sliding window (gemma3's layers): each query attends to its last
// `window` keys. Against the reference, the same bits on every ISA, and the
// same bits however a prefill is cut into steps (the keys skipped before a
// tile's window are whole runs that line up with the reduction orders).
TEST(Attention, SlidingWindowMatchesReferenceAndIsStepInvariant) {
  std::mt19937 rng(16);
  ThreadPool pool(2);
  for (const AttentionCase& c : {AttentionCase{64, 16, 150}, AttentionCase{32, 32, 300}}) {
    const Sequence seq(c, rng);
    const std::vector<int32_t> table = seq.block_table(7);
    const std::vector<KvElement> cache = seq.store(table);
    const int64_t row = kHeads * c.head_dim;
    const std::vector<float> q = random_floats(static_cast<size_t>(c.n_ctx * row), 2.0f, rng);
    for (int64_t window : {1, 5, 17, 64, 70, 1000}) {
      SCOPED_TRACE(case_name(c) + ", window " + std::to_string(window));
      const std::vector<double> ref = seq.reference(q, c.n_ctx, 0, window);
      std::vector<float> scalar_whole;
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(std::string(isa_name(isa)));
        const std::vector<float> whole =
            run_attention(kernel_table(isa), seq, cache, table, q, c.n_ctx, 0, pool, window);
        EXPECT_LT(normalized_error(whole, ref), 2e-3);
        if (isa == Isa::kScalar) {
          scalar_whole = whole;
        } else {
          EXPECT_TRUE(bitwise_equal(whole, scalar_whole)) << "differs from the scalar path";
        }
        for (int64_t chunk : {2, 9, 33}) {
          EXPECT_TRUE(bitwise_equal(
              run_in_chunks(kernel_table(isa), seq, cache, table, q, chunk, pool, window), whole))
              << "chunks of " << chunk;
        }
        // Decode steps: one token at a time, against the reference row.
        for (int64_t pos : {c.n_ctx - 1, c.n_ctx / 2, int64_t{3}}) {
          const std::vector<float> qr(q.begin() + pos * row, q.begin() + (pos + 1) * row);
          const std::vector<float> out =
              run_attention(kernel_table(isa), seq, cache, table, qr, 1, pos, pool, window);
          const std::vector<double> ref_row(ref.begin() + pos * row, ref.begin() + (pos + 1) * row);
          EXPECT_LT(normalized_error(out, ref_row), 2e-3) << "decode at " << pos;
        }
      }
    }
  }
}

}  // namespace
}  // namespace duet::cpu

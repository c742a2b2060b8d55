// Paged attention against a contiguous double-precision reference; its
// independence from which physical blocks hold the sequence, from the ISA path
// and from the thread count; and the attention primitives of every ISA path
// against their definitions in kernel_table.h and lane_math.h, bit for bit.
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

namespace duet::cpu {
namespace {

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

float round_half(float x) { return fp16_to_fp32(fp32_to_fp16(x)); }

std::vector<float> random_floats(size_t n, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

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
  // F16-rounded q, K and V of layer kLayer.
  std::vector<double> reference(const std::vector<float>& q, int64_t n_q, int64_t pos0) const {
    const int64_t hd = layout.head_dim, row = kKvHeads * hd, group = kHeads / kKvHeads;
    std::vector<double> out(static_cast<size_t>(n_q * kHeads * hd), 0.0);
    for (int64_t t = 0; t < n_q; ++t) {
      const int64_t n_keys = pos0 + t + 1;
      for (int64_t h = 0; h < kHeads; ++h) {
        const int64_t kvh = h / group;
        const float* qh = q.data() + (t * kHeads + h) * hd;
        std::vector<double> p(static_cast<size_t>(n_keys));
        double max = -INFINITY;
        for (int64_t s = 0; s < n_keys; ++s) {
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
                                 int64_t n_q, int64_t pos0, ThreadPool& pool) {
  std::vector<float> out(static_cast<size_t>(n_q * kHeads * seq.layout.head_dim), NAN);
  attention(kernels, seq.layout, cache.data(), kLayer, table, seq.shape, q.data(), n_q, pos0,
            out.data(), pool);
  return out;
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
        std::vector<float> pieces;
        for (int64_t pos0 = 0; pos0 < c.n_ctx;) {
          int64_t n = std::min(chunk, c.n_ctx - pos0);
          if (c.n_ctx - pos0 - n == 1) ++n;  // never leave a single-token step
          const std::vector<float> qc(q.begin() + pos0 * row, q.begin() + (pos0 + n) * row);
          const std::vector<float> out =
              run_attention(kernel_table(isa), seq, cache, table, qc, n, pos0, pool);
          pieces.insert(pieces.end(), out.begin(), out.end());
          pos0 += n;
        }
        EXPECT_TRUE(bitwise_equal(pieces, whole)) << "chunks of " << chunk;
      }
    }
  }
}

// ---------------------------------------------------------------------------
// The primitives, against the definitions in kernel_table.h.

void kq_scores_definition(const uint16_t* q, const uint16_t* k, int64_t n_rows, int64_t dim,
                          int groups, float* out) {
  for (int64_t t = 0; t < n_rows; ++t) {
    const uint16_t* kr = k + t * dim;
    float acc[4][16] = {};
    const int64_t n_whole = groups == 1 ? dim : dim - dim % 64;
    for (int64_t c = 0; c < n_whole / 16; ++c) {
      float* a = acc[groups == 1 ? 0 : c % 4];
      for (int l = 0; l < 16; ++l) {
        a[l] = std::fma(fp16_to_fp32(q[c * 16 + l]), fp16_to_fp32(kr[c * 16 + l]), a[l]);
      }
    }
    float lanes[16];
    for (int l = 0; l < 16; ++l) {
      lanes[l] = groups == 1 ? acc[0][l] : (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    double sum = lane_tree_sum16(lanes);
    for (int64_t e = n_whole; e < dim; ++e) {
      sum += static_cast<double>(fp16_to_fp32(q[e])) * static_cast<double>(fp16_to_fp32(kr[e]));
    }
    out[t] = static_cast<float>(sum);
  }
}

std::vector<uint16_t> random_halves(size_t n, std::mt19937& rng) {
  std::vector<uint16_t> h(n);
  const std::vector<float> f = random_floats(n, 1.0f, rng);
  for (size_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(f[i]);
  return h;
}

// Segments (16 rows of dim halves each) in separate buffers, as the blocks of
// a paged cache are, covering n_keys rows.
struct Segments {
  std::vector<std::vector<uint16_t>> buffers;
  std::vector<const uint16_t*> pointers;
  Segments(int64_t n_keys, int64_t dim, std::mt19937& rng) {
    for (int64_t t0 = 0; t0 < n_keys; t0 += 16) {
      buffers.push_back(random_halves(static_cast<size_t>(16 * dim), rng));
    }
    for (const auto& b : buffers) pointers.push_back(b.data());
  }
  const uint16_t* row(int64_t t, int64_t dim) const {
    return buffers[static_cast<size_t>(t / 16)].data() + t % 16 * dim;
  }
};

TEST(AttentionPrimitives, KqScoresFollowTheContract) {
  std::mt19937 rng(21);
  for (int64_t dim : {16, 32, 64, 80, 128, 144, 272}) {
    for (int groups : {1, 4}) {
      for (int64_t n_keys : {1, 5, 16, 17, 40}) {
        for (int64_t n_q : {1, 3, 4, 7, 24, 32}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " groups " + std::to_string(groups) +
                       " keys " + std::to_string(n_keys) + " heads " + std::to_string(n_q));
          const std::vector<uint16_t> q = random_halves(static_cast<size_t>(n_q * dim), rng);
          const Segments k(n_keys, dim, rng);
          const int64_t ld_out = n_keys + 3;  // padding the kernel must not write
          std::vector<float> expected(static_cast<size_t>(n_q * ld_out), NAN);
          for (int64_t h = 0; h < n_q; ++h) {
            for (int64_t t = 0; t < n_keys; ++t) {
              kq_scores_definition(q.data() + h * dim, k.row(t, dim), 1, dim, groups,
                                   expected.data() + h * ld_out + t);
            }
          }
          for (Isa isa : supported_isas()) {
            std::vector<float> out(expected.size(), NAN);
            kernel_table(isa).kq_scores(q.data(), n_q, k.pointers.data(), n_keys, dim, groups,
                                        out.data(), ld_out);
            EXPECT_TRUE(bitwise_equal(out, expected)) << isa_name(isa);  // NaN padding included
          }
        }
      }
    }
  }
}

// kqv_sum as kernel_table.h defines it, spelled out loop by loop.
void kqv_sum_definition(const float* p, const std::vector<std::vector<uint16_t>>& segments,
                        int64_t n_keys, int64_t dim, int groups, float* out) {
  std::vector<float> lanes(static_cast<size_t>(4 * 16 * dim), 0.0f);
  for (int64_t t = 0; t < n_keys; ++t) {
    const int64_t m = t / 16, s = t % 16, g = m % groups;
    for (int64_t d = 0; d < dim; ++d) {
      float& lane = lanes[static_cast<size_t>((g * 16 + s) * dim + d)];
      lane = std::fma(fp16_to_fp32(segments[static_cast<size_t>(m)][s * dim + d]), p[t], lane);
    }
  }
  for (int64_t d = 0; d < dim; ++d) {
    float g[16];
    for (int64_t s = 0; s < 16; ++s) {
      auto at = [&](int64_t group) {
        return lanes[static_cast<size_t>((group * 16 + s) * dim + d)];
      };
      g[s] = groups == 1 ? at(0) : (at(0) + at(2)) + (at(1) + at(3));
    }
    out[d] = lane_tree_sum16(g);
  }
}

TEST(AttentionPrimitives, KqvSumFollowsTheContract) {
  std::mt19937 rng(22);
  for (int64_t dim : {16, 32, 36, 64, 80, 128, 200}) {
    for (int groups : {1, 4}) {
      for (int64_t n_keys : {1, 7, 16, 17, 64, 100, 250}) {
        for (int64_t n_q : {1, 2, 3, 4, 7}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " groups " + std::to_string(groups) +
                       " keys " + std::to_string(n_keys) + " heads " + std::to_string(n_q));
          const int64_t ld_p = n_keys + 5;
          const std::vector<float> p = random_floats(static_cast<size_t>(n_q * ld_p), 0.3f, rng);
          const Segments v(n_keys, dim, rng);
          std::vector<float> expected(static_cast<size_t>(n_q * dim));
          for (int64_t h = 0; h < n_q; ++h) {
            kqv_sum_definition(p.data() + h * ld_p, v.buffers, n_keys, dim, groups,
                               expected.data() + h * dim);
          }
          for (Isa isa : supported_isas()) {
            std::vector<float> out(expected.size() + 1, NAN);
            kernel_table(isa).kqv_sum(p.data(), ld_p, n_q, v.pointers.data(), n_keys, dim, groups,
                                      out.data());
            EXPECT_TRUE(std::isnan(out.back())) << isa_name(isa) << " wrote past the last head";
            out.pop_back();
            EXPECT_TRUE(bitwise_equal(out, expected)) << isa_name(isa);
          }
        }
      }
    }
  }
}

// A tile of rows with one more key each, across several of the tile
// kernel's key blocks, against the definition row by row.
TEST(AttentionPrimitives, KqvSumTileFollowsTheContract) {
  std::mt19937 rng(23);
  for (int64_t dim : {16, 36, 64, 80, 128}) {
    for (int groups : {1, 4}) {
      for (int64_t n_keys0 : {1, 15, 16, 127, 300}) {
        for (auto [n_q, n_rows] : {std::pair<int64_t, int64_t>{1, 1}, {3, 8}, {2, 5}, {4, 3}}) {
          SCOPED_TRACE("dim " + std::to_string(dim) + " groups " + std::to_string(groups) +
                       " keys " + std::to_string(n_keys0) + " heads " + std::to_string(n_q) +
                       " rows " + std::to_string(n_rows));
          const int64_t n_keys = n_keys0 + n_rows - 1;
          const int64_t ld_p = n_keys + 3;
          const int64_t ld_out = n_q * dim + 7;
          const std::vector<float> p =
              random_floats(static_cast<size_t>(n_rows * n_q * ld_p), 0.3f, rng);
          const Segments v(n_keys, dim, rng);
          std::vector<float> expected(static_cast<size_t>(n_rows * ld_out), NAN);
          for (int64_t r = 0; r < n_rows; ++r) {
            for (int64_t h = 0; h < n_q; ++h) {
              kqv_sum_definition(p.data() + (r * n_q + h) * ld_p, v.buffers, n_keys0 + r, dim,
                                 groups, expected.data() + r * ld_out + h * dim);
            }
          }
          for (Isa isa : supported_isas()) {
            const KernelTable& kernels = kernel_table(isa);
            if (kernels.kqv_sum_tile == nullptr) continue;
            std::vector<float> out(expected.size(), NAN);
            kernels.kqv_sum_tile(p.data(), ld_p, n_q, n_rows, n_keys0, v.pointers.data(), dim,
                                 groups, out.data(), ld_out);
            EXPECT_TRUE(bitwise_equal(out, expected)) << isa_name(isa);
          }
        }
      }
    }
  }
}

TEST(AttentionPrimitives, SoftmaxExpFollowsTheContract) {
  std::mt19937 rng(23);
  for (int64_t n : {1, 5, 15, 16, 17, 33, 100, 257}) {
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<float> x =
          random_floats(static_cast<size_t>(n), variant == 2 ? 40.0f : 3.0f, rng);
      if (variant == 1 && n > 1) x[rng() % n] = -INFINITY;  // a masked score
      const float max = *std::max_element(x.begin(), x.end());
      std::vector<float> expected(x.size());
      double expected_sum = 0.0;
      for (int64_t i = 0; i < n; i += 16) {
        float chunk[16] = {};
        for (int64_t l = 0; l < 16 && i + l < n; ++l) {
          chunk[l] = expected[i + l] = ggml_expf(x[i + l] - max);
        }
        expected_sum += static_cast<double>(lane_tree_sum16(chunk));
      }
      for (Isa isa : supported_isas()) {
        SCOPED_TRACE(std::string(isa_name(isa)) + " n " + std::to_string(n) + " variant " +
                     std::to_string(variant));
        std::vector<float> y(x.size() + 1, NAN);  // one guard element
        const double sum = kernel_table(isa).softmax_exp(x.data(), n, max, y.data());
        EXPECT_TRUE(std::isnan(y.back())) << "wrote past n";
        y.pop_back();
        EXPECT_TRUE(bitwise_equal(y, expected));
        EXPECT_EQ(std::bit_cast<uint64_t>(sum), std::bit_cast<uint64_t>(expected_sum));
        // In place, as attention calls it.
        std::vector<float> inplace = x;
        const double sum2 = kernel_table(isa).softmax_exp(inplace.data(), n, max, inplace.data());
        EXPECT_TRUE(bitwise_equal(inplace, expected));
        EXPECT_EQ(std::bit_cast<uint64_t>(sum2), std::bit_cast<uint64_t>(expected_sum));
      }
    }
  }
}

// llama.cpp's AVX-512 ggml_v_expf (which ggml_expf reproduces) adds the
// polynomial's constant 1 inside an FMA before scaling, one rounding more than
// the ARM routine its "1.45358 plus 0.5 ulps" comment comes from: measured
// here, 2.22 ulp and 2.25e-7 relative at worst on [-80, 80].
TEST(LaneMath, GgmlExpfIsAccurate) {
  double max_rel = 0.0, max_ulp = 0.0;
  float worst_rel = 0.0f, worst_ulp = 0.0f;
  std::mt19937 rng(24);
  std::uniform_real_distribution<float> uniform(-80.0f, 80.0f);
  auto check = [&](float x) {
    const double exact = std::exp(static_cast<double>(x));
    const double diff = std::fabs(ggml_expf(x) - exact);
    const float nearest = static_cast<float>(exact);
    const double ulp = std::nextafter(nearest, INFINITY) - static_cast<double>(nearest);
    if (diff / exact > max_rel) {
      max_rel = diff / exact;
      worst_rel = x;
    }
    if (diff / ulp > max_ulp) {
      max_ulp = diff / ulp;
      worst_ulp = x;
    }
  };
  for (int i = 0; i <= 2'000'000; ++i) check(-80.0f + 160.0f * static_cast<float>(i) / 2e6f);
  for (int i = 0; i < 1'000'000; ++i) check(uniform(rng));
  for (float x = -1.0f; x <= 1.0f; x += 1.0f / 4096) check(x);
  EXPECT_LT(max_ulp, 2.5) << "worst at x = " << worst_ulp;
  EXPECT_LT(max_rel, 2.5e-7) << "worst at x = " << worst_rel;
  std::printf("  ggml_expf on [-80, 80]: max error %.3f ulp (x = %.9g), %.3g relative (x = %.9g)\n",
              max_ulp, worst_ulp, max_rel, worst_rel);
  EXPECT_EQ(ggml_expf(0.0f), 1.0f);
  EXPECT_EQ(ggml_expf(-INFINITY), 0.0f);
  EXPECT_EQ(ggml_expf(-1000.0f), 0.0f);
  EXPECT_EQ(ggml_expf(INFINITY), INFINITY);
  EXPECT_EQ(ggml_expf(89.0f), INFINITY);
  EXPECT_EQ(ggml_expf(1000.0f), INFINITY);
  EXPECT_TRUE(std::isnan(ggml_expf(NAN)));
}

TEST(LaneMath, LaneTreeSumPairsLaneWithLanePlus8First) {
  float v[16] = {};
  v[0] = 1e8f;
  v[1] = 1.0f;
  v[8] = -1e8f;  // cancels lane 0 before the 1 is added; a left-to-right sum would lose the 1
  EXPECT_EQ(lane_tree_sum16(v), 1.0f);
  for (int l = 0; l < 16; ++l) v[l] = static_cast<float>(l + 1);
  EXPECT_EQ(lane_tree_sum16(v), 136.0f);
}

}  // namespace
}  // namespace duet::cpu

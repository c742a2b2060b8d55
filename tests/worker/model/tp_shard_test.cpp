// Tensor-parallel sharding without MPI: how heads, hidden units and the
// vocabulary are split, how KV is re-sharded between TP sizes, which bytes a
// shard copies out of the file, and what cannot be split.
#include "worker/model/tp_shard.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <numeric>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"
#include "worker/kv/kv_rows.h"
#include "worker/model/cpu_forward.h"
#include "worker/model/llama_model.h"

namespace duet {
namespace {

TEST(TpShardTest, SplitEvenlyGivesTheFirstPartsTheRemainder) {
  EXPECT_EQ(split_evenly(3, 0, 2), (std::pair<int64_t, int64_t>{0, 2}));
  EXPECT_EQ(split_evenly(3, 1, 2), (std::pair<int64_t, int64_t>{2, 3}));
  EXPECT_EQ(split_evenly(9, 2, 3), (std::pair<int64_t, int64_t>{6, 9}));
  EXPECT_EQ(split_evenly(5, 3, 4), (std::pair<int64_t, int64_t>{4, 5}));
}

TEST(TpShardTest, KvPeersReshardBetweenTpSizes) {
  // 3 KV heads. TP 1 -> TP 3: the one prefill rank sends each decode rank its head.
  const std::vector<KvPeer> one_to_three = kv_peers(3, 0, 1, 3);
  ASSERT_EQ(one_to_three.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(one_to_three[i].index, i);
    EXPECT_EQ(one_to_three[i].head_begin, i);
    EXPECT_EQ(one_to_three[i].head_end, i + 1);
  }
  // TP 3 -> TP 1: rank 1 of 3 sends its head to the one decode rank.
  const std::vector<KvPeer> three_to_one = kv_peers(3, 1, 3, 1);
  ASSERT_EQ(three_to_one.size(), 1u);
  EXPECT_EQ(three_to_one[0].index, 0);
  EXPECT_EQ(three_to_one[0].head_begin, 1);
  EXPECT_EQ(three_to_one[0].head_end, 2);
  // TP 2 (heads 2 + 1) -> TP 3: rank 0 splits its two heads over decode ranks 0 and 1.
  const std::vector<KvPeer> two_to_three = kv_peers(3, 0, 2, 3);
  ASSERT_EQ(two_to_three.size(), 2u);
  EXPECT_EQ(two_to_three[1].index, 1);
  EXPECT_EQ(two_to_three[1].head_begin, 1);
  EXPECT_EQ(kv_peers(3, 1, 2, 3).at(0).index, 2);
  // Every head is sent exactly once, whatever the sizes.
  for (int p = 1; p <= 3; ++p) {
    for (int d = 1; d <= 3; ++d) {
      int64_t heads = 0;
      for (int i = 0; i < p; ++i) {
        for (const KvPeer& peer : kv_peers(3, i, p, d)) heads += peer.head_end - peer.head_begin;
      }
      EXPECT_EQ(heads, 3) << p << " -> " << d;
    }
  }
}

TEST(TpShardTest, PackedRowsOfSomeHeadsLandInAnotherShardsCache) {
  KvLayout whole;  // a TP 1 cache: 3 heads
  whole.n_layers = 2;
  whole.n_kv_heads = 3;
  whole.head_dim = 4;
  whole.block_size = 4;
  whole.n_blocks = 8;
  KvLayout shard = whole;  // the second rank of TP 2: head 2 only
  shard.n_kv_heads = 1;
  std::vector<KvElement> a(static_cast<size_t>(whole.total_elems()));
  std::iota(a.begin(), a.end(), KvElement{1});
  std::vector<KvElement> b(static_cast<size_t>(shard.total_elems()), 0);
  const std::vector<int32_t> ta = {5, 2, 7}, tb = {0, 6, 3};
  std::vector<KvElement> rows(static_cast<size_t>(packed_kv_elems(whole, 7, {2, 1})));
  for (int64_t layer = 0; layer < 2; ++layer) {
    pack_kv_rows(whole, a.data(), layer, ta, 3, 7, {2, 1}, rows.data());
    unpack_kv_rows(shard, b.data(), layer, tb, 3, 7, {0, 1}, rows.data());
  }
  // (layer 1, position 5 = block 1 slot 1, V, global head 2, dim 3).
  EXPECT_EQ(b[static_cast<size_t>(shard.v_offset(1, 6, 0, 1) + 3)],
            a[static_cast<size_t>(whole.v_offset(1, 2, 2, 1) + 3)]);
  EXPECT_EQ(b[static_cast<size_t>(shard.k_offset(0, 0, 0, 3))],
            a[static_cast<size_t>(whole.k_offset(0, 5, 2, 3))]);
}

TEST(TpShardTest, DefaultModelShardsOwnTheirPartAndAddUpToTheWhole) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(path);
  const auto whole = LlamaModel::load(path);
  // Whole, it reads the mapping and copies nothing.
  EXPECT_EQ(whole->owned_weight_bytes(), 0u);
  const ModelConfig& c = whole->config();
  for (int size = 2; size <= 3; ++size) {
    size_t owned = 0;
    for (int rank = 0; rank < size; ++rank) {
      const auto model = LlamaModel::load(path, TpPlacement{rank, size});
      const TpShard& s = model->shard();
      const auto [kv0, kv1] = split_evenly(c.n_kv_heads, rank, size);
      EXPECT_EQ(s.kv_head_begin, kv0);
      EXPECT_EQ(s.kv_head_end, kv1);
      EXPECT_EQ(s.n_heads(), s.n_kv_heads() * c.group_size());
      const LlamaLayerWeights& w = model->layer(7);
      EXPECT_EQ(w.wq.n_out, s.n_heads() * c.head_dim);
      EXPECT_EQ(w.wk.n_out, s.n_kv_heads() * c.head_dim);
      EXPECT_EQ(w.w_up.n_out, s.n_ff());
      // O and down: the rank's output rows of the whole input.
      const auto [e0, e1] = split_evenly(c.n_embd, rank, size);
      EXPECT_EQ(s.embd_begin, e0);
      EXPECT_EQ(s.embd_end, e1);
      EXPECT_EQ(w.wo.k, c.n_heads * c.head_dim);
      EXPECT_EQ(w.wo.n_out, e1 - e0);
      EXPECT_EQ(w.w_down.k, c.n_ff);
      EXPECT_EQ(w.w_down.n_out, e1 - e0);
      EXPECT_EQ(model->token_embd().n_out, s.n_vocab());
      EXPECT_EQ(model->kv_layout(4).n_kv_heads, s.n_kv_heads());
      // Within 10% of an even share (3 KV heads on 2 ranks: 2 + 1).
      const double share = static_cast<double>(model->owned_weight_bytes()) /
                           static_cast<double>(model->split_tensor_bytes());
      EXPECT_NEAR(share, 1.0 / size, 0.1 / size) << "rank " << rank << " of " << size;
      owned += model->owned_weight_bytes();
    }
    // The shards partition every split tensor: nothing twice, nothing left out.
    const auto first = LlamaModel::load(path, TpPlacement{0, size});
    EXPECT_EQ(owned, first->split_tensor_bytes()) << "tp " << size;
  }
}

TEST(TpShardTest, MoreRanksThanKvHeadsIsRefused) {
  DUET_SKIP_WITHOUT_DEFAULT_MODEL(path);
  try {
    LlamaModel::load(path, TpPlacement{0, 4});
    FAIL() << "tp 4 of 3 KV heads loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnsupported);
    EXPECT_STREQ(e.what(),
                 "tensor parallelism splits attention by KV heads: tp 4 is more than the "
                 "model's 3 KV heads");
  }
}

TEST(TpShardTest, HiddenUnitsSplitInRunsOfSixteen) {
  ModelConfig c;  // the default model's shape
  c.n_vocab = 49152;
  c.n_embd = 576;
  c.n_heads = 9;
  c.n_kv_heads = 3;
  c.head_dim = 64;
  c.n_ff = 1536;
  for (int size = 1; size <= 3; ++size) {
    int64_t next = 0;
    for (int rank = 0; rank < size; ++rank) {
      const TpShard s = make_tp_shard(c, rank, size);
      EXPECT_EQ(s.ff_begin, next);
      EXPECT_EQ(s.n_ff(), 1536 / size);
      EXPECT_EQ(s.ff_begin % 16, 0);
      next = s.ff_end;
    }
    EXPECT_EQ(next, c.n_ff);
  }
  // A width that is not whole runs: the last rank takes the tail.
  c.n_ff = 1000;  // 62 runs of 16, and 8
  EXPECT_EQ(make_tp_shard(c, 0, 2).n_ff(), 496);
  EXPECT_EQ(make_tp_shard(c, 1, 2).ff_begin, 496);
  EXPECT_EQ(make_tp_shard(c, 1, 2).ff_end, 1000);
}

TEST(TpShardTest, AssembleSlicesLaysRankPartsSideBySide) {
  // Two rows; parts of widths 3, 1 and 2 (slot 3 x 2 = 6 floats each, padded).
  const std::vector<int64_t> parts = {3, 1, 2};
  const std::vector<float> gathered = {1, 2,  3,  4,  5,  6,   // rank 0: rows {1,2,3}, {4,5,6}
                                       7, 8,  -1, -1, -1, -1,  // rank 1: {7}, {8}, padding
                                       9, 10, 11, 12, -1, -1};
  std::vector<float> all(12);
  assemble_slices(gathered.data(), 6, parts, 2, all.data());
  EXPECT_EQ(all, (std::vector<float>{1, 2, 3, 7, 9, 10, 4, 5, 6, 8, 11, 12}));
}

// The GPU checks' own models (tests/fixtures/tiny_gpu, head_dim 64): each
// loads and runs on the CPU (its logits finite and not flat), and splits in
// two shards of one KV head, half the feed-forward and half the vocabulary
// each (tests/gpu/tp_check.cpp runs them so on two GPUs).
TEST(TpShardTest, TheGpuFixturesRunAndSplitInTwo) {
  int n_models = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(testing::fixture_path("fixtures/tiny_gpu"))) {
    if (entry.path().extension() != ".gguf") continue;
    ++n_models;
    SCOPED_TRACE(entry.path().filename().string());
    const std::unique_ptr<LlamaModel> whole = LlamaModel::load(entry.path());
    const ModelConfig& c = whole->config();
    EXPECT_EQ(c.head_dim, 64);
    cpu::ThreadPool pool(1);
    CpuForward forward(*whole, cpu::kernel_table(cpu::best_isa()), pool);
    KvCache cache(whole->kv_layout(4));
    const std::vector<int32_t> tokens = {3, 40, 77, 120, 200, 298, 5, 64};
    const std::vector<int32_t> table = {0, 1, 2, 3};
    const ForwardSequence sequence{table, 0, static_cast<int64_t>(tokens.size())};
    const int64_t last = sequence.n_tokens - 1;
    std::vector<float> logits(static_cast<size_t>(c.n_vocab));
    forward.run(tokens, {&sequence, 1}, cache, {&last, 1}, logits.data());
    const auto [low, high] = std::minmax_element(logits.begin(), logits.end());
    EXPECT_TRUE(
        std::all_of(logits.begin(), logits.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_GT(*high - *low, 1.0f);
    for (int rank = 0; rank < 2; ++rank) {
      const std::unique_ptr<LlamaModel> shard =
          LlamaModel::load(entry.path(), TpPlacement{rank, 2});
      const TpShard& s = shard->shard();
      EXPECT_EQ(s.n_kv_heads(), 1);
      EXPECT_EQ(s.n_heads(), c.n_heads / 2);
      EXPECT_EQ(s.n_ff(), c.n_ff / 2);
      EXPECT_EQ(s.vocab_begin, rank * ((c.n_vocab + 1) / 2));
    }
  }
  EXPECT_EQ(n_models, 2);
}

}  // namespace
}  // namespace duet

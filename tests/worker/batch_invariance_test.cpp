// A token's logits are bitwise the same however its sequence's tokens are
// split into steps (token by token, one prefill, chunks of any size), whatever
// other sequences share the batch, and when the sequence's first blocks were
// computed by another sequence with the same prefix (a prefix-cache hit):
// each row reduces in the order of its own position's role (here positions
// from kOneTokenFrom on are "generated": llama.cpp's one-token order), never
// in one chosen by the step. The batching engine is built on this.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/cpu/isa.h"
#include "tests/test_paths.h"
#include "worker/model/cpu_forward.h"

namespace duet {
namespace {

constexpr int64_t kBlock = KvLayout::kDefaultBlockSize;
// Rows from this position on reduce in the one-token order (past the shared
// prefix's first block, so that the prefix-cache case has rows of both).
constexpr int64_t kOneTokenFrom = 30;

class BatchInvariance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string name = GetParam();
    std::filesystem::path path;
    if (name == "default") {
      auto found = testing::default_model_path();
      if (!found) GTEST_SKIP() << "default model not found: run launch/setup.sh to fetch it";
      path = *found;
    } else {
      path = testing::fixture_path("fixtures/tiny/" + name);
    }
    model_ = LlamaModel::load(path);
    n_vocab_ = model_->config().n_vocab;
    std::mt19937 rng(42);
    std::uniform_int_distribution<int32_t> token(3, static_cast<int32_t>(n_vocab_ - 1));
    for (auto* seq : {&a_, &b_, &c_}) {
      seq->resize(seq == &a_ ? 45 : seq == &b_ ? 50 : 70);
      for (auto& t : *seq) t = token(rng);
    }
    // a_ and b_ share their first two blocks (a prefix-cache hit for b_).
    std::copy(a_.begin(), a_.begin() + 2 * kBlock, b_.begin());
  }

  // Physical blocks for a sequence of n tokens, taken from a shuffled pool.
  std::vector<int32_t> take_blocks(int64_t n_tokens) {
    std::vector<int32_t> table;
    for (int64_t i = 0; i < (n_tokens + kBlock - 1) / kBlock; ++i)
      table.push_back(free_blocks_[next_free_++]);
    return table;
  }

  std::unique_ptr<KvCache> make_cache() {
    auto cache = std::make_unique<KvCache>(make_kv_layout(model_->config(), 32));
    free_blocks_.resize(32);
    std::iota(free_blocks_.begin(), free_blocks_.end(), 0);
    std::shuffle(free_blocks_.begin(), free_blocks_.end(), std::mt19937(7));
    next_free_ = 0;
    return cache;
  }

  // Logits of every position of `tokens`, run in steps of the given sizes.
  std::vector<float> run_in_steps(CpuForward& forward, const std::vector<int32_t>& tokens,
                                  const std::vector<int64_t>& steps) {
    auto cache = make_cache();
    const std::vector<int32_t> table = take_blocks(static_cast<int64_t>(tokens.size()));
    std::vector<float> logits(tokens.size() * n_vocab_);
    int64_t pos = 0;
    for (size_t s = 0; pos < static_cast<int64_t>(tokens.size()); ++s) {
      const int64_t n =
          std::min(steps[s % steps.size()], static_cast<int64_t>(tokens.size()) - pos);
      std::vector<int64_t> rows(n);
      std::iota(rows.begin(), rows.end(), 0);
      const ForwardSequence seq{table, pos, n, kOneTokenFrom};
      forward.run({tokens.data() + pos, static_cast<size_t>(n)}, {&seq, 1}, *cache, rows,
                  logits.data() + pos * n_vocab_);
      pos += n;
    }
    return logits;
  }

  std::unique_ptr<LlamaModel> model_;
  int64_t n_vocab_ = 0;
  std::vector<int32_t> a_, b_, c_;
  std::vector<int32_t> free_blocks_;
  size_t next_free_ = 0;
};

bool bitwise_equal(const float* x, const float* y, size_t n) {
  return std::memcmp(x, y, n * sizeof(float)) == 0;
}

TEST_P(BatchInvariance, AnySplitIntoStepsGivesTheSameLogits) {
  cpu::ThreadPool pool(2);
  CpuForward forward(*model_, cpu::kernel_table(cpu::best_isa()), pool);
  const std::vector<float> one_prefill =
      run_in_steps(forward, a_, {static_cast<int64_t>(a_.size())});
  for (const std::vector<int64_t>& steps :
       std::vector<std::vector<int64_t>>{{1}, {7, 1, 16, 3}, {16}, {2, 30}}) {
    const std::vector<float> split = run_in_steps(forward, a_, steps);
    EXPECT_TRUE(bitwise_equal(one_prefill.data(), split.data(), one_prefill.size()))
        << "steps starting with " << steps[0];
  }
}

TEST_P(BatchInvariance, OtherSequencesInTheBatchChangeNothing) {
  cpu::ThreadPool pool(2);
  CpuForward forward(*model_, cpu::kernel_table(cpu::best_isa()), pool);
  const std::vector<float> alone = run_in_steps(forward, a_, {1});

  // a_ decodes token by token while c_ prefills in chunks of 9 beside it.
  auto cache = make_cache();
  const std::vector<int32_t> table_a = take_blocks(static_cast<int64_t>(a_.size()));
  const std::vector<int32_t> table_c = take_blocks(static_cast<int64_t>(c_.size()));
  std::vector<float> batched(a_.size() * n_vocab_);
  std::vector<float> step_logits;
  int64_t pos_c = 0;
  for (int64_t pos = 0; pos < static_cast<int64_t>(a_.size()); ++pos) {
    const int64_t n_c = std::min<int64_t>(9, static_cast<int64_t>(c_.size()) - pos_c);
    std::vector<int32_t> tokens;
    std::vector<ForwardSequence> seqs;
    if (n_c > 0) {
      tokens.insert(tokens.end(), c_.begin() + pos_c, c_.begin() + pos_c + n_c);
      seqs.push_back({table_c, pos_c, n_c, kOneTokenFrom});
    }
    tokens.push_back(a_[pos]);
    seqs.push_back({table_a, pos, 1, kOneTokenFrom});
    const int64_t row_a = static_cast<int64_t>(tokens.size()) - 1;
    step_logits.resize(n_vocab_);
    forward.run(tokens, seqs, *cache, {&row_a, 1}, step_logits.data());
    std::copy(step_logits.begin(), step_logits.end(), batched.begin() + pos * n_vocab_);
    pos_c += std::max<int64_t>(n_c, 0);
  }
  EXPECT_TRUE(bitwise_equal(alone.data(), batched.data(), alone.size()));
}

TEST_P(BatchInvariance, SharedPrefixBlocksGiveTheSameLogits) {
  cpu::ThreadPool pool(2);
  CpuForward forward(*model_, cpu::kernel_table(cpu::best_isa()), pool);
  const std::vector<float> full = run_in_steps(forward, b_, {static_cast<int64_t>(b_.size())});

  // a_ fills two blocks; b_ then reuses them and computes only its own tail.
  auto cache = make_cache();
  const std::vector<int32_t> table_a = take_blocks(static_cast<int64_t>(a_.size()));
  std::vector<int32_t> table_b(table_a.begin(), table_a.begin() + 2);
  for (int32_t block : take_blocks(static_cast<int64_t>(b_.size()) - 2 * kBlock))
    table_b.push_back(block);
  std::vector<float> scratch(a_.size() * n_vocab_);
  {
    std::vector<int64_t> rows(a_.size());
    std::iota(rows.begin(), rows.end(), 0);
    const ForwardSequence seq{table_a, 0, static_cast<int64_t>(a_.size()), kOneTokenFrom};
    forward.run(a_, {&seq, 1}, *cache, rows, scratch.data());
  }
  const int64_t cached = 2 * kBlock;
  const int64_t rest = static_cast<int64_t>(b_.size()) - cached;
  std::vector<int64_t> rows(rest);
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> tail(rest * n_vocab_);
  const ForwardSequence seq{table_b, cached, rest, kOneTokenFrom};
  forward.run({b_.data() + cached, static_cast<size_t>(rest)}, {&seq, 1}, *cache, rows,
              tail.data());
  EXPECT_TRUE(bitwise_equal(full.data() + cached * n_vocab_, tail.data(), tail.size()));
}

// The role is what decides: the same rows in the multi-token order differ
// (so the tests above would see a row computed in the wrong one).
TEST_P(BatchInvariance, TheOneTokenOrderIsAnotherOrder) {
  cpu::ThreadPool pool(2);
  CpuForward forward(*model_, cpu::kernel_table(cpu::best_isa()), pool);
  const std::vector<float> roles = run_in_steps(forward, a_, {static_cast<int64_t>(a_.size())});
  auto cache = make_cache();
  const std::vector<int32_t> table = take_blocks(static_cast<int64_t>(a_.size()));
  std::vector<int64_t> rows(a_.size());
  std::iota(rows.begin(), rows.end(), 0);
  std::vector<float> prompt_only(a_.size() * n_vocab_);
  const ForwardSequence seq{table, 0, static_cast<int64_t>(a_.size())};  // all multi-token
  forward.run(a_, {&seq, 1}, *cache, rows, prompt_only.data());
  const size_t split = static_cast<size_t>(kOneTokenFrom) * n_vocab_;
  EXPECT_TRUE(bitwise_equal(roles.data(), prompt_only.data(), split));
  // With heads of under 64 dimensions the two orders add the same way (the
  // tiny models' 16): only the default model tells them apart.
  if (model_->config().head_dim >= 64) {
    EXPECT_FALSE(bitwise_equal(roles.data() + split, prompt_only.data() + split,
                               prompt_only.size() - split));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, BatchInvariance,
                         ::testing::Values("tiny_q4_1_gqa_tied.gguf", "tiny_mixed_gqa_tied.gguf",
                                           "tiny_f16_mha_tied.gguf", "default"),
                         [](const auto& info) {
                           std::string name = info.param;
                           name = name.substr(0, name.find('.'));
                           return name;
                         });

}  // namespace
}  // namespace duet

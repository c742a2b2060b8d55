// Disaggregation inside one process: a prefill engine exports a prompt's KV
// layer by layer, the rows travel through pack/unpack (what a transfer
// does), and a decode engine imports them. The decode engine's tokens must be
// the single engine's, its KV bit-identical, every block accounted for.
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <random>

#include "kernels/cpu/isa.h"
#include "tests/worker/model_test.h"
#include "worker/engine.h"
#include "worker/kv/kv_rows.h"

namespace duet {
namespace {

// The rows of one export chunk of one layer, as a transfer would carry them.
struct Message {
  int64_t layer = 0;
  int64_t pos0 = 0;
  int64_t n = 0;
  std::vector<KvElement> rows;
};

// Prefill engine -> decode engine, synchronously in this thread. Every
// imported request is exported by `prefill` as soon as `decode` reserves it.
class Link {
 public:
  Link(Engine& prefill, Engine& decode) : prefill_(prefill), decode_(decode) {}

  // Submits `prompt` as an import on the decode engine; its tokens go to `out`.
  SequenceId submit(std::vector<int32_t> prompt, const RequestOptions& options,
                    std::vector<int32_t>* out, bool* finished = nullptr) {
    ImportHooks hooks;
    hooks.reserved = [this, prompt, options](SequenceId id, int64_t cached,
                                             std::span<const int32_t> table) {
      Transfer& t = transfers_[id];
      t.table.assign(table.begin(), table.end());
      ExportSink sink;
      sink.layer = [this, id](SequenceId, int64_t layer, int64_t pos0, int64_t n,
                              std::span<const int32_t> block_table, const KvCache& cache) {
        Message m{layer, pos0, n, std::vector<KvElement>(packed_kv_elems(cache.layout(), n))};
        pack_kv_rows(cache.layout(), cache.data(), layer, block_table, pos0, n, m.rows.data());
        transfers_[id].messages.push_back(std::move(m));
      };
      sink.done = [this, id](SequenceId, int32_t first, int64_t) { finish(id, first); };
      t.exporter = prefill_.submit_export(prompt, options, cached, sink);
    };
    hooks.abort = [this](SequenceId id) {
      prefill_.cancel(transfers_.at(id).exporter);
      aborted_.push_back(id);
    };
    return decode_.submit_import(
        std::move(prompt), options,
        [out, finished](const TokenEvent& e) {
          if (e.token >= 0) out->push_back(e.token);
          if (e.finished && finished != nullptr) *finished = true;
        },
        hooks);
  }

  // Steps both engines until neither has work; releases aborted imports.
  void run() {
    for (int guard = 0; guard < 100000; ++guard) {
      const bool a = prefill_.step();
      const bool b = decode_.step();
      for (SequenceId id : aborted_) decode_.release_import(id);
      aborted_.clear();
      if (!a && !b && prefill_.idle() && decode_.idle()) return;
    }
    FAIL() << "the engines did not go idle";
  }

  int64_t rows_moved() const { return rows_moved_; }

 private:
  struct Transfer {
    std::vector<int32_t> table;
    SequenceId exporter;
    std::deque<Message> messages;
  };

  void finish(SequenceId id, int32_t first) {
    Transfer& t = transfers_.at(id);
    for (const Message& m : t.messages) {
      unpack_kv_rows(decode_.cache().layout(), decode_.cache().data(), m.layer, t.table, m.pos0,
                     m.n, m.rows.data());
      rows_moved_ += m.n;
    }
    decode_.complete_import(id, first);
    transfers_.erase(id);
  }

  Engine& prefill_;
  Engine& decode_;
  std::map<SequenceId, Transfer> transfers_;
  std::vector<SequenceId> aborted_;
  int64_t rows_moved_ = 0;
};

class EngineTransferTest : public testing::ModelTest {
 protected:
  std::unique_ptr<Engine> engine(int64_t n_blocks = 256, int64_t step_tokens = 64) {
    EngineConfig config;
    config.n_kv_blocks = n_blocks;
    config.scheduler.max_step_tokens = step_tokens;
    config.scheduler.max_running = 16;
    return std::make_unique<Engine>(*model_, cpu::kernel_table(cpu::best_isa()), *pool_, config);
  }

  std::vector<int32_t> single(const std::vector<int32_t>& p, const RequestOptions& options) {
    auto e = engine();
    std::vector<int32_t> out;
    e->submit(p, options, [&](const TokenEvent& ev) {
      if (ev.token >= 0) out.push_back(ev.token);
    });
    e->run_until_idle();
    return out;
  }
};

TEST_P(EngineTransferTest, DecodesExactlyAsOneEngine) {
  std::mt19937 rng(7);
  // Lengths around block (16) and chunk (64) boundaries; greedy and sampled
  // with penalties, so the sampler's state must carry over too.
  const std::vector<int64_t> lengths = {1, 15, 16, 17, 63, 64, 65, 150};
  std::vector<std::vector<int32_t>> prompts;
  std::vector<RequestOptions> options;
  for (size_t i = 0; i < lengths.size(); ++i) {
    prompts.push_back(random_prompt(rng, lengths[i]));
    RequestOptions o;
    o.max_tokens = 1 + static_cast<int64_t>(i % 3) * 9;
    o.ignore_eos = true;
    if (i % 2 == 1) {
      o.sampling.temperature = 0.9f;
      o.sampling.seed = 100 + i;
      o.sampling.repetition_penalty = 1.2f;
    }
    options.push_back(o);
  }
  auto prefill = engine();
  auto decode = engine();
  Link link(*prefill, *decode);
  std::vector<std::vector<int32_t>> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) link.submit(prompts[i], options[i], &out[i]);
  link.run();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(out[i], single(prompts[i], options[i])) << "prompt of " << lengths[i] << " tokens";
  }
  EXPECT_EQ(prefill->n_free_kv_blocks(), prefill->n_kv_blocks());
  EXPECT_EQ(decode->n_free_kv_blocks(), decode->n_kv_blocks());
}

TEST_P(EngineTransferTest, ImportedKvEqualsComputedKv) {
  std::mt19937 rng(11);
  const std::vector<int32_t> p = random_prompt(rng, 100);
  RequestOptions o;
  o.max_tokens = 8;
  o.ignore_eos = true;

  auto local = engine();
  const SequenceId computed = local->submit(p, o, {});
  local->step();
  local->step();  // 64 + 36 prompt tokens: the prompt's KV is complete
  const uint64_t expected = local->kv_checksum(computed, 100);

  auto prefill = engine();
  auto decode = engine();
  Link link(*prefill, *decode);
  std::vector<int32_t> out;
  const SequenceId imported = link.submit(p, o, &out);
  prefill->step();
  prefill->step();  // exported and completed: the import is running
  ASSERT_FALSE(decode->importing(imported));
  EXPECT_EQ(decode->kv_checksum(imported, 100), expected);
  EXPECT_EQ(link.rows_moved(), 100 * model_->config().n_layers);
}

TEST_P(EngineTransferTest, PrefixCacheOnEitherSideShipsOnlyWhatIsMissing) {
  std::mt19937 rng(3);
  const std::vector<int32_t> shared = random_prompt(rng, 48);
  auto with_tail = [&](int64_t n) {
    std::vector<int32_t> p = shared;
    const std::vector<int32_t> tail = random_prompt(rng, n);
    p.insert(p.end(), tail.begin(), tail.end());
    return p;
  };
  RequestOptions o;
  o.max_tokens = 6;
  o.ignore_eos = true;
  auto prefill = engine();
  auto decode = engine();
  Link link(*prefill, *decode);
  const std::vector<int32_t> a = with_tail(20), b = with_tail(5);
  std::vector<int32_t> out_a, out_b;
  link.submit(a, o, &out_a);
  link.run();
  const int64_t first = link.rows_moved();
  EXPECT_EQ(first, 68 * model_->config().n_layers);
  link.submit(b, o, &out_b);  // decode holds 48 of its 53 tokens (3 full blocks)
  link.run();
  EXPECT_EQ(link.rows_moved() - first, 5 * model_->config().n_layers);
  EXPECT_EQ(out_a, single(a, o));
  EXPECT_EQ(out_b, single(b, o));

  // A fresh decode engine holds nothing; the prefill engine has the shared
  // prefix cached and must still ship it.
  auto decode2 = engine();
  Link link2(*prefill, *decode2);
  std::vector<int32_t> out_c;
  const std::vector<int32_t> c = with_tail(9);
  link2.submit(c, o, &out_c);
  link2.run();
  EXPECT_EQ(link2.rows_moved(), 57 * model_->config().n_layers);
  EXPECT_EQ(out_c, single(c, o));
}

TEST_P(EngineTransferTest, ImportsWaitForBlocksAndCancelFreesThem) {
  std::mt19937 rng(5);
  RequestOptions o;
  o.max_tokens = 20;
  o.ignore_eos = true;
  auto prefill = engine();
  auto decode = engine(/*n_blocks=*/12);  // 192 tokens: one 100-token prompt at a time
  Link link(*prefill, *decode);
  std::vector<std::vector<int32_t>> prompts = {random_prompt(rng, 100), random_prompt(rng, 100),
                                               random_prompt(rng, 100)};
  std::vector<std::vector<int32_t>> out(3);
  std::vector<SequenceId> ids;
  for (size_t i = 0; i < 3; ++i) ids.push_back(link.submit(prompts[i], o, &out[i]));
  EXPECT_EQ(decode->n_waiting(), 3);
  link.run();
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(out[i], single(prompts[i], o));

  // Cancel while waiting for blocks, while the rows are in flight, and while decoding.
  bool done[3] = {false, false, false};
  for (auto& v : out) v.clear();
  for (auto& p : prompts) p = random_prompt(rng, 100);  // nothing cached: ids[0] takes two chunks
  for (size_t i = 0; i < 3; ++i) ids[i] = link.submit(prompts[i], o, &out[i], &done[i]);
  decode->cancel(ids[2]);  // waiting for blocks
  prefill->step();         // ids[0]'s first chunk is exported
  decode->cancel(ids[0]);  // in flight: blocks held until release
  EXPECT_TRUE(decode->importing(ids[0]));
  link.run();
  EXPECT_TRUE(done[0] && done[2]);
  EXPECT_EQ(out[1], single(prompts[1], o));
  EXPECT_EQ(decode->n_free_kv_blocks(), decode->n_kv_blocks());
  EXPECT_EQ(prefill->n_free_kv_blocks(), prefill->n_kv_blocks());
}

// 2 layers, 3 KV heads of 4 dims, 8 blocks of 4 positions.
KvLayout small_kv_layout() {
  KvLayout layout;
  layout.n_layers = 2;
  layout.n_kv_heads = 3;
  layout.head_dim = 4;
  layout.block_size = 4;
  layout.n_blocks = 8;
  return layout;
}

TEST(KvRowsTest, PackUnpackAcrossDifferentBlockTables) {
  const KvLayout layout = small_kv_layout();
  std::vector<KvElement> a(static_cast<size_t>(layout.total_elems()));
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<KvElement>(i * 7 + 1);
  std::vector<KvElement> b(a.size(), 0);
  const std::vector<int32_t> ta = {5, 2, 7}, tb = {0, 6, 3};
  std::vector<KvElement> rows(static_cast<size_t>(packed_kv_elems(layout, 7)));
  for (int64_t layer = 0; layer < 2; ++layer) {
    pack_kv_rows(layout, a.data(), layer, ta, 3, 7, rows.data());
    unpack_kv_rows(layout, b.data(), layer, tb, 3, 7, rows.data());
  }
  EXPECT_EQ(kv_rows_checksum(layout, a.data(), ta, 3, 7),
            kv_rows_checksum(layout, b.data(), tb, 3, 7));
  EXPECT_NE(kv_rows_checksum(layout, a.data(), ta, 3, 7),
            kv_rows_checksum(layout, a.data(), ta, 2, 7));
  // Row (layer 1, position 5, V, head 2, dim 3) landed where the layout says.
  EXPECT_EQ(b[static_cast<size_t>(layout.v_offset(1, 6, 2, 1) + 3)],
            a[static_cast<size_t>(layout.v_offset(1, 2, 2, 1) + 3)]);
}

TEST(KvRowsTest, PackedRunsBackToBackAreThePackedRows) {
  const KvLayout layout = small_kv_layout();
  std::vector<KvElement> cache(static_cast<size_t>(layout.total_elems()));
  for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<KvElement>(i * 5 + 3);
  const std::vector<int32_t> table = {6, 1, 4};
  const KvHeads heads{1, 2};
  std::vector<KvElement> packed(static_cast<size_t>(packed_kv_elems(layout, 9, heads)));
  pack_kv_rows(layout, cache.data(), 1, table, 2, 9, heads, packed.data());
  std::vector<KvElement> gathered;
  for_each_packed_run(layout, 1, table, 2, 9, heads, [&](int64_t at, int64_t elems) {
    gathered.insert(gathered.end(), cache.begin() + at, cache.begin() + at + elems);
  });
  EXPECT_EQ(gathered, packed);
}

INSTANTIATE_TEST_SUITE_P(Models, EngineTransferTest,
                         ::testing::Values("tiny_q4_1_gqa_tied.gguf", "default"),
                         testing::model_param_name);

}  // namespace
}  // namespace duet

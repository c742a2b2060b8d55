// duet-tp-step-bench: the decode step of one tensor-parallel instance. Every
// rank of `mpirun -np T` is one rank of a TP=T instance (without mpirun the
// process is a TP=1 instance of its own):
//   1. prefills B sequences of L tokens (real text: a built-in paragraph's
//      tokens, each sequence starting elsewhere in it), one sequence per run;
//   2. runs --warmup untimed decode steps, then S timed ones: one token per
//      sequence per step (the argmax of its previous logits), one
//      CpuForward::run each, logits for every row.
// The leader prints the median and p90 step latency, tokens/s (B / median),
// the share of the step spent in collectives (CpuForward::collective_time's
// delta over the step's wall time, median over steps; the leader's, then every
// rank's: it includes waiting for a slower rank), and the bytes the
// collectives gather into each rank per step: per layer O's and down's whole
// inputs and their outputs (T ranks x the widest rank's part x B floats, for
// the query dims, the hidden units and twice the output rows), the
// embeddings' all-reduce (T x B * n_embd), the logits (T x B * vocab_stride).
// One human line, then one JSON line.
//
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np T duet-tp-step-bench
//       --model M [--threads N] [--batch B] [--context L] [--steps S] [--warmup W]
// (--bind-to none: with fewer ranks than cores Open MPI binds each rank to one
// core, and --threads N > 1 would then share it.)
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <ranges>
#include <string>
#include <vector>

#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "common/sampling.h"
#include "common/stats.h"
#include "common/text/tokenizer_gguf.h"
#include "kernels/cpu/isa.h"
#include "worker/model/cpu_forward.h"
#include "worker/parallel/mpi_collective.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kText =
    "The mechanical clock changed the day slowly, and then all at once. A town that had "
    "lived by the bells of the monastery began to live by the hands of a dial on the church "
    "tower, and the hours, once stretched and squeezed to fit the season, became equal. "
    "Merchants noticed first: a contract could name the hour of delivery, a loan the hour "
    "it fell due. Workers noticed next, when the day was sold by the hour instead of by the "
    "task. By the time railways crossed the continents, every station kept the same time, "
    "telegraphed down the line, and the sun was no longer asked what hour it was.";

struct Args {
  std::string model;
  int threads = 1;
  int64_t batch = 1;
  int64_t context = 256;
  int steps = 20;
  int warmup = 3;
};

struct Result {
  std::vector<double> step_ms;     // wall time of each timed step
  std::vector<double> collective;  // its share spent in collectives
  int64_t collective_calls = 0;    // per step
};

Result run_bench(const Args& args, const LlamaModel& model, Collective* collective) {
  const ModelConfig& c = model.config();
  const int64_t n_vocab = c.n_vocab;
  const int64_t b = args.batch;
  const int64_t max_len = args.context + args.warmup + args.steps;
  const int64_t blocks_per_seq =
      (max_len + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize;
  KvCache cache(model.kv_layout(b * blocks_per_seq));
  std::vector<std::vector<int32_t>> tables(static_cast<size_t>(b));
  for (int64_t s = 0; s < b; ++s) {
    auto& table = tables[static_cast<size_t>(s)];
    table.resize(static_cast<size_t>(blocks_per_seq));
    std::iota(table.begin(), table.end(), static_cast<int32_t>(s * blocks_per_seq));
  }

  cpu::ThreadPool pool(args.threads);
  CpuForward forward(model, cpu::kernel_table(cpu::isa_from_environment()), pool, collective);
  const std::vector<int32_t> text = tokenizer_from_gguf(model.file()).encode(kText, false, false);
  DUET_ASSERT(!text.empty());

  // Prefill: sequence s holds L tokens of the text from offset 7 s (cycling).
  std::vector<int32_t> next(static_cast<size_t>(b));
  std::vector<float> logits(static_cast<size_t>(b * n_vocab));
  for (int64_t s = 0; s < b; ++s) {
    std::vector<int32_t> tokens(static_cast<size_t>(args.context));
    for (int64_t i = 0; i < args.context; ++i)
      tokens[static_cast<size_t>(i)] = text[static_cast<size_t>(7 * s + i) % text.size()];
    const ForwardSequence seq{tables[static_cast<size_t>(s)], 0, args.context};
    const int64_t last = args.context - 1;
    forward.run(tokens, {&seq, 1}, cache, {&last, 1}, logits.data());
    next[static_cast<size_t>(s)] = argmax({logits.data(), static_cast<size_t>(n_vocab)});
  }

  // Decode steps: row s is sequence s.
  std::vector<ForwardSequence> seqs(static_cast<size_t>(b));
  std::vector<int64_t> rows(static_cast<size_t>(b));
  std::iota(rows.begin(), rows.end(), 0);
  Result result;
  for (int step = 0; step < args.warmup + args.steps; ++step) {
    for (int64_t s = 0; s < b; ++s)
      seqs[static_cast<size_t>(s)] = {tables[static_cast<size_t>(s)], args.context + step, 1,
                                      args.context};  // generated: the one-token order
    const CpuForward::CollectiveTime before = forward.collective_time();
    const auto start = Clock::now();
    forward.run(next, seqs, cache, rows, logits.data());
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const CpuForward::CollectiveTime after = forward.collective_time();
    if (step >= args.warmup) {
      result.step_ms.push_back(seconds * 1e3);
      result.collective.push_back((after.seconds - before.seconds) / seconds);
      result.collective_calls = after.calls - before.calls;
    }
    for (int64_t s = 0; s < b; ++s) {
      next[static_cast<size_t>(s)] =
          argmax({logits.data() + s * n_vocab, static_cast<size_t>(n_vocab)});
    }
  }
  return result;
}

// `rank_shares`: every rank's median collective share, in rank order (a
// rank with less work waits longer in the collectives).
void report(const Args& args, const LlamaModel& model, const Result& r,
            const std::vector<double>& rank_shares) {
  const ModelConfig& c = model.config();
  const TpShard& shard = model.shard();
  const int tp = shard.size;
  const double step_median = median(r.step_ms);
  const double p90 = *percentile(r.step_ms, 90);
  const double share = median(r.collective);
  const double tokens_per_s = static_cast<double>(args.batch) / (step_median / 1e3);
  // O and down per layer: their whole inputs and their outputs gathered, every
  // rank sending as many floats as the rank with the widest part.
  const int64_t row_bytes = args.batch * c.n_embd * 4;  // one (B, n_embd) row block
  int64_t widest = 0;
  for (int64_t width : {split_evenly(c.n_kv_heads, 0, tp).second * c.group_size() * c.head_dim,
                        make_tp_shard(c, 0, tp).n_ff(), split_evenly(c.n_embd, 0, tp).second * 2})
    widest += width;
  const int64_t o_down_bytes = tp == 1 ? 0 : c.n_layers * tp * widest * args.batch * 4;
  const int64_t embedding_bytes = tp == 1 ? 0 : tp * row_bytes;
  const int64_t gather_bytes = tp == 1 ? 0 : args.batch * shard.vocab_stride * tp * 4;
  std::printf(
      "tp %d, %d thread(s)/rank, batch %lld, context %lld, %d steps: step median %.2f ms, p90 "
      "%.2f ms, %.1f tokens/s, collectives %.1f%% of the step (median, %lld calls), gathered "
      "into each rank per step: O/down inputs and outputs %.2f MB, embeddings %.3f MB, logits %.2f "
      "MB; collective share by rank: %s\n",
      tp, args.threads, static_cast<long long>(args.batch), static_cast<long long>(args.context),
      args.steps, step_median, p90, tokens_per_s, share * 100,
      static_cast<long long>(r.collective_calls), static_cast<double>(o_down_bytes) / 1e6,
      static_cast<double>(embedding_bytes) / 1e6, static_cast<double>(gather_bytes) / 1e6,
      fmt::format(
          "{:.1f}%",
          fmt::join(rank_shares | std::views::transform([](double x) { return x * 100; }), "%, "))
          .c_str());
  const nlohmann::json json = {{"tool", "duet-tp-step-bench"},
                               {"model", c.name},
                               {"isa", cpu::isa_name(cpu::isa_from_environment())},
                               {"tp", tp},
                               {"threads_per_rank", args.threads},
                               {"batch", args.batch},
                               {"context", args.context},
                               {"steps", args.steps},
                               {"step_ms_median", step_median},
                               {"step_ms_p90", p90},
                               {"tokens_per_s", tokens_per_s},
                               {"collective_share_median", share},
                               {"collective_share_median_by_rank", rank_shares},
                               {"collective_calls_per_step", r.collective_calls},
                               {"o_down_bytes_per_step", o_down_bytes},
                               {"embedding_bytes_per_step", embedding_bytes},
                               {"logits_bytes_per_step", gather_bytes},
                               {"step_ms", r.step_ms}};
  std::printf("%s\n", json.dump().c_str());
}

// The instance of all the job's ranks (or of this process alone).
int run(const Args& args) {
  if (!launched_by_mpirun()) {
    const auto model = LlamaModel::load(args.model);
    const Result result = run_bench(args, *model, nullptr);
    report(args, *model, result, {median(result.collective)});
    return 0;
  }
  MpiRuntime mpi;
  try {
    std::vector<Rank> ranks;
    for (int r = 0; r < mpi.world_size(); ++r) ranks.push_back(Rank{r});
    MpiCollective collective(mpi, ranks, 0);
    const auto model =
        LlamaModel::load(args.model, TpPlacement{mpi.rank().value, mpi.world_size()});
    const Result result = run_bench(args, *model, mpi.world_size() == 1 ? nullptr : &collective);
    const double share = median(result.collective);
    std::vector<double> rank_shares(static_cast<size_t>(mpi.world_size()));
    DUET_MPI_CHECK(
        MPI_Gather(&share, 1, MPI_DOUBLE, rank_shares.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD));
    if (mpi.rank().value == 0) report(args, *model, result, rank_shares);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-tp-step-bench: error: rank %d: %s\n", mpi.rank().value, e.what());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 1;
  }
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) {
  CLI::App app{"duet-tp-step-bench: decode step latency of a tensor-parallel instance"};
  duet::Args args;
  app.add_option("-m,--model", args.model, "GGUF model")->required();
  app.add_option("-t,--threads", args.threads, "Compute threads per rank")
      ->check(CLI::Range(1, 1024));
  app.add_option("-b,--batch", args.batch, "Sequences decoded together")
      ->check(CLI::Range(1, 4096));
  app.add_option("-c,--context", args.context, "Tokens prefilled per sequence")
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("-s,--steps", args.steps, "Timed decode steps")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", args.warmup, "Untimed decode steps first")
      ->check(CLI::Range(0, 100000));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "duet-tp-step-bench: error: %s\n", e.what());
    return 2;
  }
  try {
    return duet::run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-tp-step-bench: error: %s\n", e.what());
    return 1;
  }
}

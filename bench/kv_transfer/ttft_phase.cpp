#include "bench/kv_transfer/ttft_phase.h"

#include <spdlog/spdlog.h>

#include <ctime>
#include <random>

#include "kernels/cpu/isa.h"
#include "worker/engine.h"

namespace duet::kv_bench {
namespace {

RequestOptions first_token_options() {
  return RequestOptions{.max_tokens = 1, .sampling = {}, .ignore_eos = true};  // greedy
}

std::vector<int32_t> random_prompt(std::mt19937_64& rng, int64_t n, int64_t n_vocab) {
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(n_vocab - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(n));
  for (int32_t& t : prompt) t = token(rng);
  return prompt;
}

// CPU time of this process (every thread).
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void step_until(Engine& engine, const bool& done) {
  while (!done && engine.step()) {
  }
  DUET_ASSERT(done, "the engine went idle before the first token");
}

// One engine's prefill on this thread: submit -> first token.
struct Prefilled {
  double seconds = 0.0;
  int32_t token = -1;
};

Prefilled prefill_locally(Engine& engine, std::vector<int32_t> prompt) {
  Prefilled result;
  bool done = false;
  const double start = MPI_Wtime();
  engine.submit(std::move(prompt), first_token_options(), [&](const TokenEvent& e) {
    if (done || e.token < 0) return;
    result = {MPI_Wtime() - start, e.token};
    done = true;
  });
  step_until(engine, done);
  return result;
}

// Rank 1 to rank 2 after each rep (rank 1's clock).
struct PrefillReport {
  Prefilled local;             // the prompt on an engine without export
  double order_at = 0.0;       // the order reached the engine thread
  double last_layer_at = 0.0;  // the last layer of the last chunk was stored
  double done_at = 0.0;        // the first token was sampled (the handoff queued next)
};

EngineConfig engine_config(const Shape& shape) {
  EngineConfig config;
  config.n_kv_blocks = 2 * shape.table_blocks() + 8;
  config.scheduler.max_step_tokens = shape.chunk;  // the prompt in --tokens / --chunk steps
  return config;
}

}  // namespace

void serve_prefills(const LlamaModel& model, KvTransfer& transfer, Mailbox<PrefillOrder>& orders,
                    MPI_Comm pair, const Shape& shape, const Args& args) {
  cpu::ThreadPool pool(args.threads);
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::best_isa());
  Engine local(model, kernels, pool, engine_config(shape));
  Engine prefill(model, kernels, pool, engine_config(shape));
  std::mt19937_64 rng(args.seed + 1);
  for (int rep = -1; rep < args.reps; ++rep) {
    const std::vector<int32_t> prompt = random_prompt(rng, shape.n_tokens, model.config().n_vocab);
    PrefillReport report;
    barrier_quietly(pair);
    report.local = prefill_locally(local, prompt);
    barrier_quietly(pair);  // rank 2's local prefill runs
    barrier_quietly(pair);
    PrefillOrder order = orders.take();
    report.order_at = MPI_Wtime();
    const RequestId id = order.request.id;
    int64_t rows_sent = 0;
    bool done = false;
    ExportSink sink;
    sink.layer = [&](SequenceId, int64_t layer, int64_t pos0, int64_t n,
                     std::span<const int32_t> table, const KvCache& cache) {
      if (layer == shape.layout.n_layers - 1) report.last_layer_at = MPI_Wtime();
      transfer.send_rows(kReceiver, id, layer, pos0, n, cache, table, 0, all_kv_heads_of(cache));
      rows_sent += n;
    };
    sink.done = [&](SequenceId, int32_t first_token, int64_t cached_tokens) {
      report.done_at = MPI_Wtime();
      const auto prefill_ns = static_cast<int64_t>((report.done_at - report.order_at) * 1e9);
      transfer.send_handoff(kReceiver, KvHandoff{id, first_token, cached_tokens, prefill_ns,
                                                 rows_sent, std::nullopt});
      done = true;
    };
    const RequestOptions options{.max_tokens = order.request.max_tokens,
                                 .sampling = order.request.sampling,
                                 .ignore_eos = order.request.ignore_eos};
    prefill.submit_export(std::move(order.request.prompt), options, order.send_from,
                          std::move(sink));
    step_until(prefill, done);
    send_value(pair, kPairReceiver, report);
  }
}

TtftTimes run_decodes(const LlamaModel& model, KvTransfer& transfer, Mailbox<Arrival>& arrivals,
                      MPI_Comm pair, const Shape& shape, const Args& args, const ClockSync& sync,
                      uint64_t& next_id) {
  cpu::ThreadPool pool(args.threads);
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::best_isa());
  Engine local(model, kernels, pool, engine_config(shape));
  Engine decode(model, kernels, pool, engine_config(shape));
  std::mt19937_64 rng(args.seed + 1);  // the sender's prompts
  TtftTimes times;
  for (int rep = -1; rep < args.reps; ++rep) {
    const std::vector<int32_t> prompt = random_prompt(rng, shape.n_tokens, model.config().n_vocab);
    barrier_quietly(pair);  // rank 1's local prefill runs
    barrier_quietly(pair);
    const Prefilled local_run = prefill_locally(local, prompt);
    barrier_quietly(pair);

    const RequestId id{next_id++};
    ImportHooks hooks;
    hooks.reserved = [&](SequenceId, int64_t cached_tokens, std::span<const int32_t> table) {
      const InstanceRequest request{
          .id = id, .prompt = prompt, .max_tokens = 1, .sampling = {}, .ignore_eos = true};
      const PrefillOrder order{request, cached_tokens, {}};
      transfer.start_import(kSender, order,
                            whole_import_plan(kSender, order, decode.cache(), table,
                                              KvTransfer::Clock::now() + kTransferTimeout));
    };
    int32_t token = -1;
    double token_at = 0.0;
    bool done = false;
    const double submit_at = MPI_Wtime();
    const SequenceId sid = decode.submit_import(
        prompt, first_token_options(),
        [&](const TokenEvent& e) {
          if (done || e.token < 0) return;
          token_at = MPI_Wtime();
          token = e.token;
          done = true;
        },
        std::move(hooks));
    const double cpu_before = process_cpu_seconds();  // the engine thread sleeps in take()
    const Arrival arrival = arrivals.take();
    const double wait_cpu = process_cpu_seconds() - cpu_before;
    DUET_REQUIRE(arrival.handoff, "KV transfer failed: {}", arrival.error);
    decode.complete_import(sid, arrival.handoff->first_token);
    step_until(decode, done);
    const auto report = receive_value<PrefillReport>(pair, kPairSender);

    if (token != local_run.token || token != report.local.token) {
      spdlog::error("rep {}: first tokens differ: local {} (rank 2), {} (rank 1), disaggregated {}",
                    rep, local_run.token, report.local.token, token);
      times.tokens_equal = false;
    }
    if (rep < 0) continue;
    const double order_at = report.order_at - sync.offset;
    const double last_layer_at = report.last_layer_at - sync.offset;
    const double done_at = report.done_at - sync.offset;
    times.local.push_back(local_run.seconds);
    times.local_rank1.push_back(report.local.seconds);
    times.ttft.push_back(token_at - submit_at);
    times.order.push_back(order_at - submit_at);
    times.prefill_export.push_back(report.done_at - report.order_at);
    times.added.push_back(times.ttft.back() - local_run.seconds);
    times.export_overhead.push_back(times.prefill_export.back() - report.local.seconds);
    times.head.push_back(report.done_at - report.last_layer_at);
    times.tail.push_back(arrival.at - last_layer_at);
    times.after_done.push_back(arrival.at - done_at);
    times.handoff.push_back(token_at - arrival.at);
    times.wait_cpu.push_back(wait_cpu);
  }
  return times;
}

}  // namespace duet::kv_bench

// duet-kv-transfer-bench: what moving a prompt's KV from a prefill instance
// to a decode instance costs, under `mpirun -np 3` (rank 0 idle, rank 1 the
// prefill side, rank 2 the decode side, as `duet serve` places them):
//   1. raw MPI: rank 1 MPI_Isends the messages of one transfer back to back
//      (all posted, then waited: the transfer's window), rank 2 MPI_Recvs
//      them into one buffer, on a communicator of their own; then again
//      under the transfer's progress model (every send and receive posted,
//      MPI_Testall every --transfer-poll-us, sleeping between): the
//      baseline a transfer driven by a communication thread can reach;
//      again with the buffers on huge pages, as the KV cache's are; and
//      block to block, through datatypes over two KvCaches;
//   2. the same KV through MpiKvTransfer between two KvCaches with different
//      (shuffled) block tables: start_import on rank 2; on the order, rank 1
//      send_rows each layer of each chunk, then send_handoff; rank 2's rows
//      are checked against rank 1's (kv_rows_checksum);
//   3. with --model, the time to first token a transfer adds: one engine's
//      prefill on rank 2 against submit_import on rank 2 fed by submit_export
//      on rank 1, split into where the time goes.
//
// Clocks: every timestamp is MPI_Wtime. Rank 1's are moved onto rank 2's clock by an offset
// measured with ping-pongs (the midpoint of the fastest round trip), reported with its uncertainty
// and MPI_WTIME_IS_GLOBAL. Raw and transfer times both run from the sender's first send call to
// the receiver holding the last byte (its last MPI_Recv returned; on_complete ran, which follows
// every row's arrival in the blocks). A rank that waits while the other computes polls with sleeps
// instead of spinning in MPI, leaving the other the core. Rank 2 prints Markdown tables (and --json
// FILE); the job exits non-zero when the received KV or the first tokens differ.
//
//   mpirun -np 3 duet-kv-transfer-bench [--model M] [--tokens N] [--chunk C] [--reps R] [--json F]
//
// The phases live in bench/kv_transfer/ (rig.h, transfer_phases.h,
// ttft_phase.h, report.h); here, each rank's part and the flags.
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <optional>

#include "bench/kv_transfer/report.h"
#include "bench/kv_transfer/ttft_phase.h"
#include "common/control_plane/control_channel.h"
#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "common/timer_slack.h"
#include "sim/link/rig.h"
#include "sim/link/transfer_phases.h"
#include "worker/transfer/mpi_kv_transfer.h"
#include "worker/transfer/transfer_setup.h"

namespace duet::kv_bench {
namespace {

int run_sender(const Args& args, KvTransferAdapter& transfer, MPI_Comm pair) {
  const auto model = args.model.empty() ? nullptr : LlamaModel::load(args.model);
  const Shape shape = make_shape(args, model.get());
  Mailbox<PrefillOrder> orders;
  KvTransfer::Handlers handlers;
  handlers.on_order = [&](int, PrefillOrder order) { orders.post(std::move(order)); };
  handlers.on_cancel = [](int, RequestId id) {
    spdlog::warn("rank 2 withdrew request {}", id.value);
  };
  transfer.set_handlers(std::move(handlers));

  sync_clocks(pair, kPairSender);
  bench_raw(pair, kPairSender, shape, args.reps, {});
  bench_raw(pair, kPairSender, shape, args.reps, {},
            std::chrono::microseconds(args.transfer_poll_us));
  bench_raw(pair, kPairSender, shape, args.reps, {},
            std::chrono::microseconds(args.transfer_poll_us), RawBuffers::kHugePages);
  bench_raw_blocks(pair, kPairSender, shape, args.reps, args.seed, {},
                   std::chrono::microseconds(args.transfer_poll_us));
  send_transfers(transfer, orders, pair, shape, args.reps, args.seed);
  if (model) serve_prefills(*model, transfer, orders, pair, shape, args);
  transfer.set_handlers({});
  return 0;
}

int run_receiver(const Args& args, KvTransferAdapter& transfer, MPI_Comm pair) {
  const auto model = args.model.empty() ? nullptr : LlamaModel::load(args.model);
  const Shape shape = make_shape(args, model.get());
  Mailbox<Arrival> arrivals;
  KvTransfer::Handlers handlers;
  handlers.on_complete = [&](RequestId, const KvHandoff& handoff) {
    arrivals.post(Arrival{MPI_Wtime(), handoff, {}});
  };
  handlers.on_failed = [&](RequestId, const ServeError& error) {
    arrivals.post(Arrival{MPI_Wtime(), std::nullopt, error.message});
  };
  transfer.set_handlers(std::move(handlers));

  uint64_t next_id = 1;
  const ClockSync sync = sync_clocks(pair, kPairReceiver);
  const std::vector<double> raw = bench_raw(pair, kPairReceiver, shape, args.reps, sync);
  const std::vector<double> raw_polled =
      bench_raw(pair, kPairReceiver, shape, args.reps, sync,
                std::chrono::microseconds(args.transfer_poll_us));
  const std::vector<double> raw_polled_huge =
      bench_raw(pair, kPairReceiver, shape, args.reps, sync,
                std::chrono::microseconds(args.transfer_poll_us), RawBuffers::kHugePages);
  const std::vector<double> raw_blocks =
      bench_raw_blocks(pair, kPairReceiver, shape, args.reps, args.seed, sync,
                       std::chrono::microseconds(args.transfer_poll_us));
  const int64_t cma_before = transfer.counters().cma_bytes_received;
  TransferTimes times =
      receive_transfers(transfer, arrivals, pair, shape, args.reps, args.seed, sync, next_id);
  times.cma_bytes = transfer.counters().cma_bytes_received - cma_before;
  Json json;
  report_transfer(shape, args, sync, {raw, raw_polled, raw_polled_huge, raw_blocks}, times, json);
  bool ok = times.kv_equal;
  if (model) {
    const TtftTimes ttft =
        run_decodes(*model, transfer, arrivals, pair, shape, args, sync, next_id);
    report_ttft(shape, args, ttft, json);
    json["model"] = args.model;
    ok = ok && ttft.tokens_equal;
  }
  transfer.set_handlers({});
  if (!args.json.empty()) {
    std::ofstream out(args.json);
    out << json.dump(2) << '\n';
    DUET_REQUIRE(out.good(), "could not write {}", args.json);
  }
  return ok ? 0 : 1;
}

// Every rank constructs the same collective objects in the same order (as
// `duet serve` does): the control channel, the KV transfer, then the pair
// communicator of ranks 1 and 2. Other ranks wait, idle, in close().
int run(const Args& args) {
  // The raw baselines' polls sleep as the transfers' communication threads do.
  set_thread_timer_slack();
  MpiRuntime mpi;
  DUET_REQUIRE(mpi.world_size() >= 3, "run under mpirun -np 3 (this job has {} process(es))",
               mpi.world_size());
  ControlChannelOptions options;
  options.transfer_poll = std::chrono::microseconds(args.transfer_poll_us);
  options.max_idle_sleep = std::chrono::microseconds(args.max_idle_sleep_us);
  options.min_idle_sleep = std::min(options.min_idle_sleep, options.max_idle_sleep);
  ControlChannel channel(mpi, options);
  const int rank = mpi.rank().value;
  const bool in_pair = rank == kSender || rank == kReceiver;
  // Collective either way: MPI's communicator, or TCP's address all-gather.
  std::unique_ptr<KvTransferAdapter> transfer;
  if (args.transport == "tcp") {
    RankPlacement own;
    own.host = mpi.processor_name();
    const std::vector<RankPlacement> placements = gather_placements(mpi, own);
    std::vector<int> peers;
    if (in_pair) peers.push_back(rank == kSender ? kReceiver : kSender);
    TcpKvTransferOptions options{args.checksums};
    options.transfer_poll = std::chrono::microseconds(args.transfer_poll_us);
    transfer = make_tcp_kv_transfer(mpi, peers, placements, options);
  } else {
    MpiKvTransferOptions options{args.checksums};
    if (args.cma == "off") options.cma_staging_bytes = 0;
    transfer = std::make_unique<MpiKvTransfer>(channel, options);
  }
  MPI_Comm pair = MPI_COMM_NULL;
  DUET_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, in_pair ? 0 : MPI_UNDEFINED, rank, &pair));
  int code = 0;
  if (in_pair) {
    try {
      code =
          rank == kSender ? run_sender(args, *transfer, pair) : run_receiver(args, *transfer, pair);
    } catch (const std::exception& e) {
      // The other rank may wait for this one in MPI: end the whole job.
      std::fprintf(stderr, "duet-kv-transfer-bench: rank %d: %s\n", rank, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 2);
    }
  }
  transfer.reset();  // before the channel closes
  if (!channel.close(in_pair ? std::chrono::milliseconds(30'000) : kIdleRankWait) && code == 0)
    code = 1;
  if (pair != MPI_COMM_NULL) MPI_Comm_free(&pair);
  return code;
}

}  // namespace
}  // namespace duet::kv_bench

int main(int argc, char** argv) {
  duet::kv_bench::Args args;
  CLI::App app{"KV transfer between two ranks: raw MPI, MpiKvTransfer, and the TTFT it adds"};
  app.add_option("--model", args.model, "GGUF model: its KV layout, and the TTFT part");
  app.add_option("--n-layers", args.n_layers, "KV layout without --model: layers");
  app.add_option("--kv-heads", args.n_kv_heads, "KV layout without --model: KV heads");
  app.add_option("--head-dim", args.head_dim, "KV layout without --model: head dimension");
  app.add_option("--tokens", args.n_tokens, "prompt tokens")->check(CLI::PositiveNumber);
  app.add_option("--chunk", args.chunk, "tokens per chunk; 0: all")->check(CLI::NonNegativeNumber);
  app.add_option("--reps", args.reps, "measured repetitions")->check(CLI::PositiveNumber);
  app.add_option("--threads", args.threads, "compute threads")->check(CLI::Range(1, 1024));
  app.add_option("--seed", args.seed, "random KV, block tables and prompts");
  app.add_flag("--checksums", args.checksums, "the transfer checksums every rows message");
  app.add_option("--transport", args.transport,
                 "what carries the KV transfer: mpi (MpiKvTransfer) or tcp (TcpKvTransfer)")
      ->check(CLI::IsMember({"mpi", "tcp"}))
      ->capture_default_str();
  app.add_option("--cma", args.cma,
                 "mpi between ranks of one host: auto (payloads read by cross-memory attach "
                 "where the kernel allows it) or off (every payload an MPI message)")
      ->check(CLI::IsMember({"auto", "off"}))
      ->capture_default_str();
  app.add_option("--transfer-poll-us", args.transfer_poll_us)->check(CLI::NonNegativeNumber);
  app.add_option("--max-idle-sleep-us", args.max_idle_sleep_us)->check(CLI::PositiveNumber);
  app.add_option("--json", args.json, "also write the results here (rank 2)");
  CLI11_PARSE(app, argc, argv);
  try {
    return duet::kv_bench::run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-kv-transfer-bench: %s\n", e.what());
    return 2;
  }
}

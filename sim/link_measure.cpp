#include "sim/link_measure.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>

#include "common/control_plane/control_channel.h"
#include "common/error.h"
#include "sim/link/rig.h"
#include "sim/link/transfer_phases.h"
#include "worker/parallel/mpi_collective.h"
#include "worker/transfer/mpi_kv_transfer.h"
#include "worker/transfer/tcp_kv_transfer.h"
#include "worker/transfer/transfer_setup.h"

namespace duet::sim {
namespace {

// World ranks: rank 1 prefills and sends, rank 0 decodes and receives (and
// keeps the results).
constexpr int kSenderRank = 1;
constexpr int kReceiverRank = 0;

kv_bench::Shape transfer_shape(const ModelConfig& config, int64_t n_tokens, int64_t chunk) {
  kv_bench::Shape shape;
  shape.n_tokens = n_tokens;
  shape.chunk = std::min(n_tokens, chunk);
  DUET_REQUIRE(n_tokens > 0 && n_tokens % shape.chunk == 0,
               "a transferred prompt of {} tokens is not a whole number of {}-token chunks",
               n_tokens, chunk);
  const int64_t blocks = (n_tokens + KvLayout::kDefaultBlockSize - 1) / KvLayout::kDefaultBlockSize;
  shape.layout = make_kv_layout(config, 2 * blocks);  // room for shuffled block tables
  return shape;
}

// Every prompt's transfer `reps` times through `transfer`; the receiver's samples.
std::vector<LinkSample> time_transfers(KvTransfer& transfer, int rank, MPI_Comm pair,
                                       const kv_bench::ClockSync& sync, const ModelConfig& config,
                                       const LinkMeasureOptions& options) {
  kv_bench::Mailbox<PrefillOrder> orders;
  kv_bench::Mailbox<kv_bench::Arrival> arrivals;
  KvTransfer::Handlers handlers;
  if (rank == kSenderRank) {
    handlers.on_order = [&](int, PrefillOrder order) { orders.post(std::move(order)); };
  } else {
    handlers.on_complete = [&](RequestId, const KvHandoff& handoff) {
      arrivals.post(kv_bench::Arrival{MPI_Wtime(), handoff, {}});
    };
    handlers.on_failed = [&](RequestId, const ServeError& error) {
      arrivals.post(kv_bench::Arrival{MPI_Wtime(), std::nullopt, error.message});
    };
  }
  transfer.set_handlers(std::move(handlers));
  std::vector<LinkSample> samples;
  uint64_t next_id = 1;
  for (const int64_t n_tokens : options.prompt_tokens) {
    const kv_bench::Shape shape = transfer_shape(config, n_tokens, options.chunk_tokens);
    if (rank == kSenderRank) {
      kv_bench::send_transfers(transfer, orders, pair, shape, options.reps, options.seed,
                               kReceiverRank);
      continue;
    }
    const kv_bench::TransferTimes times = kv_bench::receive_transfers(
        transfer, arrivals, pair, shape, options.reps, options.seed, sync, next_id, kSenderRank);
    if (!times.kv_equal)
      throw Error(ErrorKind::kInternal, "a transferred prompt's KV differs from the sent KV");
    for (const double seconds : times.from_send)
      samples.push_back({shape.total_payload(), std::max(seconds, 1e-9)});
  }
  transfer.set_handlers({});
  return samples;
}

std::vector<LinkSample> time_all_reduce(const MpiRuntime& mpi, MPI_Comm pair,
                                        const ModelConfig& config,
                                        const LinkMeasureOptions& options) {
  const Rank ranks[] = {Rank{0}, Rank{1}};
  MpiCollective collective(mpi, ranks, /*instance_id=*/0);
  std::vector<LinkSample> samples;
  for (const int64_t n_tokens : options.all_reduce_tokens) {
    std::vector<float> rows(static_cast<size_t>(n_tokens * config.n_embd));
    for (int rep = -1; rep < options.reps; ++rep) {  // rep -1 warms up
      std::fill(rows.begin(), rows.end(), 1.0f);
      DUET_MPI_CHECK(MPI_Barrier(pair));
      const double start = MPI_Wtime();
      collective.all_reduce_sum(rows);
      const double seconds = MPI_Wtime() - start;
      if (rep >= 0 && mpi.rank().value == kReceiverRank)
        samples.push_back({static_cast<double>(rows.size() * sizeof(float)), seconds});
    }
  }
  return samples;
}

}  // namespace

LinkMeasurement measure_links(const MpiRuntime& mpi, const ModelConfig& config,
                              const LinkMeasureOptions& options) {
  DUET_REQUIRE(mpi.world_size() == 2,
               "measuring transfers and collectives takes two ranks (mpirun -np 2), not {}",
               mpi.world_size());
  DUET_REQUIRE(options.reps >= 1, "reps must be >= 1, got {}", options.reps);
  for (const int64_t n : options.prompt_tokens) transfer_shape(config, n, options.chunk_tokens);
  const int rank = mpi.rank().value;
  // Every rank makes the same collective objects in the same order: the
  // control channel, the MPI transfer, the pair communicator, the TCP
  // transfer's address exchange, the collective's communicator.
  ControlChannel channel(mpi);
  LinkMeasurement out;
  {
    MpiKvTransfer mpi_transfer(channel, MpiKvTransferOptions{});
    MPI_Comm pair = MPI_COMM_NULL;
    // In the pair, the sender is kv_bench::kPairSender (0), the receiver 1.
    DUET_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, 0, rank == kSenderRank ? 0 : 1, &pair));
    const int pair_rank = rank == kSenderRank ? kv_bench::kPairSender : kv_bench::kPairReceiver;
    const kv_bench::ClockSync sync = kv_bench::sync_clocks(pair, pair_rank);

    RankPlacement own;
    own.host = mpi.processor_name();
    const std::vector<RankPlacement> placements = gather_placements(mpi, own);
    const bool one_host = placements.at(0).host == placements.at(1).host;

    std::vector<LinkSample> samples =
        time_transfers(mpi_transfer, rank, pair, sync, config, options);
    if (rank == kReceiverRank) {
      const LinkCost cost = fit_link_cost(samples);
      out.transfers.push_back({one_host ? "mpi-shm" : "mpi", cost, std::move(samples)});
    }

    const int peers[] = {1 - rank};
    std::unique_ptr<TcpKvTransfer> tcp =
        make_tcp_kv_transfer(mpi, peers, placements, TcpKvTransferOptions{});
    samples = time_transfers(*tcp, rank, pair, sync, config, options);
    if (rank == kReceiverRank) {
      const LinkCost cost = fit_link_cost(samples);
      out.transfers.push_back({"tcp", cost, std::move(samples)});
    }
    tcp.reset();

    samples = time_all_reduce(mpi, pair, config, options);
    if (rank == kReceiverRank) {
      const LinkCost cost = fit_link_cost(samples);
      out.collectives.push_back({"all_reduce", 2, cost, std::move(samples)});
    }
    DUET_MPI_CHECK(MPI_Comm_free(&pair));
  }
  if (!channel.close(std::chrono::milliseconds(30'000)))
    throw Error(ErrorKind::kInternal, "the control channel did not close in time");
  return out;
}

}  // namespace duet::sim

#include "sim/link/transfer_phases.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <random>
#include <thread>

#include "common/huge_pages.h"
#include "common/stats.h"
#include "worker/transfer/kv_transfer_protocol.h"

namespace duet::kv_bench {
namespace {

// Rank 1 to rank 2 after each transfer.
struct TransferReport {
  double first_send = 0.0;  // MPI_Wtime before the first send_rows
  double last_send = 0.0;   // after the last send_rows returned
  uint64_t checksum = 0;    // of the rows sent
};

// The transfer's own copies, without MPI or threads: every message of a
// transfer packed out of one cache and unpacked into another through one
// buffer.
void time_copies(const Shape& shape, int reps, uint64_t seed, TransferTimes& times) {
  KvCache from(shape.layout), to(shape.layout);
  std::mt19937_64 rng(seed);
  fill_random(from, rng);
  const std::vector<int32_t> a = shuffled_table(shape, rng), b = shuffled_table(shape, rng);
  std::vector<KvElement> rows(static_cast<size_t>(packed_kv_elems(shape.layout, shape.chunk)));
  std::vector<double> pack, unpack;
  for (int rep = -1; rep < reps; ++rep) {
    double p = 0.0, u = 0.0;
    for (int64_t pos0 = 0; pos0 < shape.n_tokens; pos0 += shape.chunk) {
      for (int64_t layer = 0; layer < shape.layout.n_layers; ++layer) {
        const double t0 = MPI_Wtime();
        pack_kv_rows(shape.layout, from.data(), layer, a, pos0, shape.chunk, rows.data());
        const double t1 = MPI_Wtime();
        unpack_kv_rows(shape.layout, to.data(), layer, b, pos0, shape.chunk, rows.data());
        p += t1 - t0;
        u += MPI_Wtime() - t1;
      }
    }
    if (rep >= 0) pack.push_back(p), unpack.push_back(u);
  }
  times.pack = median(pack);
  times.unpack = median(unpack);
}

// Until every request is done: MPI_Testall every `poll`, sleeping between.
void test_until_done(std::vector<MPI_Request>& requests, std::chrono::microseconds poll) {
  for (;;) {
    int done = 0;
    DUET_MPI_CHECK(MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                               MPI_STATUSES_IGNORE));
    if (done != 0) return;
    std::this_thread::sleep_for(poll);
  }
}

// Each rep's seconds from the sender's start stamp to the receiver's end
// stamp, on the receiver's clock; the sender sends its stamps and gets none.
std::vector<double> rep_seconds(MPI_Comm pair, bool sender, const std::vector<double>& stamps,
                                const ClockSync& sync) {
  const int reps = static_cast<int>(stamps.size());
  if (sender) {
    DUET_MPI_CHECK(MPI_Send(stamps.data(), reps, MPI_DOUBLE, kPairReceiver, kTag, pair));
    return {};
  }
  std::vector<double> starts(stamps.size());
  DUET_MPI_CHECK(
      MPI_Recv(starts.data(), reps, MPI_DOUBLE, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
  std::vector<double> seconds;
  for (size_t i = 0; i < stamps.size(); ++i)
    seconds.push_back(stamps[i] - (starts[i] - sync.offset));
  return seconds;
}

// One message's rows (`layer`, positions [pos0, pos0 + n), every head) in
// `cache` under `table`, in the packed order, as one committed datatype over
// absolute addresses (use with MPI_BOTTOM): the runs MpiKvTransfer receives
// into, walked by the same for_each_payload_run.
MPI_Datatype rows_datatype(KvCache& cache, const std::vector<int32_t>& table, int64_t layer,
                           int64_t pos0, int64_t n) {
  KvTransfer::ImportPlan plan;
  plan.cache = &cache;
  plan.block_table = table;
  const KvTransferProtocol::PayloadPlace place{&plan, layer, pos0, n, all_kv_heads(cache.layout()),
                                               0};
  std::vector<int> lengths;
  std::vector<MPI_Aint> addresses;
  for_each_payload_run(place, [&](KvElement* at, size_t bytes) {
    MPI_Aint address = 0;
    DUET_MPI_CHECK(MPI_Get_address(at, &address));
    addresses.push_back(address);
    lengths.push_back(static_cast<int>(bytes));
  });
  MPI_Datatype type = MPI_DATATYPE_NULL;
  DUET_MPI_CHECK(MPI_Type_create_hindexed(static_cast<int>(lengths.size()), lengths.data(),
                                          addresses.data(), MPI_BYTE, &type));
  DUET_MPI_CHECK(MPI_Type_commit(&type));
  return type;
}

}  // namespace

std::vector<double> bench_raw_blocks(MPI_Comm pair, int pair_rank, const Shape& shape, int reps,
                                     uint64_t seed, const ClockSync& sync,
                                     std::chrono::microseconds poll) {
  const bool sender = pair_rank == kPairSender;
  KvCache cache(shape.layout);
  std::mt19937_64 rng(sender ? seed : seed * 31 + 7);
  std::vector<MPI_Request> requests(static_cast<size_t>(shape.n_messages()));
  std::vector<double> stamps;  // the sender's first sends, the receiver's last receives
  uint64_t sent_sum = 0;
  for (int rep = -1; rep < reps; ++rep) {  // rep -1 warms up
    const std::vector<int32_t> table = shuffled_table(shape, rng);
    fill_blocks(cache, table, sender ? &rng : nullptr);
    DUET_MPI_CHECK(MPI_Barrier(pair));
    const double start = MPI_Wtime();
    size_t i = 0;
    for (int64_t pos0 = 0; pos0 < shape.n_tokens; pos0 += shape.chunk) {
      for (int64_t layer = 0; layer < shape.layout.n_layers; ++layer, ++i) {
        MPI_Datatype type = rows_datatype(cache, table, layer, pos0, shape.chunk);
        const int code =
            sender ? MPI_Isend(MPI_BOTTOM, 1, type, kPairReceiver, kTag, pair, &requests[i])
                   : MPI_Irecv(MPI_BOTTOM, 1, type, kPairSender, kTag, pair, &requests[i]);
        MPI_Type_free(&type);  // the request keeps what it needs of it
        DUET_MPI_CHECK(code);
      }
    }
    test_until_done(requests, poll);
    const double end = MPI_Wtime();
    // Checked outside the timed span: the receiver's rows equal the sender's.
    const uint64_t sum = kv_rows_checksum(shape.layout, cache.data(), table, 0, shape.n_tokens);
    if (sender) {
      sent_sum = sum;
      DUET_MPI_CHECK(MPI_Send(&sent_sum, 1, MPI_UINT64_T, kPairReceiver, kTag, pair));
    } else {
      DUET_MPI_CHECK(
          MPI_Recv(&sent_sum, 1, MPI_UINT64_T, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
      DUET_REQUIRE(sum == sent_sum, "raw MPI between blocks: the received KV differs (rep {})",
                   rep);
    }
    if (rep >= 0) stamps.push_back(sender ? start : end);
  }
  return rep_seconds(pair, sender, stamps, sync);
}

std::vector<double> bench_raw(MPI_Comm pair, int pair_rank, const Shape& shape, int reps,
                              const ClockSync& sync, std::optional<std::chrono::microseconds> poll,
                              RawBuffers memory) {
  const int n = static_cast<int>(shape.n_messages());
  const int size = static_cast<int>(shape.message_bytes());
  std::vector<double> stamps;  // the sender's first sends, the receiver's last receives
  std::vector<MPI_Request> requests(static_cast<size_t>(n));
  if (pair_rank == kPairSender) {
    // One buffer per message, as the transfer owns one per queued message;
    // on huge pages, one mapping that holds them all.
    std::vector<std::vector<std::byte>> heap;
    HugePageMemory huge;
    std::vector<std::byte*> buffers;
    if (memory == RawBuffers::kHugePages) {
      huge = HugePageMemory(static_cast<size_t>(n) * static_cast<size_t>(size));
      std::fill(huge.data(), huge.data() + huge.size(), std::byte{90});
      for (int i = 0; i < n; ++i) buffers.push_back(huge.data() + static_cast<size_t>(i) * size);
    } else {
      heap.assign(static_cast<size_t>(n),
                  std::vector<std::byte>(static_cast<size_t>(size), std::byte{90}));
      for (auto& buffer : heap) buffers.push_back(buffer.data());
    }
    for (int rep = -1; rep < reps; ++rep) {  // rep -1 warms up
      DUET_MPI_CHECK(MPI_Barrier(pair));
      const double start = MPI_Wtime();
      for (int i = 0; i < n; ++i) {
        DUET_MPI_CHECK(MPI_Isend(buffers[static_cast<size_t>(i)], size, MPI_BYTE, kPairReceiver,
                                 kTag, pair, &requests[static_cast<size_t>(i)]));
      }
      if (poll) {
        test_until_done(requests, *poll);
      } else {
        DUET_MPI_CHECK(MPI_Waitall(n, requests.data(), MPI_STATUSES_IGNORE));
      }
      if (rep >= 0) stamps.push_back(start);
    }
    return rep_seconds(pair, true, stamps, sync);
  }
  const size_t bytes = static_cast<size_t>(poll ? n * size : size);
  std::vector<std::byte> heap;
  HugePageMemory huge;
  std::byte* buffer = nullptr;
  if (memory == RawBuffers::kHugePages) {
    huge = HugePageMemory(bytes);
    buffer = huge.data();
  } else {
    heap.resize(bytes);
    buffer = heap.data();
  }
  for (int rep = -1; rep < reps; ++rep) {
    DUET_MPI_CHECK(MPI_Barrier(pair));
    if (poll) {
      for (int i = 0; i < n; ++i) {
        DUET_MPI_CHECK(MPI_Irecv(buffer + static_cast<size_t>(i) * size, size, MPI_BYTE,
                                 kPairSender, kTag, pair, &requests[static_cast<size_t>(i)]));
      }
      test_until_done(requests, *poll);
    } else {
      for (int i = 0; i < n; ++i) {
        DUET_MPI_CHECK(
            MPI_Recv(buffer, size, MPI_BYTE, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
      }
    }
    if (rep >= 0) stamps.push_back(MPI_Wtime());
  }
  return rep_seconds(pair, false, stamps, sync);
}

void send_transfers(KvTransfer& transfer, Mailbox<PrefillOrder>& orders, MPI_Comm pair,
                    const Shape& shape, int reps, uint64_t seed, int receiver) {
  KvCache cache(shape.layout);
  std::mt19937_64 rng(seed);
  for (int rep = -1; rep < reps; ++rep) {
    const std::vector<int32_t> table = shuffled_table(shape, rng);
    fill_blocks(cache, table, &rng);
    // Before the timed span: computed while the rows are in flight, it would
    // take a core from the transfer on a small machine.
    const uint64_t checksum =
        kv_rows_checksum(shape.layout, cache.data(), table, 0, shape.n_tokens);
    barrier_quietly(pair);
    const PrefillOrder order = orders.take();
    DUET_ASSERT(order.send_from == 0 &&
                static_cast<int64_t>(order.request.prompt.size()) == shape.n_tokens);
    const RequestId id = order.request.id;
    TransferReport report;
    report.first_send = MPI_Wtime();
    // Chunk after chunk, each layer after layer: the order a chunked prefill stores them.
    for (int64_t pos0 = 0; pos0 < shape.n_tokens; pos0 += shape.chunk) {
      for (int64_t layer = 0; layer < shape.layout.n_layers; ++layer)
        transfer.send_rows(receiver, id, layer, pos0, shape.chunk, cache, table, 0,
                           all_kv_heads_of(cache));
    }
    report.last_send = MPI_Wtime();
    transfer.send_handoff(
        receiver, KvHandoff{id, 0, 0, 0, shape.n_tokens * shape.layout.n_layers, std::nullopt});
    report.checksum = checksum;
    send_value(pair, kPairReceiver, report);
  }
}

TransferTimes receive_transfers(KvTransfer& transfer, Mailbox<Arrival>& arrivals, MPI_Comm pair,
                                const Shape& shape, int reps, uint64_t seed, const ClockSync& sync,
                                uint64_t& next_id, int sender) {
  KvCache cache(shape.layout);
  std::mt19937_64 rng(seed * 31 + 7);  // other block tables than the sender's
  PrefillOrder order;
  order.request.prompt.assign(static_cast<size_t>(shape.n_tokens), 0);
  order.request.max_tokens = 1;
  TransferTimes times;
  for (int rep = -1; rep < reps; ++rep) {
    const std::vector<int32_t> table = shuffled_table(shape, rng);
    fill_blocks(cache, table, nullptr);
    order.request.id = RequestId{next_id++};
    barrier_quietly(pair);
    const double start = MPI_Wtime();
    transfer.start_import(sender, order,
                          whole_import_plan(sender, order, cache, table,
                                            KvTransfer::Clock::now() + kTransferTimeout));
    const Arrival arrival = arrivals.take();
    DUET_REQUIRE(arrival.handoff, "KV transfer failed: {}", arrival.error);
    const auto report = receive_value<TransferReport>(pair, kPairSender);
    if (kv_rows_checksum(shape.layout, cache.data(), table, 0, shape.n_tokens) != report.checksum) {
      spdlog::error("rep {}: the received KV differs from the sent KV", rep);
      times.kv_equal = false;
    }
    if (rep < 0) continue;
    times.from_send.push_back(arrival.at - (report.first_send - sync.offset));
    times.from_start.push_back(arrival.at - start);
    times.send_loop.push_back(report.last_send - report.first_send);
  }
  time_copies(shape, reps, seed, times);
  return times;
}

}  // namespace duet::kv_bench

// duet-kv-transfer-bench: what moving a prompt's KV from a prefill instance
// to a decode instance costs, under `mpirun -np 3` (rank 0 idle, rank 1 the
// prefill side, rank 2 the decode side, as `duet serve` places them):
//   1. raw MPI: rank 1 MPI_Isends the messages of one transfer back to back
//      (all posted, then waited: the transfer's window), rank 2 MPI_Recvs
//      them into one buffer, on a communicator of their own;
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
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "common/mpi/control_channel.h"
#include "common/mpi/mpi_runtime.h"
#include "common/stats.h"
#include "kernels/cpu/isa.h"
#include "worker/engine.h"
#include "worker/kv/kv_rows.h"
#include "worker/model/llama_model.h"
#include "worker/transfer/mpi_kv_transfer.h"

namespace duet {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;

// World ranks, and the same processes' ranks in their pair communicator.
constexpr int kSender = 1;    // the prefill side
constexpr int kReceiver = 2;  // the decode side
constexpr int kPairSender = 0;
constexpr int kPairReceiver = 1;
constexpr int kTag = 1;
// The transfer's per-message header (worker/transfer/mpi_kv_transfer.h).
constexpr size_t kWireHeaderBytes = 48;
// An order, or a transfer with its prefill, that takes this long has failed.
constexpr auto kTransferTimeout = 600s;
// How long an idle rank waits for ranks 1 and 2 to finish every part.
constexpr auto kIdleRankWait = std::chrono::milliseconds(3'600'000);

struct Args {
  std::string model;
  int64_t n_layers = 30;
  int64_t n_kv_heads = 3;
  int64_t head_dim = 64;
  int64_t n_tokens = 512;
  int64_t chunk = 0;  // tokens per chunk; 0: the whole prompt
  int reps = 7;
  int threads = 1;
  uint64_t seed = 1;
  bool checksums = false;
  int64_t transfer_poll_us = ControlChannelOptions{}.transfer_poll.count();
  int64_t max_idle_sleep_us = ControlChannelOptions{}.max_idle_sleep.count();
  std::string json;
};

// Hands events from the transfer's handlers (the communication thread) to
// the main thread, which blocks on it without using a core.
template <typename T>
class Mailbox {
 public:
  void post(T value) {
    std::lock_guard lock(mutex_);
    items_.push_back(std::move(value));
    ready_.notify_one();
  }
  T take() {
    std::unique_lock lock(mutex_);
    if (!ready_.wait_for(lock, kTransferTimeout, [&] { return !items_.empty(); }))
      throw Error(ErrorKind::kInternal, "no word from the transfer in time");
    T value = std::move(items_.front());
    items_.pop_front();
    return value;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<T> items_;  // guarded by mutex_
};

// What the decode side's handlers saw (stamped on the communication thread).
struct Arrival {
  double at = 0.0;                   // MPI_Wtime
  std::optional<KvHandoff> handoff;  // empty: the import failed
  std::string error;
};

// ---------------------------------------------------------------- MPI helpers

// Waits for `request` polling with sleeps (MPI_Wait would spin a core the
// other rank may be computing on).
void wait_quietly(MPI_Request& request) {
  for (int done = 0;;) {
    DUET_MPI_CHECK(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
    if (done) return;
    std::this_thread::sleep_for(100us);
  }
}

void barrier_quietly(MPI_Comm comm) {
  MPI_Request request;
  DUET_MPI_CHECK(MPI_Ibarrier(comm, &request));
  wait_quietly(request);
}

template <typename T>
void send_value(MPI_Comm comm, int destination, const T& value) {
  DUET_MPI_CHECK(MPI_Send(&value, sizeof value, MPI_BYTE, destination, kTag, comm));
}

template <typename T>
T receive_value(MPI_Comm comm, int source) {
  T value;
  MPI_Request request;
  DUET_MPI_CHECK(MPI_Irecv(&value, sizeof value, MPI_BYTE, source, kTag, comm, &request));
  wait_quietly(request);
  return value;
}

// The offset between the two ranks' MPI_Wtime, known to the receiver.
struct ClockSync {
  double offset = 0.0;       // the sender's clock minus the receiver's, seconds
  double uncertainty = 0.0;  // half the fastest round trip
  bool wtime_global = false;
};

ClockSync sync_clocks(MPI_Comm pair, int pair_rank) {
  constexpr int kRounds = 200;
  ClockSync sync;
  int* global = nullptr;
  int flag = 0;
  DUET_MPI_CHECK(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_WTIME_IS_GLOBAL, &global, &flag));
  sync.wtime_global = flag && global != nullptr && *global != 0;
  double fastest = 1e30;
  for (int i = 0; i < kRounds; ++i) {
    double t = 0.0;
    if (pair_rank == kPairReceiver) {
      const double t0 = MPI_Wtime();
      send_value(pair, kPairSender, t0);
      DUET_MPI_CHECK(MPI_Recv(&t, 1, MPI_DOUBLE, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
      const double t1 = MPI_Wtime();
      if (t1 - t0 < fastest) {
        fastest = t1 - t0;
        sync.offset = t - 0.5 * (t0 + t1);
      }
    } else {
      DUET_MPI_CHECK(MPI_Recv(&t, 1, MPI_DOUBLE, kPairReceiver, kTag, pair, MPI_STATUS_IGNORE));
      send_value(pair, kPairReceiver, MPI_Wtime());
    }
  }
  sync.uncertainty = 0.5 * fastest;
  return sync;
}

// ---------------------------------------------------------------- the transfer's shape

// One transfer: n_chunks x n_layers messages, each a header and one layer's rows of one chunk.
struct Shape {
  KvLayout layout;  // twice the blocks the prompt needs, so that shuffled tables spread
  int64_t n_tokens = 0;
  int64_t chunk = 0;

  int64_t n_chunks() const { return n_tokens / chunk; }
  int64_t n_messages() const { return n_chunks() * layout.n_layers; }
  size_t payload_bytes() const {  // of one message
    return static_cast<size_t>(packed_kv_elems(layout, chunk)) * sizeof(KvElement);
  }
  size_t message_bytes() const { return kWireHeaderBytes + payload_bytes(); }
  double total_payload() const { return static_cast<double>(payload_bytes()) * n_messages(); }
  double total_wire() const { return static_cast<double>(message_bytes()) * n_messages(); }
  int64_t table_blocks() const { return (n_tokens + layout.block_size - 1) / layout.block_size; }
};

Shape make_shape(const Args& args, const LlamaModel* model) {
  ModelConfig config;  // the flags' layout, or the model's
  config.n_layers = args.n_layers;
  config.n_kv_heads = args.n_kv_heads;
  config.head_dim = args.head_dim;
  if (model != nullptr) config = model->config();
  Shape shape;
  shape.n_tokens = args.n_tokens;
  shape.chunk = args.chunk > 0 ? args.chunk : args.n_tokens;
  DUET_REQUIRE(shape.n_tokens > 0 && shape.n_tokens % shape.chunk == 0,
               "--tokens ({}) must be a positive multiple of --chunk ({})", shape.n_tokens,
               shape.chunk);
  const int64_t block = KvLayout::kDefaultBlockSize;
  shape.layout = make_kv_layout(config, 2 * ((shape.n_tokens + block - 1) / block));
  return shape;
}

void fill_random(KvCache& cache, std::mt19937_64& rng) {
  std::generate_n(cache.data(), cache.layout().total_elems(),
                  [&] { return static_cast<KvElement>(rng()); });
}

// The prompt's blocks: distinct blocks of the cache in a random order.
std::vector<int32_t> shuffled_table(const Shape& shape, std::mt19937_64& rng) {
  std::vector<int32_t> table(static_cast<size_t>(shape.layout.n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize(static_cast<size_t>(shape.table_blocks()));
  return table;
}

// ---------------------------------------------------------------- 1. raw MPI

// Both ranks spin here (MPI_Barrier, MPI_Waitall, MPI_Recv), as nothing else
// runs. The receiver returns the seconds of each rep, from the sender's first
// MPI_Isend to its own last MPI_Recv; the sender returns nothing.
std::vector<double> bench_raw(MPI_Comm pair, int pair_rank, const Shape& shape, int reps,
                              const ClockSync& sync) {
  const int n = static_cast<int>(shape.n_messages());
  const int size = static_cast<int>(shape.message_bytes());
  std::vector<double> stamps;  // the sender's first sends, the receiver's last receives
  if (pair_rank == kPairSender) {
    // One buffer per message, as the transfer owns one per queued message.
    std::vector<std::vector<std::byte>> buffers(
        static_cast<size_t>(n), std::vector<std::byte>(static_cast<size_t>(size), std::byte{90}));
    std::vector<MPI_Request> requests(static_cast<size_t>(n));
    for (int rep = -1; rep < reps; ++rep) {  // rep -1 warms up
      DUET_MPI_CHECK(MPI_Barrier(pair));
      const double start = MPI_Wtime();
      for (int i = 0; i < n; ++i) {
        DUET_MPI_CHECK(MPI_Isend(buffers[static_cast<size_t>(i)].data(), size, MPI_BYTE,
                                 kPairReceiver, kTag, pair, &requests[static_cast<size_t>(i)]));
      }
      DUET_MPI_CHECK(MPI_Waitall(n, requests.data(), MPI_STATUSES_IGNORE));
      if (rep >= 0) stamps.push_back(start);
    }
    DUET_MPI_CHECK(MPI_Send(stamps.data(), reps, MPI_DOUBLE, kPairReceiver, kTag, pair));
    return {};
  }
  std::vector<std::byte> buffer(static_cast<size_t>(size));
  for (int rep = -1; rep < reps; ++rep) {
    DUET_MPI_CHECK(MPI_Barrier(pair));
    for (int i = 0; i < n; ++i) {
      DUET_MPI_CHECK(
          MPI_Recv(buffer.data(), size, MPI_BYTE, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
    }
    if (rep >= 0) stamps.push_back(MPI_Wtime());
  }
  std::vector<double> starts(static_cast<size_t>(reps));
  DUET_MPI_CHECK(
      MPI_Recv(starts.data(), reps, MPI_DOUBLE, kPairSender, kTag, pair, MPI_STATUS_IGNORE));
  std::vector<double> seconds;
  for (size_t i = 0; i < stamps.size(); ++i)
    seconds.push_back(stamps[i] - (starts[i] - sync.offset));
  return seconds;
}

// ---------------------------------------------------------------- 2. MpiKvTransfer

// Rank 1 to rank 2 after each transfer.
struct TransferReport {
  double first_send = 0.0;  // MPI_Wtime before the first send_rows
  double last_send = 0.0;   // after the last send_rows returned
  uint64_t checksum = 0;    // of the rows sent
};

void send_transfers(MpiKvTransfer& transfer, Mailbox<PrefillOrder>& orders, MPI_Comm pair,
                    const Shape& shape, int reps, uint64_t seed) {
  KvCache cache(shape.layout);
  std::mt19937_64 rng(seed);
  for (int rep = -1; rep < reps; ++rep) {
    fill_random(cache, rng);
    const std::vector<int32_t> table = shuffled_table(shape, rng);
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
        transfer.send_rows(kReceiver, id, layer, pos0, shape.chunk, cache, table, 0,
                           all_kv_heads_of(cache));
    }
    report.last_send = MPI_Wtime();
    transfer.send_handoff(
        kReceiver, KvHandoff{id, 0, 0, 0, shape.n_tokens * shape.layout.n_layers, std::nullopt});
    report.checksum = kv_rows_checksum(shape.layout, cache.data(), table, 0, shape.n_tokens);
    send_value(pair, kPairReceiver, report);
  }
}

struct TransferTimes {
  std::vector<double> from_send;   // first send_rows (rank 1) -> on_complete (rank 2)
  std::vector<double> from_start;  // start_import -> on_complete, both on rank 2
  std::vector<double> send_loop;   // first send_rows call -> last return (rank 1)
  double pack = 0.0;               // pack_kv_rows alone, every message (median)
  double unpack = 0.0;             // unpack_kv_rows alone, every message (median)
  bool kv_equal = true;
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

TransferTimes receive_transfers(MpiKvTransfer& transfer, Mailbox<Arrival>& arrivals, MPI_Comm pair,
                                const Shape& shape, int reps, uint64_t seed, const ClockSync& sync,
                                uint64_t& next_id) {
  KvCache cache(shape.layout);
  std::mt19937_64 rng(seed * 31 + 7);  // other block tables than the sender's
  PrefillOrder order;
  order.request.prompt.assign(static_cast<size_t>(shape.n_tokens), 0);
  order.request.max_tokens = 1;
  TransferTimes times;
  for (int rep = -1; rep < reps; ++rep) {
    std::fill_n(cache.data(), cache.layout().total_elems(), KvElement{0});
    const std::vector<int32_t> table = shuffled_table(shape, rng);
    order.request.id = RequestId{next_id++};
    barrier_quietly(pair);
    const double start = MPI_Wtime();
    transfer.start_import(kSender, order,
                          whole_import_plan(kSender, order, cache, table,
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

// ---------------------------------------------------------------- 3. TTFT with engines

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

// Per rep: rank 1's local prefill, rank 2's local prefill (each alone on the
// machine), then the disaggregated one. Separate engines for the local and
// the disaggregated runs, and a fresh random prompt per rep, keep the prefix
// cache out of every measurement.
void serve_prefills(const LlamaModel& model, MpiKvTransfer& transfer, Mailbox<PrefillOrder>& orders,
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

// Per rep, on rank 2's clock (seconds).
struct TtftTimes {
  std::vector<double> local, local_rank1, ttft, added, order, prefill_export, export_overhead, head,
      tail, after_done, handoff, wait_cpu;
  bool tokens_equal = true;
};

TtftTimes run_decodes(const LlamaModel& model, MpiKvTransfer& transfer, Mailbox<Arrival>& arrivals,
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

// ---------------------------------------------------------------- the report

// The median and every rep, in milliseconds.
Json timing_json(const std::vector<double>& seconds) {
  std::vector<double> ms;
  for (double s : seconds) ms.push_back(s * 1e3);
  return Json{{"median_ms", median(seconds) * 1e3}, {"ms", ms}};
}

void report_transfer(const Shape& shape, const Args& args, const ClockSync& sync,
                     const std::vector<double>& raw, const TransferTimes& transfer, Json& json) {
  const double raw_s = median(raw);
  const double send_s = median(transfer.from_send);
  const double start_s = median(transfer.from_start);
  fmt::print(
      "\nKV of one transfer: {} tokens x {} layers x {} B/token/layer = {:.2f} MB, in {} "
      "messages of {} B ({} chunk(s) of {} tokens x {} layers); medians of {} reps\n",
      shape.n_tokens, shape.layout.n_layers,
      shape.layout.bytes_per_token() / static_cast<size_t>(shape.layout.n_layers),
      shape.total_payload() / 1e6, shape.n_messages(), shape.message_bytes(), shape.n_chunks(),
      shape.chunk, shape.layout.n_layers, args.reps);
  fmt::print("clocks: rank 1 - rank 2 = {:+.1f} us (+- {:.1f} us); MPI_WTIME_IS_GLOBAL = {}\n\n",
             sync.offset * 1e6, sync.uncertainty * 1e6, sync.wtime_global ? 1 : 0);
  fmt::print("| path | ms | GB/s (wire) | GB/s (KV) | % of raw |\n|---|---|---|---|---|\n");
  const auto row = [&](const char* name, double s) {
    fmt::print("| {} | {:.3f} | {:.2f} | {:.2f} | {:.0f} |\n", name, s * 1e3,
               shape.total_wire() / s / 1e9, shape.total_payload() / s / 1e9, 100.0 * raw_s / s);
  };
  row("raw MPI: Isend window -> last Recv", raw_s);
  row("MpiKvTransfer: first send_rows -> on_complete", send_s);
  row("MpiKvTransfer: start_import -> on_complete (with the order's trip)", start_s);
  fmt::print(
      "\nstages: rank 1's send_rows loop (pack + queue) {:.3f} ms; without MPI, "
      "pack_kv_rows {:.3f} ms, unpack_kv_rows {:.3f} ms (every message)\n",
      median(transfer.send_loop) * 1e3, transfer.pack * 1e3, transfer.unpack * 1e3);
  fmt::print("\nreceived KV equals sent KV in every rep: {}\n", transfer.kv_equal ? "yes" : "NO");

  json["shape"] = {{"layers_kv_heads_head_dim",
                    {shape.layout.n_layers, shape.layout.n_kv_heads, shape.layout.head_dim}},
                   {"tokens", shape.n_tokens},
                   {"chunk", shape.chunk},
                   {"messages", shape.n_messages()},
                   {"message_bytes", shape.message_bytes()},
                   {"payload_bytes", shape.total_payload()}};
  json["reps"] = args.reps;
  json["clock"] = {{"offset_us", sync.offset * 1e6},
                   {"uncertainty_us", sync.uncertainty * 1e6},
                   {"wtime_is_global", sync.wtime_global}};
  json["raw"] = timing_json(raw);
  json["raw"]["gbps_wire"] = shape.total_wire() / raw_s / 1e9;
  json["transfer"] = {{"from_first_send", timing_json(transfer.from_send)},
                      {"from_start_import", timing_json(transfer.from_start)},
                      {"send_rows_loop", timing_json(transfer.send_loop)},
                      {"pack_alone_ms", transfer.pack * 1e3},
                      {"unpack_alone_ms", transfer.unpack * 1e3},
                      {"gbps_wire", shape.total_wire() / send_s / 1e9},
                      {"percent_of_raw", 100.0 * raw_s / send_s},
                      {"kv_equal", transfer.kv_equal}};
  json["options"] = {{"checksums", args.checksums},
                     {"transfer_poll_us", args.transfer_poll_us},
                     {"max_idle_sleep_us", args.max_idle_sleep_us}};
}

void report_ttft(const Shape& shape, const Args& args, const TtftTimes& t, Json& json) {
  const std::vector<std::pair<const char*, std::vector<double>>> rows = {
      {"(a) local prefill, rank 2: submit -> first token", t.local},
      {"(b) disaggregated, rank 2: submit_import -> first token", t.ttft},
      {"(b) - (a)", t.added},
      {"order: submit_import (rank 2) -> order on rank 1's engine thread", t.order},
      {"rank 1 prefill with export: order -> first token sampled", t.prefill_export},
      {"rank 1 prefill without export: submit -> first token", t.local_rank1},
      {"export overhead: with - without (rank 1)", t.export_overhead},
      {"rank 1: last layer's KV stored -> first token sampled (its attention, FFN, head)", t.head},
      {"transfer tail: last layer stored -> handoff, every row in (rank 2)", t.tail},
      {"first token sampled (rank 1) -> handoff at rank 2", t.after_done},
      {"handoff: on_complete -> first token on rank 2", t.handoff},
      {"rank 2 CPU (communication thread) while waiting for the KV", t.wait_cpu},
  };
  fmt::print("\nTTFT of a {}-token prompt, {} compute thread(s) per rank, medians of {} reps\n\n",
             shape.n_tokens, args.threads, args.reps);
  fmt::print("| step | ms |\n|---|---|\n");
  Json& out = json["ttft"];
  for (const auto& [name, seconds] : rows) {
    fmt::print("| {} | {:.2f} |\n", name, median(seconds) * 1e3);
    out[name] = timing_json(seconds);
  }
  fmt::print(
      "\nper rep, (b) = order + (order -> last layer stored) + transfer tail + handoff\n"
      "first tokens equal in every rep (local on both ranks, disaggregated): {}\n",
      t.tokens_equal ? "yes" : "NO");
  out["tokens_equal"] = t.tokens_equal;
  out["threads"] = args.threads;
}

// ---------------------------------------------------------------- the ranks

int run_sender(const Args& args, MpiKvTransfer& transfer, MPI_Comm pair) {
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
  send_transfers(transfer, orders, pair, shape, args.reps, args.seed);
  if (model) serve_prefills(*model, transfer, orders, pair, shape, args);
  transfer.set_handlers({});
  return 0;
}

int run_receiver(const Args& args, MpiKvTransfer& transfer, MPI_Comm pair) {
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
  const TransferTimes times =
      receive_transfers(transfer, arrivals, pair, shape, args.reps, args.seed, sync, next_id);
  Json json;
  report_transfer(shape, args, sync, raw, times, json);
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
  MpiRuntime mpi;
  DUET_REQUIRE(mpi.world_size() >= 3, "run under mpirun -np 3 (this job has {} process(es))",
               mpi.world_size());
  ControlChannelOptions options;
  options.transfer_poll = std::chrono::microseconds(args.transfer_poll_us);
  options.max_idle_sleep = std::chrono::microseconds(args.max_idle_sleep_us);
  options.min_idle_sleep = std::min(options.min_idle_sleep, options.max_idle_sleep);
  ControlChannel channel(mpi, options);
  std::optional<MpiKvTransfer> transfer(std::in_place, channel,
                                        MpiKvTransferOptions{args.checksums});
  const int rank = mpi.rank().value;
  const bool in_pair = rank == kSender || rank == kReceiver;
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
}  // namespace duet

int main(int argc, char** argv) {
  duet::Args args;
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
  app.add_option("--transfer-poll-us", args.transfer_poll_us)->check(CLI::NonNegativeNumber);
  app.add_option("--max-idle-sleep-us", args.max_idle_sleep_us)->check(CLI::PositiveNumber);
  app.add_option("--json", args.json, "also write the results here (rank 2)");
  CLI11_PARSE(app, argc, argv);
  try {
    return duet::run(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet-kv-transfer-bench: %s\n", e.what());
    return 2;
  }
}

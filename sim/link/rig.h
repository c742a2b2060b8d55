// duet-kv-transfer-bench's rig (bench/kv_transfer_bench.cpp runs it): its
// flags, the ranks' roles, the transfer's shape, and the MPI helpers and clock
// sync its phases share (sim/link/transfer_phases.h, ttft_phase.h).
#pragma once

#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/control_plane/control_channel.h"
#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "worker/kv/kv_cache.h"
#include "worker/kv/kv_rows.h"
#include "worker/model/llama_model.h"
#include "worker/transfer/kv_transfer.h"

namespace duet::kv_bench {

using namespace std::chrono_literals;

// World ranks, and the same processes' ranks in their pair communicator.
inline constexpr int kSender = 1;    // the prefill side
inline constexpr int kReceiver = 2;  // the decode side
inline constexpr int kPairSender = 0;
inline constexpr int kPairReceiver = 1;
inline constexpr int kTag = 1;
// The transfer's per-message header (worker/transfer/mpi_kv_transfer.h).
inline constexpr size_t kWireHeaderBytes = 48;
// An order, or a transfer with its prefill, that takes this long has failed.
inline constexpr auto kTransferTimeout = 600s;
// How long an idle rank waits for ranks 1 and 2 to finish every part.
inline constexpr auto kIdleRankWait = std::chrono::milliseconds(3'600'000);

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
  std::string transport = "mpi";  // what carries the KV transfer: mpi or tcp
  std::string cma = "auto";       // mpi: payloads by cross-memory attach (auto) or not (off)
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
void wait_quietly(MPI_Request& request);
void barrier_quietly(MPI_Comm comm);

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

// Measured with ping-pongs between the pair's two ranks (both call it).
ClockSync sync_clocks(MPI_Comm pair, int pair_rank);

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

Shape make_shape(const Args& args, const LlamaModel* model);

void fill_random(KvCache& cache, std::mt19937_64& rng);

// The prompt's blocks: distinct blocks of the cache in a random order.
std::vector<int32_t> shuffled_table(const Shape& shape, std::mt19937_64& rng);

// Random values (or, without `rng`, zeros) in `table`'s blocks of every
// layer, and nothing else. The cache holds twice the prompt; a rep that
// wrote all of it on both sides (47 MB at 512 tokens) would push the rows to
// be sent out of the last-level cache the two ranks share, while raw MPI's
// buffers, the same every rep, fit in it (23.6 MB): the transfer would send
// from DRAM and the baseline from cache. Preparing only the blocks a rep
// moves touches as much memory as raw MPI does.
void fill_blocks(KvCache& cache, const std::vector<int32_t>& table, std::mt19937_64* rng);

}  // namespace duet::kv_bench

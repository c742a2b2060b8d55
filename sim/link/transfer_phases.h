// duet-kv-transfer-bench's first two phases, between rank 1 (the sender,
// the prefill side) and rank 2 (the receiver, the decode side):
//   1. raw MPI: the messages of one transfer, MPI_Isend back to back and
//      MPI_Recv into one buffer, on the pair's own communicator; and again
//      under the transfer's progress model (posted, then tested and slept);
//   2. the same KV through MpiKvTransfer between two KvCaches with different
//      (shuffled) block tables, the received rows checked against the sent
//      (kv_rows_checksum).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "sim/link/rig.h"
#include "worker/transfer/kv_transfer.h"

namespace duet::kv_bench {

// ---------------------------------------------------------------- 1. raw MPI

// Without `poll`, both ranks spin here (MPI_Barrier, MPI_Waitall, MPI_Recv),
// as nothing else runs: the most MPI can do with a core to burn. With it,
// the progress model of the transfer's communication thread: every send and
// receive posted at once (MPI_Isend, MPI_Irecv into one buffer per
// message), then MPI_Testall every `poll`, sleeping in between, so that MPI
// moves the bytes only inside those calls. The receiver returns the seconds
// of each rep, from the sender's first MPI_Isend to its own last receive;
// the sender returns nothing.
// Where raw MPI's buffers live: the heap (4 KiB pages), or transparent huge
// pages, as the KV cache and the CMA staging ring do (common/huge_pages.h).
// Open MPI's single-copy shared-memory path reads huge pages several times
// faster; over TCP it makes no difference.
enum class RawBuffers { kHeap, kHugePages };

std::vector<double> bench_raw(MPI_Comm pair, int pair_rank, const Shape& shape, int reps,
                              const ClockSync& sync,
                              std::optional<std::chrono::microseconds> poll = std::nullopt,
                              RawBuffers memory = RawBuffers::kHeap);

// Raw MPI under the polled progress model as above, but straight between
// two KvCaches with different (shuffled) block tables: each message is sent
// from the sender's blocks and received into the receiver's through an
// MPI_Type_create_hindexed datatype per side, built inside the timed span.
// What a transfer that neither packs nor unpacks itself could reach.
std::vector<double> bench_raw_blocks(MPI_Comm pair, int pair_rank, const Shape& shape, int reps,
                                     uint64_t seed, const ClockSync& sync,
                                     std::chrono::microseconds poll);

// ---------------------------------------------------------------- 2. MpiKvTransfer

struct TransferTimes {
  std::vector<double> from_send;   // first send_rows (rank 1) -> on_complete (rank 2)
  std::vector<double> from_start;  // start_import -> on_complete, both on rank 2
  std::vector<double> send_loop;   // first send_rows call -> last return (rank 1)
  double pack = 0.0;               // pack_kv_rows alone, every message (median)
  double unpack = 0.0;             // unpack_kv_rows alone, every message (median)
  bool kv_equal = true;
  int64_t cma_bytes = 0;  // of the payloads, read by cross-memory attach (rank 2)
};

// The sender (rank 1 of the bench): serves `reps` transfers (and a warm-up)
// as `receiver` (a world rank) orders them.
void send_transfers(KvTransfer& transfer, Mailbox<PrefillOrder>& orders, MPI_Comm pair,
                    const Shape& shape, int reps, uint64_t seed, int receiver = kReceiver);

// The receiver (rank 2 of the bench): orders them from `sender` (a world
// rank), checks each, and times them (request ids from next_id on).
TransferTimes receive_transfers(KvTransfer& transfer, Mailbox<Arrival>& arrivals, MPI_Comm pair,
                                const Shape& shape, int reps, uint64_t seed, const ClockSync& sync,
                                uint64_t& next_id, int sender = kSender);

}  // namespace duet::kv_bench

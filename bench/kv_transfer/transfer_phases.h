// duet-kv-transfer-bench's first two phases, between rank 1 (the sender,
// the prefill side) and rank 2 (the receiver, the decode side):
//   1. raw MPI: the messages of one transfer, MPI_Isend back to back and
//      MPI_Recv into one buffer, on the pair's own communicator;
//   2. the same KV through MpiKvTransfer between two KvCaches with different
//      (shuffled) block tables, the received rows checked against the sent
//      (kv_rows_checksum).
#pragma once

#include <cstdint>
#include <vector>

#include "bench/kv_transfer/rig.h"
#include "worker/transfer/kv_transfer.h"

namespace duet::kv_bench {

// ---------------------------------------------------------------- 1. raw MPI

// Both ranks spin here (MPI_Barrier, MPI_Waitall, MPI_Recv), as nothing else
// runs. The receiver returns the seconds of each rep, from the sender's first
// MPI_Isend to its own last MPI_Recv; the sender returns nothing.
std::vector<double> bench_raw(MPI_Comm pair, int pair_rank, const Shape& shape, int reps,
                              const ClockSync& sync);

// ---------------------------------------------------------------- 2. MpiKvTransfer

struct TransferTimes {
  std::vector<double> from_send;   // first send_rows (rank 1) -> on_complete (rank 2)
  std::vector<double> from_start;  // start_import -> on_complete, both on rank 2
  std::vector<double> send_loop;   // first send_rows call -> last return (rank 1)
  double pack = 0.0;               // pack_kv_rows alone, every message (median)
  double unpack = 0.0;             // unpack_kv_rows alone, every message (median)
  bool kv_equal = true;
};

// Rank 1: serves `reps` transfers (and a warm-up) as rank 2 orders them.
void send_transfers(KvTransfer& transfer, Mailbox<PrefillOrder>& orders, MPI_Comm pair,
                    const Shape& shape, int reps, uint64_t seed);

// Rank 2: orders them, checks each, and times them (request ids from next_id on).
TransferTimes receive_transfers(KvTransfer& transfer, Mailbox<Arrival>& arrivals, MPI_Comm pair,
                                const Shape& shape, int reps, uint64_t seed, const ClockSync& sync,
                                uint64_t& next_id);

}  // namespace duet::kv_bench

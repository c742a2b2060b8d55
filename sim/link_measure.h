// Measuring what a profile (sim/profile.h) says of moving bytes between
// two ranks of one host, under `mpirun -np 2 duet profile ...`:
//   - KV transfers through the real transfer code: MpiKvTransfer ("mpi-shm":
//     MPI between ranks of one host goes over shared memory; "mpi" when the
//     ranks are on different hosts) and TcpKvTransfer ("tcp", loopback on
//     one host), each a prompt's KV moved from rank 1 (the prefill side) to
//     rank 0 (the decode side) in the messages a chunked prefill sends (one
//     per layer per chunk of the step budget), timed from the sender's first
//     send to the receiver's on_complete (clocks aligned by ping-pongs); the
//     phases of duet-kv-transfer-bench (sim/link/transfer_phases.h);
//   - the tensor-parallel all-reduce (MpiCollective::all_reduce_sum) of the
//     float rows a step of n tokens reduces, n_tokens * n_embd, both ranks.
// A sample's bytes are the KV payload (headers are the fitted latency's) or
// the reduced floats; every repetition is a sample.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/control_plane/mpi_runtime.h"
#include "common/model/model_config.h"
#include "sim/profile.h"

namespace duet::sim {

struct LinkMeasureOptions {
  // Prompts whose KV is transferred, in tokens; each moves in chunks of
  // min(its length, chunk_tokens) tokens (so a multiple of it, or shorter).
  std::vector<int64_t> prompt_tokens = {1, 4, 16, 64, 256, 512, 1024, 2048};
  int64_t chunk_tokens = 512;  // the step budget of the prefill side
  // Rows of an all-reduce: n_tokens * n_embd floats each.
  std::vector<int64_t> all_reduce_tokens = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
  int reps = 5;
  uint64_t seed = 1;
};

struct LinkMeasurement {
  std::vector<TransferProfile> transfers;      // on rank 0; empty on rank 1
  std::vector<CollectiveProfile> collectives;  // on rank 0; empty on rank 1
};

// Collective: both ranks of a world of two call it with the same arguments
// (rank 1 serves rank 0's measurement). Throws duet::Error
// (kInvalidArgument) for another world size or a chunk that does not divide a
// prompt longer than it; a transfer that fails throws (kInternal).
LinkMeasurement measure_links(const MpiRuntime& mpi, const ModelConfig& config,
                              const LinkMeasureOptions& options);

}  // namespace duet::sim

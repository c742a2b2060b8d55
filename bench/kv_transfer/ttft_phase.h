// duet-kv-transfer-bench's third phase (with --model): the time to first
// token a transfer adds. Per rep, one engine's prefill on each rank alone,
// then the disaggregated one: submit_import on rank 2 fed by submit_export on
// rank 1, split into where the time goes.
#pragma once

#include <cstdint>
#include <vector>

#include "sim/link/rig.h"
#include "worker/transfer/kv_transfer.h"

namespace duet::kv_bench {

// Per rep: rank 1's local prefill, rank 2's local prefill (each alone on the
// machine), then the disaggregated one. Separate engines for the local and
// the disaggregated runs, and a fresh random prompt per rep, keep the prefix
// cache out of every measurement.
void serve_prefills(const LlamaModel& model, KvTransfer& transfer, Mailbox<PrefillOrder>& orders,
                    MPI_Comm pair, const Shape& shape, const Args& args);

// Per rep, on rank 2's clock (seconds).
struct TtftTimes {
  std::vector<double> local, local_rank1, ttft, added, order, prefill_export, export_overhead, head,
      tail, after_done, handoff, wait_cpu;
  bool tokens_equal = true;
};

// Rank 2's side of serve_prefills (request ids from next_id on).
TtftTimes run_decodes(const LlamaModel& model, KvTransfer& transfer, Mailbox<Arrival>& arrivals,
                      MPI_Comm pair, const Shape& shape, const Args& args, const ClockSync& sync,
                      uint64_t& next_id);

}  // namespace duet::kv_bench

// One instance on several ranks (tensor parallelism): the leader runs the engine and
// decides everything (which sequences run, their blocks, what is sampled); each
// follower holds its shard of the weights and a KV cache of the same blocks for its
// own KV heads, and does what the leader posts (Collective::post), in order:
//   step     run this forward batch (its collectives keep every rank in lockstep)
//            and, in a prefill instance, ship its heads' exported rows to the
//            decode ranks that hold them;
//   expect   register an import of its heads (the leader's order leaves after all have);
//   confirm  the leader has its rows and the handoff: wait for all of its own
//            rows (or the import's failure) and answer;
//   release  the import is over without them: stop writing its blocks and answer;
//   lost     these ranks are lost: its transfer stops waiting on them (a joined
//            group's followers hear of losses only through the leader);
//   stop     the leader's engine has stopped.
// Only the leader samples and talks to the coordinator and other instances'
// leaders; the KV itself moves rank to rank (worker/transfer/kv_transfer.h).
//
// Thread affinity: TpLeader on the leader's engine thread; run_tp_follower on the
// follower's main thread, until stop.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <vector>

#include "common/serving.h"
#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "worker/engine.h"
#include "worker/model/llama_model.h"
#include "worker/parallel/collective.h"
#include "worker/parallel/device_collective.h"
#include "worker/transfer/kv_transfer.h"

namespace duet {

// Rows of one batch sequence a prefill instance ships to a decode instance.
struct TpExport {
  RequestId id;
  size_t sequence = 0;  // in the batch
  int64_t pos0 = 0;
  int64_t n = 0;
  std::vector<int32_t> decode_ranks;  // the decode instance's ranks, leader first
};

// The decode side's transfer of one prompt, as every rank of the instance sees it.
struct TpImport {
  RequestId id;
  int64_t send_from = 0;
  int64_t n_prompt = 0;
  std::vector<int32_t> block_table;
  std::chrono::milliseconds timeout{0};  // from now
  std::vector<int32_t> prefill_ranks;    // the prefill instance's ranks, leader first
};

// The transfer plan of rank `index` of a `size`-rank decode instance.
KvTransfer::ImportPlan tp_import_plan(const TpImport& import, const LlamaModel& model,
                                      KvCache& cache);

// Ships rows [pos0, pos0 + n) of `layer` of this rank's KV heads to every
// rank of the decode instance that holds some of them.
void tp_send_rows(KvTransfer& transfer, const LlamaModel& model, RequestId id, int64_t layer,
                  int64_t pos0, int64_t n, std::span<const int32_t> decode_ranks,
                  const KvCache& cache, std::span<const int32_t> block_table);

class TpLeader final {
 public:
  // Rank 0 of `collective` (outlives this object), of two ranks or more;
  // `device_collective`: the same ranks on their GPUs (NCCL) when the
  // instance runs there (outlives this object), else null.
  explicit TpLeader(Collective& collective, DeviceCollective* device_collective = nullptr);
  TpLeader(const TpLeader&) = delete;
  TpLeader& operator=(const TpLeader&) = delete;

  Collective& collective() { return collective_; }
  DeviceCollective* device_collective() { return device_collective_; }

  void step(const ForwardBatch& batch, std::span<const TpExport> exports);
  // Returns once every follower has registered the import.
  void expect_import(const TpImport& import);
  // Waits for every follower's rows of `id`: true when all have them all.
  bool confirm_import(RequestId id);
  // Every follower stops writing `id`'s blocks; returns when they have.
  void release_import(RequestId id);
  // The followers leave run_tp_follower. Once only.
  void stop();
  // Any thread: the followers are told that `ranks` are lost ahead of the
  // next command (a release that follows the loss finds their transfers
  // no longer waiting on those ranks).
  void peers_lost(std::span<const Rank> ranks);

 private:
  // The engine's thread, before each command: the losses told since.
  void tell_losses();
  // One byte from every follower (the leader's own is ignored).
  std::vector<std::byte> gather_answers();

  Collective& collective_;
  DeviceCollective* const device_collective_;
  std::vector<std::byte> message_;  // reused
  std::mutex lost_mutex_;
  std::vector<int32_t> lost_;  // guarded by lost_mutex_: not yet told
};

// Where a follower runs: the CPU (device -1), or CUDA device `device` with
// the instance's device collective.
struct TpFollowerPlacement {
  int device = -1;
  DeviceCollective* device_collective = nullptr;
};

// A follower's whole life in the instance: builds its cache (n_kv_blocks,
// as the leader's) and forward pass, then obeys the leader until stop.
// `transfer` (null when the instance has no peers) is this rank's, its
// handlers taken over for the follower's imports. On a GPU the host cache
// is the staging copy of the device's, as the leader's engine keeps it.
void run_tp_follower(const LlamaModel& model, const cpu::KernelTable& kernels,
                     cpu::ThreadPool& pool, Collective& collective, int64_t n_kv_blocks,
                     KvTransfer* transfer, const TpFollowerPlacement& placement = {});

}  // namespace duet

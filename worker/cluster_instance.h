// An instance rank's life in an mpirun cluster (`duet serve` on every rank
// but the coordinator's), after the rank's resources are wired and the
// handshake is passed: load this rank's shard of the model, then either lead
// the instance (its engine behind an InstanceServer until the coordinator's
// Shutdown, then stop the followers) or follow the leader (tensor
// parallelism: mirror every step, worker/tensor_parallel.h).
//
// A rank that cannot load its shard, or join its instance's NCCL
// communicator, says so (every rank of the instance learns whether all
// could); the leader then reports the instance failed to the coordinator
// (InstanceReady with an error) and every rank waits for the Shutdown.
//
// Thread affinity: the rank's main thread.
#pragma once

#include <chrono>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/control_plane/control_channel.h"
#include "worker/engine.h"
#include "worker/model/llama_model.h"
#include "worker/parallel/collective.h"
#include "worker/transfer/kv_transfer.h"
#include "worker/transfer/transfer_kind.h"

namespace duet {

struct ClusterInstanceOptions {
  std::string model_path;  // the GGUF file every rank loads its shard of
  std::string model_name;  // the id clients name
  int compute_threads = 1;
  int device = -1;  // this rank's: -1 the CPU, else a CUDA device
  // Disaggregated: the longest a decode instance waits for a prompt's KV
  // (the prefill side's queue included).
  std::chrono::milliseconds kv_transfer_timeout{120'000};
  // How often every rank heartbeats to the coordinator (its lease / 6).
  std::chrono::milliseconds heartbeat_interval{500};
  // The engine's configuration for this rank's loaded shard and the model's
  // end-of-generation ids (every rank of an instance must count the same KV
  // blocks). May throw: the rank then reports it could not load.
  std::function<EngineConfig(const LlamaModel& shard, std::vector<int32_t> end_of_generation)>
      engine_config;
  // An instance of one rank, counted lost while it lives: instead of
  // leaving the process, once its engine has stopped (what it held runs
  // elsewhere; its KV goes with the engine) and its channel is closed, this
  // is called with its role, model and configuration and its result returned
  // (tools: it joins the cluster again as a new member). Empty: it leaves.
  std::function<int(InstanceRole role, const LlamaModel& model, const EngineConfig& config)> rejoin;
};

// This rank's part of its instance in `spec`, until the coordinator's
// Shutdown. `channel`, `transfer` (over MPI or TCP; null when this rank
// moves no KV) and `collective` (the instance's ranks) are the rank's, wired
// by the caller; `placements`: every rank's, by world rank. Heartbeats to
// the coordinator from the start (worker/rank_liveness.h): a rank whose
// instance is lost leaves the process from there (or rejoins: `rejoin`). Closes the channel before
// returning. Returns the exit code: 0, 1 when not every rank closed in
// time, 2 when the instance could not start.
int serve_cluster_instance(MpiRuntime& mpi, ControlChannel& channel, KvTransfer* transfer,
                           Collective& collective, const ClusterSpec& spec,
                           std::span<const RankPlacement> placements,
                           const ClusterInstanceOptions& options);

}  // namespace duet

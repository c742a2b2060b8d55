#include "worker/cluster_instance.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>

#include "common/text/tokenizer_gguf.h"
#include "kernels/cpu/isa.h"
#include "worker/instance_server.h"
#include "worker/local_instance.h"
#include "worker/model/model_forward.h"
#include "worker/parallel/device_collective.h"
#include "worker/rank_liveness.h"
#include "worker/tensor_parallel.h"

namespace duet {
namespace {

constexpr auto kCloseTimeout = std::chrono::milliseconds(30'000);

// The ranks of every instance by its leader, for the KV transfer.
std::map<int, std::vector<int32_t>> ranks_by_leader(const ClusterSpec& spec) {
  std::map<int, std::vector<int32_t>> ranks;
  for (const InstanceSpec& instance : spec.instances) {
    for (Rank rank : instance.ranks) ranks[instance.leader().value].push_back(rank.value);
  }
  return ranks;
}

// Whether every rank of the instance loaded its shard (each says so): a rank
// that failed must not leave the others waiting in the first step.
bool all_loaded(Collective& collective, bool loaded) {
  const std::byte mine = loaded ? std::byte{1} : std::byte{0};
  std::vector<std::byte> all(static_cast<size_t>(collective.size()));
  collective.all_gather(std::span<const std::byte>(&mine, 1), all);
  return std::all_of(all.begin(), all.end(), [](std::byte b) { return b == std::byte{1}; });
}

void log_transfer(const InstanceSpec& self, Rank rank, const KvTransfer& transfer) {
  const KvTransfer::Counters c = transfer.counters();
  spdlog::info(
      "instance {} (rank {}): kv transfer: {} messages ({} bytes) sent, {} ({} bytes) "
      "received, {} rows messages dropped, {} imports completed, {} failed; rows by "
      "cross-memory attach: {} bytes sent, {} received",
      self.id, rank.value, c.messages_sent, c.bytes_sent, c.messages_received, c.bytes_received,
      c.rows_dropped, c.imports_completed, c.imports_failed, c.cma_bytes_sent,
      c.cma_bytes_received);
}

// This rank's shard of the model and, when the instance runs on GPUs, the
// instance's NCCL communicator for its collectives.
struct LoadedShard {
  std::unique_ptr<LlamaModel> model;
  std::unique_ptr<DeviceCollective> device_collective;  // null on the CPU and for tp 1
};

// The shard and the engine's configuration; a null model when it (or
// another rank of the instance: each says so) could not load, or could not
// join the instance's communicator, after the leader reported why to the
// coordinator.
LoadedShard load_shard(ControlChannel& channel, Collective& collective, const InstanceSpec& self,
                       std::span<const RankPlacement> placements,
                       const ClusterInstanceOptions& options, EngineConfig& config) {
  const int device = options.device;
  LoadedShard shard;
  std::string error;
  auto report = [&]() {
    if (collective.rank() == 0) report_instance_failure(channel, self.id, error);
    return LoadedShard{};
  };
  try {
    if (self.tp > 1 && device >= 0) {
      require_device(device);  // "no GPU" before "two ranks on one GPU"
      require_gpu_per_rank(self, placements);
    }
    shard.model =
        LlamaModel::load(options.model_path, TpPlacement{collective.rank(), self.tp},
                         device < 0 ? &cpu::kernel_table(cpu::isa_from_environment()) : nullptr);
    config = options.engine_config(
        *shard.model, tokenizer_from_gguf(shard.model->file()).end_of_generation_ids());
  } catch (const std::exception& e) {
    error = e.what();
    spdlog::error("instance {} (rank {}): {}", self.id, channel.rank().value, error);
  }
  if (self.tp > 1 && !all_loaded(collective, error.empty()) && error.empty())
    error = "another rank of this instance could not load its shard (see its log)";
  if (!error.empty()) return report();
  if (self.tp == 1) return shard;
  const LlamaModel& model = *shard.model;
  const TpShard& split = model.shard();
  spdlog::info(
      "instance {} (rank {}): shard {} of {}: KV heads [{}, {}), {} weight bytes of its own "
      "({:.1f}% of the {} split)",
      self.id, channel.rank().value, split.rank, split.size, split.kv_head_begin, split.kv_head_end,
      model.owned_weight_bytes(),
      100.0 * static_cast<double>(model.owned_weight_bytes()) /
          static_cast<double>(model.split_tensor_bytes()),
      model.split_tensor_bytes());
  if (device < 0) return shard;
  // Every rank has its shard: now they join one NCCL communicator together.
  try {
    shard.device_collective = join_device_collective(collective, device);
    spdlog::info("instance {} (rank {}): NCCL rank {} of {} on cuda:{}", self.id,
                 channel.rank().value, collective.rank(), self.tp, device);
  } catch (const std::exception& e) {
    error = e.what();
    spdlog::error("instance {} (rank {}): {}", self.id, channel.rank().value, error);
  }
  if (!all_loaded(collective, error.empty()) && error.empty())
    error = "another rank of this instance could not join its NCCL communicator (see its log)";
  if (!error.empty()) return report();
  return shard;
}

// The leader: the engine behind an InstanceServer until Shutdown, then the
// followers are told to stop.
void lead_instance(ControlChannel& channel, RankLiveness& liveness, LossLatch* latch,
                   Collective& collective, DeviceCollective* device_collective,
                   const InstanceSpec& self, const LlamaModel& model, const EngineConfig& config,
                   cpu::ThreadPool& pool, const PeerLinks& peers, const std::string& model_name) {
  std::optional<TpLeader> tp;
  if (self.tp > 1) tp.emplace(collective, device_collective);
  InstanceStats stats;
  std::string reason;
  {
    LocalInstance instance(model, cpu::kernel_table(cpu::isa_from_environment()), pool, config,
                           model_name, peers, tp ? &*tp : nullptr);
    InstanceServer server(channel, instance, self.id);
    liveness.watch([&instance] { return instance.progress(); });
    spdlog::info("instance {} (rank {}, {}, tp {}): serving {} with {} compute threads", self.id,
                 channel.rank().value, instance_role_name(self.role), self.tp, model_name,
                 pool.size());
    if (latch != nullptr) latch->serving(&server);
    reason = server.serve();
    if (latch != nullptr) latch->serving(nullptr);
    stats = instance.stats();
    liveness.watch({});
  }  // the engine thread has stopped: the followers may go
  if (tp) tp->stop();
  spdlog::info("instance {} (rank {}): {} ({} steps, {} tokens generated)", self.id,
               channel.rank().value, reason, stats.steps, stats.generated_tokens);
}

}  // namespace

int serve_cluster_instance(MpiRuntime& mpi, ControlChannel& channel, KvTransfer* transfer,
                           Collective& collective, const ClusterSpec& spec,
                           std::span<const RankPlacement> placements,
                           const ClusterInstanceOptions& options) {
  const InstanceSpec& self = *spec.instance_of(channel.rank());
  // A loss this rank lives through stops its server, and it rejoins.
  const bool may_rejoin = options.rejoin && self.tp == 1;
  LossLatch latch;
  EngineConfig config;
  // Outlives the engine (whose CUDA graphs captured the communicator's
  // operations), and the heartbeats.
  LoadedShard shard;
  // Heartbeats from the start: loading the model takes seconds.
  std::optional<RankLiveness> liveness;
  liveness.emplace(
      channel, self.role != InstanceRole::kBoth ? transfer : nullptr, &mpi, self,
      options.heartbeat_interval,
      may_rejoin ? RankLiveness::LostHandler([&latch](const std::string& why) { latch.lost(why); })
                 : RankLiveness::LostHandler());
  shard = load_shard(channel, collective, self, placements, options, config);
  const LlamaModel* model = shard.model.get();
  if (model == nullptr) {
    channel.close(kCloseTimeout);
    return 2;
  }
  {
    cpu::ThreadPool pool(options.compute_threads);
    PeerLinks peers;
    if (self.role != InstanceRole::kBoth && transfer != nullptr) {
      peers.transfer = transfer;
      peers.transfer_timeout = options.kv_transfer_timeout;
      for (Rank rank : self.ranks) peers.own_ranks.push_back(rank.value);
      peers.instance_ranks = ranks_by_leader(spec);
    }
    if (collective.rank() == 0) {
      lead_instance(channel, *liveness, may_rejoin ? &latch : nullptr, collective,
                    shard.device_collective.get(), self, *model, config, pool, peers,
                    options.model_name);
    } else {
      spdlog::info("instance {} (rank {}): tensor-parallel follower {} of {}", self.id,
                   channel.rank().value, collective.rank(), self.tp);
      run_tp_follower(*model, cpu::kernel_table(cpu::isa_from_environment()), pool, collective,
                      config.n_kv_blocks, peers.transfer,
                      {options.device, shard.device_collective.get()});
    }
    if (peers.transfer != nullptr) log_transfer(self, channel.rank(), *transfer);
  }  // the engine has stopped: nothing sends any more
  if (latch.is_lost()) {
    // The coordinator has forgotten this rank: no heartbeats, no close
    // handshake to wait for; MPI is not finalized (RankLiveness).
    liveness.reset();
    channel.close(std::chrono::milliseconds(0));
    return options.rejoin(self.role, *model, config);
  }
  return channel.close(kCloseTimeout) ? 0 : 1;
}

}  // namespace duet

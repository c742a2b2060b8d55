// `duet serve` under mpirun: the coordinator on rank 0, the instances on the
// other ranks, `tp` ranks each: prefill and decode instances (disaggregated),
// or instances that run both phases (colocated).
//
// Every rank: block the stop signals, initialize MPI, build and validate the
// spec (an impossible or unsupported layout is the same error on every rank,
// before any message flows), open the control channel and pass the
// handshake. Then
// - rank 0 opens the model file for its tokenizer, waits until every
//   instance reports ready, routes over the remote instances and serves both
//   fronts until SIGINT/SIGTERM; then it refuses new requests, cancels what
//   runs, stops the fronts, sends Shutdown to every leader and closes the
//   channel;
// - every other rank loads its shard of the model; an instance's leader runs
//   its engine behind an InstanceServer until Shutdown, then stops its
//   followers (which mirror every step, worker/tensor_parallel.h); every
//   rank closes the channel.
// MPI is finalized last, on every rank.
//
// Instance ranks ignore SIGINT/SIGTERM (mpirun forwards them to every rank):
// the coordinator's Shutdown ends them, so that every rank ends in order.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>

#include "common/error.h"
#include "common/mpi/control_channel.h"
#include "common/mpi/control_handshake.h"
#include "common/mpi/mpi_runtime.h"
#include "common/text/tokenizer_gguf.h"
#include "coordinator/remote_instance.h"
#include "coordinator/router.h"
#include "kernels/cpu/isa.h"
#include "tools/serve_command.h"
#include "worker/instance_server.h"
#include "worker/model/model_forward.h"
#include "worker/parallel/mpi_collective.h"
#include "worker/tensor_parallel.h"
#include "worker/transfer/kv_link.h"
#include "worker/transfer/kv_link_setup.h"
#include "worker/transfer/mpi_kv_transfer.h"

namespace duet::tools {
namespace {

using namespace std::chrono_literals;

// Loading a model takes seconds; a rank that has not reported in this long
// is stuck.
constexpr auto kReadyTimeout = std::chrono::milliseconds(300'000);
constexpr auto kCloseTimeout = std::chrono::milliseconds(30'000);

// The spec of this run: the cluster flags or file, or without any under
// mpirun, one colocated instance on every rank but the coordinator's.
// Throws on every rank alike for a layout the model cannot take.
ClusterSpec serving_spec(const ClusterFlags& flags, int world_size, const std::string& model) {
  ClusterSpec spec = flags.any()
                         ? cluster_spec_from_flags(flags, world_size)
                         : parse_cluster_flags(0, world_size - 1, 1, ClusterMode::kColocated);
  spec.validate(world_size);
  const ModelConfig config = ModelConfig::from_gguf(GgufFile::open(model));
  for (const InstanceSpec& instance : spec.instances) {
    if (instance.tp > config.n_kv_heads) {
      throw Error(ErrorKind::kUnsupported,
                  fmt::format("instance {} has tp {}, more than the model's {} KV heads "
                              "(tensor parallelism splits attention by KV heads)",
                              instance.id, instance.tp, config.n_kv_heads));
    }
  }
  return spec;
}

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

int serve_coordinator(ControlChannel& channel, const ClusterSpec& spec, const ServeArgs& args,
                      const sigset_t& signals) {
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplateKind> chat;
  std::vector<InstanceReady> ready;
  try {
    // The tokenizer and template only: the weights stay on the instances.
    const GgufFile file = GgufFile::open(args.model);
    tokenizer.emplace(tokenizer_from_gguf(file));
    chat = serve::chat_template(file);
    ready = await_instances_ready(channel, spec, kReadyTimeout);
  } catch (const std::exception& e) {
    shut_down_leaders(channel, spec, e.what());
    channel.close(kCloseTimeout);
    throw;
  }
  // Declared in this order so that the cluster's shut_down (which joins the
  // dispatcher, the thread calling into the router and the service) comes
  // before either is destroyed.
  RemoteCluster cluster(channel, spec, ready);
  std::vector<RoutedInstance> instances;
  for (size_t i = 0; i < spec.instances.size(); ++i) {
    instances.push_back(
        {cluster.instances()[i], spec.instances[i].role, spec.instances[i].leader().value});
  }
  RoutedInstances routed(std::move(instances), make_routing_policy(spec.mode));
  const std::string model_name = serve::model_name(args);
  spdlog::info("cluster: {}; routing: {}", spec.describe(), routed.policy().name());
  Service service(routed, *tokenizer, chat, model_name, serve::service_limits(args));
  serve::run_fronts_until_signal(service, args, signals);

  // Where the requests went, for logs (and tests).
  const std::vector<int64_t> routed_counts = routed.routed_counts();
  const std::vector<InstanceStats> stats = routed.instance_stats();
  for (size_t i = 0; i < spec.instances.size(); ++i) {
    spdlog::info("instance {} (rank {}): {} requests routed, {} tokens generated", i,
                 spec.instances[i].leader().value, routed_counts[i], stats[i].generated_tokens);
  }
  if (!cluster.shut_down("the coordinator is shutting down", kCloseTimeout)) {
    spdlog::error("not every rank closed the control channel in time");
    return 1;
  }
  return 0;
}

void log_transfer(const InstanceSpec& self, Rank rank, const MpiKvTransfer& transfer) {
  const MpiKvTransfer::Counters c = transfer.counters();
  spdlog::info(
      "instance {} (rank {}): kv transfer: {} messages ({} bytes) sent, {} ({} bytes) "
      "received, {} rows messages dropped, {} imports completed, {} failed",
      self.id, rank.value, c.messages_sent, c.bytes_sent, c.messages_received, c.bytes_received,
      c.rows_dropped, c.imports_completed, c.imports_failed);
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
                       std::span<const RankPlacement> placements, const ServeArgs& args, int device,
                       EngineConfig& config) {
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
    shard.model = LlamaModel::load(args.model, TpPlacement{collective.rank(), self.tp});
    config = serve::engine_config(args, *shard.model,
                                  tokenizer_from_gguf(shard.model->file()).end_of_generation_ids(),
                                  device);
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
void lead_instance(ControlChannel& channel, Collective& collective,
                   DeviceCollective* device_collective, const InstanceSpec& self,
                   const LlamaModel& model, const EngineConfig& config, cpu::ThreadPool& pool,
                   const PeerLinks& peers, const ServeArgs& args) {
  std::optional<TpLeader> tp;
  if (self.tp > 1) tp.emplace(collective, device_collective);
  const std::string model_name = serve::model_name(args);
  InstanceStats stats;
  std::string reason;
  {
    LocalInstance instance(model, cpu::kernel_table(cpu::isa_from_environment()), pool, config,
                           model_name, peers, tp ? &*tp : nullptr);
    InstanceServer server(channel, instance, self.id);
    spdlog::info("instance {} (rank {}, {}, tp {}): serving {} with {} compute threads", self.id,
                 channel.rank().value, instance_role_name(self.role), self.tp, model_name,
                 pool.size());
    reason = server.serve();
    stats = instance.stats();
  }  // the engine thread has stopped: the followers may go
  if (tp) tp->stop();
  spdlog::info("instance {} (rank {}): {} ({} steps, {} tokens generated)", self.id,
               channel.rank().value, reason, stats.steps, stats.generated_tokens);
}

int serve_instance(ControlChannel& channel, MpiKvTransfer& transfer, Collective& collective,
                   const ClusterSpec& spec, std::span<const RankPlacement> placements,
                   const ServeArgs& args, int device) {
  const InstanceSpec& self = *spec.instance_of(channel.rank());
  EngineConfig config;
  // Outlives the engine (whose CUDA graphs captured the communicator's operations).
  const LoadedShard shard = load_shard(channel, collective, self, placements, args, device, config);
  const LlamaModel* model = shard.model.get();
  if (model == nullptr) {
    channel.close(kCloseTimeout);
    return 2;
  }
  {
    cpu::ThreadPool pool(serve::compute_threads(args));
    PeerLinks peers;
    if (self.role != InstanceRole::kBoth) {
      peers.transfer = &transfer;
      peers.transfer_timeout =
          std::chrono::milliseconds(static_cast<int64_t>(args.kv_transfer_timeout_s * 1000.0));
      for (Rank rank : self.ranks) peers.own_ranks.push_back(rank.value);
      peers.instance_ranks = ranks_by_leader(spec);
    }
    if (collective.rank() == 0) {
      lead_instance(channel, collective, shard.device_collective.get(), self, *model, config, pool,
                    peers, args);
    } else {
      spdlog::info("instance {} (rank {}): tensor-parallel follower {} of {}", self.id,
                   channel.rank().value, collective.rank(), self.tp);
      run_tp_follower(*model, cpu::kernel_table(cpu::isa_from_environment()), pool, collective,
                      config.n_kv_blocks, peers.transfer, {device, shard.device_collective.get()});
    }
    if (peers.transfer != nullptr) log_transfer(self, channel.rank(), transfer);
  }  // the engine has stopped: nothing sends any more
  return channel.close(kCloseTimeout) ? 0 : 1;
}

}  // namespace

// Every rank. Errors are printed here, as `duet` prints them, while MPI is
// still up: once one rank exits non-zero mpirun kills the others, so each
// must have printed its line before any leaves MPI_Finalize (a fence).
int run_cluster_serve(const ServeArgs& args, const sigset_t& signals) {
  MpiRuntime mpi;  // finalized last
  try {
    const ClusterSpec spec = serving_spec(args.cluster, mpi.world_size(), args.model);
    ControlChannel channel(mpi);
    // Where every rank runs, and the device links of its GPU pairs (both
    // collective over the world, as the transfer's communicator is).
    const RankPlacement placement = own_placement(mpi, spec, args.device);
    const std::vector<RankPlacement> placements = gather_placements(mpi, placement);
    std::optional<MpiKvTransfer> transfer;  // every rank: its communicator is collective
    transfer.emplace(
        channel, MpiKvTransferOptions{args.kv_checksums},
        make_device_kv_links(mpi, spec, placements, parse_same_host_gpus(args.kv_same_host)));
    // Every rank too (MPI_Comm_split); the coordinator's is empty.
    const InstanceSpec* own = spec.instance_of(mpi.rank());
    MpiCollective collective(
        mpi, own != nullptr ? std::span<const Rank>(own->ranks) : std::span<const Rank>(),
        own != nullptr ? own->id : 0);
    try {
      if (mpi.rank() == kCoordinatorRank) {
        coordinator_handshake(channel, spec);
      } else {
        instance_handshake(channel, spec);
      }
    } catch (const Error&) {
      transfer.reset();
      channel.close(10s);  // so that the verdict reaches every rank
      throw;
    }
    const int code = mpi.rank() == kCoordinatorRank
                         ? serve_coordinator(channel, spec, args, signals)
                         : serve_instance(channel, *transfer, collective, spec, placements, args,
                                          placement.device);
    spdlog::info("rank {}: exiting with code {}", mpi.rank().value, code);
    return code;
  } catch (const Error& e) {
    std::fprintf(stderr, "duet: %s: %s\n", std::string(error_kind_name(e.kind())).c_str(),
                 e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: error: %s\n", e.what());
  }
  return 2;
}

}  // namespace duet::tools

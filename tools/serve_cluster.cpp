// `duet serve` under mpirun: the coordinator on rank 0, the instances on the
// other ranks, `tp` ranks each: prefill and decode instances (disaggregated),
// or instances that run both phases (colocated). Wiring only: the two sides
// live in coordinator/cluster/cluster_coordinator.h and worker/cluster_instance.h.
//
// Every rank: block the stop signals, initialize MPI, build and validate the
// spec (an impossible or unsupported layout is the same error on every rank,
// before any message flows), learn where every rank runs, open the control
// channel (over TCP between hosts), the KV transfer and the instance's
// collective, and pass the handshake. Then
// - rank 0 opens the model file for its tokenizer, waits until every
//   instance reports ready (ClusterCoordinator), serves both fronts until
//   SIGINT/SIGTERM; then it drains (new requests refused, running ones
//   finish, for up to --drain-timeout), stops the fronts, and shuts the
//   cluster down;
// - every other rank runs its part of its instance (serve_cluster_instance)
//   until the coordinator's Shutdown.
// MPI is finalized last, on every rank.
//
// Instance ranks ignore SIGINT/SIGTERM (blocked, never waited for): mpirun,
// signalled, sends SIGTERM to every rank, odls_base_sigkill_timeout seconds
// after its own, and SIGKILL as long after that. The coordinator's Shutdown
// ends them, once its drain is over, so that every rank ends in order.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <set>

#include "common/cluster/model_fingerprint.h"
#include "common/control_plane/control_channel.h"
#include "common/control_plane/control_handshake.h"
#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"
#include "common/text/tokenizer_gguf.h"
#include "coordinator/cluster/cluster_coordinator.h"
#include "coordinator/rebalancer.h"
#include "tools/serve_command.h"
#include "worker/cluster_instance.h"
#include "worker/parallel/mpi_collective.h"
#include "worker/transfer/kv_member_links.h"
#include "worker/transfer/kv_transfer_adapter.h"
#include "worker/transfer/kv_transfer_config.h"
#include "worker/transfer/split_kv_transfer.h"
#include "worker/transfer/transfer_kind.h"
#include "worker/transfer/transfer_setup.h"

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
// Whether mpirun was told to keep the job going when a rank dies
// (--enable-recovery sets this variable for every rank).
bool recovery_enabled() {
  const char* value = std::getenv("OMPI_MCA_orte_enable_recovery");
  return value != nullptr && (std::string(value) == "1" || std::string(value) == "true");
}

ClusterSpec serving_spec(const ClusterFlags& flags, int world_size, const std::string& model) {
  ClusterSpec spec = flags.any()
                         ? cluster_spec_from_flags(flags, world_size)
                         : parse_cluster_flags(0, world_size - 1, 1, ClusterMode::kColocated);
  spec.validate(world_size);
  const ModelConfig config = ModelConfig::from_gguf(GgufFile::open(model));
  if (flags.any_ep() && !config.is_moe()) {
    throw Error(ErrorKind::kInvalidArgument,
                fmt::format("--ep spreads a mixture of experts over an instance's ranks; {} has "
                            "no experts (use --tp)",
                            config.name));
  }
  for (const InstanceSpec& instance : spec.instances) {
    if (config.is_moe() && instance.tp > config.n_experts) {
      throw Error(ErrorKind::kUnsupported,
                  fmt::format("instance {} has ep {}, more than the model's {} experts (each "
                              "rank holds whole experts)",
                              instance.id, instance.tp, config.n_experts));
    }
    if (instance.tp > config.n_kv_heads) {
      throw Error(ErrorKind::kUnsupported,
                  fmt::format("instance {} has tp {}, more than the model's {} KV heads "
                              "(tensor parallelism splits attention by KV heads)",
                              instance.id, instance.tp, config.n_kv_heads));
    }
  }
  return spec;
}

// Instances that join a disaggregated cluster link their KV with every
// instance rank (worker/transfer/kv_member_links.h): each rank listens, its
// transfer splits between the job's ranks and the members, and the
// coordinator learns every listener (one all-gather). CPU instances with a
// join port and a key only; collective over MPI_COMM_WORLD (every rank
// decides alike from the same flags).
struct MemberKvLinks {
  std::unique_ptr<KvLinkListener> listener;  // an instance rank's
  std::vector<KvLinkAddress> addresses;      // the coordinator's: every listener
};

bool takes_kv_members(const ClusterSpec& spec, const ServeArgs& args) {
  return spec.mode == ClusterMode::kDisaggregated && args.join_port >= 0 &&
         !args.cluster_key_file.empty() && args.device == "cpu";
}

// This rank's transfer, split between `job` (the transfer made at start-up)
// and the members, with the listener for their links in `links`.
std::unique_ptr<KvTransfer> open_member_kv_links(const MpiRuntime& mpi, const ClusterSpec& spec,
                                                 std::span<const RankPlacement> placements,
                                                 const ServeArgs& args, const KvTransferConfig& kv,
                                                 std::unique_ptr<KvTransferAdapter> job,
                                                 MemberKvLinks& links) {
  TcpAddress own;
  if (spec.instance_of(mpi.rank()) != nullptr && job != nullptr) {
    try {
      links.listener =
          std::make_unique<KvLinkListener>(ClusterKey::from_file(args.cluster_key_file));
      const KvLinkAddress address = links.listener->address(mpi.rank().value, "");
      own = {address.port, address.ipv4};
    } catch (const std::exception& e) {
      spdlog::warn("rank {}: no KV links with joined instances: {}", mpi.rank().value, e.what());
      links.listener.reset();
    }
  }
  const std::vector<std::byte> all = mpi.all_gather(own.encode());
  if (mpi.rank() == kCoordinatorRank) {
    for (int rank = 0; rank < mpi.world_size(); ++rank) {
      const TcpAddress address = TcpAddress::decode(std::span(all).subspan(
          static_cast<size_t>(rank) * TcpAddress::kRecordBytes, TcpAddress::kRecordBytes));
      if (address.port != 0) {
        links.addresses.push_back({rank, placements[static_cast<size_t>(rank)].host, address.port,
                                   address.ipv4, spec.instance_of(Rank{rank})->leader().value});
      }
    }
  }
  if (links.listener == nullptr) return job;
  auto split = std::make_unique<SplitKvTransfer>(
      std::move(job),
      std::make_unique<TcpKvTransfer>(mpi.rank().value, std::map<int, int>{},
                                      TcpKvTransferOptions{kv.checksums, kv.drop_rows_of}),
      mpi.world_size());
  links.listener->start(
      [members = &split->members()](int rank, int fd) { members->add_peer(rank, fd); });
  return split;
}

int serve_coordinator(ControlChannel& channel, const ClusterSpec& spec, const ServeArgs& args,
                      const sigset_t& signals, std::vector<KvLinkAddress> kv_links) {
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplateKind> chat;
  bool split_reasoning = false;
  try {
    // The tokenizer and template only: the weights stay on the instances.
    const GgufFile file = GgufFile::open(args.model);
    tokenizer.emplace(tokenizer_from_gguf(file));
    chat = serve::chat_template(file, args);
    split_reasoning = serve::split_reasoning(file, args);
  } catch (const std::exception& e) {
    abort_cluster(channel, spec, e.what(), kCloseTimeout);
    throw;
  }
  // Declared before the service: the cluster's shut_down (which joins the
  // thread calling into the router and the service) comes before the
  // service is destroyed.
  ClusterCoordinatorOptions options;
  options.ready_timeout = kReadyTimeout;
  options.close_timeout = kCloseTimeout;
  options.instance_lease = serve::instance_lease(args);
  options.max_retries = args.max_retries;
  // Only where an instance can come back: a replacement or a woken rank joins.
  if (args.join_port >= 0)
    options.rerun_wait = std::chrono::milliseconds(static_cast<int64_t>(args.rerun_wait_s * 1000));
  // Rebalancing: checked before any instance is waited for.
  std::optional<SloTargets> slo;
  if (args.rebalance == "auto") {
    try {
      if (args.slo.empty())
        throw Error(ErrorKind::kInvalidArgument, "--rebalance auto needs --slo ttft=MS,tpot=MS");
      slo = parse_slo(args.slo);
    } catch (const std::exception& e) {
      abort_cluster(channel, spec, e.what(), kCloseTimeout);
      throw;
    }
  }
  if (args.join_port >= 0 && args.cluster_key_file.empty()) {
    abort_cluster(channel, spec, "--join-port needs --cluster-key FILE", kCloseTimeout);
    throw Error(ErrorKind::kInvalidArgument, "--join-port needs --cluster-key FILE");
  }
  // The key guards joins and admin calls (duet-client set-role) alike.
  if (!args.cluster_key_file.empty()) {
    try {
      options.cluster_key = ClusterKey::from_file(args.cluster_key_file);
      if (args.join_port >= 0) options.model_fingerprint = model_fingerprint(args.model);
    } catch (const std::exception& e) {
      abort_cluster(channel, spec, e.what(), kCloseTimeout);
      throw;
    }
  }
  if (args.join_port >= 0) options.join_port = static_cast<uint16_t>(args.join_port);
  options.kv_links = std::move(kv_links);
  ClusterCoordinator cluster(channel, spec, options);
  Service service(cluster.router(), *tokenizer, chat, serve::model_name(args),
                  serve::service_limits(args));
  std::optional<Rebalancer> rebalancer;
  if (slo) rebalancer.emplace(cluster.router(), service, RebalancerOptions{.slo = *slo});
  serve::run_fronts_until_signal(service, args, signals, split_reasoning, &cluster.router(),
                                 options.cluster_key);
  rebalancer.reset();  // no role changes while the cluster ends
  if (!cluster.shut_down("the coordinator is shutting down", kCloseTimeout)) {
    spdlog::error("not every rank closed the control channel in time");
    return 1;
  }
  return 0;
}

// This rank's part of its instance, with the serve flags as its options.
int serve_instance(MpiRuntime& mpi, ControlChannel& channel, KvTransfer* transfer,
                   Collective& collective, const ClusterSpec& spec,
                   std::span<const RankPlacement> placements, const ServeArgs& args, int device,
                   const sigset_t& signals) {
  ClusterInstanceOptions options;
  options.model_path = args.model;
  options.model_name = serve::model_name(args);
  options.compute_threads = serve::compute_threads(args);
  options.device = device;
  options.kv_transfer_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(args.kv_transfer_timeout_s * 1000.0));
  options.heartbeat_interval = std::max(serve::instance_lease(args) / 6, 1ms);
  options.engine_config = [&](const LlamaModel& shard, std::vector<int32_t> end_of_generation) {
    return serve::engine_config(args, shard, std::move(end_of_generation), device);
  };
  // Rejoin: a cluster on CPUs whose coordinator opened a known join port
  // (--join-port N, not 0: every rank reads the same flags) with a key.
  if (args.join_port > 0 && !args.cluster_key_file.empty() && device < 0) {
    const std::string& coordinator_host = placements[kCoordinatorRank.value].host;
    const bool one_host =
        std::all_of(placements.begin(), placements.end(),
                    [&](const RankPlacement& p) { return p.host == coordinator_host; });
    const std::string address =
        fmt::format("{}:{}", one_host ? "127.0.0.1" : coordinator_host, args.join_port);
    options.rejoin = [&args, address, &signals](InstanceRole role, const LlamaModel& model,
                                                const EngineConfig& config) {
      return rejoin_as_member(args, address, role, model, config, signals);
    };
  }
  return serve_cluster_instance(mpi, channel, transfer, collective, spec, placements, options);
}

// How the control channel carries the coordinator's messages:
// --control-transport, auto choosing TCP when the ranks span hosts (control
// is host-side: any device). The same on every rank.
Transport control_transport(const ServeArgs& args, size_t n_hosts) {
  return parse_transport(args.control_transport, n_hosts > 1 ? Transport::kTcp : Transport::kMpi);
}

}  // namespace

// Every rank. Errors are printed here, as `duet` prints them, while MPI is
// still up: once one rank exits non-zero mpirun kills the others, so each
// must have printed its line before any leaves MPI_Finalize (a fence).
int run_cluster_serve(const ServeArgs& args, const sigset_t& signals) {
  MpiRuntime mpi;  // finalized last
  try {
    const ClusterSpec spec = serving_spec(args.cluster, mpi.world_size(), args.model);
    // Where every rank runs (collective over the world), then the control
    // channel over the link that decides (collective too: the same order on
    // every rank), then the device transfer of its GPU pairs.
    const RankPlacement placement = own_placement(mpi, spec, args.device);
    const std::vector<RankPlacement> placements = gather_placements(mpi, placement);
    std::set<std::string> hosts;
    for (const RankPlacement& p : placements) hosts.insert(p.host);
    ControlChannelOptions channel_options;
    channel_options.transport = control_transport(args, hosts.size());
    ControlChannel channel(mpi, channel_options);
    KvTransferConfig kv =
        kv_transfer_config({args.kv_transport, args.kv_cma, args.kv_same_host, args.kv_checksums},
                           args.device == "cpu", hosts.size());
    if (const char* drop = std::getenv("DUET_TEST_DROP_KV_ROWS_OF"))  // tests only
      kv.drop_rows_of = std::strtoull(drop, nullptr, 10);
    // Every rank makes one (its start-up is collective); over TCP, a rank
    // that moves no KV has none.
    std::unique_ptr<KvTransferAdapter> made = make_kv_transfer(kv, mpi, channel, spec, placements);
    std::unique_ptr<KvTransfer> transfer;
    MemberKvLinks member_links;  // destroyed before the transfer it adds links to
    if (takes_kv_members(spec, args)) {
      transfer =
          open_member_kv_links(mpi, spec, placements, args, kv, std::move(made), member_links);
    } else {
      transfer = std::move(made);
    }
    if (mpi.rank() == kCoordinatorRank) {
      spdlog::info(
          "control channel: coordinator to ranks over {} (--control-transport {}; ranks "
          "on {} host(s))",
          transport_name(channel.transport()), args.control_transport, hosts.size());
    }
    if (mpi.rank() == kCoordinatorRank && spec.mode == ClusterMode::kDisaggregated) {
      spdlog::info(
          "kv transfer: between instances over {} (--kv-transport {}; ranks on {} host(s))",
          transport_name(kv.transport), args.kv_transport, hosts.size());
    }
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
      member_links.listener.reset();
      transfer.reset();
      channel.close(10s);  // so that the verdict reaches every rank
      throw;
    }
    if (mpi.rank() == kCoordinatorRank && !recovery_enabled()) {
      spdlog::warn(
          "mpirun was started without --enable-recovery: the job is one failure domain (one "
          "rank's death ends every rank); with it, a lost instance costs a pause");
    } else if (mpi.rank() == kCoordinatorRank && hosts.size() > 1) {
      // Between hosts MPI runs over TCP, where Open MPI 4.1 can wedge a
      // survivor that was talking to a lost rank: say what still uses it.
      std::string on_mpi;
      if (kv.transport == Transport::kMpi && spec.mode == ClusterMode::kDisaggregated) {
        on_mpi = fmt::format("KV (--kv-transport {}, --device {})", args.kv_transport, args.device);
      }
      if (channel.transport() == Transport::kMpi) {
        on_mpi += fmt::format("{}control (--control-transport {})", on_mpi.empty() ? "" : " and ",
                              args.control_transport);
      }
      if (!on_mpi.empty()) {
        spdlog::warn(
            "ranks on {} hosts and {} over mpi: between hosts MPI runs over TCP, where Open MPI "
            "4.1 can deadlock a survivor that was talking to a lost rank (docs/FAILURES.md); "
            "--kv-transport tcp (CPU instances) and --control-transport tcp use Duet's own "
            "sockets instead",
            hosts.size(), on_mpi);
      }
    }
    const int code =
        mpi.rank() == kCoordinatorRank
            ? serve_coordinator(channel, spec, args, signals, std::move(member_links.addresses))
            : serve_instance(mpi, channel, transfer.get(), collective, spec, placements, args,
                             placement.device, signals);
    // After a loss MPI_Finalize could wait on a dead rank forever.
    if (channel.forgot_any()) mpi.leave_without_finalize();
    spdlog::info("rank {}: exiting with code {}{}", mpi.rank().value, code,
                 channel.forgot_any() ? " (without MPI_Finalize: ranks were lost)" : "");
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

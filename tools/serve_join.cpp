// `duet serve --join HOST:PORT`: one instance that joins a running cluster
// (coordinator/cluster/join_listener.h) instead of starting with it. A plain
// process (or a one-rank mpirun job of its own): no MPI is used; or, with
// `--tp T`, an mpirun job of T ranks of its own, whose rank 0 joins for the
// group and leads the others' steps over MPI (worker/tensor_parallel.h).
// A prefill or decode instance links its KV with every instance rank of the
// cluster first, on each of its ranks (worker/transfer/kv_member_links.h).
//
// It loads the model, dials the coordinator and proves the cluster key,
// then is a leader like any other: an InstanceServer over a ControlChannel
// whose only peer is the coordinator, heartbeats included. Unlike the ranks
// of the mpirun job it leaves on SIGTERM or SIGINT: it says Leaving, waits
// for the coordinator's LeaveAccepted (after which no request comes), lets
// what it runs finish (up to --drain-timeout), says Leaving{done}, closes its
// channel and exits 0. A second signal cuts the drain short; what is then
// left is the coordinator's to run again elsewhere, as after a loss.
//
// A member the coordinator counted lost (stalled past its lease, its link
// cut) that is still alive rejoins: it drops its engine (its requests already
// run elsewhere, its KV is void), joins again as a new member with a new
// instance id, and is routed to again. Should a replacement have taken its
// place meanwhile, it stays as extra capacity: more capacity costs nothing
// a drain would not, and an operator's SIGTERM sends it away.
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <optional>
#include <thread>

#include "common/cluster/model_fingerprint.h"
#include "common/control_plane/control_channel.h"
#include "common/error.h"
#include "common/net/cluster_auth.h"
#include "common/text/tokenizer_gguf.h"
#include "coordinator/cluster/join_listener.h"
#include "kernels/cpu/isa.h"
#include "tools/device_option.h"
#include "tools/serve_command.h"
#include "worker/instance_server.h"
#include "worker/local_instance.h"
#include "worker/parallel/mpi_collective.h"
#include "worker/rank_liveness.h"
#include "worker/tensor_parallel.h"
#include "worker/transfer/kv_member_links.h"
#include "worker/transfer/tcp_kv_transfer.h"

namespace duet::tools {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kCloseTimeout = 10s;
// A lost member joins again, trying every kRejoinPause for up to kRejoinWindow.
constexpr auto kRejoinPause = 1000ms;
constexpr auto kRejoinWindow = std::chrono::milliseconds(60'000);

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0) return "unknown host";
  return name;
}

// The leave on a stop signal, on a thread of its own: Leaving, then (once
// the coordinator accepted and the instance is idle, or the drain timed out)
// Leaving{done} and the server's end.
class Leaver final {
 public:
  Leaver(ControlChannel& channel, LocalInstance& instance, InstanceServer& server,
         int32_t instance_id, const sigset_t& signals, std::chrono::milliseconds drain)
      : channel_(channel),
        instance_(instance),
        server_(server),
        id_(instance_id),
        signals_(signals),
        drain_(drain) {
    thread_ = std::thread([this] { run(); });
  }
  ~Leaver() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    wake_.notify_all();
    // Its sigwait ends with a signal to itself: this thread's mask has them
    // blocked, so the signal waits for the leaver's sigwait.
    if (!leaving_) pthread_kill(thread_.native_handle(), SIGTERM);
    thread_.join();
  }
  // The coordinator's LeaveAccepted arrived (the server's thread).
  void accepted() {
    {
      std::lock_guard lock(mutex_);
      accepted_ = true;
    }
    wake_.notify_all();
  }

 private:
  void run() {
    int signal = 0;
    sigwait(&signals_, &signal);
    {
      std::lock_guard lock(mutex_);
      if (done_) return;
    }
    leaving_ = true;
    spdlog::info("{}: leaving the cluster (draining for up to {} ms)",
                 signal == SIGINT ? "SIGINT" : "SIGTERM", drain_.count());
    try {
      channel_.send(kCoordinatorRank, Leaving{id_, "the instance is stopping", false});
    } catch (const Error&) {
      return;  // the cluster is ending anyway
    }
    const auto deadline = Clock::now() + drain_;
    std::unique_lock lock(mutex_);
    bool cut = false;
    while (!done_ && !cut && Clock::now() < deadline) {
      const InstanceStats stats = instance_.stats();
      if (accepted_ && stats.running == 0 && stats.waiting == 0) break;
      wake_.wait_for(lock, 20ms);
      // A second stop signal cuts the drain short.
      const timespec now{0, 0};
      cut = sigtimedwait(&signals_, nullptr, &now) > 0;
    }
    if (cut) spdlog::warn("a second stop signal: cutting the drain short");
    if (done_) return;
    lock.unlock();
    const InstanceStats stats = instance_.stats();
    const bool drained = accepted_ && stats.running == 0 && stats.waiting == 0;
    const std::string reason = drained ? "drained"
                               : cut   ? "drain cut short by a second signal"
                                       : fmt::format("drain cut after {} ms", drain_.count());
    try {
      channel_.send(kCoordinatorRank, Leaving{id_, reason, true});
    } catch (const Error&) {
    }
    server_.stop(reason);
  }

  ControlChannel& channel_;
  LocalInstance& instance_;
  InstanceServer& server_;
  const int32_t id_;
  const sigset_t signals_;
  const std::chrono::milliseconds drain_;
  std::atomic<bool> leaving_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool accepted_ = false;
  bool done_ = false;
  std::thread thread_;  // last
};

// What one membership ended in: the exit code, or a loss to rejoin from.
struct Membership {
  int code = 0;
  bool lost = false;
};

// Whether a stop signal of `signals` is pending (taken if so).
bool stop_signal_pending(const sigset_t& signals) {
  const timespec now{0, 0};
  return sigtimedwait(&signals, nullptr, &now) > 0;
}

// The join, retried every kRejoinPause for up to `window` (a coordinator
// busy with the loss may not answer at once); nullopt when a stop signal
// came meanwhile. The first join is tried once (window 0): its errors are
// the user's to read.
std::optional<JoinVerdict> join(const std::string& address, const ClusterKey& key,
                                const JoinRequest& request, std::chrono::milliseconds window,
                                const sigset_t& signals, int& socket) {
  const auto deadline = Clock::now() + window;
  for (;;) {
    try {
      return join_cluster(address, key, request, kHandshakeTimeout, socket);
    } catch (const Error& e) {
      if (Clock::now() + kRejoinPause >= deadline) throw;
      spdlog::warn("rejoin: {}; trying again in {} ms", e.what(), kRejoinPause.count());
    }
    const timespec pause{0, static_cast<long>(kRejoinPause.count()) * 1'000'000};
    if (sigtimedwait(&signals, nullptr, &pause) > 0) return std::nullopt;
  }
}

// A member of more than one rank (`mpirun -np T duet serve --join ... --tp
// T`): its mpirun job's ranks, rank 0 the leader, which alone talks to the
// coordinator; the others follow its steps (worker/tensor_parallel.h).
struct Group {
  MpiRuntime& mpi;
  Collective& collective;  // every rank of the job
  bool leader() const { return collective.rank() == 0; }
};

// The leader's outcome of the join (a verdict, or its error as a refusal),
// to every rank of `group`.
JoinVerdict share_verdict(Group& group, JoinVerdict verdict) {
  std::vector<std::byte> bytes = encode_control_message(verdict);
  uint64_t size = bytes.size();
  group.collective.broadcast(std::as_writable_bytes(std::span(&size, 1)), 0);
  bytes.resize(size);
  group.collective.broadcast(bytes, 0);
  return std::get<JoinVerdict>(decode_control_message(bytes));
}

// A prefill or decode member's KV transfer (worker/transfer/kv_member_links.h)
// on its rank `index`, taking links on `listener` from now on (owned by the
// returned links, which drop it before the transfer).
struct KvLinks {
  std::unique_ptr<TcpKvTransfer> transfer;
  std::unique_ptr<KvLinkListener> listener;  // declared last: destroyed first
};

KvLinks open_kv_links(const ServeArgs& args, const JoinVerdict& verdict, int index,
                      std::unique_ptr<KvLinkListener> listener, PeerLinks& peers) {
  KvLinks links;
  if (listener == nullptr) return links;
  links.transfer = std::make_unique<TcpKvTransfer>(
      verdict.member.value + index, std::map<int, int>{}, TcpKvTransferOptions{args.kv_checksums});
  links.listener = std::move(listener);
  links.listener->start(
      [members = links.transfer.get()](int rank, int fd) { members->add_peer(rank, fd); });
  peers.transfer = links.transfer.get();
  peers.transfer_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(args.kv_transfer_timeout_s * 1000.0));
  return links;
}

// Dials every rank of the verdict, again every second while some is not
// reached (a listener busy with another handshake, a peer stalled), for up
// to two leases and two seconds: long enough for the coordinator to count a
// peer that is gone as lost, and so route nothing between the two. A rank
// still not reached is lost to this one. The caller's heartbeats already
// run: the dials may take longer than a lease.
void dial_kv_peers(const ClusterKey& key, const JoinVerdict& verdict, int index, KvLinks& links,
                   PeerLinks& peers) {
  if (links.transfer == nullptr) return;
  const int self = verdict.member.value + index;
  const auto deadline = Clock::now() + 2 * std::chrono::milliseconds(verdict.lease_ms) + 2s;
  std::vector<KvLinkAddress> left = verdict.kv_peers;
  for (bool first = true; !left.empty() && (first || Clock::now() < deadline); first = false) {
    if (!first) std::this_thread::sleep_for(kRejoinPause);
    const std::map<int, int> reached = dial_kv_links(self, left, host_name(), key);
    for (const auto& [rank, fd] : reached) links.transfer->add_peer(rank, fd);
    std::erase_if(left, [&](const KvLinkAddress& peer) { return reached.contains(peer.rank); });
  }
  std::vector<Rank> unreached;
  for (const KvLinkAddress& peer : left) unreached.push_back(Rank{peer.rank});
  if (!unreached.empty()) links.transfer->peers_lost(unreached);
  // A tensor-parallel instance's KV comes from, and goes to, each of its ranks.
  for (const KvLinkAddress& peer : verdict.kv_peers)
    peers.instance_ranks[peer.leader].push_back(peer.rank);
  spdlog::info("kv transfer: KV links with {} of {} ranks",
               verdict.kv_peers.size() - unreached.size(), verdict.kv_peers.size());
}

// A follower rank of a group's membership: its KV links, then the leader's
// steps until it stops them.
int follow_member(const ServeArgs& args, const ClusterKey& key, const LlamaModel& model,
                  const cpu::KernelTable& kernels, const EngineConfig& config,
                  const JoinVerdict& verdict, std::unique_ptr<KvLinkListener> listener,
                  Group& group) {
  PeerLinks peers;
  const int index = group.collective.rank();
  KvLinks links = open_kv_links(args, verdict, index, std::move(listener), peers);
  dial_kv_peers(key, verdict, index, links, peers);
  std::byte linked{1};
  std::vector<std::byte> all(static_cast<size_t>(group.collective.size()));
  group.collective.all_gather(std::span(&linked, 1), all);  // every rank linked
  {
    cpu::ThreadPool pool(serve::compute_threads(args));
    spdlog::info("instance {} (member {}): tensor-parallel follower {} of {}", verdict.instance_id,
                 verdict.member.value + index, index, group.collective.size());
    run_tp_follower(model, kernels, pool, group.collective, config.n_kv_blocks,
                    links.transfer.get());
  }
  return 0;
}

// One membership: the instance behind an InstanceServer over the joined
// channel, until the coordinator's Shutdown, a leave, or a loss. A prefill
// or decode member brings the listener its request named; a group's leader
// leads its followers' steps.
Membership serve_member(const ServeArgs& args, const ClusterKey& key, const LlamaModel& model,
                        const cpu::KernelTable& kernels, const EngineConfig& config,
                        InstanceRole role, const JoinVerdict& verdict, int socket,
                        std::unique_ptr<KvLinkListener> listener, const sigset_t& signals,
                        Group* group) {
  ControlChannelOptions options;
  options.transport = Transport::kTcp;
  ControlChannel channel(JoinedLink{verdict.member, socket}, options);
  const int32_t tp = group != nullptr ? group->collective.size() : 1;
  InstanceSpec self{verdict.instance_id, role, tp, {}};
  for (int32_t k = 0; k < tp; ++k) self.ranks.push_back(Rank{verdict.member.value + k});
  PeerLinks peers;
  KvLinks links = open_kv_links(args, verdict, 0, std::move(listener), peers);
  if (links.transfer != nullptr) {
    for (const Rank rank : self.ranks) peers.own_ranks.push_back(rank.value);
  }
  // Lost (stalled past the lease, or cut off): the server stops, the
  // instance and its KV go, and the caller joins again as a new member. A
  // group leaves instead, exit code 1, so that its mpirun ends the followers
  // (whose steps a lost leader no longer leads). Heartbeats from now on: the
  // lease began at the admission, before the KV links.
  LossLatch latch;
  RankLiveness::LostHandler on_lost = [&latch](const std::string& why) { latch.lost(why); };
  if (group != nullptr) {
    on_lost = [id = verdict.instance_id](const std::string& why) {
      spdlog::error("instance {} (joined group): {}; leaving", id, why);
      spdlog::default_logger()->flush();
      std::_Exit(1);
    };
  }
  RankLiveness liveness(channel, links.transfer.get(), nullptr, self,
                        std::max(std::chrono::milliseconds(verdict.lease_ms) / 6, 1ms), on_lost);
  dial_kv_peers(key, verdict, 0, links, peers);
  std::optional<TpLeader> tp_leader;
  if (group != nullptr) {
    std::byte linked{1};
    std::vector<std::byte> all(static_cast<size_t>(tp));
    group->collective.all_gather(std::span(&linked, 1), all);  // every rank linked
    tp_leader.emplace(group->collective);
    liveness.also_tell([&tp_leader](std::span<const Rank> ranks) { tp_leader->peers_lost(ranks); });
  }
  InstanceStats stats;
  std::string reason;
  {
    cpu::ThreadPool pool(serve::compute_threads(args));
    LocalInstance instance(model, kernels, pool, config, serve::model_name(args), peers,
                           tp_leader ? &*tp_leader : nullptr);
    InstanceServer server(channel, instance, verdict.instance_id);
    liveness.watch([&instance] { return instance.progress(); });
    Leaver leaver(channel, instance, server, verdict.instance_id, signals,
                  std::chrono::milliseconds(static_cast<int64_t>(args.drain_timeout_s * 1000)));
    server.on_leave_accepted([&leaver] { leaver.accepted(); });
    latch.serving(&server);
    spdlog::info("instance {} ({}, joined): serving {} with {} compute threads{}",
                 verdict.instance_id, instance_role_name(role), serve::model_name(args),
                 pool.size(), tp > 1 ? fmt::format(", tp {}", tp) : std::string());
    reason = server.serve();
    latch.serving(nullptr);
    stats = instance.stats();
    liveness.watch({});
  }  // the engine has stopped: what it held is dropped with it
  liveness.also_tell({});
  if (tp_leader) tp_leader->stop();  // the followers leave their loop
  spdlog::info("instance {}: {} ({} steps, {} tokens generated)", verdict.instance_id, reason,
               stats.steps, stats.generated_tokens);
  const bool closed = channel.close(kCloseTimeout);
  return {closed ? 0 : 1, latch.is_lost()};
}

// Joins (`window` 0: once), serves, and joins again after each loss, until
// the coordinator's Shutdown, a leave, or a stop signal.
// A group's members (ranks past the leader) do not rejoin: a group lost
// ends, as the ranks of the mpirun job's tensor-parallel instances do.
int membership_loop(const ServeArgs& args, const ClusterKey& key, const std::string& address,
                    const LlamaModel& model, const cpu::KernelTable& kernels,
                    const EngineConfig& config, InstanceRole role, std::chrono::milliseconds window,
                    const sigset_t& signals, Group* group = nullptr) {
  JoinRequest request;
  request.version = fmt::format("duet {}", DUET_VERSION);
  request.model_fingerprint = model_fingerprint(args.model);
  request.role = role;
  request.tp = group != nullptr ? group->collective.size() : 1;
  request.host = host_name();
  for (;;) {
    // A prefill or decode instance listens for KV links before it joins,
    // on every rank; the leader names them all.
    std::unique_ptr<KvLinkListener> listener;
    if (role != InstanceRole::kBoth) {
      listener = std::make_unique<KvLinkListener>(key);
      const KvLinkAddress own = listener->address(-1, request.host);
      request.kv = {own};
      if (group != nullptr) {
        const std::vector<std::byte> all =
            group->mpi.all_gather(TcpAddress{own.port, own.ipv4}.encode());
        request.kv.clear();
        for (size_t at = 0; at < all.size(); at += TcpAddress::kRecordBytes) {
          const TcpAddress rank =
              TcpAddress::decode(std::span(all).subspan(at, TcpAddress::kRecordBytes));
          request.kv.push_back({-1, request.host, rank.port, rank.ipv4, -1});
        }
      }
    }
    int socket = -1;
    std::optional<JoinVerdict> verdict;
    std::string failure;
    if (group == nullptr || group->leader()) {
      try {
        verdict = join(address, key, request, window, signals, socket);
      } catch (const std::exception& e) {
        if (group == nullptr) throw;
        failure = e.what();
      }
    }
    if (group != nullptr) {
      // Every rank goes on with the leader's verdict, or ends with its error.
      verdict =
          share_verdict(*group, verdict ? *verdict : JoinVerdict{false, {}, 0, 0, failure, {}});
      if (!verdict->accepted && group->leader()) throw Error(ErrorKind::kInvalidArgument, failure);
      if (!verdict->accepted) return 2;
      if (!group->leader()) {
        return follow_member(args, key, model, kernels, config, *verdict, std::move(listener),
                             *group);
      }
    }
    if (!verdict) {
      spdlog::info("a stop signal while rejoining: exiting");
      return 0;
    }
    spdlog::info("joined the cluster at {} as instance {} (member {})", address,
                 verdict->instance_id, verdict->member.value);
    const Membership membership = serve_member(args, key, model, kernels, config, role, *verdict,
                                               socket, std::move(listener), signals, group);
    if (!membership.lost) return membership.code;
    if (group != nullptr) return 1;
    if (stop_signal_pending(signals)) return 0;
    // Its requests run elsewhere now; it comes back as a new member, with
    // an empty KV cache, under the epoch its loss made.
    spdlog::warn("rejoining the cluster at {} as a new member", address);
    window = kRejoinWindow;
  }
}

// `mpirun -np T duet serve --join ... --tp T`: every rank loads its shard
// (all say whether they could), then the leader joins for the group.
int run_group_join(const ServeArgs& args, const ClusterKey& key, InstanceRole role, int device,
                   int tp, const sigset_t& signals) {
  if (device >= 0) {
    throw Error(ErrorKind::kUnsupported,
                "an instance of more than one rank joins on the CPU only (its collectives and "
                "KV links are host-side)");
  }
  if (!launched_by_mpirun()) {
    throw Error(
        ErrorKind::kInvalidArgument,
        fmt::format("--tp {} joins as a job of its own: mpirun -np {} duet serve --join ...", tp,
                    tp));
  }
  MpiRuntime mpi;  // finalized last
  if (mpi.world_size() != tp) {
    throw Error(
        ErrorKind::kInvalidArgument,
        fmt::format("--tp {} joins as mpirun -np {}, not -np {}", tp, tp, mpi.world_size()));
  }
  std::vector<Rank> ranks;
  for (int r = 0; r < tp; ++r) ranks.push_back(Rank{r});
  MpiCollective collective(mpi, ranks, 0);
  const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
  std::unique_ptr<LlamaModel> model;
  EngineConfig config;
  std::string error;
  try {
    model = LlamaModel::load(args.model, TpPlacement{collective.rank(), tp}, &kernels);
    const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
    config = serve::engine_config(args, *model, tokenizer.end_of_generation_ids(), device);
  } catch (const std::exception& e) {
    error = e.what();
  }
  const std::byte loaded = error.empty() ? std::byte{1} : std::byte{0};
  const std::vector<std::byte> all = mpi.all_gather(std::span(&loaded, 1));
  if (!error.empty()) throw Error(ErrorKind::kInvalidArgument, error);
  if (std::find(all.begin(), all.end(), std::byte{0}) != all.end()) {
    if (collective.rank() != 0) return 2;
    throw Error(ErrorKind::kInvalidArgument,
                "another rank of this instance could not load its shard (see its log)");
  }
  Group group{mpi, collective};
  return membership_loop(args, key, args.join, *model, kernels, config, role, 0ms, signals, &group);
}

}  // namespace

int rejoin_as_member(const ServeArgs& args, const std::string& address, InstanceRole role,
                     const LlamaModel& model, const EngineConfig& config, const sigset_t& signals) {
  spdlog::warn("rejoining the cluster at {} as a new member", address);
  return membership_loop(args, ClusterKey::from_file(args.cluster_key_file), address, model,
                         cpu::kernel_table(cpu::isa_from_environment()), config, role,
                         kRejoinWindow, signals);
}

int run_join_serve(const ServeArgs& args, const sigset_t& signals) {
  try {
    if (args.cluster_key_file.empty())
      throw Error(ErrorKind::kInvalidArgument, "--join needs --cluster-key FILE");
    const ClusterKey key = ClusterKey::from_file(args.cluster_key_file);
    const InstanceRole role = parse_instance_role(args.role);
    const int device = parse_device(args.device);
    if (role != InstanceRole::kBoth && device >= 0) {
      throw Error(ErrorKind::kUnsupported,
                  "a prefill or decode instance joins on the CPU only (its KV moves over TCP)");
    }
    require_device(device);
    const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
    const int tp = args.cluster.tp.value_or(args.cluster.ep.value_or(1));
    if (tp > 1) return run_group_join(args, key, role, device, tp, signals);
    std::unique_ptr<LlamaModel> model =
        LlamaModel::load(args.model, {}, device < 0 ? &kernels : nullptr);
    const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
    const EngineConfig config =
        serve::engine_config(args, *model, tokenizer.end_of_generation_ids(), device);

    // The first join is tried once: its errors are the user's to read.
    return membership_loop(args, key, args.join, *model, kernels, config, role, 0ms, signals);
  } catch (const Error& e) {
    std::fprintf(stderr, "duet: %s: %s\n", std::string(error_kind_name(e.kind())).c_str(),
                 e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: error: %s\n", e.what());
  }
  return 2;
}

}  // namespace duet::tools

// `duet serve --join HOST:PORT`: one instance that joins a running cluster
// (coordinator/cluster/join_listener.h) instead of starting with it. A plain
// process (or a one-rank mpirun job of its own): no MPI is used.
//
// It loads the model, dials the coordinator and proves the cluster key,
// then is a leader like any other: an InstanceServer over a ControlChannel
// whose only peer is the coordinator, heartbeats included. Unlike the ranks
// of the mpirun job it leaves on SIGTERM or SIGINT: it says Leaving, waits
// for the coordinator's LeaveAccepted (after which no request comes), lets
// what it runs finish (up to --drain-timeout), says Leaving{done}, closes its
// channel and exits 0. A second signal cuts the drain short; what is then
// left is the coordinator's to run again elsewhere, as after a loss.
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
#include "worker/rank_liveness.h"

namespace duet::tools {
namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kCloseTimeout = 10s;

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

}  // namespace

int run_join_serve(const ServeArgs& args, const sigset_t& signals) {
  try {
    if (args.cluster_key_file.empty())
      throw Error(ErrorKind::kInvalidArgument, "--join needs --cluster-key FILE");
    const ClusterKey key = ClusterKey::from_file(args.cluster_key_file);
    const InstanceRole role = parse_instance_role(args.role);
    const int device = parse_device(args.device);
    require_device(device);
    const cpu::KernelTable& kernels = cpu::kernel_table(cpu::isa_from_environment());
    std::unique_ptr<LlamaModel> model =
        LlamaModel::load(args.model, {}, device < 0 ? &kernels : nullptr);
    const Tokenizer tokenizer = tokenizer_from_gguf(model->file());
    const std::string name = serve::model_name(args);
    const EngineConfig config =
        serve::engine_config(args, *model, tokenizer.end_of_generation_ids(), device);

    JoinRequest request;
    request.version = fmt::format("duet {}", DUET_VERSION);
    request.model_fingerprint = model_fingerprint(args.model);
    request.role = role;
    request.tp = 1;
    request.host = host_name();
    int socket = -1;
    const JoinVerdict verdict = join_cluster(args.join, key, request, kHandshakeTimeout, socket);
    spdlog::info("joined the cluster at {} as instance {} (member {})", args.join,
                 verdict.instance_id, verdict.member.value);

    ControlChannelOptions options;
    options.transport = Transport::kTcp;
    ControlChannel channel(JoinedLink{verdict.member, socket}, options);
    const InstanceSpec self{verdict.instance_id, role, 1, {verdict.member}};
    RankLiveness liveness(channel, nullptr, nullptr, self,
                          std::max(std::chrono::milliseconds(verdict.lease_ms) / 6, 1ms));
    InstanceStats stats;
    std::string reason;
    {
      cpu::ThreadPool pool(serve::compute_threads(args));
      LocalInstance instance(*model, kernels, pool, config, name);
      InstanceServer server(channel, instance, verdict.instance_id);
      liveness.watch([&instance] { return instance.progress(); });
      Leaver leaver(channel, instance, server, verdict.instance_id, signals,
                    std::chrono::milliseconds(static_cast<int64_t>(args.drain_timeout_s * 1000)));
      server.on_leave_accepted([&leaver] { leaver.accepted(); });
      spdlog::info("instance {} ({}, joined): serving {} with {} compute threads",
                   verdict.instance_id, instance_role_name(role), name, pool.size());
      reason = server.serve();
      stats = instance.stats();
      liveness.watch({});
    }
    spdlog::info("instance {}: {} ({} steps, {} tokens generated)", verdict.instance_id, reason,
                 stats.steps, stats.generated_tokens);
    return channel.close(kCloseTimeout) ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "duet: %s: %s\n", std::string(error_kind_name(e.kind())).c_str(),
                 e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "duet: error: %s\n", e.what());
  }
  return 2;
}

}  // namespace duet::tools

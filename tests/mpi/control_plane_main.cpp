// The control plane under mpirun: one program, one scenario per run, driven
// by tests/mpi/mpi_tests.cmake. Rank 0 plays the coordinator, the other ranks
// play instances with a fake engine (no model): what is tested is the spec
// check, the handshake, the channel and the shutdown, not the engine.
//
//   handshake         every rank passes the handshake and closes
//   roundtrip         thousands of requests to every leader from two threads at
//                     once, cancels, step events back, stats at the end
//   shutdown          leaders flood events and close at once; nothing is lost
//   idle              every rank idles 10 s; CPU time gathered to rank 0
//   forget            the coordinator tells rank 2 it is lost and forgets it:
//                     what was sent before still arrives, close() agrees
//                     without it; over TCP rank 2 then sees its connection
//                     end and does not wait either
//   lost              (--link tcp, mpirun --enable-recovery) rank 2 says
//                     goodbye and is SIGKILLed: the coordinator hears of the
//                     lost connection at once, a receive() waiting returns,
//                     and close() agrees with rank 1 alone
//
// --link mpi|tcp chooses the channel's link (ControlChannelOptions::link).
//
// Every failure prints "[rank R] error: <message>" and exits 1, so the failing
// scenarios (a version mismatch, a world of the wrong size) can check that
// every rank gave the same message.
#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"
#include "common/control_plane/control_channel.h"
#include "common/control_plane/control_handshake.h"
#include "common/control_plane/mpi_runtime.h"
#include "common/error.h"

namespace duet {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string scenario = "handshake";
  int requests = 4000;
  double idle_seconds = 10.0;
  // Of one core, all ranks together. What it catches is a rank that spins
  // (a whole core) or a backoff that stops backing off (a ceiling of 200 us
  // instead of 2 ms would wake each rank ten times as often: about 20% of a
  // core each). At 2 ms an idle rank costs 1-2.5% of a core here, on a
  // shared 2-core VM, varying from day to day.
  double idle_cpu_limit = 0.15;
  int bad_version_rank = -1;  // this rank speaks protocol version 99
  int handshake_timeout_ms = 20'000;
  int burst = 2000;  // shutdown: events each leader sends right before closing
  std::string link = "mpi";
};

// Shared by the coordinator and the fake instances: what the instance answers
// to a request, so the coordinator can check every event.
int64_t tokens_for(RequestId id) { return 1 + static_cast<int64_t>(id.value % 7); }
bool refused(RequestId id) { return id.value % 13 == 0; }  // submitted with max_tokens 0
int32_t token_at(uint64_t prompt_sum, int64_t k) {
  return static_cast<int32_t>((prompt_sum + static_cast<uint64_t>(k)) % 49152);
}
uint64_t sum_of(const std::vector<int32_t>& prompt) {
  uint64_t sum = 0;
  for (int32_t t : prompt) sum += static_cast<uint64_t>(t);
  return sum;
}

void check(bool ok, const std::string& what) {
  if (!ok) throw Error(ErrorKind::kInternal, "check failed: " + what);
}

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);  // every thread of the process
  auto seconds = [](const timeval& t) { return t.tv_sec + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// ---------------------------------------------------------------- fake instance

// The leader's loop: drain the inbox, then run one "step" that advances every
// running request by one token and reports the step's events in one message.
// Ends on Shutdown with a StatsReport.
void run_fake_leader(ControlChannel& channel, const InstanceSpec& instance) {
  struct Running {
    uint64_t prompt_sum = 0;
    int64_t target = 0;
    int64_t emitted = 0;
  };
  std::map<RequestId, Running> running;
  InstanceStats stats;
  bool shutdown = false;
  while (!shutdown) {
    StepEvents step;
    step.instance_id = instance.id;
    step.step = stats.steps;
    auto timeout = running.empty() ? 1000ms : 0ms;
    while (std::optional<ReceivedMessage> received = channel.receive(timeout)) {
      timeout = 0ms;
      check(received->source == kCoordinatorRank, "instance messages come from rank 0");
      if (auto* submit = std::get_if<SubmitRequest>(&received->message)) {
        const InstanceRequest& request = submit->request;
        stats.prompt_tokens += static_cast<int64_t>(request.prompt.size());
        if (request.max_tokens <= 0) {
          InstanceEvent failed;
          failed.id = request.id;
          failed.finished = true;
          failed.finish = InstanceFinish::kFailed;
          failed.error =
              ServeError{ServeErrorKind::kInvalidArgument, "max_tokens must be positive"};
          step.events.push_back(failed);
          continue;
        }
        running[request.id] = Running{sum_of(request.prompt), request.max_tokens, 0};
      } else if (auto* cancel = std::get_if<Cancel>(&received->message)) {
        if (running.erase(cancel->id) > 0) {
          InstanceEvent cancelled;
          cancelled.id = cancel->id;
          cancelled.finished = true;
          cancelled.finish = InstanceFinish::kCancelled;
          step.events.push_back(cancelled);
        }
      } else if (std::holds_alternative<Shutdown>(received->message)) {
        shutdown = true;
      } else {
        check(false,
              std::string("unexpected ") + std::string(control_message_name(received->message)));
      }
    }
    for (auto it = running.begin(); it != running.end();) {
      Running& r = it->second;
      InstanceEvent event;
      event.id = it->first;
      if (r.emitted == 0) {
        event.admitted = true;
        event.cached_tokens = static_cast<int64_t>(r.prompt_sum % 16);
        event.admitted_at = Clock::now();
      }
      event.token = token_at(r.prompt_sum, r.emitted++);
      ++stats.generated_tokens;
      if (r.emitted == r.target) {
        event.finished = true;
        event.finish =
            it->first.value % 11 == 0 ? InstanceFinish::kEndOfGeneration : InstanceFinish::kLength;
        it = running.erase(it);
      } else {
        ++it;
      }
      step.events.push_back(event);
    }
    if (!step.events.empty()) {
      ++stats.steps;
      channel.send(kCoordinatorRank, step);
    }
  }
  check(running.empty(), "nothing runs at shutdown");
  channel.send(kCoordinatorRank, StatsReport{instance.id, stats});
}

// ---------------------------------------------------------------- coordinator

void run_roundtrip_coordinator(ControlChannel& channel, const ClusterSpec& spec,
                               const Options& options) {
  const std::vector<Rank> leaders = spec.leaders();
  struct Expected {
    Rank leader;
    uint64_t prompt_sum = 0;
    int64_t tokens_seen = 0;
    bool cancelled = false;
    bool admitted = false;
    bool finished = false;
  };
  std::map<RequestId, Expected> expected;
  std::mutex expected_mutex;  // the submitting threads and the receive loop
  int64_t prompt_tokens_sent = 0;

  // Two threads submit at once; nothing waits for an answer in between.
  const auto start = Clock::now();
  auto submit_range = [&](int first, int step) {
    std::mt19937 random(static_cast<unsigned>(first));
    for (int i = first; i <= options.requests; i += step) {
      InstanceRequest request;
      request.id = RequestId{static_cast<uint64_t>(i)};
      // Mostly short prompts, a few far past the eager limit (rendezvous).
      const size_t length = i % 500 == 0 ? 200'000 : 1 + random() % 3000;
      request.prompt.resize(length);
      for (int32_t& t : request.prompt) t = static_cast<int32_t>(random() % 49152);
      request.max_tokens = refused(request.id) ? 0 : tokens_for(request.id);
      request.sampling.temperature = 0.5f;
      request.sampling.seed = static_cast<uint64_t>(i);
      const Rank leader = leaders[static_cast<size_t>(i) % leaders.size()];
      {
        std::lock_guard lock(expected_mutex);
        expected[request.id] = Expected{leader, sum_of(request.prompt)};
        prompt_tokens_sent += static_cast<int64_t>(length);
      }
      channel.send(leader, SubmitRequest{std::move(request)});
      if (i % 10 == 0) {
        std::lock_guard lock(expected_mutex);
        expected[RequestId{static_cast<uint64_t>(i)}].cancelled = true;
        channel.send(leader, Cancel{RequestId{static_cast<uint64_t>(i)}});
      }
    }
  };
  std::thread odd(submit_range, 1, 2);
  std::thread even(submit_range, 2, 2);

  int64_t n_finished = 0;
  int64_t n_step_messages = 0;
  int64_t n_events = 0;
  int64_t tokens_seen = 0;
  const auto deadline = Clock::now() + 300s;
  while (n_finished < options.requests) {
    check(Clock::now() < deadline, "every request finishes within 300 s");
    std::optional<ReceivedMessage> received = channel.receive(1000ms);
    if (!received) continue;
    const auto* step = std::get_if<StepEvents>(&received->message);
    check(step != nullptr, "the coordinator gets step events");
    check(spec.instances.at(static_cast<size_t>(step->instance_id)).leader() == received->source,
          "step events come from the instance's leader");
    ++n_step_messages;
    std::lock_guard lock(expected_mutex);
    for (const InstanceEvent& event : step->events) {
      ++n_events;
      auto it = expected.find(event.id);
      check(it != expected.end(), "an event names a submitted request");
      Expected& e = it->second;
      check(e.leader == received->source, "a request's events come from its leader");
      check(!e.finished, "no event after a request's finish");
      if (event.admitted) {
        check(!e.admitted && e.tokens_seen == 0, "admitted once, with the first token");
        check(event.cached_tokens == static_cast<int64_t>(e.prompt_sum % 16), "cached tokens");
        e.admitted = true;
      }
      if (event.token >= 0) {
        check(e.admitted, "tokens after admission");
        check(event.token == token_at(e.prompt_sum, e.tokens_seen), "the expected token");
        ++e.tokens_seen;
        ++tokens_seen;
      }
      if (event.finished) {
        e.finished = true;
        ++n_finished;
        switch (event.finish) {
          case InstanceFinish::kFailed:
            check(refused(event.id) && event.error &&
                      event.error->kind == ServeErrorKind::kInvalidArgument &&
                      event.error->message == "max_tokens must be positive",
                  "only the max_tokens 0 requests fail, with their error");
            break;
          case InstanceFinish::kCancelled:
            check(e.cancelled && !event.error, "only cancelled requests end cancelled");
            break;
          case InstanceFinish::kEndOfGeneration:
          case InstanceFinish::kLength:
            check(!refused(event.id) && e.tokens_seen == tokens_for(event.id),
                  "a finished request got all its tokens");
            check((event.finish == InstanceFinish::kEndOfGeneration) == (event.id.value % 11 == 0),
                  "the finish reason");
            break;
        }
      }
    }
  }
  odd.join();
  even.join();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  for (Rank leader : leaders) channel.send(leader, Shutdown{"test over"});
  int64_t stats_tokens = 0;
  int64_t stats_prompt_tokens = 0;
  for (size_t n = 0; n < leaders.size(); ++n) {
    std::optional<ReceivedMessage> received = channel.receive(30s);
    check(received.has_value(), "every leader reports its stats at shutdown");
    const auto* report = std::get_if<StatsReport>(&received->message);
    check(report != nullptr, "stats after the last step");
    stats_tokens += report->stats.generated_tokens;
    stats_prompt_tokens += report->stats.prompt_tokens;
  }
  check(stats_tokens == tokens_seen, "the instances generated exactly the tokens received");
  check(stats_prompt_tokens == prompt_tokens_sent, "the instances got every prompt token");
  const ControlChannel::Counters counters = channel.counters();
  std::printf(
      "roundtrip: %d requests (%lld prompt tokens) to %zu leaders, %lld step messages carrying "
      "%lld events (%lld tokens) in %.2f s; channel sent %lld, received %lld, malformed %lld\n",
      options.requests, static_cast<long long>(prompt_tokens_sent), leaders.size(),
      static_cast<long long>(n_step_messages), static_cast<long long>(n_events),
      static_cast<long long>(tokens_seen), seconds, static_cast<long long>(counters.sent),
      static_cast<long long>(counters.received), static_cast<long long>(counters.malformed));
  check(counters.malformed == 0, "no malformed message");
}

// Leaders flood step events and close at once; the coordinator sends
// Shutdown and closes. Everything sent before anyone's close arrives.
void run_shutdown(ControlChannel& channel, const ClusterSpec& spec, const Options& options) {
  const Rank self = channel.rank();
  const auto start = Clock::now();
  if (self == kCoordinatorRank) {
    for (Rank leader : spec.leaders()) channel.send(leader, Shutdown{"closing"});
  } else if (spec.is_leader(self)) {
    for (int i = 0; i < options.burst; ++i) {
      StepEvents step;
      step.instance_id = spec.instance_of(self)->id;
      step.step = i;
      step.events.resize(8);
      channel.send(kCoordinatorRank, step);
    }
  }
  check(channel.close(30s), "every rank closed");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();

  // Everything is in the inbox now; receive() does not wait any more.
  std::map<Rank, int64_t> steps_from;
  int n_shutdowns = 0;
  while (std::optional<ReceivedMessage> received = channel.receive(10s)) {
    if (const auto* step = std::get_if<StepEvents>(&received->message)) {
      check(step->step == steps_from[received->source]++, "events arrive in order");
    } else if (std::holds_alternative<Shutdown>(received->message)) {
      ++n_shutdowns;
    }
  }
  if (self == kCoordinatorRank) {
    for (Rank leader : spec.leaders()) {
      check(steps_from[leader] == options.burst, "every event sent before close arrived");
    }
    std::printf(
        "shutdown: %zu leaders x %d messages sent right before close, all received; "
        "close took %.3f s\n",
        spec.leaders().size(), options.burst, seconds);
  } else if (spec.is_leader(self)) {
    check(n_shutdowns == 1, "the leader got its Shutdown");
  }
}

// Every rank idles with the channel running; CPU time gathered to rank 0.
void run_idle(ControlChannel& channel, const ClusterSpec& spec, const Options& options) {
  DUET_MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
  const double cpu_before = cpu_seconds();
  const auto start = Clock::now();
  const auto end = start + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(options.idle_seconds));
  // The real idle state: a dispatcher blocked on the inbox.
  while (Clock::now() < end) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
    std::optional<ReceivedMessage> received = channel.receive(left);
    check(!received.has_value(), "nothing arrives while idle");
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu = cpu_seconds() - cpu_before;

  std::vector<double> all(static_cast<size_t>(channel.world_size()));
  DUET_MPI_CHECK(MPI_Gather(&cpu, 1, MPI_DOUBLE, all.data(), 1, MPI_DOUBLE, 0, MPI_COMM_WORLD));
  if (channel.rank() == kCoordinatorRank) {
    double total = 0;
    for (size_t r = 0; r < all.size(); ++r) {
      std::printf("idle: rank %zu used %.1f ms CPU (user+system) in %.2f s = %.3f%% of a core\n", r,
                  all[r] * 1e3, wall, 100.0 * all[r] / wall);
      total += all[r];
    }
    const double share = total / wall;
    std::printf(
        "idle: all %zu ranks together: %.1f ms CPU in %.2f s = %.3f%% of one core "
        "(limit %.1f%%)\n",
        all.size(), total * 1e3, wall, 100.0 * share, 100.0 * options.idle_cpu_limit);
    check(share < options.idle_cpu_limit, "idle ranks use under the CPU limit");
  }
  if (channel.rank() == kCoordinatorRank) {
    for (Rank leader : spec.leaders()) channel.send(leader, Shutdown{"idle test over"});
  }
}

// The coordinator tells rank 2 (a leader) that it is lost, sends it one more
// message after forget() (dropped over TCP, unwaited over MPI), and closes
// with rank 1 alone. Rank 2 gets what was sent before forget(); over TCP its
// connection to rank 0 then ends and its close() agrees without rank 0.
void run_forget(ControlChannel& channel, const Options& options) {
  const Rank self = channel.rank();
  const Rank victim{2};
  const bool tcp = channel.transport() == Transport::kTcp;
  constexpr int kBefore = 50;  // messages to the victim before forget()
  if (self == kCoordinatorRank) {
    for (int i = 0; i < kBefore; ++i) channel.send(victim, Cancel{RequestId{uint64_t(i)}});
    const RanksLost lost{1, {victim}, "forget scenario"};
    channel.send(Rank{1}, lost);
    channel.send(victim, lost);
    const std::vector<Rank> forgotten = {victim};
    channel.forget(forgotten);
    // Once the thread has applied forget() (it is woken at once): holds
    // nothing up, and over TCP is dropped.
    std::this_thread::sleep_for(200ms);
    channel.send(victim, Cancel{RequestId{999}});
    const auto start = Clock::now();
    check(channel.close(30s), "the coordinator closed with rank 1 alone");
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    check(seconds < 5.0, "close() did not wait on the forgotten rank");
    check(channel.forgot_any(), "forgot_any");
    const ControlChannel::Counters counters = channel.counters();
    if (tcp) check(counters.unsent >= 1, "the message after forget() was not sent over TCP");
    check(counters.links_lost == 0, "a forgotten rank's end is no lost link");
    std::printf("forget (%s): closed without rank 2 in %.3f s; sent %lld, unsent %lld\n",
                options.link.c_str(), seconds, static_cast<long long>(counters.sent),
                static_cast<long long>(counters.unsent));
    return;
  }
  // Both leaders get the RanksLost; the victim gets every message before it.
  int n_cancels = 0;
  for (;;) {
    std::optional<ReceivedMessage> received = channel.receive(30s);
    check(received.has_value(), "the messages sent before forget() arrive");
    if (const auto* cancel = std::get_if<Cancel>(&received->message)) {
      check(cancel->id.value == uint64_t(n_cancels++), "in order, none after forget()");
      continue;
    }
    check(std::holds_alternative<RanksLost>(received->message), "a RanksLost");
    break;
  }
  if (self == victim) {
    check(n_cancels == kBefore, "every message before forget() arrived first");
    const auto start = Clock::now();
    const bool closed = channel.close(tcp ? 30s : 2s);
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (tcp) {
      // Rank 0 closed its socket: the connection ended before its marker.
      check(closed && seconds < 5.0, "the forgotten rank's close() did not wait on rank 0");
      check(channel.counters().links_lost == 1, "rank 2 saw its connection to rank 0 end");
    } else {
      check(!closed, "over MPI a forgotten rank gets no close marker");
    }
  } else {
    check(channel.close(30s), "rank 1 closed with the coordinator");
  }
}

// Over TCP: rank 2 says goodbye and is SIGKILLed. Rank 0's handler hears of
// the lost connection, a receive() waiting returns at once, and close()
// agrees with rank 1 alone; rank 0 prints "lost: PASS" only when all held.
void run_lost(MpiRuntime& mpi, ControlChannel& channel) {
  check(channel.transport() == Transport::kTcp, "the lost scenario needs --link tcp");
  const Rank self = channel.rank();
  const Rank victim{2};
  // Survivors may not finalize: MPI_Finalize could wait on the dead rank.
  mpi.leave_without_finalize();
  if (self == victim) {
    channel.send(kCoordinatorRank, StatsReport{1, {}});
    std::this_thread::sleep_for(300ms);  // the goodbye leaves
    std::raise(SIGKILL);
  }
  if (self != kCoordinatorRank) {
    std::optional<ReceivedMessage> received = channel.receive(30s);
    check(received && std::holds_alternative<Shutdown>(received->message), "Shutdown");
    check(channel.close(30s), "rank 1 closed with the coordinator");
    return;
  }
  std::mutex mutex;
  std::vector<std::pair<Rank, std::string>> lost;
  Clock::time_point lost_at;
  channel.set_link_lost_handler([&](Rank rank, const std::string& why) {
    std::lock_guard lock(mutex);
    lost.emplace_back(rank, why);
    lost_at = Clock::now();
  });
  std::optional<ReceivedMessage> goodbye = channel.receive(30s);
  check(goodbye && goodbye->source == victim, "rank 2's goodbye");
  const auto waiting_since = Clock::now();
  std::optional<ReceivedMessage> none = channel.receive(60s);
  const double waited = std::chrono::duration<double>(Clock::now() - waiting_since).count();
  check(!none.has_value(), "nothing more arrives");
  check(waited < 10.0, "a receive() waiting returns when a connection is lost");
  {
    std::lock_guard lock(mutex);
    check(lost.size() == 1 && lost[0].first == victim, "the handler named rank 2, once");
  }
  channel.send(Rank{1}, Shutdown{"lost scenario over"});
  const auto start = Clock::now();
  check(channel.close(30s), "close() agreed with rank 1 alone");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  check(seconds < 5.0, "close() did not wait on the dead rank");
  const ControlChannel::Counters counters = channel.counters();
  check(counters.links_lost == 1, "one lost link (rank 1 closed in order)");
  check(channel.forgot_any(), "a lost link counts for forgot_any");
  std::printf(
      "lost: rank 2 (%s) reported %.0f ms after its goodbye, the receive returned "
      "after %.0f ms, close took %.3f s; lost: PASS\n",
      lost[0].second.c_str(),
      std::chrono::duration<double, std::milli>(lost_at - waiting_since).count(), waited * 1e3,
      seconds);
}

// MPI first, then the spec: every error after MpiRuntime leaves through
// MPI_Finalize, so every rank prints its line before mpirun ends the job.
int run(const ClusterFlags& flags, const Options& options) {
  MpiRuntime mpi;
  const Rank self = mpi.rank();
  try {
    const ClusterSpec spec = cluster_spec_from_flags(flags, mpi.world_size());
    spec.validate(mpi.world_size());
    ControlChannelOptions channel_options;
    if (options.link == "tcp") {
      channel_options.transport = Transport::kTcp;
    } else if (options.link != "mpi") {
      throw Error(ErrorKind::kInvalidArgument, "--link is mpi or tcp, not " + options.link);
    }
    ControlChannel channel(mpi, channel_options);
    HandshakeOptions handshake;
    handshake.timeout = std::chrono::milliseconds(options.handshake_timeout_ms);
    if (self.value == options.bad_version_rank) handshake.protocol_version = 99;
    try {
      if (self == kCoordinatorRank) {
        coordinator_handshake(channel, spec, handshake);
      } else {
        instance_handshake(channel, spec, handshake);
      }
    } catch (const Error&) {
      channel.close(10s);  // so that the verdict reaches every rank
      throw;
    }

    if (options.scenario == "handshake") {
      if (self == kCoordinatorRank) std::printf("handshake: %s\n", spec.describe().c_str());
      check(channel.close(30s), "every rank closed");
    } else if (options.scenario == "roundtrip") {
      if (self == kCoordinatorRank) {
        run_roundtrip_coordinator(channel, spec, options);
      } else if (spec.is_leader(self)) {
        run_fake_leader(channel, *spec.instance_of(self));
      }
      check(channel.close(30s), "every rank closed");
    } else if (options.scenario == "shutdown") {
      run_shutdown(channel, spec, options);
    } else if (options.scenario == "forget") {
      run_forget(channel, options);
    } else if (options.scenario == "lost") {
      run_lost(mpi, channel);
    } else if (options.scenario == "idle") {
      run_idle(channel, spec, options);
      if (self != kCoordinatorRank && spec.is_leader(self)) {
        std::optional<ReceivedMessage> received = channel.receive(30s);
        check(received && std::holds_alternative<Shutdown>(received->message), "Shutdown");
      }
      check(channel.close(30s), "every rank closed");
    } else {
      throw Error(ErrorKind::kInvalidArgument, "unknown scenario " + options.scenario);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] error: %s\n", self.value, e.what());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace duet

int main(int argc, char** argv) {
  duet::Options options;
  duet::ClusterFlags flags;
  CLI::App app("The control plane's mpirun tests");
  app.add_option("--scenario", options.scenario,
                 "handshake, roundtrip, shutdown, idle, forget or lost");
  app.add_option("--link", options.link, "the control channel's link: mpi or tcp");
  app.add_option("--prefill", flags.prefill, "prefill instances");
  app.add_option("--decode", flags.decode, "decode instances");
  app.add_option("--tp", flags.tp, "ranks per instance");
  app.add_option("--mode", flags.mode, "disaggregated or colocated");
  app.add_option("--cluster", flags.file, "a cluster spec (JSON)");
  app.add_option("--requests", options.requests, "roundtrip: requests");
  app.add_option("--idle-seconds", options.idle_seconds, "idle: how long");
  app.add_option("--idle-cpu-limit", options.idle_cpu_limit, "idle: CPU share of one core");
  app.add_option("--bad-version-rank", options.bad_version_rank,
                 "this rank speaks control protocol version 99");
  app.add_option("--handshake-timeout-ms", options.handshake_timeout_ms, "handshake deadline");
  app.add_option("--burst", options.burst, "shutdown: messages per leader before close");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!flags.any()) flags.prefill = flags.decode = 1;
    return duet::run(flags, options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

// Can one mpirun job hold several failure domains? A probe of Open MPI with
// Duet's communication pattern, in which one rank is SIGKILLed in a chosen
// phase and the others must go on.
//
// Four ranks, the roles of a small cluster:
//   0  the coordinator: heartbeats to and from every rank, holds a lease on
//      each, and tells the others when one is lost;
//   1  a prefill instance: KV payloads to and from the victim and rank 3;
//   2  the victim: a decode instance, tensor parallel with rank 3;
//   3  a decode instance's leader: collectives with the victim (their TP
//      communicator) and with rank 1 (a survivors' communicator).
// As in Duet, each traffic has its own communicator (control: a duplicate of
// the world; KV: another duplicate; each TP group: a split), control runs on
// a communication thread of its own (MPI_Isend, MPI_Iprobe then MPI_Recv,
// MPI_Test), and KV payloads (8 MiB by default, far above the eager limit)
// and collectives run on the main thread, all under MPI_THREAD_MULTIPLE.
//
// The victim dies (raise(SIGKILL)) in one phase:
//   idle        nothing in flight toward it but heartbeats;
//   kv-send     its payload to rank 1 posted, rank 1's payload to it posted,
//               neither finished;
//   kv-recv     it announced a payload (the header arrived) and never sends it;
//   collective  rank 3 waits in an allreduce it will never join.
// The survivors never wait without a deadline: every operation toward the
// victim is non-blocking, polled, and given up when the coordinator's lease
// on the victim expires. Then, for --after seconds, they exchange heartbeats,
// KV payloads (1 <-> 3) and allreduces (1, 3) as before the loss, and each
// reports what still works and what became of the requests left toward the
// victim. The run ends with MPI_Finalize under a watchdog (--exit finalize)
// or without it (--exit skip).
//
// Each survivor prints one line "[rank R] survived: ..." and exits 0 when
// everything it tried after the loss worked; "[rank R] FAILED: ..." and exit
// 1 otherwise. Run it with `mpirun --enable-recovery -np 4`; tests/mpi/
// failure_probe.sh checks the lines.
#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int kCoordinator = 0;
constexpr int kPrefill = 1;
constexpr int kVictim = 2;
constexpr int kLeader = 3;

constexpr int kTagHeartbeat = 1;
constexpr int kTagLost = 2;
constexpr int kTagDone = 3;
constexpr int kTagHeader = 10;
constexpr int kTagPayload = 11;

struct Options {
  std::string phase = "idle";
  std::string exit_mode = "finalize";
  double after_seconds = 2.0;
  int payload_mib = 8;
  int lease_ms = 400;
  int heartbeat_ms = 5;
};

int g_rank = -1;

void say(const char* format, auto... args) {
  std::fprintf(stdout, "[rank %d] ", g_rank);
  std::fprintf(stdout, format, args...);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

// Fails the probe on this rank: an MPI call toward a survivor must not fail.
void require(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  say("FAILED: %s: %s", what, mpi_error(code).c_str());
  std::_Exit(1);
}

// Polls `requests` until all are done or `deadline`; true when done. An
// error on any of them is reported (not fatal: it is what the probe looks
// for on requests toward the victim).
bool wait_until(std::vector<MPI_Request>& requests, Clock::time_point deadline,
                std::string* error = nullptr) {
  while (true) {
    int done = 0;
    const int code =
        MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) {
      if (error) *error = mpi_error(code);
      return false;
    }
    if (done) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(50us);
  }
}

// ------------------------------------------------------------ control thread

// Heartbeats on the control communicator, as Duet's communication thread
// moves control messages: every rank sends one to the coordinator each
// heartbeat_ms; the coordinator answers each rank at the same pace, holds a
// lease on each, and when the victim's expires sends "lost" to the others.
class Control {
 public:
  Control(MPI_Comm comm, const Options& options, int rank, int size)
      : comm_(comm),
        options_(options),
        rank_(rank),
        size_(size),
        last_seen_(size, Clock::now()),
        heard_(size, 0) {
    thread_ = std::thread([this] { run(); });
  }
  ~Control() { stop(); }

  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  bool victim_lost() const { return lost_.load(); }
  // The coordinator: how long after the victim's last heartbeat it said so.
  int64_t lost_after_ms() const { return lost_after_ms_.load(); }
  int64_t heard_from(int rank) const {
    std::lock_guard lock(mutex_);
    return heard_[rank];
  }
  int64_t sends_left_toward_victim() const { return left_toward_victim_.load(); }
  int done_count() const { return done_.load(); }
  void send_done() { want_done_ = true; }

 private:
  struct Send {
    std::vector<int> word;
    MPI_Request request = MPI_REQUEST_NULL;
    int destination = 0;
  };

  void post(int destination, int tag, int value) {
    if (destination == kVictim && lost_) return;  // nothing more toward the lost
    sends_.push_back(Send{{value}, MPI_REQUEST_NULL, destination});
    Send& send = sends_.back();
    require(MPI_Isend(send.word.data(), 1, MPI_INT, destination, tag, comm_, &send.request),
            "MPI_Isend (control)");
  }

  void run() {
    auto next_beat = Clock::now();
    while (!stop_) {
      const auto now = Clock::now();
      if (now >= next_beat) {
        next_beat = now + std::chrono::milliseconds(options_.heartbeat_ms);
        if (rank_ == kCoordinator) {
          for (int r = 1; r < size_; ++r) post(r, kTagHeartbeat, 0);
        } else {
          post(kCoordinator, kTagHeartbeat, 0);
        }
      }
      if (want_done_.exchange(false)) post(kCoordinator, kTagDone, rank_);
      receive();
      if (rank_ == kCoordinator && !lost_) check_leases(now);
      test_sends();
      std::this_thread::sleep_for(200us);
    }
  }

  void receive() {
    while (true) {
      int flag = 0;
      MPI_Status status;
      require(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &status), "MPI_Iprobe");
      if (!flag) return;
      int word = 0;
      require(
          MPI_Recv(&word, 1, MPI_INT, status.MPI_SOURCE, status.MPI_TAG, comm_, MPI_STATUS_IGNORE),
          "MPI_Recv (control)");
      {
        std::lock_guard lock(mutex_);
        last_seen_[status.MPI_SOURCE] = Clock::now();
        ++heard_[status.MPI_SOURCE];
      }
      if (status.MPI_TAG == kTagLost) lost_ = true;
      if (status.MPI_TAG == kTagDone) ++done_;
    }
  }

  void check_leases(Clock::time_point now) {
    Clock::time_point seen;
    {
      std::lock_guard lock(mutex_);
      seen = last_seen_[kVictim];
    }
    if (now - seen < std::chrono::milliseconds(options_.lease_ms)) return;
    lost_after_ms_ =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - seen).count();
    lost_ = true;
    for (int r = 1; r < size_; ++r)
      if (r != kVictim) post(r, kTagLost, kVictim);
  }

  // Frees the sends that completed. Sends toward the lost victim that never
  // complete are left as they are: their buffers stay (a bounded leak).
  void test_sends() {
    int64_t toward_victim = 0;
    for (auto it = sends_.begin(); it != sends_.end();) {
      int done = 0;
      const int code = MPI_Test(&it->request, &done, MPI_STATUS_IGNORE);
      if (code != MPI_SUCCESS && it->destination != kVictim) require(code, "MPI_Test (control)");
      if (done || code != MPI_SUCCESS) {
        it = sends_.erase(it);
      } else {
        if (it->destination == kVictim) ++toward_victim;
        ++it;
      }
    }
    left_toward_victim_ = toward_victim;
  }

  const MPI_Comm comm_;
  const Options& options_;
  const int rank_;
  const int size_;
  std::vector<Send> sends_;  // control thread only (a vector of small, stable words)
  mutable std::mutex mutex_;
  std::vector<Clock::time_point> last_seen_;  // guarded by mutex_
  std::vector<int64_t> heard_;                // guarded by mutex_
  std::atomic<bool> stop_{false};
  std::atomic<bool> lost_{false};
  std::atomic<bool> want_done_{false};
  std::atomic<int> done_{0};
  std::atomic<int64_t> lost_after_ms_{-1};
  std::atomic<int64_t> left_toward_victim_{0};
  std::thread thread_;
};

// ------------------------------------------------------------------ KV moves

// One payload each way between this rank and `peer`, header first (as
// Duet's rows header announces its payload): true when both finished by the
// deadline.
bool exchange_payloads(MPI_Comm kv, int peer, std::vector<char>& out, std::vector<char>& in,
                       Clock::time_point deadline) {
  int header_out = static_cast<int>(out.size());
  int header_in = 0;
  std::vector<MPI_Request> requests(4, MPI_REQUEST_NULL);
  require(MPI_Isend(&header_out, 1, MPI_INT, peer, kTagHeader, kv, &requests[0]), "MPI_Isend");
  require(MPI_Isend(out.data(), static_cast<int>(out.size()), MPI_CHAR, peer, kTagPayload, kv,
                    &requests[1]),
          "MPI_Isend (payload)");
  require(MPI_Irecv(&header_in, 1, MPI_INT, peer, kTagHeader, kv, &requests[2]), "MPI_Irecv");
  require(MPI_Irecv(in.data(), static_cast<int>(in.size()), MPI_CHAR, peer, kTagPayload, kv,
                    &requests[3]),
          "MPI_Irecv (payload)");
  return wait_until(requests, deadline);
}

bool all_reduce(MPI_Comm comm, Clock::time_point deadline, std::string* error = nullptr) {
  static thread_local std::vector<float> data(4096, 1.0f), sum(4096);
  MPI_Request request = MPI_REQUEST_NULL;
  require(MPI_Iallreduce(data.data(), sum.data(), static_cast<int>(data.size()), MPI_FLOAT, MPI_SUM,
                         comm, &request),
          "MPI_Iallreduce");
  std::vector<MPI_Request> requests{request};
  return wait_until(requests, deadline, error);
}

// What became of requests left toward the victim, for the report.
std::string fate(std::vector<MPI_Request>& requests) {
  int pending = 0, failed = 0, done = 0;
  for (MPI_Request& request : requests) {
    if (request == MPI_REQUEST_NULL) {
      ++done;
      continue;
    }
    int flag = 0;
    const int code = MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
    if (code != MPI_SUCCESS)
      ++failed;
    else if (flag)
      ++done;
    else
      ++pending;
  }
  return std::to_string(done) + " done, " + std::to_string(failed) + " failed, " +
         std::to_string(pending) + " never finish";
}

[[noreturn]] void die() {
  say("dies now (SIGKILL)");
  std::raise(SIGKILL);
  std::_Exit(9);
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const char* value = argv[i + 1];
    if (flag == "--phase")
      options.phase = value;
    else if (flag == "--exit")
      options.exit_mode = value;
    else if (flag == "--after")
      options.after_seconds = std::atof(value);
    else if (flag == "--payload-mib")
      options.payload_mib = std::atoi(value);
    else if (flag == "--lease-ms")
      options.lease_ms = std::atoi(value);
    else {
      std::fprintf(stderr, "unknown option %s\n", flag.c_str());
      return 2;
    }
  }
  const bool known_phase = options.phase == "idle" || options.phase == "kv-send" ||
                           options.phase == "kv-recv" || options.phase == "collective";
  if (!known_phase || (options.exit_mode != "finalize" && options.exit_mode != "skip")) {
    std::fprintf(stderr,
                 "usage: failure_probe --phase idle|kv-send|kv-recv|collective "
                 "[--exit finalize|skip] [--after S] [--payload-mib N]\n");
    return 2;
  }

  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (provided < MPI_THREAD_MULTIPLE || size != 4) {
    say("FAILED: needs 4 ranks and MPI_THREAD_MULTIPLE (got %d ranks, level %d)", size, provided);
    MPI_Finalize();
    return 1;
  }
  const int rank = g_rank;

  // Duet's communicators: control and KV duplicates of the world, a TP
  // group {2, 3} and a survivors' group {1, 3}.
  MPI_Comm control_comm, kv_comm, tp_comm, survivors_comm;
  require(MPI_Comm_dup(MPI_COMM_WORLD, &control_comm), "MPI_Comm_dup");
  require(MPI_Comm_dup(MPI_COMM_WORLD, &kv_comm), "MPI_Comm_dup");
  require(MPI_Comm_split(MPI_COMM_WORLD, rank >= kVictim ? 0 : MPI_UNDEFINED, rank, &tp_comm),
          "MPI_Comm_split");
  require(MPI_Comm_split(MPI_COMM_WORLD, rank == kPrefill || rank == kLeader ? 0 : MPI_UNDEFINED,
                         rank, &survivors_comm),
          "MPI_Comm_split");

  const size_t payload_bytes = static_cast<size_t>(options.payload_mib) << 20;
  std::vector<char> out(payload_bytes, static_cast<char>(rank)), in(payload_bytes);
  Control control(control_comm, options, rank, size);

  // Warm-up: every path once, with everyone alive.
  const auto warm_deadline = Clock::now() + 20s;
  bool warm = true;
  if (rank == kPrefill) {
    warm = exchange_payloads(kv_comm, kVictim, out, in, warm_deadline) &&
           exchange_payloads(kv_comm, kLeader, out, in, warm_deadline) &&
           all_reduce(survivors_comm, warm_deadline);
  } else if (rank == kVictim) {
    warm = exchange_payloads(kv_comm, kPrefill, out, in, warm_deadline) &&
           all_reduce(tp_comm, warm_deadline);
  } else if (rank == kLeader) {
    warm = exchange_payloads(kv_comm, kPrefill, out, in, warm_deadline) &&
           all_reduce(tp_comm, warm_deadline) && all_reduce(survivors_comm, warm_deadline);
  }
  if (!warm) {
    say("FAILED: the warm-up did not finish");
    std::_Exit(1);
  }
  require(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");  // the last wait on everyone

  // The phase: the victim dies in it; the survivors' operations toward the
  // victim are polled until the coordinator says it is lost.
  std::vector<MPI_Request> toward_victim;
  auto wait_for_loss = [&](const char* what) {
    const auto deadline = Clock::now() + 20s;
    while (!control.victim_lost() && Clock::now() < deadline) {
      int flag = 0;
      // Keep testing, as Duet's communication thread would.
      MPI_Testall(static_cast<int>(toward_victim.size()), toward_victim.data(), &flag,
                  MPI_STATUSES_IGNORE);
      std::this_thread::sleep_for(1ms);
    }
    if (!control.victim_lost()) {
      say("FAILED: no word of the victim's loss within 20 s (%s)", what);
      std::_Exit(1);
    }
  };
  int collective_rounds = 0;
  if (rank == kVictim) {
    if (options.phase == "idle") {
      std::this_thread::sleep_for(100ms);
      die();
    }
    if (options.phase == "kv-send") {
      int header = static_cast<int>(payload_bytes);
      MPI_Request requests[3];
      MPI_Isend(&header, 1, MPI_INT, kPrefill, kTagHeader, kv_comm, &requests[0]);
      MPI_Isend(out.data(), static_cast<int>(payload_bytes), MPI_CHAR, kPrefill, kTagPayload,
                kv_comm, &requests[1]);
      MPI_Irecv(in.data(), static_cast<int>(payload_bytes), MPI_CHAR, kPrefill, kTagPayload,
                kv_comm, &requests[2]);
      std::this_thread::sleep_for(5ms);  // the peer has matched: the rendezvous is under way
      die();
    }
    if (options.phase == "kv-recv") {
      int header = static_cast<int>(payload_bytes);
      MPI_Send(&header, 1, MPI_INT, kPrefill, kTagHeader, kv_comm);
      std::this_thread::sleep_for(50ms);
      die();
    }
    for (int i = 0; i < 20; ++i) all_reduce(tp_comm, Clock::now() + 5s);
    die();  // before the 21st, which rank 3 enters
  } else if (rank == kPrefill && options.phase == "kv-send") {
    int header = 0;
    toward_victim.assign(3, MPI_REQUEST_NULL);
    MPI_Irecv(&header, 1, MPI_INT, kVictim, kTagHeader, kv_comm, &toward_victim[0]);
    MPI_Irecv(in.data(), static_cast<int>(payload_bytes), MPI_CHAR, kVictim, kTagPayload, kv_comm,
              &toward_victim[1]);
    MPI_Isend(out.data(), static_cast<int>(payload_bytes), MPI_CHAR, kVictim, kTagPayload, kv_comm,
              &toward_victim[2]);
    wait_for_loss("kv-send");
  } else if (rank == kPrefill && options.phase == "kv-recv") {
    int header = 0;
    MPI_Recv(&header, 1, MPI_INT, kVictim, kTagHeader, kv_comm, MPI_STATUS_IGNORE);
    // The payload it announced: probed for, never there.
    const auto deadline = Clock::now() + 20s;
    MPI_Message message = MPI_MESSAGE_NULL;
    int flag = 0;
    while (!control.victim_lost() && Clock::now() < deadline) {
      MPI_Improbe(kVictim, kTagPayload, kv_comm, &flag, &message, MPI_STATUS_IGNORE);
      if (flag) break;
      std::this_thread::sleep_for(1ms);
    }
    if (flag) say("note: a payload from the victim was matched although it never sent one");
    wait_for_loss("kv-recv");
  } else if (rank == kLeader && options.phase == "collective") {
    while (!control.victim_lost()) {
      std::string error;
      if (!all_reduce(tp_comm, Clock::now() + std::chrono::milliseconds(options.lease_ms * 3),
                      &error)) {
        if (!error.empty()) say("note: the allreduce with the victim failed: %s", error.c_str());
        break;
      }
      ++collective_rounds;
    }
    wait_for_loss("collective");
  } else if (rank != kCoordinator) {
    wait_for_loss(options.phase.c_str());
  } else {
    wait_for_loss(options.phase.c_str());
  }
  const std::string left = fate(toward_victim);

  // After the loss: the survivors' traffic, as before it.
  const auto lost_at = Clock::now();
  const auto end = lost_at + std::chrono::duration<double>(options.after_seconds);
  int transfers = 0, reductions = 0;
  bool ok = true;
  std::string failure;
  if (rank == kPrefill || rank == kLeader) {
    const int peer = rank == kPrefill ? kLeader : kPrefill;
    // Both sides run the same number of rounds: the prefill rank decides,
    // by its own clock, and tells rank 3 after each round.
    int more = 1;
    while (ok && more) {
      ok = exchange_payloads(kv_comm, peer, out, in, Clock::now() + 5s);
      if (!ok) failure = "a KV transfer with a survivor did not finish";
      if (ok && in[0] != static_cast<char>(peer)) {
        ok = false;
        failure = "a KV payload from a survivor arrived wrong";
      }
      transfers += ok;
      if (ok && !all_reduce(survivors_comm, Clock::now() + 5s)) {
        ok = false;
        failure = "an allreduce among survivors did not finish";
      }
      reductions += ok;
      more = Clock::now() < end;
      if (ok) {
        MPI_Request request;
        if (rank == kPrefill)
          MPI_Isend(&more, 1, MPI_INT, peer, kTagDone, kv_comm, &request);
        else
          MPI_Irecv(&more, 1, MPI_INT, peer, kTagDone, kv_comm, &request);
        std::vector<MPI_Request> requests{request};
        ok = wait_until(requests, Clock::now() + 5s);
        if (!ok) failure = "a round's word between survivors did not arrive";
      }
    }
  } else {
    std::this_thread::sleep_until(end);
  }
  const int64_t heard_before =
      rank == kCoordinator ? control.heard_from(kPrefill) : control.heard_from(kCoordinator);
  std::this_thread::sleep_for(200ms);
  const int64_t heard_after =
      rank == kCoordinator ? control.heard_from(kPrefill) : control.heard_from(kCoordinator);
  if (ok && heard_after <= heard_before) {
    ok = false;
    failure = "heartbeats stopped";
  }

  // Say done to the coordinator, which waits for both (the world barrier
  // would wait on the victim forever).
  if (rank == kCoordinator) {
    const auto deadline = Clock::now() + 10s;
    while (control.done_count() < 2 && Clock::now() < deadline) std::this_thread::sleep_for(1ms);
    if (ok && control.done_count() != 2) {
      ok = false;
      failure = "a survivor's last word did not arrive";
    }
  } else {
    control.send_done();
    std::this_thread::sleep_for(50ms);
  }
  control.stop();

  if (!ok) {
    say("FAILED: after the loss (phase %s): %s (after %d transfers and %d allreduces)",
        options.phase.c_str(), failure.c_str(), transfers, reductions);
    std::_Exit(1);
  }
  char detail[160] = "";
  if (rank == kCoordinator) {
    std::snprintf(detail, sizeof detail, "; lease expired %lld ms after the last heartbeat",
                  static_cast<long long>(control.lost_after_ms()));
  } else if (rank == kLeader && options.phase == "collective") {
    std::snprintf(detail, sizeof detail, "; %d allreduces with the victim, the next never finished",
                  collective_rounds);
  }
  say("survived: phase %s; after the loss %d KV transfers and %d allreduces, heartbeats flowing; "
      "requests toward the victim: %s; control sends left toward it: %lld%s",
      options.phase.c_str(), transfers, reductions, left.c_str(),
      static_cast<long long>(control.sends_left_toward_victim()), detail);

  if (options.exit_mode == "skip") {
    say("exit: without MPI_Finalize");
    std::_Exit(0);
  }
  // MPI_Finalize under a watchdog: a hang is a finding, not a test timeout.
  std::thread([] {
    std::this_thread::sleep_for(10s);
    say("exit: MPI_Finalize hung (10 s); leaving without it");
    std::_Exit(3);
  }).detach();
  const int code = MPI_Finalize();
  say("exit: MPI_Finalize returned %s", code == MPI_SUCCESS ? "MPI_SUCCESS" : "an error");
  return 0;
}

#include "common/control_plane/control_channel.h"

#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <map>
#include <optional>
#include <utility>

#include "common/error.h"
#include "common/timer_slack.h"

namespace duet {
namespace {

// How long a channel stopped without close() keeps pushing out what it queued
// (and a closed one what its endpoints still have in flight).
constexpr std::chrono::milliseconds kStopFlush{200};
// Finished sends' buffers kept for buffer(): KV payloads, not headers.
constexpr size_t kMaxSpares = 64;
constexpr size_t kMinSpareBytes = 4096;

}  // namespace

ControlChannel::ControlChannel(ControlChannelOptions options, Rank rank, int world_size,
                               bool joined)
    : options_(options),
      rank_(rank),
      world_size_(world_size),
      joined_(joined),
      queue_(options.bulk_window_bytes) {
  DUET_REQUIRE(
      options_.min_idle_sleep.count() > 0 && options_.min_idle_sleep <= options_.max_idle_sleep,
      "control channel: need 0 < min_idle_sleep <= max_idle_sleep");
  DUET_REQUIRE(options_.max_receives_per_pass > 0,
               "control channel: max_receives_per_pass must be positive");
  // Every rank's address, and a joined member's own (its vectors reach it).
  const auto n = static_cast<size_t>(std::max(world_size_, rank_.value + 1));
  closed_by_.assign(n, false);
  forgotten_.assign(n, false);
  forgotten_seen_.assign(n, false);
  ended_.assign(n, false);
  // Always: rank 0 may admit members (TCP) beside MPI ranks later.
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw Error(ErrorKind::kInternal, "control channel: eventfd failed");
}

ControlChannel::ControlChannel(const MpiRuntime& mpi, ControlChannelOptions options)
    : ControlChannel(options, mpi.rank(), mpi.world_size(), false) {
  if (options_.transport == Transport::kTcp) {
    connect_tcp(mpi);
  } else {
    DUET_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
  }
  thread_ = std::thread([this] { run(); });
}

ControlChannel::ControlChannel(JoinedLink link, ControlChannelOptions options)
    : ControlChannel(options, link.self, 0, true) {
  DUET_REQUIRE(link.self.value > 0 && link.socket >= 0,
               "control channel: a joined member needs an address and a socket");
  DUET_REQUIRE(options_.transport == Transport::kTcp,
               "control channel: a joined member speaks TCP only");
  tcp_ = std::make_unique<TcpFrameLink>(std::map<int, int>{{kCoordinatorRank.value, link.socket}});
  thread_ = std::thread([this] { run(); });
}

void ControlChannel::admit(Rank member, int socket) {
  {
    // Both locks: the by-rank vectors grow, which the thread reads under
    // one or the other.
    std::lock_guard pass(pass_mutex_);
    std::lock_guard lock(mutex_);
    const bool fresh =
        member.value >= world_size_ && static_cast<size_t>(member.value) >= forgotten_.size();
    if (rank_ != kCoordinatorRank || joined_ || !fresh || closing_ || stop_) {
      ::close(socket);
      throw Error(
          ErrorKind::kInternal,
          format("control channel: cannot admit member {} (rank {}, {} addresses{})", member.value,
                 rank_.value, forgotten_.size(), closing_ || stop_ ? ", closing" : ""));
    }
    const auto n = static_cast<size_t>(member.value) + 1;
    closed_by_.resize(n, false);
    forgotten_.resize(n, false);
    forgotten_seen_.resize(n, false);
    ended_.resize(n, false);
    admitted_.emplace_back(member.value, socket);
    woken_ = true;
  }
  notify_thread();
}

ControlChannel::~ControlChannel() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  notify_thread();
  if (thread_.joinable()) thread_.join();
  // Receives from lost ranks never finish: their buffers stay MPI's, and the
  // communicator, which they still name, is not freed.
  if (abandoned_receives_.empty() && abandoned_sends_.empty() && comm_ != MPI_COMM_NULL)
    MPI_Comm_free(&comm_);
  for (Incoming& incoming : abandoned_receives_)
    static_cast<void>(new std::vector<std::byte>(std::move(incoming.bytes)));  // leaked
  for (Outgoing& outgoing : abandoned_sends_)
    static_cast<void>(new std::vector<std::byte>(std::move(outgoing.bytes)));  // leaked
  tcp_.reset();                                                                // closes the sockets
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void ControlChannel::send(Rank destination, const ControlMessage& message) {
  DUET_REQUIRE(destination.value >= 0 && destination != rank_,
               "control channel: cannot send to rank {} (this is rank {} of {})", destination.value,
               rank_.value, world_size_);
  DUET_REQUIRE(linked(destination.value),
               "control channel: over TCP rank {} talks to rank 0 only, not to rank {}",
               rank_.value, destination.value);
  Outgoing outgoing{comm_, destination.value, kMessageTag, SendLane::kControl,
                    encode_control_message(message)};
  DUET_REQUIRE(outgoing.bytes.size() <= static_cast<size_t>(INT_MAX),
               "control channel: a {}-byte {} message is over MPI's 2 GiB count limit",
               outgoing.bytes.size(), control_message_name(message));
  {
    std::lock_guard lock(mutex_);
    DUET_REQUIRE(static_cast<size_t>(destination.value) < forgotten_.size(),
                 "control channel: rank {} has no peer {} ({} addresses)", rank_.value,
                 destination.value, forgotten_.size());
    DUET_REQUIRE(!closing_ && !stop_, "control channel: send after close ({} to rank {})",
                 control_message_name(message), destination.value);
    queue_.push(std::move(outgoing));
    ++own_pending_;
    woken_ = true;
  }
  notify_thread();
}

void ControlChannel::post(const CommEndpoint& from, MPI_Comm comm, int destination, int tag,
                          std::vector<std::byte> bytes, SendLane lane) {
  DUET_REQUIRE(destination >= 0 && destination < world_size_,
               "control channel: cannot post to rank {} of {}", destination, world_size_);
  DUET_REQUIRE(bytes.size() <= static_cast<size_t>(INT_MAX),
               "control channel: a {}-byte message is over MPI's 2 GiB count limit", bytes.size());
  {
    std::lock_guard lock(mutex_);
    queue_.push(Outgoing{comm, destination, tag, lane, std::move(bytes), &from});
    woken_ = true;
  }
  notify_thread();
}

std::vector<std::byte> ControlChannel::buffer(size_t size) {
  std::vector<std::byte> bytes;
  {
    std::lock_guard lock(mutex_);
    if (!spares_.empty()) {
      bytes = std::move(spares_.back());
      spares_.pop_back();
    }
  }
  bytes.resize(size);
  return bytes;
}

std::optional<ReceivedMessage> ControlChannel::receive_until(
    std::chrono::steady_clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  if (left.count() <= 0) return std::nullopt;
  return receive(left);
}

std::optional<ReceivedMessage> ControlChannel::receive(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  inbox_ready_.wait_for(lock, timeout, [&] {
    return !inbox_.empty() || closed_ || stop_ || receive_interrupts_ > 0;
  });
  if (receive_interrupts_ > 0) --receive_interrupts_;
  if (inbox_.empty()) return std::nullopt;
  ReceivedMessage message = std::move(inbox_.front());
  inbox_.pop_front();
  return message;
}

void ControlChannel::set_intercept(Intercept intercept) {
  std::lock_guard pass(pass_mutex_);
  intercept_ = std::move(intercept);
}

void ControlChannel::set_link_lost_handler(LinkLost handler) {
  std::lock_guard pass(pass_mutex_);
  link_lost_ = std::move(handler);
}

void ControlChannel::forget(std::span<const Rank> ranks) {
  {
    std::lock_guard lock(mutex_);
    for (Rank rank : ranks) {
      if (rank.value < 0 || static_cast<size_t>(rank.value) >= forgotten_.size() || rank == rank_)
        continue;
      if (forgotten_[static_cast<size_t>(rank.value)]) continue;
      forgotten_[static_cast<size_t>(rank.value)] = true;
      forget_pending_ = true;
      woken_ = true;
    }
  }
  notify_thread();
  inbox_ready_.notify_all();
}

bool ControlChannel::forgot_any() const {
  std::lock_guard lock(mutex_);
  // Joined members are outside the MPI job: forgetting them is not a reason
  // to skip MPI_Finalize.
  const auto ranks_end =
      forgotten_.begin() + std::min<ptrdiff_t>(static_cast<ptrdiff_t>(forgotten_.size()),
                                               static_cast<ptrdiff_t>(world_size_));
  return link_lost_any_ || std::find(forgotten_.begin(), ranks_end, true) != ranks_end;
}

bool ControlChannel::receiving() const {
  std::lock_guard lock(mutex_);
  return !closed_ && !stop_;
}

bool ControlChannel::close(std::chrono::milliseconds timeout) {
  {
    std::unique_lock lock(mutex_);
    DUET_REQUIRE(!closing_, "control channel: close() called twice");
    closing_ = true;
    notify_thread();
    inbox_ready_.wait_for(lock, timeout, [&] { return closed_ || stop_; });
    if (closed_) {
      lock.unlock();
      thread_.join();
      return true;
    }
    stop_ = true;
  }
  notify_thread();
  thread_.join();
  inbox_ready_.notify_all();
  spdlog::warn("control channel: rank {} closed without every other rank within {} ms", rank_.value,
               timeout.count());
  return false;
}

void ControlChannel::attach(CommEndpoint& endpoint) {
  {
    std::lock_guard pass(pass_mutex_);
    endpoints_.push_back(&endpoint);
  }
  wake();
}

size_t ControlChannel::detach(CommEndpoint& endpoint, std::chrono::milliseconds flush) {
  {
    std::lock_guard pass(pass_mutex_);
    std::erase(endpoints_, &endpoint);
  }
  const auto from_endpoint = [&](const Outgoing& outgoing) { return outgoing.from == &endpoint; };
  {
    std::unique_lock lock(mutex_);
    taken_.wait_for(lock, flush,
                    [&] { return thread_done_ || queue_.count_if(from_endpoint) == 0; });
  }
  // With the pass lock held none of its messages is between the queue and
  // MPI_Isend: what is still queued is dropped whole, never posted later.
  std::lock_guard pass(pass_mutex_);
  std::lock_guard lock(mutex_);
  return queue_.erase_if(from_endpoint);
}

void ControlChannel::wake() {
  {
    std::lock_guard lock(mutex_);
    woken_ = true;
  }
  notify_thread();
}

ControlChannel::Counters ControlChannel::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

// ---------------------------------------------------------------- the communication thread

void ControlChannel::run() {
  set_thread_timer_slack();  // transfer_poll's pauses last what they say
  auto idle_sleep = options_.min_idle_sleep;
  std::vector<Outgoing> fresh;  // taken from the queue under the lock, posted outside it
  bool closed = false;
  try {
    while (true) {
      drain_wake_fd();  // before woken_ is read: a later wake-up stays pending
      std::unique_lock pass(pass_mutex_);
      bool stop = false;
      {
        std::lock_guard lock(mutex_);
        stop = stop_;
        woken_ = false;
        if (!admitted_.empty()) apply_admissions();
        if (forget_pending_) apply_forgotten();
        if (closing_ && !close_markers_queued_) queue_close_markers();
        queue_.take(fresh);
      }
      taken_.notify_all();
      if (stop) {
        // No agreement with the other ranks, but what was queued still
        // leaves (a refusal's last words): post it and let it go out briefly.
        post_sends(fresh);
        flush_for(kStopFlush);
        break;
      }
      bool active = post_sends(fresh);
      if (tcp_) {
        // Forgotten ranks' sockets close once what was queued for them
        // before forget() had its chance to leave.
        for (int rank : to_drop_) tcp_->drop(rank);
        active = active || !to_drop_.empty();
        to_drop_.clear();
      }
      active = test_sends() || active;
      if (comm_ != MPI_COMM_NULL) active = receive_some() || active;
      if (tcp_) active = receive_tcp() || active;
      bool transferring = n_endpoint_sends_in_flight_ > 0;
      for (CommEndpoint* endpoint : endpoints_) {
        active = endpoint->progress() || active;
        transferring = endpoint->in_flight() || transferring;
      }
      const bool sends_in_flight = !in_flight_.empty() || !incoming_.empty();
      // MPI operations that poll() cannot see: over TCP the thread still
      // polls for them on the idle back-off.
      const bool mpi_work = comm_ != MPI_COMM_NULL || !endpoints_.empty() || sends_in_flight ||
                            !abandoned_sends_.empty() || transferring;
      const bool tcp_writing = tcp_ && tcp_->writing();
      pass.unlock();

      std::unique_lock lock(mutex_);
      if (forget_pending_) apply_forgotten();
      if (close_markers_queued_ && own_pending_ == 0 && !tcp_writing && peers_settled()) {
        closed_ = true;
        closed = true;
        inbox_ready_.notify_all();
        break;
      }
      if (active) {
        idle_sleep = options_.min_idle_sleep;
        continue;
      }
      auto pause = sends_in_flight ? std::min(idle_sleep, options_.in_flight_poll) : idle_sleep;
      if (transferring) pause = std::min(pause, options_.transfer_poll);
      if (tcp_) {
        // Woken by the eventfd (send(), stop, close) or by the sockets.
        if (stop_ || woken_ || (closing_ && !close_markers_queued_)) continue;
        lock.unlock();
        tcp_->wait(wake_fd_, mpi_work ? std::optional(pause) : std::nullopt);
      } else {
        wake_.wait_for(lock, pause,
                       [&] { return stop_ || woken_ || (closing_ && !close_markers_queued_); });
      }
      if (mpi_work) idle_sleep = std::min(idle_sleep * 2, options_.max_idle_sleep);
    }
    // Closed: what the endpoints still have in flight gets a moment, as
    // after a stop.
    if (closed && !in_flight_.empty()) flush_for(kStopFlush);
  } catch (const std::exception& e) {
    // An MPI failure: nothing more can move on this channel. Wake everyone
    // waiting on it; close() then reports that the ranks did not agree.
    spdlog::error("control channel: rank {}: communication thread stopped: {}", rank_.value,
                  e.what());
    std::lock_guard lock(mutex_);
    stop_ = true;
    inbox_ready_.notify_all();
  }
  abandon_in_flight();
  {
    std::lock_guard lock(mutex_);
    thread_done_ = true;
  }
  taken_.notify_all();
}

// The close markers follow every message queued before close() began
// (send() refuses new ones), so a peer that has our marker has all of our
// messages: MPI does not let messages from one rank overtake.
void ControlChannel::queue_close_markers() {
  for (int r = 0; r < static_cast<int>(forgotten_.size()); ++r) {
    if (!linked(r) || forgotten_[static_cast<size_t>(r)]) continue;
    // A member that left has had rank 0's marker (answer_close).
    if (r >= world_size_ && !joined_ && closed_by_[static_cast<size_t>(r)]) continue;
    queue_.push(Outgoing{comm_, r, kCloseTag, SendLane::kControl, {}});
    ++own_pending_;
  }
  close_markers_queued_ = true;
}

// Under mutex_, on the communication thread: the channel's own messages to
// newly forgotten ranks stop counting as pending (queued ones are caught as
// they are posted), and receives from them that had begun are given up.
void ControlChannel::apply_forgotten() {
  forget_pending_ = false;
  std::erase_if(in_flight_, [&](Outgoing& outgoing) {
    if (!forgotten_[static_cast<size_t>(outgoing.destination)]) return false;
    abandon(outgoing);
    return true;
  });
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    if (forgotten_[static_cast<size_t>(it->source.value)]) {
      abandoned_receives_.push_back(std::move(*it));
      it = incoming_.erase(it);
    } else {
      ++it;
    }
  }
  for (int r = 0; r < static_cast<int>(forgotten_.size()); ++r) {
    if (!forgotten_[static_cast<size_t>(r)] || forgotten_seen_[static_cast<size_t>(r)]) continue;
    forgotten_seen_[static_cast<size_t>(r)] = true;
    if (tcp_) to_drop_.push_back(r);
    spdlog::warn("control channel: rank {} no longer waits on rank {}", rank_.value, r);
  }
}

bool ControlChannel::peers_settled() const {
  for (int r = 0; r < static_cast<int>(closed_by_.size()); ++r) {
    if (!linked(r)) continue;
    const auto i = static_cast<size_t>(r);
    if (!closed_by_[i] && !forgotten_[i] && !ended_[i]) return false;
  }
  return true;
}

// Under mutex_, on the communication thread: a send to a forgotten rank
// stops counting (own_pending_, the endpoints' sends in flight) and moves to
// abandoned_sends_, tested on each pass but waited on by nothing.
void ControlChannel::abandon(Outgoing& outgoing) {
  if (outgoing.request != MPI_REQUEST_NULL && outgoing.from != nullptr)
    --n_endpoint_sends_in_flight_;
  if (outgoing.from == nullptr) --own_pending_;
  ++counters_.abandoned_sends;
  counters_.abandoned_bytes += static_cast<int64_t>(outgoing.bytes.size());
  abandoned_sends_.push_back(std::move(outgoing));
}

bool ControlChannel::post_sends(std::vector<Outgoing>& fresh) {
  const bool any = !fresh.empty();
  int64_t n_messages = 0;
  if (tcp_) {
    // The channel's own messages onto the link, in queue order (a forgotten
    // rank's too: its socket closes after this pass); the endpoints' to a
    // forgotten rank are dropped, as over MPI.
    int64_t n_unsent = 0, n_own = 0;
    std::erase_if(fresh, [&](Outgoing& outgoing) {
      if (outgoing.from != nullptr || !over_tcp(outgoing.destination)) return false;
      ++n_own;
      if (tcp_->queue(outgoing.destination, static_cast<uint32_t>(outgoing.tag), outgoing.bytes)) {
        if (outgoing.tag == kMessageTag) ++n_messages;
      } else {
        ++n_unsent;
      }
      return true;
    });
    std::lock_guard lock(mutex_);
    own_pending_ -= n_own;
    counters_.sent += n_messages;
    counters_.unsent += n_unsent;
    n_messages = 0;
  }
  {
    // To a forgotten rank: the channel's own messages (a RanksLost to a
    // stalled rank) still leave, unwaited; the endpoints' (KV) are dropped.
    std::lock_guard lock(mutex_);
    std::erase_if(fresh, [&](Outgoing& outgoing) {
      if (!forgotten_[static_cast<size_t>(outgoing.destination)]) return false;
      if (outgoing.from == nullptr) {
        MPI_Isend(outgoing.bytes.data(), static_cast<int>(outgoing.bytes.size()), MPI_BYTE,
                  outgoing.destination, outgoing.tag, outgoing.comm, &outgoing.request);
        abandon(outgoing);
      }
      return true;
    });
  }
  for (Outgoing& outgoing : fresh) {
    in_flight_.push_back(std::move(outgoing));
    Outgoing& posted = in_flight_.back();
    // The buffer stays put: moving an Outgoing moves the vector's heap block,
    // never the bytes, and in_flight_ holds it until MPI_Test says done.
    DUET_MPI_CHECK(MPI_Isend(posted.bytes.data(), static_cast<int>(posted.bytes.size()), MPI_BYTE,
                             posted.destination, posted.tag, posted.comm, &posted.request));
    if (posted.from != nullptr) ++n_endpoint_sends_in_flight_;
    if (posted.from == nullptr && posted.tag == kMessageTag) ++n_messages;
  }
  if (n_messages > 0) {
    std::lock_guard lock(mutex_);
    counters_.sent += n_messages;
  }
  fresh.clear();
  return any;
}

void ControlChannel::flush_for(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while ((!in_flight_.empty() || (tcp_ && tcp_->writing())) &&
         std::chrono::steady_clock::now() < deadline) {
    test_sends();
    // A peer's rendezvous send to us may be what holds ours up.
    if (comm_ != MPI_COMM_NULL) receive_some();
    if (tcp_) {
      receive_tcp();  // writes what the sockets take
      tcp_->wait(-1, options_.in_flight_poll);
    } else {
      std::this_thread::sleep_for(options_.in_flight_poll);
    }
  }
}

bool ControlChannel::test_sends() {
  // Sends to lost ranks: freed if they ever finish (a stalled rank woke);
  // an error on one is expected and ends it.
  int64_t freed = 0;
  std::erase_if(abandoned_sends_, [&](Outgoing& outgoing) {
    int finished = 0;
    const bool over =
        MPI_Test(&outgoing.request, &finished, MPI_STATUS_IGNORE) != MPI_SUCCESS || finished != 0;
    if (over) freed += static_cast<int64_t>(outgoing.bytes.size());
    return over;
  });
  if (freed > 0) {
    std::lock_guard lock(mutex_);
    counters_.abandoned_bytes -= freed;
  }
  std::vector<Outgoing> done;
  std::erase_if(in_flight_, [&](Outgoing& outgoing) {
    int finished = 0;
    DUET_MPI_CHECK(MPI_Test(&outgoing.request, &finished, MPI_STATUS_IGNORE));
    if (finished) done.push_back(std::move(outgoing));
    return finished != 0;
  });
  if (done.empty()) return false;
  std::lock_guard lock(mutex_);
  for (Outgoing& outgoing : done) {
    if (outgoing.lane == SendLane::kBulk) queue_.sent(outgoing.destination, outgoing.bytes.size());
    if (outgoing.from == nullptr) {
      --own_pending_;
      continue;
    }
    --n_endpoint_sends_in_flight_;
    if (spares_.size() < kMaxSpares && outgoing.bytes.capacity() >= kMinSpareBytes)
      spares_.push_back(std::move(outgoing.bytes));
  }
  return true;
}

bool ControlChannel::receive_some() {
  const bool started = start_receives();
  return finish_receives() || started;
}

bool ControlChannel::start_receives() {
  int n = 0;
  for (; n < options_.max_receives_per_pass; ++n) {
    int flag = 0;
    MPI_Message message = MPI_MESSAGE_NULL;
    MPI_Status status;
    DUET_MPI_CHECK(MPI_Improbe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &message, &status));
    if (!flag) break;
    int count = 0;
    DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
    incoming_.push_back(Incoming{Rank{status.MPI_SOURCE}, status.MPI_TAG,
                                 std::vector<std::byte>(static_cast<size_t>(count))});
    Incoming& incoming = incoming_.back();
    DUET_MPI_CHECK(MPI_Imrecv(incoming.bytes.data(), count, MPI_BYTE, &message, &incoming.request));
  }
  return n > 0;
}

bool ControlChannel::finish_receives() {
  if (incoming_.empty()) return false;
  std::vector<ReceivedMessage> received;
  int64_t malformed = 0;
  bool any = false;
  // A source whose oldest receive is unfinished delivers nothing after it.
  std::vector<bool> held(static_cast<size_t>(world_size_), false);
  for (auto it = incoming_.begin(); it != incoming_.end();) {
    const auto source = static_cast<size_t>(it->source.value);
    int done = 0;
    if (!held[source]) DUET_MPI_CHECK(MPI_Test(&it->request, &done, MPI_STATUS_IGNORE));
    if (!done) {
      held[source] = true;
      ++it;
      continue;
    }
    any = true;
    Incoming incoming = std::move(*it);
    it = incoming_.erase(it);
    if (incoming.tag == kCloseTag) {
      closed_by_[source] = true;
      continue;
    }
    try {
      ReceivedMessage message{incoming.source, decode_control_message(incoming.bytes),
                              std::chrono::steady_clock::now()};
      if (intercept_ && intercept_(message)) continue;
      received.push_back(std::move(message));
    } catch (const Error& e) {
      ++malformed;
      spdlog::error("control channel: rank {}: dropped a message from rank {}: {}", rank_.value,
                    incoming.source.value, e.what());
    }
  }
  if (!received.empty() || malformed > 0) {
    std::lock_guard lock(mutex_);
    counters_.received += static_cast<int64_t>(received.size());
    counters_.malformed += malformed;
    for (ReceivedMessage& message : received) inbox_.push_back(std::move(message));
  }
  if (!received.empty()) inbox_ready_.notify_all();
  return any;
}

void ControlChannel::abandon_in_flight() {
  // After a failed close or an error. A send MPI has not finished cannot be
  // taken back safely (a matched send cannot be cancelled), so its request is
  // released and its buffer deliberately leaked: MPI may still read it.
  size_t leaked = 0;
  for (Outgoing& outgoing : in_flight_) {
    int done = 0;
    if (MPI_Test(&outgoing.request, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) continue;
    MPI_Request_free(&outgoing.request);
    static_cast<void>(new std::vector<std::byte>(std::move(outgoing.bytes)));  // leaked
    ++leaked;
  }
  in_flight_.clear();
  if (leaked > 0) {
    spdlog::warn("control channel: rank {}: abandoned {} unfinished send(s)", rank_.value, leaked);
  }
}

}  // namespace duet

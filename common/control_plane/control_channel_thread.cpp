// The control channel's communication thread (common/control_plane/control_channel.h):
// its passes (take from the queue, post, test, receive, drive the endpoints,
// sleep), the closing agreement, forgetting lost ranks, and what it does with
// MPI's requests. The channel's surface, which other threads call, is in
// control_channel.cpp; the TCP link's parts in control_channel_tcp.cpp.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>

#include "common/control_plane/control_channel.h"
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

#include "common/mpi/control_channel.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <climits>
#include <utility>

#include "common/error.h"

namespace duet {
namespace {

// Tags on the channel's own communicator.
constexpr int kMessageTag = 1;  // one encoded ControlMessage
constexpr int kCloseTag = 2;    // empty: the sender has closed; nothing follows it

// How long a channel stopped without close() keeps pushing out what it queued.
constexpr std::chrono::milliseconds kStopFlush{200};

}  // namespace

ControlChannel::ControlChannel(const MpiRuntime& mpi, ControlChannelOptions options)
    : options_(options), rank_(mpi.rank()), world_size_(mpi.world_size()) {
  DUET_REQUIRE(
      options_.min_idle_sleep.count() > 0 && options_.min_idle_sleep <= options_.max_idle_sleep,
      "control channel: need 0 < min_idle_sleep <= max_idle_sleep");
  DUET_REQUIRE(options_.max_receives_per_pass > 0,
               "control channel: max_receives_per_pass must be positive");
  DUET_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
  closed_by_.assign(static_cast<size_t>(world_size_), false);
  thread_ = std::thread([this] { run(); });
}

ControlChannel::~ControlChannel() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void ControlChannel::send(Rank destination, const ControlMessage& message) {
  DUET_REQUIRE(destination.value >= 0 && destination.value < world_size_ && destination != rank_,
               "control channel: cannot send to rank {} (this is rank {} of {})", destination.value,
               rank_.value, world_size_);
  Outgoing outgoing{destination, kMessageTag, encode_control_message(message)};
  DUET_REQUIRE(outgoing.bytes.size() <= static_cast<size_t>(INT_MAX),
               "control channel: a {}-byte {} message is over MPI's 2 GiB count limit",
               outgoing.bytes.size(), control_message_name(message));
  {
    std::lock_guard lock(mutex_);
    DUET_REQUIRE(!closing_ && !stop_, "control channel: send after close ({} to rank {})",
                 control_message_name(message), destination.value);
    outbox_.push_back(std::move(outgoing));
  }
  wake_.notify_one();
}

std::optional<ReceivedMessage> ControlChannel::receive(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  inbox_ready_.wait_for(lock, timeout, [&] { return !inbox_.empty() || closed_ || stop_; });
  if (inbox_.empty()) return std::nullopt;
  ReceivedMessage message = std::move(inbox_.front());
  inbox_.pop_front();
  return message;
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
    wake_.notify_one();
    inbox_ready_.wait_for(lock, timeout, [&] { return closed_ || stop_; });
    if (closed_) {
      lock.unlock();
      thread_.join();
      return true;
    }
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
  inbox_ready_.notify_all();
  spdlog::warn("control channel: rank {} closed without every other rank within {} ms", rank_.value,
               timeout.count());
  return false;
}

void ControlChannel::attach(CommEndpoint& endpoint) {
  {
    std::lock_guard lock(endpoints_mutex_);
    endpoints_.push_back(&endpoint);
  }
  wake();
}

void ControlChannel::detach(CommEndpoint& endpoint) {
  std::lock_guard lock(endpoints_mutex_);
  std::erase(endpoints_, &endpoint);
}

void ControlChannel::wake() {
  {
    std::lock_guard lock(mutex_);
    woken_ = true;
  }
  wake_.notify_one();
}

ControlChannel::Counters ControlChannel::counters() const {
  std::lock_guard lock(mutex_);
  return counters_;
}

// ---------------------------------------------------------------- the communication thread

void ControlChannel::run() {
  auto idle_sleep = options_.min_idle_sleep;
  std::deque<Outgoing> fresh;  // taken from outbox_ under the lock, posted outside it
  try {
    while (true) {
      bool closing = false;
      bool stop = false;
      {
        std::lock_guard lock(mutex_);
        fresh.swap(outbox_);
        closing = closing_;
        stop = stop_;
        woken_ = false;
      }
      if (stop) {
        // No agreement with the other ranks, but what was queued still
        // leaves (a refusal's last words): post it and let it go out briefly.
        post_sends(fresh);
        flush_for(kStopFlush);
        break;
      }
      bool active = post_sends(fresh);
      // The close markers follow every message queued before close() began
      // (send() refuses new ones), so a peer that has our marker has all of
      // our messages: MPI does not let messages from one rank overtake.
      if (closing && !close_markers_sent_) {
        for (int r = 0; r < world_size_; ++r) {
          if (r != rank_.value) fresh.push_back(Outgoing{Rank{r}, kCloseTag, {}});
        }
        post_sends(fresh);
        close_markers_sent_ = true;
        active = true;
      }
      active = test_sends() || active;
      active = receive_some() || active;
      bool transferring = false;
      {
        std::lock_guard lock(endpoints_mutex_);
        for (CommEndpoint* endpoint : endpoints_) {
          active = endpoint->progress() || active;
          transferring = transferring || endpoint->in_flight();
        }
      }

      if (close_markers_sent_ && in_flight_.empty() && n_closed_peers_ == world_size_ - 1) {
        std::lock_guard lock(mutex_);
        closed_ = true;
        inbox_ready_.notify_all();
        break;
      }
      if (active) {
        idle_sleep = options_.min_idle_sleep;
        continue;
      }
      auto pause = in_flight_.empty() ? idle_sleep : std::min(idle_sleep, options_.in_flight_poll);
      if (transferring) pause = std::min(pause, options_.transfer_poll);
      {
        std::unique_lock lock(mutex_);
        wake_.wait_for(lock, pause, [&] {
          return !outbox_.empty() || stop_ || woken_ || (closing_ && !close_markers_sent_);
        });
      }
      idle_sleep = std::min(idle_sleep * 2, options_.max_idle_sleep);
    }
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
}

bool ControlChannel::post_sends(std::deque<Outgoing>& fresh) {
  const bool any = !fresh.empty();
  for (Outgoing& outgoing : fresh) {
    in_flight_.push_back(std::move(outgoing));
    Outgoing& posted = in_flight_.back();
    // The buffer stays put: moving an Outgoing moves the vector's heap block,
    // never the bytes, and in_flight_ holds it until MPI_Test says done.
    DUET_MPI_CHECK(MPI_Isend(posted.bytes.data(), static_cast<int>(posted.bytes.size()), MPI_BYTE,
                             posted.destination.value, posted.tag, comm_, &posted.request));
  }
  if (any) {
    int64_t n_messages = 0;
    for (const Outgoing& outgoing : fresh) n_messages += outgoing.tag == kMessageTag ? 1 : 0;
    std::lock_guard lock(mutex_);
    counters_.sent += n_messages;
  }
  fresh.clear();
  return any;
}

void ControlChannel::flush_for(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (!in_flight_.empty() && std::chrono::steady_clock::now() < deadline) {
    test_sends();
    receive_some();  // a peer's rendezvous send to us may be what holds ours up
    std::this_thread::sleep_for(options_.in_flight_poll);
  }
}

bool ControlChannel::test_sends() {
  const size_t before = in_flight_.size();
  std::erase_if(in_flight_, [&](Outgoing& outgoing) {
    int done = 0;
    DUET_MPI_CHECK(MPI_Test(&outgoing.request, &done, MPI_STATUS_IGNORE));
    return done != 0;
  });
  return in_flight_.size() != before;
}

bool ControlChannel::receive_some() {
  int n = 0;
  std::vector<ReceivedMessage> received;
  int64_t malformed = 0;
  for (; n < options_.max_receives_per_pass; ++n) {
    int flag = 0;
    MPI_Status status;
    DUET_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_, &flag, &status));
    if (!flag) break;
    int count = 0;
    DUET_MPI_CHECK(MPI_Get_count(&status, MPI_BYTE, &count));
    // Only this thread receives on comm_, so the probed message is the one
    // this receive matches (the first from that source with that tag).
    std::vector<std::byte> bytes(static_cast<size_t>(count));
    DUET_MPI_CHECK(MPI_Recv(bytes.data(), count, MPI_BYTE, status.MPI_SOURCE, status.MPI_TAG, comm_,
                            MPI_STATUS_IGNORE));
    const Rank source{status.MPI_SOURCE};
    if (status.MPI_TAG == kCloseTag) {
      if (!closed_by_[static_cast<size_t>(source.value)]) {
        closed_by_[static_cast<size_t>(source.value)] = true;
        ++n_closed_peers_;
      }
      continue;
    }
    try {
      received.push_back(ReceivedMessage{source, decode_control_message(bytes)});
    } catch (const Error& e) {
      ++malformed;
      spdlog::error("control channel: rank {}: dropped a message from rank {}: {}", rank_.value,
                    source.value, e.what());
    }
  }
  if (!received.empty() || malformed > 0) {
    std::lock_guard lock(mutex_);
    counters_.received += static_cast<int64_t>(received.size());
    counters_.malformed += malformed;
    for (ReceivedMessage& message : received) inbox_.push_back(std::move(message));
  }
  if (!received.empty()) inbox_ready_.notify_all();
  return n > 0;
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

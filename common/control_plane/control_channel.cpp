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

namespace duet {

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
    const size_t skipped = closed_by_.size();
    closed_by_.resize(n, false);
    forgotten_.resize(n, false);
    forgotten_seen_.resize(n, false);
    ended_.resize(n, false);
    // The addresses passed over (an earlier member's followers, which reach
    // rank 0 through their leader) have no link: nothing to close there.
    for (size_t r = skipped; r + 1 < n; ++r) closed_by_[r] = ended_[r] = true;
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

}  // namespace duet

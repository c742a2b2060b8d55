// The control channel's TCP link (common/control_plane/control_channel.h,
// Transport::kTcp): its start-up in the constructor, the communication
// thread's wake-up eventfd, the receive side of each pass, and joined
// members admitted at runtime. The rest of the channel is in
// control_channel.cpp (its surface) and control_channel_thread.cpp (the
// communication thread).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/control_plane/control_channel.h"
#include "common/error.h"
#include "common/format.h"
#include "common/net/tcp_connect.h"

namespace duet {
namespace {

// The control connections' hello (connect_tcp_peers): every rank dials rank 0.
constexpr TcpPurpose kControlPurpose{0x4843'4344, "control channel"};  // "DCCH"

// Throws on every rank alike unless every rank's `failure` is empty.
void agree_connected(const MpiRuntime& mpi, const std::string& failure) {
  const std::byte ready{static_cast<unsigned char>(failure.empty() ? 1 : 0)};
  const std::vector<std::byte> all = mpi.all_gather(std::span(&ready, 1));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] == std::byte{1}) continue;
    throw Error(ErrorKind::kInternal,
                failure.empty() ? format("control channel: rank {} could not connect over TCP", r)
                                : failure);
  }
}

}  // namespace

void ControlChannel::connect_tcp(const MpiRuntime& mpi) {
  std::optional<TcpListener> listener;
  std::string failure;
  if (rank_ == kCoordinatorRank) {
    try {
      listener.emplace();
    } catch (const std::exception& e) {
      failure = format("control channel: rank 0: {}", e.what());
    }
  }
  agree_connected(mpi, failure);
  // Rank 0's address to every rank (the others' records are empty).
  const TcpAddress own = listener ? listener->address() : TcpAddress{};
  const std::vector<std::byte> all = mpi.all_gather(own.encode());
  const TcpAddress coordinator = TcpAddress::decode(std::span(all).first(TcpAddress::kRecordBytes));
  std::vector<TcpPeer> peers;
  if (rank_ == kCoordinatorRank) {
    for (int r = 1; r < world_size_; ++r) peers.push_back({r, {}, false, false});
  } else {
    // Its addresses other than loopback first: a rank on rank 0's host
    // reaches them too.
    peers.push_back({kCoordinatorRank.value, coordinator, false, true});
  }
  std::map<int, int> sockets;
  try {
    sockets =
        connect_tcp_peers(rank_.value, listener ? &*listener : nullptr, peers, kControlPurpose,
                          std::chrono::steady_clock::now() + options_.connect_timeout);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  agree_connected(mpi, failure);
  tcp_ = std::make_unique<TcpFrameLink>(std::move(sockets));
}

bool ControlChannel::linked(int rank) const {
  if (rank == rank_.value) return false;
  if (joined_) return rank == kCoordinatorRank.value;
  if (rank >= world_size_) return rank_ == kCoordinatorRank;  // a member: rank 0's peer only
  if (options_.transport == Transport::kMpi) return true;
  return rank_ == kCoordinatorRank || rank == kCoordinatorRank.value;
}

bool ControlChannel::over_tcp(int rank) const {
  return joined_ || rank >= world_size_ || options_.transport == Transport::kTcp;
}

void ControlChannel::apply_admissions() {
  for (const auto& [member, socket] : admitted_) {
    if (tcp_) {
      tcp_->add(member, socket);
    } else {
      tcp_ = std::make_unique<TcpFrameLink>(std::map<int, int>{{member, socket}});
    }
    spdlog::info("control channel: rank {} admitted member {}", rank_.value, member);
  }
  admitted_.clear();
}

void ControlChannel::answer_close(int member) {
  // The member leaves: it waits for this marker (or the connection's end),
  // then nothing more comes from it or goes to it.
  tcp_->queue(member, kCloseTag, {});
  tcp_->drop(member);
}

void ControlChannel::notify_thread() {
  wake_.notify_one();
  if (wake_fd_ >= 0) {
    const uint64_t one = 1;
    static_cast<void>(write(wake_fd_, &one, sizeof one));
  }
}

void ControlChannel::drain_wake_fd() {
  uint64_t count = 0;
  static_cast<void>(read(wake_fd_, &count, sizeof count));
}

bool ControlChannel::receive_tcp() {
  std::vector<TcpFrameLink::Frame> frames;
  std::vector<TcpFrameLink::Ended> ended;
  const bool moved = tcp_->pump(frames, ended);
  std::vector<ReceivedMessage> received;
  int64_t malformed = 0;
  for (TcpFrameLink::Frame& frame : frames) {
    if (frame.tag == kCloseTag) {
      closed_by_[static_cast<size_t>(frame.peer)] = true;
      if (frame.peer >= world_size_ && !joined_) answer_close(frame.peer);
      continue;
    }
    try {
      ReceivedMessage message{Rank{frame.peer}, decode_control_message(frame.body),
                              std::chrono::steady_clock::now()};
      if (intercept_ && intercept_(message)) continue;
      received.push_back(std::move(message));
    } catch (const Error& e) {
      ++malformed;
      spdlog::error("control channel: rank {}: dropped a message from rank {}: {}", rank_.value,
                    frame.peer, e.what());
    }
  }
  // Connections that ended before their close marker, of ranks not
  // forgotten: lost peers.
  std::vector<TcpFrameLink::Ended> lost;
  {
    std::lock_guard lock(mutex_);
    counters_.received += static_cast<int64_t>(received.size());
    counters_.malformed += malformed;
    for (ReceivedMessage& message : received) inbox_.push_back(std::move(message));
    for (TcpFrameLink::Ended& end : ended) {
      const auto r = static_cast<size_t>(end.peer);
      ended_[r] = true;
      if (closed_by_[r] || forgotten_[r]) continue;
      if (end.peer < world_size_) link_lost_any_ = true;  // a member is no MPI rank
      ++counters_.links_lost;
      lost.push_back(std::move(end));
    }
  }
  for (const TcpFrameLink::Ended& end : lost) {
    spdlog::warn(
        "control channel: rank {} lost its connection to rank {} ({}); it waits on it "
        "no more",
        rank_.value, end.peer, end.why);
    if (link_lost_) link_lost_(Rank{end.peer}, end.why);
  }
  // Only a handler's owner expects a receive() to return early; the waits
  // of the start-up (handshake, readiness) keep their deadlines.
  if (!lost.empty() && link_lost_) {
    std::lock_guard lock(mutex_);
    ++receive_interrupts_;
  }
  if (!received.empty() || !lost.empty()) inbox_ready_.notify_all();
  return moved;
}

}  // namespace duet

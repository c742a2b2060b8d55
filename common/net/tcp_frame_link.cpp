#include "common/net/tcp_frame_link.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "common/error.h"
#include "common/format.h"

namespace duet {
namespace {

// Bytes read from one peer in one pump(), so that one busy peer cannot keep
// the thread from the others.
constexpr size_t kReadPerPump = size_t{1} << 20;
constexpr size_t kReadChunk = size_t{64} << 10;
// Written bytes at the front of a peer's queue are cut off past this much.
constexpr size_t kCompactBytes = size_t{1} << 20;

void put_u32(std::byte* at, uint32_t value) {
  for (int i = 0; i < 4; ++i) at[i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
}

uint32_t get_u32(const std::byte* at) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) value |= static_cast<uint32_t>(at[i]) << (8 * i);
  return value;
}

}  // namespace

TcpFrameLink::TcpFrameLink(std::map<int, int> sockets, size_t max_frame_bytes)
    : max_frame_bytes_(max_frame_bytes) {
  for (const auto& [peer, fd] : sockets) {
    DUET_ASSERT(fd >= 0, "a socket for peer {}", peer);
    peers_[peer].fd = fd;
  }
}

void TcpFrameLink::add(int peer, int socket) {
  DUET_ASSERT(socket >= 0 && !peers_.contains(peer), "a socket for new peer {}", peer);
  peers_[peer].fd = socket;
}

TcpFrameLink::~TcpFrameLink() {
  for (auto& [peer, p] : peers_) {
    if (p.fd >= 0) close(p.fd);
  }
}

bool TcpFrameLink::connected(int peer) const {
  const auto it = peers_.find(peer);
  return it != peers_.end() && it->second.fd >= 0;
}

bool TcpFrameLink::queue(int peer, uint32_t tag, std::span<const std::byte> body) {
  const auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.fd < 0) return false;
  DUET_ASSERT(body.size() <= max_frame_bytes_, "a {}-byte frame (limit {})", body.size(),
              max_frame_bytes_);
  std::vector<std::byte>& out = it->second.out;
  const size_t at = out.size();
  out.resize(at + kHeaderBytes + body.size());
  put_u32(out.data() + at, static_cast<uint32_t>(body.size()));
  put_u32(out.data() + at + 4, tag);
  if (!body.empty()) std::memcpy(out.data() + at + kHeaderBytes, body.data(), body.size());
  return true;
}

bool TcpFrameLink::writing() const {
  return std::any_of(peers_.begin(), peers_.end(), [](const auto& entry) {
    return entry.second.fd >= 0 && entry.second.out_sent < entry.second.out.size();
  });
}

bool TcpFrameLink::pump(std::vector<Frame>& frames, std::vector<Ended>& ended) {
  bool moved = false;
  std::vector<pollfd> fds;
  std::vector<int> ranks;
  for (auto& [peer, p] : peers_) {
    if (p.fd < 0) continue;
    if (p.out_sent < p.out.size() && !write_some(peer, p, ended, moved)) continue;
    fds.push_back({p.fd, POLLIN, 0});
    ranks.push_back(peer);
  }
  if (fds.empty()) return moved;
  if (poll(fds.data(), fds.size(), 0) <= 0) return moved;
  for (size_t i = 0; i < fds.size(); ++i) {
    if (fds[i].revents == 0) continue;
    Peer& p = peers_[ranks[i]];
    if (p.fd >= 0) read_some(ranks[i], p, frames, ended, moved);
  }
  return moved;
}

bool TcpFrameLink::write_some(int peer, Peer& p, std::vector<Ended>& ended, bool& moved) {
  while (p.out_sent < p.out.size()) {
    const ssize_t n =
        send(p.fd, p.out.data() + p.out_sent, p.out.size() - p.out_sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      end(peer, p, strerror(errno), ended);
      moved = true;
      return false;
    }
    p.out_sent += static_cast<size_t>(n);
    moved = true;
  }
  if (p.out_sent == p.out.size()) {
    p.out.clear();
    p.out_sent = 0;
  } else if (p.out_sent >= kCompactBytes) {
    p.out.erase(p.out.begin(), p.out.begin() + static_cast<std::ptrdiff_t>(p.out_sent));
    p.out_sent = 0;
  }
  return true;
}

bool TcpFrameLink::read_some(int peer, Peer& p, std::vector<Frame>& frames,
                             std::vector<Ended>& ended, bool& moved) {
  size_t read = 0;
  while (read < kReadPerPump) {
    if (p.in.size() - p.in_used < kReadChunk) p.in.resize(p.in_used + kReadChunk);
    const ssize_t n = recv(p.fd, p.in.data() + p.in_used, p.in.size() - p.in_used, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) {
      end(peer, p, n == 0 ? "closed the connection" : strerror(errno), ended);
      moved = true;
      return false;
    }
    moved = true;
    p.in_used += static_cast<size_t>(n);
    read += static_cast<size_t>(n);
    // Every whole frame out, the rest moved to the front.
    size_t at = 0;
    while (p.in_used - at >= kHeaderBytes) {
      const size_t length = get_u32(p.in.data() + at);
      if (length > max_frame_bytes_) {
        end(peer, p, format("sent a {}-byte frame (limit {})", length, max_frame_bytes_), ended);
        return false;
      }
      if (p.in_used - at - kHeaderBytes < length) {
        // Room for the rest of this frame, so that it comes in few reads.
        if (p.in.size() < at + kHeaderBytes + length) p.in.resize(at + kHeaderBytes + length);
        break;
      }
      const std::byte* body = p.in.data() + at + kHeaderBytes;
      frames.push_back(
          Frame{peer, get_u32(p.in.data() + at + 4), std::vector<std::byte>(body, body + length)});
      at += kHeaderBytes + length;
    }
    if (at > 0) {
      std::memmove(p.in.data(), p.in.data() + at, p.in_used - at);
      p.in_used -= at;
    }
  }
  return true;
}

void TcpFrameLink::Peer::close_socket() {
  close(fd);
  fd = -1;
  out = {};
  out_sent = 0;
  in = {};
  in_used = 0;
}

void TcpFrameLink::end(int peer, Peer& p, std::string why, std::vector<Ended>& ended) {
  p.close_socket();
  ended.push_back(Ended{peer, std::move(why)});
}

void TcpFrameLink::wait(int wake_fd, std::optional<std::chrono::microseconds> timeout) const {
  std::vector<pollfd> fds;
  if (wake_fd >= 0) fds.push_back({wake_fd, POLLIN, 0});
  for (const auto& [peer, p] : peers_) {
    if (p.fd < 0) continue;
    const bool pending = p.out_sent < p.out.size();
    fds.push_back({p.fd, static_cast<short>(POLLIN | (pending ? POLLOUT : 0)), 0});
  }
  timespec limit{};
  if (timeout) {
    const auto us = std::max<int64_t>(timeout->count(), 0);
    limit.tv_sec = static_cast<time_t>(us / 1'000'000);
    limit.tv_nsec = static_cast<long>((us % 1'000'000) * 1000);
  }
  ppoll(fds.data(), fds.size(), timeout ? &limit : nullptr, nullptr);
}

void TcpFrameLink::drop(int peer) {
  const auto it = peers_.find(peer);
  if (it == peers_.end() || it->second.fd < 0) return;
  Peer& p = it->second;
  // Unread bytes at close() would make it a reset, which may throw away
  // what the peer has not read yet: read them away first.
  std::byte sink[4096];
  while (recv(p.fd, sink, sizeof sink, MSG_DONTWAIT) > 0) {
  }
  if (p.out_sent < p.out.size()) {
    static_cast<void>(send(p.fd, p.out.data() + p.out_sent, p.out.size() - p.out_sent,
                           MSG_NOSIGNAL | MSG_DONTWAIT));
  }
  shutdown(p.fd, SHUT_WR);
  p.close_socket();
}

}  // namespace duet

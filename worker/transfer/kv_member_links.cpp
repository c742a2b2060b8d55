#include "worker/transfer/kv_member_links.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "common/error.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

std::array<std::byte, 4> rank_bytes(int rank) {
  std::array<std::byte, 4> bytes;
  const auto value = static_cast<uint32_t>(rank);
  for (size_t i = 0; i < 4; ++i) bytes[i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
  return bytes;
}

int rank_of(std::span<const std::byte> hello) {
  DUET_REQUIRE(hello.size() == 4, "a KV link's hello of {} bytes, not 4", hello.size());
  uint32_t value = 0;
  for (size_t i = 0; i < 4; ++i) value |= static_cast<uint32_t>(hello[i]) << (8 * i);
  const auto rank = static_cast<int32_t>(value);
  DUET_REQUIRE(rank > 0, "a KV link from rank {}", rank);
  return rank;
}

}  // namespace

KvLinkListener::KvLinkListener(ClusterKey key) : key_(std::move(key)) {
  stop_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  DUET_REQUIRE(stop_fd_ >= 0, "kv link listener: eventfd: {}", std::strerror(errno));
}

KvLinkListener::~KvLinkListener() {
  const uint64_t one = 1;
  static_cast<void>(write(stop_fd_, &one, sizeof one));
  if (thread_.joinable()) thread_.join();
  close(stop_fd_);
}

KvLinkAddress KvLinkListener::address(int rank, std::string host) const {
  const TcpAddress own = listener_.address();
  return {rank, std::move(host), own.port, own.ipv4};
}

void KvLinkListener::start(OnLink on_link) {
  DUET_ASSERT(!thread_.joinable(), "a KV link listener starts once");
  on_link_ = std::move(on_link);
  thread_ = std::thread([this] { run(); });
}

void KvLinkListener::run() {
  for (;;) {
    pollfd fds[2] = {{listener_.fd(), POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int socket = accept4(listener_.fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (socket < 0) continue;
    handle(socket);
    close(socket);  // the transfer holds a duplicate of an accepted link
  }
}

void KvLinkListener::handle(int fd) {
  int rank = -1;
  try {
    authenticate_listener(
        fd, key_, kKvLinkPurpose,
        [&](std::span<const std::byte> hello) {
          rank = rank_of(hello);
          // Into the transfer before the answer leaves (see start()).
          const int link = dup(fd);
          DUET_REQUIRE(link >= 0, "dup: {}", std::strerror(errno));
          on_link_(rank, link);
          return AuthAnswer{true, {}, {}};
        },
        Clock::now() + kKvLinkTimeout);
    spdlog::info("kv transfer: a KV link from member {}", rank);
  } catch (const std::exception& e) {
    spdlog::warn("kv link listener: {}", e.what());
  }
}

std::map<int, int> dial_kv_links(int self, std::span<const KvLinkAddress> peers,
                                 const std::string& own_host, const ClusterKey& key) {
  std::map<int, int> links;
  const std::array<std::byte, 4> hello = rank_bytes(self);
  for (const KvLinkAddress& peer : peers) {
    const auto deadline = Clock::now() + kKvLinkTimeout;
    int fd = -1;
    try {
      fd = dial_tcp(TcpAddress{peer.port, peer.ipv4}, peer.host == own_host, deadline);
      authenticate_dialer(fd, key, kKvLinkPurpose, hello, deadline);
      links[peer.rank] = std::exchange(fd, -1);
    } catch (const std::exception& e) {
      spdlog::warn("kv transfer: no KV link to rank {} ({}): {}", peer.rank, peer.host, e.what());
    }
    if (fd >= 0) close(fd);
  }
  return links;
}

}  // namespace duet

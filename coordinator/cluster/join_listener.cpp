#include "coordinator/cluster/join_listener.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/format.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

void make_non_blocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// An owned socket, closed unless released.
struct Socket {
  int fd = -1;
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  int release() { return std::exchange(fd, -1); }
};

}  // namespace

JoinListener::JoinListener(RemoteCluster& cluster, ClusterKey key, ClusterMode mode,
                           std::string fingerprint, uint16_t port)
    : cluster_(cluster), key_(std::move(key)), mode_(mode), fingerprint_(std::move(fingerprint)) {
  Socket listener{socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)};
  if (listener.fd < 0) throw Error(ErrorKind::kInternal, "join listener: no socket");
  const int one = 1;
  setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(port);
  if (bind(listener.fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
      listen(listener.fd, 16) != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                format("--join-port {}: cannot listen: {}", port, std::strerror(errno)));
  }
  socklen_t length = sizeof address;
  getsockname(listener.fd, reinterpret_cast<sockaddr*>(&address), &length);
  port_ = ntohs(address.sin_port);
  stop_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (stop_fd_ < 0) throw Error(ErrorKind::kInternal, "join listener: eventfd failed");
  fd_ = listener.release();
  spdlog::info("join listener: instances may join on port {} (cluster key {})", port_,
               key_.fingerprint());
  thread_ = std::thread([this] { run(); });
}

JoinListener::~JoinListener() {
  const uint64_t one = 1;
  static_cast<void>(write(stop_fd_, &one, sizeof one));
  thread_.join();
  ::close(fd_);
  ::close(stop_fd_);
}

void JoinListener::run() {
  for (;;) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0 && errno != EINTR) return;
    if (fds[1].revents != 0) return;
    if ((fds[0].revents & POLLIN) == 0) continue;
    const int socket = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (socket < 0) continue;
    make_non_blocking(socket);
    handle(socket);
  }
}

void JoinListener::handle(int fd) {
  Socket socket{fd};
  JoinRequest request;
  JoinVerdict verdict;
  try {
    const AuthAnswer answer = authenticate_listener(
        socket.fd, key_, kJoinControlPurpose,
        [&](std::span<const std::byte> hello) {
          AuthAnswer out;
          try {
            const ControlMessage message = decode_control_message(hello);
            const auto* join = std::get_if<JoinRequest>(&message);
            if (join == nullptr) throw Error(ErrorKind::kCorruptFile, "not a join request");
            request = *join;
            verdict = cluster_.judge_join(request, mode_, fingerprint_);
          } catch (const Error& e) {
            verdict =
                JoinVerdict{false, {}, 0, 0, format("a malformed join request: {}", e.what()), {}};
          }
          out.accepted = verdict.accepted;
          out.reason = verdict.reason;
          out.payload = encode_control_message(verdict);
          return out;
        },
        Clock::now() + kHandshakeTimeout);
    if (!answer.accepted) {
      spdlog::warn("join listener: refused {} ({}): {}", request.host,
                   instance_role_name(request.role), answer.reason);
      return;
    }
  } catch (const std::exception& e) {
    spdlog::warn("join listener: {}", e.what());
    return;
  }
  try {
    cluster_.admit(verdict, request, socket.release());
  } catch (const std::exception& e) {
    spdlog::warn("join listener: {} not admitted: {}", request.host, e.what());
  }
}

JoinVerdict join_cluster(const std::string& address, const ClusterKey& key,
                         const JoinRequest& request, std::chrono::milliseconds timeout, int& out) {
  const auto deadline = Clock::now() + timeout;
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    throw Error(ErrorKind::kInvalidArgument,
                format("--join {}: expected HOST:PORT (the coordinator's --join-port)", address));
  }
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int status = getaddrinfo(host.c_str(), port.c_str(), &hints, &found); status != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                format("--join {}: {}", address, gai_strerror(status)));
  }
  std::string failure = "no address";
  Socket socket;
  for (addrinfo* a = found; a != nullptr && socket.fd < 0; a = a->ai_next) {
    Socket attempt{::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol)};
    if (attempt.fd < 0) continue;
    make_non_blocking(attempt.fd);
    if (connect(attempt.fd, a->ai_addr, a->ai_addrlen) != 0 && errno != EINPROGRESS) {
      failure = std::strerror(errno);
      continue;
    }
    pollfd fd{attempt.fd, POLLOUT, 0};
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (poll(&fd, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) <= 0) {
      failure = "timed out connecting";
      continue;
    }
    int error = 0;
    socklen_t length = sizeof error;
    getsockopt(attempt.fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      failure = std::strerror(error);
      continue;
    }
    socket.fd = attempt.release();
  }
  freeaddrinfo(found);
  if (socket.fd < 0) {
    throw Error(ErrorKind::kInvalidArgument,
                format("cannot reach the coordinator at {}: {}", address, failure));
  }
  const std::vector<std::byte> answer = authenticate_dialer(
      socket.fd, key, kJoinControlPurpose, encode_control_message(request), deadline);
  const ControlMessage message = decode_control_message(answer);
  const auto* verdict = std::get_if<JoinVerdict>(&message);
  if (verdict == nullptr) {
    throw Error(ErrorKind::kInternal, format("the coordinator at {} answered with a {} message",
                                             address, control_message_name(message)));
  }
  out = socket.release();
  return *verdict;
}

}  // namespace duet

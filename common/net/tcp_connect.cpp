#include "common/net/tcp_connect.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "common/error.h"
#include "common/format.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

// How long one connection attempt (connect, hello, its answer) may take
// before the next address is tried.
constexpr auto kAttemptPatience = std::chrono::seconds(3);
constexpr auto kRetryPause = std::chrono::milliseconds(100);

struct Hello {
  uint32_t magic = 0;
  int32_t from = 0;
  int32_t to = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(Hello) == 16);

void non_blocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void no_delay(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::string dotted(uint32_t ipv4) {
  char text[INET_ADDRSTRLEN] = {};
  in_addr address{};
  address.s_addr = ipv4;
  inet_ntop(AF_INET, &address, text, sizeof text);
  return text;
}

bool is_loopback(uint32_t ipv4) { return (ntohl(ipv4) >> 24) == 127; }

// One side of a connection being set up: its socket and the hello bytes
// sent or received so far.
struct Attempt {
  int fd = -1;
  bool outgoing = false;  // a connect (else an accept)
  int peer = -1;          // the rank meant (connects), or -1 until its hello (accepts)
  size_t address = 0;     // connects: the index in the peer's addresses
  bool connected = false;
  std::array<std::byte, sizeof(Hello)> out{};
  size_t sent = 0;
  std::array<std::byte, sizeof(Hello)> in{};
  size_t received = 0;
  Clock::time_point give_up;
};

std::array<std::byte, sizeof(Hello)> hello_bytes(uint32_t magic, int from, int to) {
  Hello hello;
  hello.magic = magic;
  hello.from = from;
  hello.to = to;
  std::array<std::byte, sizeof(Hello)> bytes;
  std::memcpy(bytes.data(), &hello, sizeof hello);
  return bytes;
}

Hello read_hello(const std::array<std::byte, sizeof(Hello)>& bytes) {
  Hello hello;
  std::memcpy(&hello, bytes.data(), sizeof hello);
  return hello;
}

// Sends what is left of the hello, reads what came of the answer. False:
// the connection failed.
bool pump(Attempt& a) {
  while (a.sent < a.out.size()) {
    const ssize_t n = send(a.fd, a.out.data() + a.sent, a.out.size() - a.sent, MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    a.sent += static_cast<size_t>(n);
  }
  while (a.received < a.in.size()) {
    const ssize_t n = recv(a.fd, a.in.data() + a.received, a.in.size() - a.received, 0);
    if (n == 0) return false;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    a.received += static_cast<size_t>(n);
  }
  return true;
}

// The addresses to try for `peer`, in order.
std::vector<uint32_t> targets(const TcpPeer& peer) {
  std::vector<uint32_t> out;
  if (peer.same_host) out.push_back(htonl(INADDR_LOOPBACK));
  for (uint32_t ipv4 : peer.address.ipv4) {
    if (!is_loopback(ipv4)) out.push_back(ipv4);
  }
  if (out.empty()) out.push_back(htonl(INADDR_LOOPBACK));
  return out;
}

}  // namespace

std::array<std::byte, TcpAddress::kRecordBytes> TcpAddress::encode() const {
  std::array<std::byte, kRecordBytes> record{};
  const uint32_t port32 = port;
  const auto count = static_cast<uint32_t>(std::min(ipv4.size(), kMaxAddresses));
  std::memcpy(record.data(), &port32, 4);
  std::memcpy(record.data() + 4, &count, 4);
  std::memcpy(record.data() + 8, ipv4.data(), 4 * count);
  return record;
}

TcpAddress TcpAddress::decode(std::span<const std::byte> record) {
  DUET_ASSERT(record.size() == kRecordBytes, "a {}-byte TCP address record", record.size());
  uint32_t port32 = 0, count = 0;
  std::memcpy(&port32, record.data(), 4);
  std::memcpy(&count, record.data() + 4, 4);
  TcpAddress address;
  address.port = static_cast<uint16_t>(port32);
  address.ipv4.resize(std::min<size_t>(count, kMaxAddresses));
  std::memcpy(address.ipv4.data(), record.data() + 8, 4 * address.ipv4.size());
  return address;
}

TcpListener::TcpListener() {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw Error(ErrorKind::kInternal, format("tcp: socket: {}", strerror(errno)));
  sockaddr_in any{};
  any.sin_family = AF_INET;
  any.sin_addr.s_addr = htonl(INADDR_ANY);
  any.sin_port = 0;
  socklen_t length = sizeof any;
  if (bind(fd_, reinterpret_cast<sockaddr*>(&any), sizeof any) != 0 ||
      listen(fd_, SOMAXCONN) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&any), &length) != 0) {
    const std::string why = strerror(errno);
    close(fd_);
    throw Error(ErrorKind::kInternal, format("tcp: cannot listen: {}", why));
  }
  non_blocking(fd_);
  port_ = ntohs(any.sin_port);
}

TcpListener::~TcpListener() { close(fd_); }

TcpAddress TcpListener::address() const {
  TcpAddress address;
  address.port = port_;
  std::vector<uint32_t> loopback;
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) == 0) {
    for (const ifaddrs* i = all; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      if ((i->ifa_flags & IFF_UP) == 0) continue;
      const uint32_t ipv4 = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr;
      (is_loopback(ipv4) ? loopback : address.ipv4).push_back(ipv4);
    }
    freeifaddrs(all);
  }
  address.ipv4.insert(address.ipv4.end(), loopback.begin(), loopback.end());
  if (address.ipv4.size() > TcpAddress::kMaxAddresses)
    address.ipv4.resize(TcpAddress::kMaxAddresses);
  return address;
}

int dial_tcp(const TcpAddress& address, bool same_host, Clock::time_point deadline) {
  std::string failure = "no address";
  for (uint32_t ipv4 : targets(TcpPeer{0, address, same_host, true})) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) break;
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw Error(ErrorKind::kInternal, format("tcp: socket: {}", strerror(errno)));
    non_blocking(fd);
    no_delay(fd);
    sockaddr_in target{};
    target.sin_family = AF_INET;
    target.sin_addr.s_addr = ipv4;
    target.sin_port = htons(address.port);
    int error = 0;
    if (connect(fd, reinterpret_cast<sockaddr*>(&target), sizeof target) != 0) {
      error = errno;
      if (error == EINPROGRESS) {
        pollfd out{fd, POLLOUT, 0};
        const auto patience = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::min<Clock::duration>(deadline - now, kAttemptPatience));
        if (poll(&out, 1, static_cast<int>(patience.count()) + 1) <= 0) {
          error = ETIMEDOUT;
        } else {
          socklen_t length = sizeof error;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length);
        }
      }
    }
    if (error == 0) return fd;
    failure = format("{}:{}: {}", dotted(ipv4), address.port, strerror(error));
    close(fd);
  }
  throw Error(ErrorKind::kInvalidArgument, format("cannot connect to {}", failure));
}

namespace {

// One call of connect_tcp_peers, in its stages: dial the peers this rank
// dials (each address in turn), accept the ones that dial it, and move every
// attempt on (connected, hello sent, answer read and checked) until each peer
// has one connection or the deadline passes.
class PeerConnector {
 public:
  PeerConnector(int self, const TcpListener* listener, std::span<const TcpPeer> peers,
                TcpPurpose purpose)
      : self_(self), listener_(listener), peers_(peers), purpose_(purpose) {
    for (const TcpPeer& peer : peers) {
      DUET_ASSERT(peer.rank != self, "rank {} does not connect to itself", self);
      if (peer.dial) {
        addresses_[peer.rank] = targets(peer);
      } else {
        accepted_[peer.rank] = &peer;
      }
    }
    DUET_ASSERT(accepted_.empty() || listener != nullptr, "rank {} accepts without a listener",
                self);
  }
  ~PeerConnector() {
    for (Attempt& a : attempts_) drop(a);
    for (auto& [rank, fd] : connected_) close(fd);
  }
  PeerConnector(const PeerConnector&) = delete;
  PeerConnector& operator=(const PeerConnector&) = delete;

  std::map<int, int> run(Clock::time_point deadline) {
    while (connected_.size() < addresses_.size() + accepted_.size()) {
      const Clock::time_point now = Clock::now();
      if (now >= deadline) throw_missing();
      dial(now);
      wait(std::min<Clock::duration>(deadline - now, kRetryPause));
      accept_new();
      for (Attempt& a : attempts_) {
        if (a.fd >= 0) advance(a);
      }
      std::erase_if(attempts_, [](const Attempt& a) { return a.fd < 0; });
    }
    return std::exchange(connected_, {});
  }

 private:
  static void drop(Attempt& a) {
    close(a.fd);
    a.fd = -1;
  }

  uint16_t port_of(int rank) const {
    for (const TcpPeer& peer : peers_) {
      if (peer.rank == rank) return peer.address.port;
    }
    return 0;
  }

  [[noreturn]] void throw_missing() const {
    std::string missing;
    for (const TcpPeer& peer : peers_) {
      if (!connected_.contains(peer.rank))
        missing += format("{}{}", missing.empty() ? "" : ", ", peer.rank);
    }
    throw Error(ErrorKind::kInternal, format("{}: rank {} could not connect to rank(s) {} in time",
                                             purpose_.name, self_, missing));
  }

  // A connection under way to every peer this rank dials and has not yet.
  void dial(Clock::time_point now) {
    for (const auto& [rank, to] : addresses_) {
      if (connected_.contains(rank) || now < retry_at_[rank]) continue;
      const bool under_way = std::any_of(attempts_.begin(), attempts_.end(), [&](const Attempt& a) {
        return a.fd >= 0 && a.outgoing && a.peer == rank;
      });
      if (!under_way) start(rank, now);
    }
  }

  // A connect to the peer's next address.
  void start(int rank, Clock::time_point now) {
    const std::vector<uint32_t>& to = addresses_[rank];
    size_t& index = next_address_[rank];
    Attempt a;
    a.outgoing = true;
    a.peer = rank;
    a.address = index % to.size();
    ++index;
    a.give_up = now + kAttemptPatience;
    a.out = hello_bytes(purpose_.magic, self_, rank);
    a.fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (a.fd < 0) return;
    non_blocking(a.fd);
    no_delay(a.fd);
    sockaddr_in target{};
    target.sin_family = AF_INET;
    target.sin_addr.s_addr = to[a.address];
    target.sin_port = htons(port_of(rank));
    if (connect(a.fd, reinterpret_cast<sockaddr*>(&target), sizeof target) == 0) {
      a.connected = true;
    } else if (errno != EINPROGRESS) {
      spdlog::debug("{}: connect to rank {} at {}: {}", purpose_.name, rank, dotted(to[a.address]),
                    strerror(errno));
      drop(a);
      retry_at_[rank] = now + kRetryPause;
      return;
    }
    attempts_.push_back(a);
  }

  // Until a socket can move on, or `most` has passed.
  void wait(Clock::duration most) const {
    std::vector<pollfd> fds;
    if (listener_ != nullptr) fds.push_back({listener_->fd(), POLLIN, 0});
    for (const Attempt& a : attempts_) {
      const bool writing = !a.connected || a.sent < a.out.size();
      fds.push_back({a.fd, static_cast<short>(writing ? POLLOUT : POLLIN), 0});
    }
    poll(fds.data(), fds.size(),
         static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(most).count()) + 1);
  }

  // New connections from the peers that dial: their hello says who they are.
  void accept_new() {
    while (listener_ != nullptr) {
      const int fd = accept4(listener_->fd(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) break;
      no_delay(fd);
      Attempt a;
      a.fd = fd;
      a.connected = true;
      a.sent = a.out.size();  // answers only once the hello is in
      a.give_up = Clock::now() + kAttemptPatience;
      attempts_.push_back(a);
    }
  }

  // False while a connect is still under way (or it failed: dropped).
  bool finish_connect(Attempt& a) {
    int error = 0;
    socklen_t length = sizeof error;
    getsockopt(a.fd, SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      spdlog::debug("{}: connect to rank {}: {}", purpose_.name, a.peer, strerror(error));
      drop(a);
      retry_at_[a.peer] = Clock::now() + kRetryPause;
      return false;
    }
    sockaddr_in peer_address{};
    socklen_t peer_length = sizeof peer_address;
    if (getpeername(a.fd, reinterpret_cast<sockaddr*>(&peer_address), &peer_length) != 0) {
      if (Clock::now() > a.give_up) drop(a);
      return false;  // still connecting
    }
    a.connected = true;
    return true;
  }

  // An accepted connection's hello is in: answer it if it is one this rank
  // waits for. False: dropped.
  bool answer_hello(Attempt& a) {
    const Hello hello = read_hello(a.in);
    if (hello.magic != purpose_.magic || hello.to != self_ || !accepted_.contains(hello.from) ||
        connected_.contains(hello.from)) {
      drop(a);
      return false;
    }
    a.peer = hello.from;
    a.out = hello_bytes(purpose_.magic, self_, hello.from);
    a.sent = 0;
    if (!pump(a)) {
      drop(a);
      return false;
    }
    return true;
  }

  void advance(Attempt& a) {
    const bool outgoing = a.outgoing;
    if (!a.connected && !finish_connect(a)) return;
    if (!pump(a)) {
      if (outgoing) retry_at_[a.peer] = Clock::now() + kRetryPause;
      drop(a);
      return;
    }
    if (!outgoing && a.peer < 0 && a.received == a.in.size() && !answer_hello(a)) return;
    const bool done = a.sent == a.out.size() && a.received == a.in.size() && a.peer >= 0;
    if (done && outgoing) {
      const Hello answer = read_hello(a.in);
      if (answer.magic != purpose_.magic || answer.from != a.peer || answer.to != self_) {
        drop(a);  // another listener at that address: try the next one
        return;
      }
    }
    if (done) {
      connected_[a.peer] = a.fd;
      a.fd = -1;
      return;
    }
    if (Clock::now() > a.give_up) {
      if (outgoing) retry_at_[a.peer] = Clock::now();
      drop(a);
    }
  }

  const int self_;
  const TcpListener* const listener_;
  const std::span<const TcpPeer> peers_;
  const TcpPurpose purpose_;
  std::map<int, int> connected_;
  std::map<int, const TcpPeer*> accepted_;          // the peers that dial this rank
  std::vector<Attempt> attempts_;                   // connects out and accepts in, being set up
  std::map<int, std::vector<uint32_t>> addresses_;  // of the peers this rank dials
  std::map<int, size_t> next_address_;
  std::map<int, Clock::time_point> retry_at_;
};

}  // namespace

std::map<int, int> connect_tcp_peers(int self, const TcpListener* listener,
                                     std::span<const TcpPeer> peers, TcpPurpose purpose,
                                     Clock::time_point deadline) {
  return PeerConnector(self, listener, peers, purpose).run(deadline);
}

}  // namespace duet

// Connections between the ranks of a job over TCP sockets of Duet's own,
// without MPI: the start-up that TcpKvTransfer (worker/transfer/
// tcp_kv_transfer.h) and the control channel's TCP link (common/control_plane/
// control_channel.h) share. A rank that is to accept connections listens on
// an ephemeral port on every address (TcpListener); its port and its host's
// IPv4 addresses reach the ranks that dial it (the caller's all-gather,
// TcpAddress's fixed-size record); then each pair connects once
// (connect_tcp_peers): one side dials, trying the peer's addresses in order
// (loopback first for a peer on the same host), and each side says hello
// with the connection's purpose (a magic number the caller picks), its rank
// and the rank it meant to reach, so a connection that lands on the wrong
// listener (an address another host has too, another purpose's listener) is
// dropped and the next address tried.
//
// Non-blocking sockets throughout: every wait is a poll() with the caller's
// deadline. Any thread (no state outside the objects).
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <vector>

namespace duet {

// Where a rank's listener is: its port (0: the rank does not listen) and
// its host's IPv4 addresses (network byte order), others before loopback.
struct TcpAddress {
  uint16_t port = 0;
  std::vector<uint32_t> ipv4;

  static constexpr size_t kMaxAddresses = 8;
  static constexpr size_t kRecordBytes = 8 + 4 * kMaxAddresses;
  std::array<std::byte, kRecordBytes> encode() const;
  static TcpAddress decode(std::span<const std::byte> record);
};

// A listening socket on every address, on a port the system picks. Owns it.
class TcpListener final {
 public:
  TcpListener();  // throws Error(kInternal) when no socket can listen
  ~TcpListener();
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  int fd() const { return fd_; }
  // The port and this host's IPv4 addresses (interfaces that are up).
  TcpAddress address() const;

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

struct TcpPeer {
  int rank = 0;
  TcpAddress address;      // where it listens (only read when this rank dials it)
  bool same_host = false;  // try loopback first
  bool dial = false;       // this rank connects to it; else it connects to this rank
};

// What the connections are for: both sides of one must name the same.
struct TcpPurpose {
  uint32_t magic = 0;     // in every hello
  const char* name = "";  // in log lines and errors: "kv transfer"
};

// A connected, non-blocking socket (with TCP_NODELAY) to every peer, by
// rank, the caller owning them: dials the peers marked `dial`, accepts the
// others on `listener` (which may be null when every peer is dialled).
// Throws Error(kInternal) naming the peers not connected by `deadline`.
std::map<int, int> connect_tcp_peers(int self, const TcpListener* listener,
                                     std::span<const TcpPeer> peers, TcpPurpose purpose,
                                     std::chrono::steady_clock::time_point deadline);

// One connection to the listener at `address`, trying its IPv4 addresses in
// order (loopback first when `same_host`), each for a few seconds at most: a
// connected, non-blocking socket with TCP_NODELAY, the caller's. Throws
// Error(kInvalidArgument) with the last address's failure when none connects by
// `deadline`.
int dial_tcp(const TcpAddress& address, bool same_host,
             std::chrono::steady_clock::time_point deadline);

}  // namespace duet

// The start-up of TcpKvTransfer's connections (worker/transfer/tcp_kv_transfer.h),
// without MPI: every rank that may exchange KV listens on an ephemeral port
// on every address (TcpKvListener); its port and its host's IPv4 addresses
// travel to every rank (the caller's all-gather, TcpKvAddress's fixed-size
// record); then every pair connects once (connect_kv_peers): the lower rank
// connects to the higher, trying the peer's addresses in order (loopback
// first for a peer on the same host), and each side says hello with its rank
// and the rank it meant to reach, so a connection that lands on the wrong
// listener (an address another host has too) is dropped and the next address
// tried.
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

// Where a rank's KV listener is: its port (0: the rank does not listen) and
// its host's IPv4 addresses (network byte order), others before loopback.
struct TcpKvAddress {
  uint16_t port = 0;
  std::vector<uint32_t> ipv4;

  static constexpr size_t kMaxAddresses = 8;
  static constexpr size_t kRecordBytes = 8 + 4 * kMaxAddresses;
  std::array<std::byte, kRecordBytes> encode() const;
  static TcpKvAddress decode(std::span<const std::byte> record);
};

// A listening socket on every address, on a port the system picks. Owns it.
class TcpKvListener final {
 public:
  TcpKvListener();  // throws Error(kInternal) when no socket can listen
  ~TcpKvListener();
  TcpKvListener(const TcpKvListener&) = delete;
  TcpKvListener& operator=(const TcpKvListener&) = delete;

  int fd() const { return fd_; }
  // The port and this host's IPv4 addresses (interfaces that are up).
  TcpKvAddress address() const;

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

struct TcpKvPeer {
  int rank = 0;
  TcpKvAddress address;
  bool same_host = false;  // try loopback first
};

// A connected, non-blocking socket (with TCP_NODELAY) to every peer, by
// rank, the caller owning them: connects to the peers of higher rank than
// `self`, accepts those of lower rank on `listener`. Throws
// Error(kInternal) naming the peers not connected by `deadline`.
std::map<int, int> connect_kv_peers(int self, const TcpKvListener& listener,
                                    std::span<const TcpKvPeer> peers,
                                    std::chrono::steady_clock::time_point deadline);

}  // namespace duet

// KV links with the instances that join a running disaggregated cluster
// (coordinator/cluster/join_listener.h), whose prefill and decode sides must
// move KV with ranks they never met at start-up.
//
// Every prefill or decode rank of a cluster that takes joins listens on a
// port of its own (KvLinkListener), as does every prefill or decode member.
// The coordinator learns the job's listeners at start-up (one all-gather)
// and each member's from its JoinRequest, and hands a joiner every live one
// in its JoinVerdict. The joiner dials each (dial_kv_links) before it
// reports ready, so the coordinator routes to it only once its links are
// up; later joiners dial it in turn. Each connection proves the cluster key
// both ways (common/net/cluster_auth.h, purpose kKvLinkPurpose) and the
// dialer's hello is its address on the cluster (4 bytes, little-endian).
// Then the link carries TcpKvTransfer's frames (TcpKvTransfer::add_peer),
// as the links made at start-up do; a rank whose link ends is lost to the
// transfer, as any peer.
//
// Threads: KvLinkListener accepts on a thread of its own from start() to
// destruction; dial_kv_links on the caller's.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <thread>

#include "common/cluster/control_messages.h"
#include "common/net/cluster_auth.h"
#include "common/net/tcp_connect.h"

namespace duet {

inline constexpr uint32_t kKvLinkPurpose = 0x4b4c'4b44;  // "DKLK"
// The longest one link's connect and handshake may take, either side.
inline constexpr std::chrono::milliseconds kKvLinkTimeout{5'000};

class KvLinkListener final {
 public:
  // A new link: the dialer's address on the cluster and a socket of the
  // link, the callee's to own.
  using OnLink = std::function<void(int rank, int fd)>;

  // Listens at once on a port the system picks; accepts nothing before
  // start(). Throws Error(kInternal) when no socket can listen.
  explicit KvLinkListener(ClusterKey key);
  ~KvLinkListener();  // stops accepting once a handshake under way ends (kKvLinkTimeout at most)
  KvLinkListener(const KvLinkListener&) = delete;
  KvLinkListener& operator=(const KvLinkListener&) = delete;

  // Where it listens, as the coordinator hands it on.
  KvLinkAddress address(int rank, std::string host) const;
  // Accepts links from now on, one handshake at a time (each bounded by
  // kKvLinkTimeout). A dialer that proves the key is handed to `on_link`
  // before its answer leaves, so the link is in the transfer before the
  // dialer can report ready. Once.
  void start(OnLink on_link);

 private:
  void run();               // the thread
  void handle(int socket);  // one connection

  TcpListener listener_;
  const ClusterKey key_;
  OnLink on_link_;
  int stop_fd_ = -1;  // an eventfd: the destructor writes it
  std::thread thread_;
};

// The joiner (address `self` on the cluster, running on `own_host`): a link
// to every peer it reaches, by rank; each dial and handshake bounded by
// kKvLinkTimeout. A peer not reached (lost meanwhile, a listener another
// key guards) is logged and left out: the caller tells its transfer the
// peer is lost, so no import waits on it.
std::map<int, int> dial_kv_links(int self, std::span<const KvLinkAddress> peers,
                                 const std::string& own_host, const ClusterKey& key);

}  // namespace duet

// The coordinator's door for instances that join a running cluster
// (`duet serve --join HOST:PORT`): a TCP listener on --join-port, and the
// joining side's dial.
//
// Every connection is authenticated before anything else is read
// (common/net/cluster_auth.h: both ends prove the cluster key, which is never
// sent). The joiner's hello is its JoinRequest (version, model fingerprint,
// role, tp); RemoteCluster::judge_join decides, and the answer is a
// JoinVerdict: its address on the control channel and its instance id, or a
// one-line reason, logged on both sides. An accepted connection becomes the
// member's control link (ControlChannel::admit), over which it reports ready
// like any leader. Connections are handled one at a time, each bounded by
// kHandshakeTimeout, so a stranger that stalls holds the door that long at most.
//
// Thread affinity: the listener runs its own thread from construction to
// destruction; join_cluster is called on the joiner's main thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"
#include "common/net/cluster_auth.h"
#include "coordinator/cluster/remote_instance.h"

namespace duet {

// The purpose both ends bind into their proofs: a control link.
inline constexpr uint32_t kJoinControlPurpose = 0x4e4a'4344;  // "DCJN"
inline constexpr std::chrono::milliseconds kHandshakeTimeout{5'000};

class JoinListener final {
 public:
  // Listens on `port` on every IPv4 address (0: one the system picks;
  // port() says which) and admits what `cluster` accepts. `cluster` outlives
  // the listener. Throws Error(kInvalidArgument) when the port is taken.
  JoinListener(RemoteCluster& cluster, ClusterKey key, ClusterMode mode, std::string fingerprint,
               uint16_t port);
  ~JoinListener();  // stops accepting; a handshake under way is cut short
  JoinListener(const JoinListener&) = delete;
  JoinListener& operator=(const JoinListener&) = delete;

  uint16_t port() const { return port_; }

 private:
  void run();               // the listener's thread
  void handle(int socket);  // one connection: authenticate, judge, admit

  RemoteCluster& cluster_;
  const ClusterKey key_;
  const ClusterMode mode_;
  const std::string fingerprint_;
  int fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: the destructor writes it
  uint16_t port_ = 0;
  std::thread thread_;  // last: starts after everything above exists
};

// The joiner: dials `address` ("HOST:PORT"), proves the key, sends `request`
// and returns the coordinator's verdict with the connected, authenticated,
// non-blocking socket (the caller's from then on) in `socket`. Throws
// duet::Error with the one-line reason when it cannot connect, either side's
// proof fails, or the coordinator refuses (the verdict's reason) — with no
// socket left open. Every wait is bounded by `timeout`.
JoinVerdict join_cluster(const std::string& address, const ClusterKey& key,
                         const JoinRequest& request, std::chrono::milliseconds timeout,
                         int& socket);

}  // namespace duet

// The control plane's start: every instance leader says Hello, the
// coordinator checks each against its own cluster spec and protocol version,
// and answers every instance rank (leaders and TP followers) with one verdict
// for the whole cluster. A refusal ends every rank with the same message; a
// silent rank ends the wait at a deadline instead of hanging it.
//
// Runs on the thread that owns the channel's inbox at start-up (the main
// thread), before any other control message; the spec has been validated
// against the world on every rank already (ClusterSpec::validate).
#pragma once

#include <chrono>
#include <cstdint>

#include "common/cluster/cluster_spec.h"
#include "common/cluster/control_messages.h"
#include "common/control_plane/control_channel.h"

namespace duet {

struct HandshakeOptions {
  // How long the coordinator waits for every Hello; an instance rank waits
  // this plus a grace period for the verdict.
  std::chrono::milliseconds timeout{60'000};
  // The version this rank speaks; only tests set another.
  uint32_t protocol_version = kControlProtocolVersion;
};

// Rank 0. Returns when every leader's Hello matched the spec and the version;
// otherwise refuses every instance rank and throws duet::Error whose message
// is "control handshake refused: <reason>", the same line every rank prints.
void coordinator_handshake(ControlChannel& channel, const ClusterSpec& spec,
                           const HandshakeOptions& options = {});

// Every other rank: a leader sends its Hello; every instance rank then waits
// for the verdict. Throws duet::Error "control handshake refused: <reason>"
// on a refusal, or a clear error when no verdict comes in time.
void instance_handshake(ControlChannel& channel, const ClusterSpec& spec,
                        const HandshakeOptions& options = {});

}  // namespace duet

// The control plane's messages in plain C++, and their wire form.
//
// The coordinator and the instance leaders exchange these over MPI
// (common/control_plane/control_channel.h). On the wire each is one Cap'n Proto
// `Message` (common/cluster/control.capnp); this header keeps Cap'n Proto out of
// everything else. The conversions round-trip common/serving.h's types
// exactly (every field, floats bit for bit).
//
// Pure values and pure functions: any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/cluster/cluster_spec.h"
#include "common/serving.h"

namespace duet {

// Equals `protocolVersion` in control.capnp (checked at compile time).
inline constexpr uint32_t kControlProtocolVersion = 7;

// Leader -> coordinator, first message (see control.capnp).
struct Hello {
  uint32_t protocol_version = kControlProtocolVersion;
  Rank rank;
  int32_t instance_id = 0;
  InstanceRole role = InstanceRole::kBoth;
};

// Coordinator -> every instance rank: the verdict on the whole cluster.
struct HelloReply {
  bool accepted = false;
  uint32_t protocol_version = kControlProtocolVersion;
  std::string reason;  // when refused
};

// Coordinator -> leader.
struct SubmitRequest {
  InstanceRequest request;
};

// Coordinator -> leader.
struct Cancel {
  RequestId id;
};

// Leader -> coordinator: one engine step's events for all the instance's
// sequences.
struct StepEvents {
  int32_t instance_id = 0;
  int64_t step = 0;
  std::vector<InstanceEvent> events;
};

// Leader -> coordinator.
struct StatsReport {
  int32_t instance_id = 0;
  InstanceStats stats;
};

// Coordinator -> leader.
struct Shutdown {
  std::string reason;
};

// Leader -> coordinator, once after the handshake: the instance has loaded its
// model and takes requests, or (`error` not empty) it could not start.
struct InstanceReady {
  int32_t instance_id = 0;
  InstanceInfo info;
  InstanceStats stats;
  std::string error;
};

// Every instance rank -> coordinator, every heartbeat interval, also when
// idle (the coordinator's lease on the instance, coordinator/cluster/liveness.h).
struct Heartbeat {
  int32_t instance_id = 0;
  Rank rank;
  uint64_t epoch = 0;  // the newest RanksLost epoch this rank has applied
  int64_t step = -1;   // the engine's step counter; -1 on a tensor-parallel follower
  bool busy = false;   // inside an engine step
};

// Coordinator -> every rank: `ranks` are lost (dead, stalled, or in a lost
// instance). A rank that finds itself, or a rank of its own instance, in the
// list drops what it holds and leaves; every other rank stops waiting on them.
struct RanksLost {
  uint64_t epoch = 0;  // the cluster's loss count: one more with every loss
  std::vector<Rank> ranks;
  std::string reason;
};

// A joining instance -> coordinator, the payload of its authenticated hello
// (coordinator/cluster/join_listener.h).
// Where a rank listens for the KV links of instances that join
// (worker/transfer/kv_member_links.h): port 0 when it takes none.
struct KvLinkAddress {
  int32_t rank = -1;
  std::string host;
  uint16_t port = 0;
  std::vector<uint32_t> ipv4;  // network byte order, loopback last
  int32_t leader = -1;         // its instance's leader (tensor parallelism)
};

struct JoinRequest {
  uint32_t protocol_version = kControlProtocolVersion;
  std::string version;            // Duet's version string
  std::string model_fingerprint;  // common/cluster/model_fingerprint.h
  InstanceRole role = InstanceRole::kBoth;
  int32_t tp = 1;
  std::string host;  // where it runs, for logs and /health
  // A prefill or decode instance's KV listeners, one a rank, leader first
  // (their ranks unused: the verdict gives the addresses).
  std::vector<KvLinkAddress> kv;
};

// Coordinator -> the joining instance: its control-channel address and
// instance id, or (accepted false) why not.
struct JoinVerdict {
  bool accepted = false;
  Rank member;
  int32_t instance_id = 0;
  int64_t lease_ms = 0;  // heartbeat every lease_ms / 6
  std::string reason;
  // A prefill or decode joiner: every live rank it links its KV with.
  std::vector<KvLinkAddress> kv_peers;
};

// A joined instance's leader -> coordinator, twice: it leaves (SIGTERM), so
// nothing new should go to it; then (done) it has drained and goes.
struct Leaving {
  int32_t instance_id = 0;
  std::string reason;
  bool done = false;  // its requests are done: it goes now (the first says it is leaving)
};

// Coordinator -> that leader: no request follows. Once its requests are
// done it closes its channel and goes.
struct LeaveAccepted {
  int32_t instance_id = 0;
};

// PrefillOrder and KvHandoff (common/serving.h) travel between instances, on
// the KV transfer's communicator.
using ControlMessage =
    std::variant<Hello, HelloReply, SubmitRequest, Cancel, StepEvents, StatsReport, Shutdown,
                 InstanceReady, PrefillOrder, KvHandoff, Heartbeat, RanksLost, JoinRequest,
                 JoinVerdict, Leaving, LeaveAccepted>;

// "hello", "hello_reply", "submit", "cancel", "step_events", "stats", "shutdown",
// "instance_ready", "prefill_order", "kv_handoff", "heartbeat", "ranks_lost",
// "join_request", "join_verdict", "leaving", "leave_accepted".
std::string_view control_message_name(const ControlMessage& message);

// The message's Cap'n Proto flat-array form; its size is a multiple of 8.
std::vector<std::byte> encode_control_message(const ControlMessage& message);

// The inverse. Throws duet::Error (kCorruptFile) on bytes that are not a
// control message: a size that is not a multiple of 8, a malformed Cap'n Proto
// message, or a message kind or enum value this version does not know.
// `bytes` need not be aligned (it is copied when it is not).
ControlMessage decode_control_message(std::span<const std::byte> bytes);

}  // namespace duet

#include "common/control_plane/control_handshake.h"

#include <fmt/format.h>

#include <map>
#include <string>

#include "common/error.h"

namespace duet {
namespace {

using Clock = std::chrono::steady_clock;

std::string describe_instance(const InstanceSpec& instance) {
  return fmt::format("instance {} ({})", instance.id, instance_role_name(instance.role));
}

[[noreturn]] void refused(const std::string& reason) {
  throw Error(ErrorKind::kInvalidArgument, "control handshake refused: " + reason);
}

// Why `hello` from `source` does not fit the coordinator's spec, or "".
std::string check_hello(const Hello& hello, Rank source, const ClusterSpec& spec,
                        uint32_t coordinator_version) {
  const InstanceSpec* instance = spec.instance_of(source);
  if (hello.protocol_version != coordinator_version) {
    return fmt::format(
        "rank {}, {}, speaks control protocol version {}, the coordinator speaks version {}; "
        "start every rank from the same build",
        source.value, instance ? "leader of " + describe_instance(*instance) : "in no instance",
        hello.protocol_version, coordinator_version);
  }
  if (instance == nullptr || instance->leader() != source) {
    return fmt::format("rank {} said Hello but leads no instance in the coordinator's spec",
                       source.value);
  }
  if (hello.rank != source || hello.instance_id != instance->id || hello.role != instance->role) {
    return fmt::format(
        "rank {} says it is rank {} leading instance {} ({}), the coordinator's spec has it "
        "leading {}; start every rank with the same cluster spec",
        source.value, hello.rank.value, hello.instance_id, instance_role_name(hello.role),
        describe_instance(*instance));
  }
  return {};
}

}  // namespace

void coordinator_handshake(ControlChannel& channel, const ClusterSpec& spec,
                           const HandshakeOptions& options) {
  DUET_ASSERT(channel.rank() == kCoordinatorRank, "the coordinator's handshake runs on rank 0");
  const std::vector<Rank> leaders = spec.leaders();
  std::map<Rank, bool> heard;  // leader -> said Hello
  for (Rank leader : leaders) heard[leader] = false;
  size_t n_heard = 0;
  std::string reason;  // the first problem; empty while all is well

  const auto deadline = Clock::now() + options.timeout;
  while (n_heard < leaders.size()) {
    std::optional<ReceivedMessage> received = channel.receive_until(deadline);
    if (!received) {
      std::string silent;
      for (const auto& [leader, said] : heard) {
        if (!said) silent += fmt::format("{}{}", silent.empty() ? "" : ", ", leader.value);
      }
      if (reason.empty()) {
        reason =
            fmt::format("no Hello from rank(s) {} within {} ms", silent, options.timeout.count());
      }
      break;
    }
    const Hello* hello = std::get_if<Hello>(&received->message);
    std::string problem;
    if (hello == nullptr) {
      problem = fmt::format("rank {} sent a {} message before its Hello", received->source.value,
                            control_message_name(received->message));
    } else {
      problem = check_hello(*hello, received->source, spec, options.protocol_version);
    }
    const auto it = heard.find(received->source);
    if (it != heard.end() && !it->second) {
      it->second = true;
      ++n_heard;
    }
    if (reason.empty()) reason = problem;
  }

  // One verdict to every instance rank, followers included: they all wait
  // for it. Refusals carry the first reason so every rank prints one line.
  HelloReply reply{reason.empty(), options.protocol_version, reason};
  for (const InstanceSpec& instance : spec.instances) {
    for (Rank rank : instance.ranks) channel.send(rank, reply);
  }
  if (!reason.empty()) refused(reason);
}

void instance_handshake(ControlChannel& channel, const ClusterSpec& spec,
                        const HandshakeOptions& options) {
  const Rank self = channel.rank();
  const InstanceSpec* instance = spec.instance_of(self);
  DUET_ASSERT(instance != nullptr, "rank {} is in no instance of a validated spec", self.value);
  if (instance->leader() == self) {
    channel.send(kCoordinatorRank,
                 Hello{options.protocol_version, self, instance->id, instance->role});
  }
  // The coordinator answers within its own timeout; the grace covers the
  // ranks' different start times.
  const auto wait = options.timeout + std::chrono::seconds(10);
  std::optional<ReceivedMessage> received = channel.receive(wait);
  if (!received) {
    throw Error(ErrorKind::kInternal,
                fmt::format("control handshake: no answer from the coordinator (rank 0) within "
                            "{} ms",
                            wait.count()));
  }
  const HelloReply* reply = std::get_if<HelloReply>(&received->message);
  if (received->source != kCoordinatorRank || reply == nullptr) {
    refused(fmt::format("rank {} got a {} message from rank {} before the coordinator's answer",
                        self.value, control_message_name(received->message),
                        received->source.value));
  }
  if (!reply->accepted) refused(reply->reason);
  if (reply->protocol_version != options.protocol_version) {
    refused(
        fmt::format("the coordinator speaks control protocol version {}, rank {} speaks version {}",
                    reply->protocol_version, self.value, options.protocol_version));
  }
}

}  // namespace duet

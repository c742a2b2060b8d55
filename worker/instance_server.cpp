#include "worker/instance_server.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "common/error.h"

namespace duet {
namespace {

// How long a blocked receive sleeps before it looks again; the channel wakes
// it at once when a message arrives, so this only bounds an idle wait.
constexpr auto kIdleReceive = std::chrono::milliseconds(60'000);
// serve()'s receive, which also notices stop().
constexpr auto kStopPoll = std::chrono::milliseconds(100);

}  // namespace

InstanceServer::InstanceServer(ControlChannel& channel, LocalInstance& instance,
                               int32_t instance_id)
    : channel_(channel), instance_(instance), instance_id_(instance_id) {
  // Both run on the engine thread once per step: the stats first, then the events.
  instance_.set_step_observer([this](const InstanceStats& stats) {
    InstanceStats report = stats;
    report.send_bytes_abandoned = channel_.counters().abandoned_bytes;
    send(StatsReport{instance_id_, report});
  });
  instance_.set_event_handler([this](std::span<const InstanceEvent> events) {
    StepEvents step;
    step.instance_id = instance_id_;
    step.events.assign(events.begin(), events.end());
    step.step = instance_.stats().steps;
    send(step);
  });
}

InstanceServer::~InstanceServer() {
  instance_.set_event_handler({});
  instance_.set_step_observer({});
}

void InstanceServer::send(const ControlMessage& message) {
  try {
    channel_.send(kCoordinatorRank, message);
  } catch (const Error& e) {
    // Only after close() began (the cluster is shutting down): nobody reads it.
    spdlog::debug("instance {}: dropped a {} message: {}", instance_id_,
                  control_message_name(message), e.what());
  }
}

void InstanceServer::stop(std::string reason) {
  std::lock_guard lock(mutex_);
  if (!stop_) stop_ = std::move(reason);
}

void InstanceServer::on_leave_accepted(std::function<void()> callback) {
  std::lock_guard lock(mutex_);
  on_leave_accepted_ = std::move(callback);
}

std::string InstanceServer::serve() {
  send(InstanceReady{instance_id_, instance_.info(), instance_.stats(), {}});
  for (;;) {
    std::optional<ReceivedMessage> received = channel_.receive(kStopPoll);
    {
      std::lock_guard lock(mutex_);
      if (stop_) return *stop_;
    }
    if (!received) {
      if (!channel_.receiving()) return "the control channel stopped";
      continue;
    }
    if (received->source != kCoordinatorRank) {
      spdlog::error("instance {}: dropped a {} message from rank {} (only the coordinator's count)",
                    instance_id_, control_message_name(received->message), received->source.value);
      continue;
    }
    ControlMessage& message = received->message;
    if (auto* submit = std::get_if<SubmitRequest>(&message)) {
      instance_.submit(std::move(submit->request));
    } else if (const auto* cancel = std::get_if<Cancel>(&message)) {
      instance_.cancel(cancel->id);
    } else if (const auto* shutdown = std::get_if<Shutdown>(&message)) {
      return shutdown->reason;
    } else if (std::holds_alternative<LeaveAccepted>(message)) {
      std::function<void()> callback;
      {
        std::lock_guard lock(mutex_);
        callback = on_leave_accepted_;
      }
      if (callback) callback();
    } else {
      spdlog::error("instance {}: dropped an unexpected {} message", instance_id_,
                    control_message_name(message));
    }
  }
}

void report_instance_failure(ControlChannel& channel, int32_t instance_id,
                             const std::string& error) {
  channel.send(kCoordinatorRank, InstanceReady{.instance_id = instance_id, .error = error});
  for (;;) {
    std::optional<ReceivedMessage> received = channel.receive(kIdleReceive);
    if (!received && !channel.receiving()) return;
    if (received && received->source == kCoordinatorRank &&
        std::holds_alternative<Shutdown>(received->message))
      return;
  }
}

}  // namespace duet

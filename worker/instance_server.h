// An instance leader's side of the control plane (mpirun deployments).
//
// The leader rank runs the engine behind a LocalInstance (its engine thread)
// and this server on its main thread. serve() tells the coordinator the
// instance is ready (InstanceReady: model info and first stats), then applies
// the coordinator's SubmitRequest and Cancel messages to the instance until a
// Shutdown arrives. The instance's events and stats go back from its engine
// thread: per engine step one StatsReport, then one StepEvents message holding
// all of that step's events (when it had any), so the coordinator's view of
// the KV pool is never older than the events it hands to clients. Nothing polls: the main thread
// blocks in ControlChannel::receive, the engine thread on its queue.
//
// Thread affinity: construct, serve() and destroy on one thread (the main
// thread); the forwarding callbacks run on the instance's engine thread and
// only call ControlChannel::send (any thread).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>

#include "common/cluster/cluster_spec.h"
#include "common/control_plane/control_channel.h"
#include "worker/local_instance.h"

namespace duet {

class InstanceServer final {
 public:
  // `channel` and `instance` outlive the server. Installs the instance's event
  // handler and step observer; the destructor removes them. Destroy the
  // instance (joining its engine thread) before closing the channel, so no
  // step sends after close; a send that still races close is dropped.
  InstanceServer(ControlChannel& channel, LocalInstance& instance, int32_t instance_id);
  ~InstanceServer();
  InstanceServer(const InstanceServer&) = delete;
  InstanceServer& operator=(const InstanceServer&) = delete;

  // Sends InstanceReady, then serves until the coordinator's Shutdown (or
  // stop()) and returns its reason. Messages from any rank but the
  // coordinator, and kinds an instance does not take, are logged and dropped.
  std::string serve();

  // A joined instance's leave (tools/serve_join.cpp). Any thread: serve()
  // returns `reason` within kStopPoll.
  void stop(std::string reason);
  // Called on serve()'s thread when the coordinator's LeaveAccepted arrives.
  void on_leave_accepted(std::function<void()> callback);

 private:
  void send(const ControlMessage& message);  // any thread; drops after close

  ControlChannel& channel_;
  LocalInstance& instance_;
  const int32_t instance_id_;
  std::mutex mutex_;  // guards the members below
  std::optional<std::string> stop_;
  std::function<void()> on_leave_accepted_;
};

// A leader whose instance could not start: tells the coordinator why (an
// InstanceReady with `error`), then waits for its Shutdown so that every rank
// closes the channel together. Main thread.
void report_instance_failure(ControlChannel& channel, int32_t instance_id,
                             const std::string& error);

}  // namespace duet

// What one instance does, with no thread and no clock of its own.
//
// It owns the engine. Commands (the coordinator's submit and cancel, the
// peers' orders, handoffs and releases) apply between steps; step() runs one
// engine step; events (admissions, tokens, finishes) collect until taken.
// LocalInstance (worker/local_instance.h) feeds it from its engine thread, the
// cluster simulator's instance (sim/sim_instance.h) from a simulated clock:
// the simulator runs this very logic. Disaggregated, a decode instance
// imports the prompt of every request that names a prefill peer and reports
// all of its events, admission included; a prefill instance exports the
// prompts its decode peers order and reports none of its own. A sequence's
// state is the engine's (Engine::state), read here and kept nowhere else.
//
// Thread affinity: one thread, the instance's engine thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <variant>
#include <vector>

#include "common/serving.h"
#include "worker/engine.h"
#include "worker/tensor_parallel.h"

namespace duet {

// A request's engine options (its prompt aside), as every instance submits it.
RequestOptions request_options(const InstanceRequest& request);
// How an engine's finish reads to the coordinator.
InstanceFinish instance_finish(FinishReason reason);

// How an instance reaches its peers: a KV transfer (worker/transfer/), or the
// simulator's model of one. Called on the engine thread, inside apply() and
// step().
class InstancePeers {
 public:
  virtual ~InstancePeers() = default;
  // Decode side: the import's blocks are reserved in `cache`; the rows are to
  // land there, and `order` goes to prefill instance `prefill_peer`.
  virtual void start_import(int32_t prefill_peer, const PrefillOrder& order,
                            const TpImport& import, KvCache& cache) = 0;
  // Decode side: an import in flight was cancelled. True: no row can land any
  // more and its blocks go now; false: they wait for ImportReleased.
  virtual bool abort_import(int32_t prefill_peer, RequestId id) = 0;
  // Prefill side: rows [pos0, pos0 + n) of `layer` are in `cache`, valid
  // until the call returns.
  virtual void send_rows(RequestId id, int64_t layer, int64_t pos0, int64_t n,
                         std::span<const int32_t> decode_ranks, const KvCache& cache,
                         std::span<const int32_t> block_table) = 0;
  virtual void send_handoff(int32_t decode_peer, const KvHandoff& handoff) = 0;
  // Whether rows to or from `rank` move device to device.
  virtual bool device_transfer(int32_t /*rank*/) const { return false; }
};

struct InstanceCoreOptions {
  InstancePeers* peers = nullptr;  // outlives the core; none: no disaggregation
  TpLeader* tp = nullptr;          // this instance's followers (outlives the core)
  // The longest a decode instance waits for a prompt's KV, from the moment
  // its blocks are reserved (the prefill side's queue included).
  std::chrono::milliseconds transfer_timeout{120'000};
  // This instance's ranks, leader first, and every instance's by its leader
  // (tensor parallelism). Empty / absent: one rank each.
  std::vector<int32_t> own_ranks;
  std::map<int, std::vector<int32_t>> instance_ranks;
  // The clock events are stamped with (admission, prefill time). None: events
  // carry no time and the coordinator stamps them on arrival (the simulator).
  std::function<std::chrono::steady_clock::time_point()> now;
};

// What an instance is told.
struct CancelRequest {
  RequestId id;
};
struct PeerOrder {  // from a decode peer: compute this prompt for it
  int32_t peer = 0;
  PrefillOrder order;
};
struct OrderWithdrawn {  // from a decode peer: its order's request was cancelled
  RequestId id;
};
struct ImportDone {  // every row of an import is in
  RequestId id;
  KvHandoff handoff;
};
struct ImportFailed {  // an import ended without its KV; nothing more is written
  RequestId id;
  ServeError error;
};
struct ImportReleased {  // after an abort: nothing more is written
  RequestId id;
};
struct ImportQuarantined {  // a lost rank may still write the blocks: keep them
  RequestId id;
};
using InstanceCommand = std::variant<InstanceRequest, CancelRequest, PeerOrder, OrderWithdrawn,
                                     ImportDone, ImportFailed, ImportReleased, ImportQuarantined>;

class InstanceCore final {
 public:
  InstanceCore(std::unique_ptr<Engine> engine, InstanceCoreOptions options);
  InstanceCore(const InstanceCore&) = delete;
  InstanceCore& operator=(const InstanceCore&) = delete;

  void apply(InstanceCommand& command);
  // One engine step; false when it had nothing to do. A step that throws
  // (a broken invariant) fails every live request and export, and the
  // instance goes on.
  bool step();

  bool has_events() const { return !events_.empty(); }
  // The events since the last take, in order.
  std::vector<InstanceEvent> take_events();
  InstanceStats stats() const;
  bool idle() const { return engine_->idle(); }
  Engine& engine() { return *engine_; }
  const Engine& engine() const { return *engine_; }

 private:
  // A prompt this (prefill) instance computes for a decode peer.
  struct Export {
    SequenceId sequence;
    int32_t peer = 0;
    std::vector<int32_t> decode_ranks;  // leader (peer) first
    std::chrono::steady_clock::time_point admitted_at{};
    int64_t rows_sent = 0;
  };

  void apply_submit(InstanceRequest& request);
  void apply_cancel(RequestId id);
  void apply_order(PeerOrder& order);
  void apply_withdrawn(RequestId id);
  void apply_done(const ImportDone& done);
  void apply_failed(const ImportFailed& failed);
  void apply_released(RequestId id);
  void apply_quarantined(RequestId id);
  // Cancels a live sequence; an import whose rows may still land keeps its
  // blocks until ImportReleased.
  void cancel_sequence(RequestId id, SequenceId sequence);
  // An import that ends without its KV (failed, or released after a cancel):
  // the followers let go of it too, then the engine frees its blocks.
  void release_import(RequestId id, SequenceId sequence);
  void forget(RequestId id, SequenceId sequence);
  void fail(RequestId id, ServeError error);  // a finished kFailed event
  void fail_everything(const std::string& what);
  void mirror_step(const ForwardBatch& batch);  // tensor parallelism
  std::chrono::steady_clock::time_point now() const;

  std::unique_ptr<Engine> engine_;
  const InstanceCoreOptions options_;
  std::map<RequestId, SequenceId> sequences_;
  std::map<SequenceId, RequestId> requests_;
  std::map<RequestId, SequenceId> releasing_;  // cancelled imports waiting for ImportReleased
  // Imports whose blocks a lost rank's rows may still land in: kept forever.
  int64_t n_quarantined_ = 0;
  int64_t quarantined_blocks_ = 0;
  std::map<RequestId, Export> exports_;
  bool abort_released_ = false;        // what the last abort_import said
  std::vector<InstanceEvent> events_;  // since the last take
  std::vector<TpExport> tp_exports_;   // of the current step
};

}  // namespace duet

// How the RPC front streams a request's output to its client.
//
// UpdateRelay is the front's UpdateSink: the service calls it on the
// instance's event thread once per step, and it carries that step's updates
// into the front's kj event loop in one crossing. StreamTable, on the loop
// thread, turns each request's updates into TokenSink.write() chunks (one in
// flight at a time, so tokens batch up behind a slow client) and a final
// done(); when a client is gone it cancels the request, freeing its KV.
#pragma once

#include <kj/async.h>
#include <kj/refcount.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/duet.capnp.h"
#include "coordinator/service.h"

namespace duet {

// Carries each engine step's updates into the loop thread with one
// executeSync call. The loop never waits for the engine, so the engine's short
// wait for the loop cannot deadlock. It also counts the requests that still
// owe a final update, so that the front is destroyed only once the service is
// done calling deliver().
class UpdateRelay final : public UpdateSink {
 public:
  using LoopHandler = std::function<void(std::vector<RequestUpdate>&)>;

  // kj::Own's destructor is noexcept(false); UpdateSink's is noexcept.
  ~UpdateRelay() noexcept override {}

  // Loop thread, before the first start(): updates go to `handler`, which
  // runs on the loop thread.
  void attach(kj::Own<const kj::Executor> executor, LoopHandler handler);
  // Loop thread, as it shuts down: later updates are only counted.
  void detach();
  // Loop thread: a started request now owes one final update.
  void started();

  // The instance's event thread.
  void deliver(std::vector<RequestUpdate> updates) override;

  // Any thread but the loop's, once the loop has exited: waits until every
  // request started through this relay got its final update.
  void wait_finished();

 private:
  void run_handler(std::vector<RequestUpdate>& updates);  // loop thread

  std::mutex mutex_;  // guards attached_, loop_thread_ and n_unfinished_
  std::condition_variable finished_cv_;
  kj::Own<const kj::Executor> executor_;  // set by attach(), then read-only
  LoopHandler handler_;                   // set by attach(), then read-only
  std::thread::id loop_thread_;
  bool attached_ = false;
  int64_t n_unfinished_ = 0;
};

// The streams of the requests the front started, by request id. Loop thread
// only. Per request it keeps the text and tokens not yet written and at most
// one TokenSink.write() in flight; when the write resolves, whatever piled up
// meanwhile goes as the next chunk. After the final update and an empty
// buffer it calls done() and forgets the request.
//
// Re-entrancy: should Service::cancel ever deliver a final update at once,
// every method looks its stream up again after calling into the service.
class StreamTable final : public kj::Refcounted, private kj::TaskSet::ErrorHandler {
 public:
  explicit StreamTable(Service& service) : service_(service), tasks_(*this) {}

  void add(RequestId id, rpc::TokenSink::Client sink, bool include_token_ids);
  void on_updates(std::vector<RequestUpdate>& updates);
  // Cancels the request unless it already finished (RequestHandle).
  void cancel(RequestId id);

  // Stopping, step one: refuses new requests (closed()) and cancels the
  // unfinished ones, whose final updates still reach their clients as
  // done(cancelled).
  void close();
  bool closed() const { return closed_; }
  // Resolves once every stream sent its done() and the client answered it.
  kj::Promise<void> drained();
  // Stopping, last step (also when the loop fails): cancels what is left and
  // drops the client sinks; their connections close next.
  void shut_down();

 private:
  struct FinalUpdate {
    ServeFinish finish = ServeFinish::kStop;
    RequestTimings timings;
    std::optional<ServeError> error;
  };
  struct Stream {
    rpc::TokenSink::Client sink;
    bool include_token_ids = false;
    std::string text;             // not yet written
    std::vector<int32_t> tokens;  // not yet written (include_token_ids)
    bool writing = false;         // a write() is in flight
    bool broken = false;          // a write() failed: the client is gone
    std::optional<FinalUpdate> final_update;
  };
  using Streams = std::map<RequestId, Stream>;

  // Starts the next write, or done() once everything is written.
  void pump(RequestId id);
  void on_written(RequestId id, bool ok);
  std::vector<RequestId> unfinished() const;
  void erase(Streams::iterator it);
  void taskFailed(kj::Exception&& exception) override;

  Service& service_;
  Streams streams_;
  bool closed_ = false;
  kj::Own<kj::PromiseFulfiller<void>> empty_fulfiller_;  // while drained() waits
  kj::TaskSet tasks_;  // last: destroyed first, with the callbacks that use `this`
};

}  // namespace duet

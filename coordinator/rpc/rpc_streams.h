// How the RPC front streams a request's output to its client.
//
// UpdateRelay is the front's UpdateSink: the service calls it on the
// instance's event thread once per step, and it queues that step's updates
// for the front's kj event loop, never waiting for it. StreamTable, on the loop
// thread, turns each request's updates into TokenSink.write() chunks (one in
// flight at a time, so tokens batch up behind a slow client) and a final
// done(); when a client is gone it cancels the request, freeing its KV.
// ConnectionActivity tells a connection's idle timeout whether it streams.
#pragma once

#include <kj/async.h>
#include <kj/refcount.h>
#include <kj/time.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/duet.capnp.h"
#include "coordinator/service.h"

namespace duet {

// Carries each engine step's updates into the loop thread without ever
// making the engine wait for it: deliver() appends the step's updates to a
// queue under a short lock and, when the loop is not already due to drain,
// wakes it through a cross-thread fulfiller. The loop drains the queue in
// arrival order, so each request's updates stay in order. It also counts the
// requests that still owe a final update, so that the front is destroyed
// only once the service is done calling deliver().
//
// Lifetimes: nothing is posted that points at the relay except its own
// fulfiller, which the loop thread destroys in detach() while the promise it
// fulfils is still alive; after detach() deliver() only counts. The relay is
// a member of the server and outlives its loop thread (wait_finished()).
class UpdateRelay final : public UpdateSink {
 public:
  using LoopHandler = std::function<void(std::vector<RequestUpdate>&)>;

  // kj::Own's destructor is noexcept(false); UpdateSink's is noexcept.
  ~UpdateRelay() noexcept override {}

  // Loop thread, before the first start(): updates go to `handler`, which
  // runs on the loop thread, from the promise run() returns.
  void attach(LoopHandler handler);
  // Loop thread: drains the queue into the handler whenever deliver() wakes
  // it; never resolves. Keep it alive (eagerly evaluated) until detach().
  kj::Promise<void> run();
  // Loop thread, as it shuts down: queued updates are dropped and later ones
  // only counted.
  void detach();
  // Loop thread: a started request now owes one final update.
  void started();

  // The instance's event thread (any thread): never blocks on the loop.
  void deliver(std::vector<RequestUpdate> updates) override;

  // Any thread but the loop's, once the loop has exited: waits until every
  // request started through this relay got its final update.
  void wait_finished();

 private:
  void drain();  // loop thread

  std::mutex mutex_;  // guards everything below but handler_
  std::condition_variable finished_cv_;
  LoopHandler handler_;  // set by attach(), then read-only; loop thread
  bool attached_ = false;
  std::vector<std::vector<RequestUpdate>> queue_;  // steps not yet handled, oldest first
  // Armed by run() while it waits; taken (and fulfilled) by the first
  // deliver() after that, or destroyed by detach() on the loop thread.
  kj::Own<kj::CrossThreadPromiseFulfiller<void>> wake_;
  int64_t n_unfinished_ = 0;
};

// What one client connection is doing, for its idle timeout: when it last
// made a call or ended a stream, and how many of its streams still run. A
// connection with a stream running (even one waiting in the queue for its
// first token) is never idle. Loop thread only; refcounted because the
// connection's capabilities and its streams share it.
class ConnectionActivity final : public kj::Refcounted {
 public:
  explicit ConnectionActivity(const kj::MonotonicClock& clock)
      : clock_(clock), last_(clock.now()) {}

  void touch() { last_ = clock_.now(); }
  kj::TimePoint last() const { return last_; }
  void stream_started() { ++n_streams_; }
  void stream_ended() {
    --n_streams_;
    touch();
  }
  bool streaming() const { return n_streams_ > 0; }

 private:
  const kj::MonotonicClock& clock_;
  kj::TimePoint last_;
  int64_t n_streams_ = 0;
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

  // `connection` is the client connection the request came on: it counts
  // as streaming until the request's done() is sent.
  void add(RequestId id, rpc::TokenSink::Client sink, bool include_token_ids,
           kj::Own<ConnectionActivity> connection);
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
    kj::Own<ConnectionActivity> connection;
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

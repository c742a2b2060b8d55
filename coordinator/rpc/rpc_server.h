// The coordinator's Cap'n Proto front (common/duet.capnp).
//
// Clients bootstrap a `Gateway`, log in for an `Inference` and call it;
// generate() streams tokens back to a `TokenSink` the client passes in, one
// write() in flight per request (pending text batches up while the client is
// slower than the model), then done(). The `RequestHandle` a started request
// returns cancels it when cancel() is called or when it is dropped before the
// request finished, so a client that disconnects frees its KV at once.
//
// Limits: at most max_connections connections (this front's own count; the
// HTTP front has its own), an idle timeout per connection, and reader limits
// (rpc_reader_limits) on every message.
//
// Threads: the server runs its own kj event loop on a thread it starts; every
// kj and capnp object lives there. The service's updates arrive on the
// instance's event thread and are queued for the loop (UpdateRelay), which
// drains them in order; the engine thread never waits for the loop. Cap'n
// Proto types stay in the coordinator/rpc_* files.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "common/net/cluster_auth.h"
#include "coordinator/cluster_admin.h"
#include "coordinator/service.h"

namespace duet {

struct RpcServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;    // 0: any free port (read it back with port())
  std::string api_key;  // empty: login accepts any key
  // Connections open at once; a connection past them is closed at once
  // (counted in duet_connections_refused_total{front="rpc"}).
  size_t max_connections = 1024;
  // A connection with no stream running and no call for this long is closed;
  // 0: never.
  std::chrono::milliseconds idle_timeout{300'000};
  // Admin calls (coordinator/rpc/rpc_admin.h): the cluster they change
  // (outlives the server), and the key a client must prove. Without either,
  // every admin call is refused with the reason.
  ClusterAdmin* admin = nullptr;
  std::optional<ClusterKey> admin_key;
};

// The Cap'n Proto reader limits of every incoming message, sized to the
// largest legitimate request (see the definition for the reckoning). A
// message over the traversal limit fails the connection ("Message is too
// large", sent to the client as the reason it is disconnected); one that
// passes it but makes the reader traverse more, or nests deeper, gets a typed
// invalidArgument. The server keeps serving either way.
struct RpcReaderLimits {
  uint64_t traversal_limit_words = 0;
  int nesting_limit = 0;
};
RpcReaderLimits rpc_reader_limits(const Service& service);

class RpcServer final {
 public:
  // Binds host:port, starts the event-loop thread and returns once it
  // listens. Throws duet::Error (kInvalidArgument) when it cannot bind.
  // `service` outlives the server, and its instance must keep delivering
  // updates until the destructor returns: the destructor cancels the requests
  // this front started and waits for their final updates, so that the
  // service never calls into a destroyed front.
  RpcServer(Service& service, RpcServerOptions options);
  ~RpcServer();  // stop(), join, wait for the final updates
  RpcServer(const RpcServer&) = delete;
  RpcServer& operator=(const RpcServer&) = delete;

  uint16_t port() const;
  // Stops accepting connections and requests and cancels what runs; the
  // cancelled requests' clients still get done(cancelled) (for up to a few
  // seconds), then every connection closes. Idempotent; callable from any
  // thread; returns without waiting for the loop to exit (the destructor does).
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace duet

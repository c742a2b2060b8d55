// The coordinator's Cap'n Proto front (common/duet.capnp).
//
// Clients bootstrap a `Gateway`, log in for an `Inference` and call it;
// generate() streams tokens back to a `TokenSink` the client passes in, one
// write() in flight per request (pending text batches up while the client is
// slower than the model), then done(). The `RequestHandle` a started request
// returns cancels it when cancel() is called or when it is dropped before the
// request finished, so a client that disconnects frees its KV at once.
//
// Threads: the server runs its own kj event loop on a thread it starts; every
// kj and capnp object lives there. The service's updates arrive on the
// instance's event thread and cross into the loop through a kj::Executor, one
// crossing per engine step. Cap'n Proto types stay in the coordinator/rpc_*
// files.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "coordinator/service.h"

namespace duet {

struct RpcServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;    // 0: any free port (read it back with port())
  std::string api_key;  // empty: login accepts any key
};

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

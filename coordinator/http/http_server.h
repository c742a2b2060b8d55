// The OpenAI-compatible HTTP front of the coordinator.
//
// Routes (HTTP/1.1, keep-alive, one request at a time per connection):
//   POST /v1/completions, POST /v1/chat/completions  (JSON, or server-sent
//        events with "stream": true; see openai_api.h for the fields)
//   GET  /v1/models, GET /v1/models/{id}
//   GET  /health, /health/live, /health/ready  (health_routes.h)
//   GET  /metrics  Service::metrics_text(), Prometheus text format 0.0.4
// Errors are OpenAI's {"error": {...}} objects with the status of their kind
// (openai_api.h); a wrong method is 405, a body over max_body_bytes 413 (and
// the connection is closed). With an API key, every route but the health ones needs
// `Authorization: Bearer KEY` (else 401).
//
// A client that goes away while its request generates (its socket reaches
// end-of-file or a write fails) gets the request cancelled, so its KV is
// freed at once.
//
// Threading: the server runs Boost.Beast on one Asio thread of its own, which
// owns every connection and calls Service::start and Service::cancel. Service
// updates arrive on the instance's event thread and are posted to that thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "coordinator/service.h"

namespace duet {

struct HttpServerOptions {
  std::string host = "127.0.0.1";  // a name or an address ("0.0.0.0", "::")
  uint16_t port = 0;               // 0: any free port
  std::string api_key;             // empty: none required
  size_t max_body_bytes = 1 << 20;
};

class HttpServer final {
 public:
  // Binds, starts the server's thread and returns once it listens; throws
  // duet::Error when it cannot bind. `service` must outlive the server.
  HttpServer(Service& service, HttpServerOptions options);
  // stop(), then waits for the thread.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // The port it listens on (the one chosen when options.port was 0).
  uint16_t port() const;

  // Closes the listening socket, cancels the requests still generating (their
  // clients get the final error response), closes every connection once its
  // response is written, and ends the server's thread; waits a few seconds at
  // most, then drops what is left. Idempotent; call it from any thread but the
  // server's own.
  void stop();

 private:
  class Impl;  // the Asio and Beast machinery (http_server_impl.h)
  std::unique_ptr<Impl> impl_;
};

}  // namespace duet

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
// `Authorization: Bearer KEY` (else 401, decided from the header fields before
// the body is read). A completion that arrives while the service's waiting
// queue is full gets its 429 from the header fields too. Past max_connections
// open connections, a new one gets 503 {"error": {"type": "overloaded", ...}}
// and is closed without its request being read (counted in
// duet_connections_refused_total); a connection idle for idle_timeout between
// requests is closed.
//
// A client that goes away while its request generates (its socket reaches
// end-of-file or a write fails) gets the request cancelled, so its KV is
// freed at once.
//
// Threading: the server runs Boost.Beast on one Asio thread of its own (the
// I/O thread), which owns every connection: it reads and frames requests,
// checks the API key, admits requests (Service::admit), cancels them and
// writes responses. What costs in proportion to a request's size, the JSON
// parsing, validation and tokenization (Service::prepare, /tokenize,
// /detokenize), runs on a pool of worker_threads, so a flood of large
// requests never holds up the token streams the I/O thread writes. Service
// updates arrive on the instance's event thread and are posted to the I/O
// thread.
#pragma once

#include <chrono>
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
  // Connections open at once; the next ones get 503 (overloaded) and close.
  size_t max_connections = 1024;
  // How long a connection may sit with no request under way (keep-alive
  // idle), and the longest wait for the rest of a request's bytes.
  std::chrono::milliseconds idle_timeout{60'000};
  int worker_threads = 2;  // parse, validate and tokenize requests (>= 1)
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

// The OpenAI-compatible HTTP front of the coordinator (HTTP/1.1, keep-alive, one
// request at a time per connection):
//   POST /v1/completions, /v1/chat/completions  (JSON, or server-sent events with
//        "stream": true; the fields: openai_api.h)
//   GET  /v1/models, /v1/models/{id}; /health, /health/live, /health/ready
//        (health_routes.h); /metrics (Service::metrics_text(), Prometheus text format 0.0.4)
// Errors are OpenAI's {"error": {...}} objects with their kind's status; a wrong method
// is 405, a body over max_body_bytes 413 (and the connection closed). From the header
// fields, before the body is read: with an API key every route but the health ones
// needs `Authorization: Bearer KEY` (else 401), and a completion while the service's
// waiting queue is full gets 429. Past max_connections a new connection gets 503
// `overloaded` and is closed unread (duet_connections_refused_total); one idle for
// idle_timeout is closed. A client that goes away mid-generation has its request
// cancelled, so its KV is freed at once.
//
// Threads (docs/ARCHITECTURE.md, "The fronts' threads and limits"): one Asio I/O thread
// owns every connection; JSON parsing, validation and tokenization run on
// worker_threads; Service updates are posted to the I/O thread.
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
  // Chat replies that begin with a <think> block return it as
  // reasoning_content (openai::ReasoningSplitter); completions never do.
  bool split_reasoning = false;
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

// duet-client's connection to a Duet server (common/duet.capnp).
//
// A Session connects, checks the protocol version, logs in and runs calls to
// their end on the caller's kj event loop (one thread: the program's). A
// generation streams its text to a callback as chunks arrive; SIGINT, which
// the program must have captured with kj::UnixEventPort::captureSignal before
// kj::setupAsyncIo, cancels it on the server, and the session still waits for
// the server's done() so that the timings are complete.
#pragma once

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>
#include <kj/async-unix.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "common/duet.capnp.h"

namespace duet::client {

// Exit codes: 1 when the server cannot be reached or the connection breaks,
// 2 for a refused request or bad flags, 130 after Ctrl-C.
constexpr int kExitConnection = 1;
constexpr int kExitRefused = 2;
constexpr int kExitInterrupted = 130;

// A failure reported as one line on stderr ("duet-client: KIND: MESSAGE").
class ClientError : public std::runtime_error {
 public:
  ClientError(int exit_code, std::string kind, const std::string& message)
      : std::runtime_error(message), exit_code_(exit_code), kind_(std::move(kind)) {}
  int exit_code() const { return exit_code_; }
  const std::string& kind() const { return kind_; }

 private:
  int exit_code_;
  std::string kind_;
};

std::string_view error_kind_name(rpc::ErrorKind kind);  // "invalid_argument", "too_long", ...
std::string_view finish_reason_name(rpc::FinishReason reason);  // "stop", "length", ...

struct Endpoint {
  std::string host;
  uint16_t port = 0;
};

// "HOST:PORT" or "[V6]:PORT"; throws ClientError (exit 2) when malformed.
Endpoint parse_endpoint(std::string_view text);

struct Timings {
  double queue_ms = 0, ttft_ms = 0, tpot_ms = 0, e2e_ms = 0;
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

struct GenerateOutcome {
  rpc::FinishReason reason = rpc::FinishReason::STOP;
  Timings timings;
  std::string text;          // everything generated
  bool interrupted = false;  // Ctrl-C cancelled it
  std::string error_kind;    // set when reason is ERROR
  std::string error_message;
};

class Session {
 public:
  // Connects and logs in. Throws ClientError: exit 1 when the server cannot
  // be reached, 2 when the login is refused.
  Session(kj::AsyncIoContext& io, const Endpoint& endpoint, const std::string& api_key);

  // Runs one generation to its end. `fill` writes the request; `on_text`
  // receives each chunk's text as it arrives. Throws ClientError: exit 2 when
  // the server refuses the request, 1 when the connection breaks.
  GenerateOutcome generate(const std::function<void(rpc::GenerateRequest::Builder)>& fill,
                           const std::function<void(std::string_view)>& on_text);

  capnp::Response<rpc::Inference::StatsResults> stats();
  capnp::Response<rpc::Inference::ModelInfoResults> model_info();

  kj::WaitScope& wait_scope() { return io_.waitScope; }
  kj::UnixEventPort& event_port() { return io_.unixEventPort; }

 private:
  // Waits for `promise`; a kj exception (the connection broke) becomes a
  // ClientError with exit 1.
  template <typename T>
  T wait(kj::Promise<T>&& promise);

  kj::AsyncIoContext& io_;
  kj::Own<kj::AsyncIoStream> stream_;
  kj::Own<capnp::TwoPartyClient> rpc_;
  rpc::Inference::Client inference_ = nullptr;
};

}  // namespace duet::client

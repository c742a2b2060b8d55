// duet-client's session with a Duet server: calls run to their end on the
// program's one kj event loop (client/ makes the connection and the calls).
// A generation streams its text to a callback as chunks arrive; SIGINT, which
// the program must have captured with kj::UnixEventPort::captureSignal before
// kj::setupAsyncIo, cancels it on the server, and the session still waits for
// the server's done() so that the timings are complete.
#pragma once

#include <kj/async-io.h>
#include <kj/async-unix.h>

#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "client/connection.h"
#include "client/generation.h"

namespace duet::client {

// Exit codes: 1 when the server cannot be reached or the connection breaks,
// 2 for a refused request or bad flags, 130 after Ctrl-C.
constexpr int kExitConnection = 1;
constexpr int kExitRefused = 2;
constexpr int kExitInterrupted = 130;

// A failure reported as one line on stderr ("duet-client: KIND: MESSAGE"),
// beside the RpcErrors of the connection and its calls (exit 1 when the
// connection was lost, else 2).
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

struct GenerateOutcome {
  Finish finish;
  std::string text;          // everything generated
  bool interrupted = false;  // Ctrl-C cancelled it
};

class Session {
 public:
  // Connects and logs in (see Connection). Throws RpcError.
  Session(kj::AsyncIoContext& io, const Endpoint& endpoint, const std::string& api_key)
      : io_(io), connection_(io, endpoint, api_key) {}

  // Runs one generation to its end; `on_text` receives each chunk's text as
  // it arrives. Throws RpcError when the server refuses the request or the
  // connection breaks; ClientError (exit 130) when a second Ctrl-C stops the
  // wait for the server.
  GenerateOutcome generate(const Prompt& prompt, const GenerateOptions& options,
                           const std::function<void(std::string_view)>& on_text);

  capnp::Response<rpc::Inference::StatsResults> stats();
  capnp::Response<rpc::Inference::ModelInfoResults> model_info();
  rpc::HealthStatus health();
  // Proves the cluster key of `key_file` (common/net/admin_proof.h) and asks
  // for `instance` to take `role`; returns the coordinator's one line. Throws
  // RpcError with the server's kind when it refuses, ClientError
  // (invalid_argument, exit 2) for a key file that cannot be read.
  std::string set_role(const std::string& key_file, int instance, const std::string& role);

  kj::WaitScope& wait_scope() { return io_.waitScope; }
  kj::UnixEventPort& event_port() { return io_.unixEventPort; }

 private:
  // Waits for `promise`; a kj exception (the connection broke) becomes an
  // RpcError.
  template <typename T>
  T wait(kj::Promise<T>&& promise);

  kj::AsyncIoContext& io_;
  Connection connection_;
};

}  // namespace duet::client

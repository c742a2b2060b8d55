// A client's connection to a Duet server over Cap'n Proto RPC
// (common/duet.capnp), shared by `duet-client` and `duet-bench`: the server's
// address, the connection with its version check and login, and the names of
// the protocol's enums as both tools print them.
//
// Thread affinity: a Connection, and every capability it hands out, belong to
// the kj event loop of the thread that made it.
#pragma once

#include <capnp/rpc-twoparty.h>
#include <kj/async-io.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "common/duet.capnp.h"

namespace duet::client {

std::string_view error_kind_name(rpc::ErrorKind kind);  // "invalid_argument", "too_long", ...
std::string_view finish_reason_name(rpc::FinishReason reason);  // "stop", "length", ...

// A failure to reach the server or to run a call on it. kind() is
// "connection" (the server cannot be reached, or the connection broke),
// "protocol" (the server speaks another protocol version), "invalid_argument"
// for a malformed address, else the kind of the server's refusal
// (error_kind_name), or "internal" for any other failure of a call.
class RpcError : public std::runtime_error {
 public:
  RpcError(std::string kind, const std::string& message)
      : std::runtime_error(message), kind_(std::move(kind)) {}
  const std::string& kind() const { return kind_; }
  // The server was never reached, or went away: no request was refused.
  bool lost_connection() const { return kind_ == "connection" || kind_ == "protocol"; }

 private:
  std::string kind_;
};

// A call's kj exception as an RpcError: "connection" when the connection
// broke, else "internal".
RpcError rpc_error(const kj::Exception& exception);

struct Endpoint {
  std::string host;  // an IPv6 address without brackets
  uint16_t port = 0;

  std::string describe() const;  // "HOST:PORT", "[V6]:PORT"
};

// "HOST:PORT" or "[V6]:PORT"; throws RpcError (invalid_argument) naming
// what is wrong.
Endpoint parse_endpoint(std::string_view text);

class Connection final {
 public:
  // Connects to `endpoint`, checks the server's protocol version and logs in
  // with `api_key`, waiting on `io`'s event loop (this thread's). Throws
  // RpcError: "connection" when the server cannot be reached, "protocol"
  // when it speaks another version, the server's kind when it refuses the
  // login.
  Connection(kj::AsyncIoContext& io, const Endpoint& endpoint, const std::string& api_key);
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // The logged-in capability every call goes through.
  rpc::Inference::Client& inference() { return inference_; }
  // The server's bootstrap capability (admin calls start there).
  rpc::Gateway::Client& gateway() { return gateway_; }

 private:
  kj::Own<kj::AsyncIoStream> stream_;
  kj::Own<capnp::TwoPartyClient> rpc_;  // over stream_
  rpc::Gateway::Client gateway_ = nullptr;
  rpc::Inference::Client inference_ = nullptr;
};

}  // namespace duet::client

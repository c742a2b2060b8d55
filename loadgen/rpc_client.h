// duet-bench over Duet's Cap'n Proto protocol (common/duet.capnp), through
// the shared client library (client/: connection, calls, streams).
//
// One connection carries every request: Gateway.login(apiKey) gives the
// Inference capability; each request is Inference.generate with the prompt as
// token ids, maxTokens, ignoreEos and greedy sampling, and a TokenSink of its
// own whose write() calls are the token chunks (timestamped as they arrive)
// and whose done() carries the server's timings. A refusal's error kind
// ("overloaded", "too_long", ...) becomes the record's error_kind; a failure
// after the start "error" or "cancelled"; a broken connection "connection";
// a request over its deadline "timeout" (and is dropped, which cancels it on
// the server).
//
// Thread affinity: every kj and Cap'n Proto object lives on the client's own
// event-loop thread; send() and tokenize() reach it through its kj::Executor
// from any other thread (never from the client's own thread, i.e. not from a
// RecordDone callback).
#pragma once

#include <memory>
#include <string>

#include "loadgen/client.h"

namespace duet::loadgen {

struct RpcClientOptions {
  std::string endpoint = "127.0.0.1:7433";  // HOST:PORT, or [V6]:PORT
  std::string api_key;
  double request_timeout_s = 600;  // from sending to done()
};

// Connects, checks the protocol version and logs in. Throws duet::Error when
// the server cannot be reached, speaks another protocol or refuses the key
// ("KIND: MESSAGE", the kinds of client::RpcError).
std::unique_ptr<Client> make_rpc_client(const RpcClientOptions& options);

}  // namespace duet::loadgen

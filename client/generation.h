// One generation over a Connection (client/connection.h): the request written
// from plain values, the server's answer (started or refused), and the
// stream of text chunks and the finish handed to a StreamReceiver.
//
// Thread affinity: the connection's event loop, for everything here; a
// receiver is called on that loop only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "client/connection.h"

namespace duet::client {

struct ChatTurn {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// Text (the server tokenizes it, special tokens parsed), token ids as they
// are, or chat turns (the model's chat template applies).
using Prompt = std::variant<std::string, std::vector<int32_t>, std::vector<ChatTurn>>;

// Everything of a request but its prompt; the defaults are the protocol's.
struct GenerateOptions {
  uint32_t max_tokens = 0;   // 0: the server's default
  float temperature = 0.0f;  // 0: greedy
  uint64_t seed = 0;
  float top_p = 1.0f;  // 1: off
  int32_t top_k = 0;   // 0: off
  float min_p = 0.0f;  // 0: off
  std::vector<std::string> stop;
  bool ignore_eos = false;  // generate exactly max_tokens tokens
};

struct Timings {
  double queue_ms = 0, ttft_ms = 0, tpot_ms = 0, e2e_ms = 0;
  uint32_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};

// The server's done(): how the generation ended.
struct Finish {
  rpc::FinishReason reason = rpc::FinishReason::STOP;
  Timings timings;
  std::string error_kind;  // with reason ERROR (error_kind_name), and its message
  std::string error_message;
};

// Hears one generation's stream, on the connection's event loop.
class StreamReceiver {
 public:
  virtual ~StreamReceiver() = default;
  // Each chunk's text as it arrives (valid UTF-8; may be empty).
  virtual void on_text(std::string_view text) = 0;
  // The server's done(), at most once and last.
  virtual void on_finish(const Finish& finish) = 0;
  // The server let go of the stream without done(): the connection went
  // away, or the request was refused. Last too, never after on_finish.
  virtual void on_dropped() = 0;
};

// Why the server refused a request (nothing of it runs).
struct Refusal {
  std::string kind;  // error_kind_name
  std::string message;
};

// The server's answer to a generate call.
struct GenerateStart {
  // Started: hold the handle until the finish, since dropping it cancels
  // the request on the server.
  rpc::RequestHandle::Client handle = nullptr;
  std::optional<Refusal> refused;
};

// A generate call, written and ready to go; send() once. Its stream goes to
// `receiver`, which the RPC system owns from send() on, as long as the
// server holds the stream.
class GenerateCall final {
 public:
  GenerateCall(rpc::Inference::Client& inference, const Prompt& prompt,
               const GenerateOptions& options, std::unique_ptr<StreamReceiver> receiver);

  // Resolves with the server's answer; rejects (a kj exception, see
  // rpc_error) when the connection breaks first.
  kj::Promise<GenerateStart> send();

 private:
  capnp::Request<rpc::Inference::GenerateParams, rpc::Inference::GenerateResults> request_;
};

}  // namespace duet::client

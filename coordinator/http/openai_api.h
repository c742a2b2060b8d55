// The OpenAI-compatible JSON of Duet's HTTP front: request bodies in,
// response bodies, server-sent events and error objects out.
//
// Pure functions and values, no sockets and no threads: the HTTP server
// (http_server.h) reads the bytes and calls these, and they can be tested and
// fuzzed alone. A request body becomes a ServeRequest or an ApiError that says
// which field is wrong and why (the fields: parse_completion_request);
// validation of values that need the model (prompt length, token ids,
// max_tokens over the limit) stays with Service::start.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "coordinator/http/reasoning.h"
#include "coordinator/service.h"

namespace duet::openai {

enum class Endpoint {
  kCompletions,      // POST /v1/completions
  kChatCompletions,  // POST /v1/chat/completions
};

struct CompletionRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // as the client named it; may be empty
  ServeRequest serve;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// An error reply: its HTTP status and OpenAI's error object
// {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  unsigned status = 500;
  std::string message;
  std::string type;       // "invalid_request_error", "authentication_error", ...
  std::string code;       // "invalid_json", "model_not_found", ...
  std::string param;      // the offending request field; empty: none
  int retry_after_s = 0;  // > 0: the reply carries Retry-After
};

// The reply for a typed error of the service: invalid_argument and too_long
// 400, not_found 404, unauthenticated 401, overloaded 429 and unavailable 503
// (both with Retry-After), internal 500.
ApiError api_error(const ServeError& error);
// A 400 for the request field `param` (may be empty).
ApiError invalid_request(std::string code, std::string param, std::string message);
// The JSON body of an error reply.
std::string error_body(const ApiError& error);

// Parses the body of a completions or chat-completions request. `default_seed`
// is the seed when the request names none. Checks JSON types, UTF-8 and the
// ranges of the sampling controls; never throws for bad input.
// Requests follow OpenAI's: `model`, `prompt` (a string, one token-id list, or
// a list holding one of those), `messages` (content a string or a list of
// text parts), `n` (only 1), `stop` (a string or a list), `max_tokens`
// (chat also `max_completion_tokens`), `temperature` (default 1, as
// OpenAI's), `top_p`, `seed` (random when absent), `stream`,
// `stream_options.include_usage`, and the extras `top_k` (-1 or 0: off),
// `min_p`, `frequency_penalty`, `presence_penalty`, `repetition_penalty`,
// `ignore_eos`, and vLLM's `return_token_ids` (each choice, whole or streamed
// chunk, then carries its generated ids as `token_ids`, an end-of-generation
// token included). Unknown fields are ignored; known features Duet lacks
// (`logprobs`, `echo`, `best_of` > 1, `suffix`, tools) are refused.
std::variant<CompletionRequest, ApiError> parse_completion_request(Endpoint endpoint,
                                                                   std::string_view body,
                                                                   uint64_t default_seed);

// The error reply for a final update that did not finish normally (kError,
// or kCancelled, which reaches a client only when the server shuts down);
// nullopt for kStop and kLength.
std::optional<ApiError> failure(const RequestUpdate& final_update);

// "stop" or "length" (what OpenAI's finish_reason says for the finishes that
// end a response normally).
std::string_view finish_reason(ServeFinish finish);

// The responses of one admitted request: one complete body, or (streaming) the
// server-sent events `data: {json}\n\n` of each update and `data: [DONE]\n\n`
// after the last. Holds the per-request constants (id, creation time, model),
// whether the first chat chunk went out, and (whole responses) the text and
// token ids so far. One per request; not thread-safe.
class ResponseWriter {
 public:
  // `id` is the response id ("cmpl-..." or "chatcmpl-..."), `created` Unix seconds.
  // `split_reasoning`: a chat reply's leading <think> block goes to
  // `reasoning_content` (message or delta) apart from `content`
  // (ReasoningSplitter's rule); completions keep the raw text.
  ResponseWriter(const CompletionRequest& request, std::string id, int64_t created,
                 std::string model, bool split_reasoning = false);

  // Streaming: the events that open the stream (chat: the chunk with
  // delta.role "assistant"; completions: none).
  std::string stream_start();
  // Streaming: the events of one update. A final update adds, for kStop and
  // kLength, the chunk with finish_reason and Duet's timings, the usage chunk
  // when asked for, and [DONE]; for the others, stream_error(failure()).
  std::string stream_update(const RequestUpdate& update);
  // Streaming: an error after the stream began, as OpenAI streams one: an
  // event {"error": {...}}, then [DONE].
  static std::string stream_error(const ApiError& error);

  // Non-streaming: adds an update's text and token ids to the response, the
  // final update's included.
  void collect(const RequestUpdate& update);
  // Non-streaming: the body of the response with everything collected, from
  // the final update (kStop or kLength).
  std::string full_response(const RequestUpdate& final_update) const;

 private:
  // One chunk as an event; `final_update` (or nullptr) adds finish_reason and
  // the timings, `role` the chat delta's role, `reasoning` (when not empty)
  // the delta's reasoning_content; `tokens` go out when asked for.
  std::string chunk_event(std::string_view text, std::span<const int32_t> tokens,
                          const RequestUpdate* final_update, bool role,
                          std::string_view reasoning = {});
  // Streaming: the update's text as (reasoning, content), split when asked for.
  ReasoningSplitter::Parts split(const RequestUpdate& update);

  const Endpoint endpoint_;
  const bool include_usage_;
  const bool return_token_ids_;
  const std::string id_;
  const int64_t created_;
  const std::string model_;
  const bool split_reasoning_;
  bool sent_role_ = false;
  ReasoningSplitter splitter_;   // streamed replies, when split_reasoning_
  std::string text_;             // collected (whole responses)
  std::vector<int32_t> tokens_;  // collected when return_token_ids_ (whole responses)
};

// llama-server's POST /tokenize {"content", "add_special" (default false)}
// and POST /detokenize {"tokens"}: the request bodies (or the 400 that says
// why not, with the codes of the completions routes) and the replies
// {"tokens": [...]} and {"content": "..."} (a slice of tokens may end inside a
// UTF-8 sequence: replaced with U+FFFD, as llama-server does).
struct TokenizeRequest {
  std::string content;
  bool add_special = false;
};
std::variant<TokenizeRequest, ApiError> parse_tokenize_request(std::string_view body);
std::variant<std::vector<int32_t>, ApiError> parse_detokenize_request(std::string_view body);
std::string tokenize_body(const std::vector<int32_t>& tokens);
std::string detokenize_body(std::string_view text);

// The body of GET /v1/models: OpenAI's list with the one served model.
std::string models_body(const ModelSummary& model, int64_t created);
// The body of GET /v1/models/{id}.
std::string model_body(const ModelSummary& model, int64_t created);

}  // namespace duet::openai

// duet-bench over HTTP: any OpenAI-compatible server (Duet's HTTP front,
// llama-server, vLLM).
//
// Each request is POST /v1/completions with the prompt as a token-id list, `max_tokens`,
// `ignore_eos: true`, `temperature: 0` and, streaming, `stream_options: {include_usage: true}`.
// Every server-sent event carrying text is a token chunk, timestamped as it is read; the
// generated-token count is `usage.completion_tokens` (else llama-server's `timings.predicted_n`,
// else the number of text chunks); Duet's `duet` object gives the server's own TTFT/TPOT/E2E.
// Errors: "http_<status>" with the body's message, "connection" (refused or broken),
// "timeout" (over its deadline), "stream_error" (an error event inside a stream).
// Tokenizing uses llama-server's POST /tokenize {"content", "add_special"} (Duet answers it too).
//
// Thread affinity: the client runs Boost.Asio on one thread of its own, over a pool of
// keep-alive connections (one per request in flight, reused once idle); every connection and
// request belongs to that thread. send() and tokenize() may be called from any other thread.
#pragma once

#include <memory>
#include <string>

#include "loadgen/client.h"

namespace duet::loadgen {

struct HttpClientOptions {
  std::string url;  // "http://HOST:PORT", optionally with a path prefix; a final "/v1" is dropped
  std::string api_key;             // sent as "Authorization: Bearer KEY" when not empty
  std::string model;               // empty: GET /v1/models' first id, if any
  double request_timeout_s = 600;  // from sending to the last byte of the response
};

// Resolves the host and learns the model name. Throws duet::Error for a bad
// URL or an unknown host (a server that is down shows at the first request).
std::unique_ptr<Client> make_http_client(const HttpClientOptions& options);

}  // namespace duet::loadgen

// The contract between the coordinator and the instances that run the model.
//
// The coordinator speaks token ids to an instance: it tokenizes, applies the
// chat template, detokenizes and matches stop strings itself, so an instance
// only prefills, decodes and samples. An instance is reached through
// InstanceClient, whatever it is: an engine thread in this process
// (worker/local_instance.h) or, later, a group of MPI ranks.
//
// Every submitted request gets exactly one finished event, also when the
// instance refuses it (finish kFailed with a typed error). Events come in
// batches, one batch per engine step, so a front that forwards them to a
// network loop crosses threads once per step, not once per token.
#pragma once

#include <chrono>
#include <compare>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/sampling.h"

namespace duet {

// A request's id, unique within one coordinator's lifetime.
struct RequestId {
  uint64_t value = 0;
  auto operator<=>(const RequestId&) const = default;
};

// Why a request was refused or failed, in the words of the client protocols
// (HTTP status and Cap'n Proto error kind follow from it).
enum class ServeErrorKind {
  kInvalidArgument,  // malformed or impossible request (HTTP 400)
  kTooLong,          // prompt or prompt + max_tokens over a limit (HTTP 400)
  kNotFound,         // unknown model or route (HTTP 404)
  kUnauthenticated,  // missing or wrong API key (HTTP 401)
  kOverloaded,       // queue full; retry later (HTTP 429)
  kUnavailable,      // shutting down or no instance (HTTP 503)
  kInternal,         // a broken invariant of ours (HTTP 500)
};

std::string_view serve_error_kind_name(ServeErrorKind kind);  // "invalid_argument", ...

struct ServeError {
  ServeErrorKind kind = ServeErrorKind::kInternal;
  std::string message;
};

// A value or the typed reason there is none: expected outcomes (a full queue,
// an over-long prompt) are results, not exceptions.
template <typename T>
using Result = std::variant<T, ServeError>;

struct InstanceRequest {
  RequestId id;
  std::vector<int32_t> prompt;  // token ids, chat template applied
  int64_t max_tokens = 128;
  SamplingParams sampling;
  bool ignore_eos = false;  // generate exactly max_tokens tokens (benchmarks)
  // Disaggregated serving: the transfer address (MPI rank) of the prefill
  // instance that computes the prompt's KV for the decode instance that gets
  // this request; -1 when the instance computes the prompt itself.
  int32_t prefill_peer = -1;
};

enum class InstanceFinish {
  kEndOfGeneration,  // sampled an end-of-generation token (it is the last token event)
  kLength,           // reached max_tokens
  kCancelled,        // cancel() arrived first
  kFailed,           // refused or failed; `error` says why
};

struct InstanceEvent {
  RequestId id;
  // The sequence got KV and its first compute step (its queueing ended);
  // cached_tokens of its prompt came from the prefix cache. At most once.
  bool admitted = false;
  int64_t cached_tokens = 0;
  // When the admission happened (this host's steady clock): events reach the
  // coordinator at the end of the step, the admission was at its start.
  std::chrono::steady_clock::time_point admitted_at{};
  int32_t token = -1;  // a generated token, or -1
  bool finished = false;
  InstanceFinish finish = InstanceFinish::kLength;
  std::optional<ServeError> error;  // with kFailed
};

// A snapshot; counters are cumulative since start.
struct InstanceStats {
  int64_t running = 0;  // sequences holding KV
  int64_t waiting = 0;  // submitted, not yet admitted
  int64_t kv_blocks_total = 0;
  int64_t kv_blocks_free = 0;
  int64_t kv_block_tokens = 0;  // tokens per block
  int64_t steps = 0;
  int64_t prompt_tokens = 0;      // looked up in the prefix cache
  int64_t prefix_hit_tokens = 0;  // of those, found cached
  int64_t generated_tokens = 0;
  int64_t preemptions = 0;
};

// What the coordinator needs to know of the model to validate requests.
struct InstanceInfo {
  std::string model_name;
  int64_t n_ctx = 0;  // the model's context (prompt + generated tokens)
  int64_t n_vocab = 0;
  int64_t kv_capacity_tokens = 0;  // the most tokens one sequence can hold
  std::vector<int32_t> end_of_generation;
};

// ---------------------------------------------------------------- between instances
// Disaggregated serving: what a decode instance and a prefill instance say
// to each other (beside the KV rows themselves; worker/transfer/kv_transfer.h).

// Decode -> prefill: compute this prompt and ship its KV rows of positions
// >= send_from (the decode side holds the rest in its prefix cache).
struct PrefillOrder {
  InstanceRequest request;
  int64_t send_from = 0;
  // The decode instance's ranks, leader first: each gets the KV heads its
  // shard holds (worker/model/tp_shard.h kv_peers) straight from the prefill rank
  // holding them. Empty: the order's sender alone (tp 1).
  std::vector<int32_t> decode_ranks;
};

// Prefill -> decode, after the last rows of an order: how decoding goes on.
struct KvHandoff {
  RequestId id;
  int32_t first_token = -1;         // sampled after the prompt, as one engine would
  int64_t cached_tokens = 0;        // prompt tokens the prefill side's prefix cache held
  int64_t prefill_ns = 0;           // from the prefill admission to the handoff
  int64_t rows_sent = 0;            // KV rows (positions x layers) shipped
  std::optional<ServeError> error;  // the prefill failed or was withdrawn: no rows follow
};

// An instance as the coordinator sees it. Thread-safe: submit, cancel and
// stats may be called from any thread and never wait for a model step.
class InstanceClient {
 public:
  // Receives the events of one step (or of one refusal) on the instance's
  // event thread; must not block for long: it holds up the next step.
  using EventHandler = std::function<void(std::span<const InstanceEvent>)>;

  virtual ~InstanceClient() = default;

  virtual const InstanceInfo& info() const = 0;
  // Set once, before the first submit.
  virtual void set_event_handler(EventHandler handler) = 0;
  virtual void submit(InstanceRequest request) = 0;
  // Ends a request and frees its KV at once; unknown or finished ids are ignored.
  virtual void cancel(RequestId id) = 0;
  virtual InstanceStats stats() const = 0;
};

}  // namespace duet

// The coordinator's core, shared by its fronts (Cap'n Proto RPC and HTTP).
//
// A front turns its protocol's request into a ServeRequest and calls start():
// the service validates it (typed errors, never an exception for bad input),
// tokenizes it and applies the chat template, admits it or refuses it with a
// typed overload, and hands it to the instance through the instance's one
// queue. The instance's events come back once per step; the service
// detokenizes them incrementally, matches stop strings, keeps per-request
// timings and metrics, and passes each front its requests' updates in one call
// (UpdateSink::deliver), so a front crosses into its network loop once per step.
//
// Thread affinity: start, prepare, admit, cancel and the queries from any thread
// (which front calls what where: docs/ARCHITECTURE.md, "The fronts' threads and
// limits"); deliver() as UpdateSink says. Mutable request state is guarded by
// mutex_; tokenization runs outside it. Stopping: begin_drain, wait_idle, cut.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/serving.h"
#include "common/text/chat_template.h"
#include "common/text/stop_matcher.h"
#include "common/text/tokenizer.h"
#include "coordinator/metrics.h"

namespace duet {

struct ServiceLimits {
  int64_t max_waiting = 256;         // admitted requests not yet running; more -> kOverloaded
  int64_t max_prompt_tokens = 0;     // 0: the model's context
  int64_t max_tokens = 0;            // the most a request may ask for; 0: the model's context
  int64_t default_max_tokens = 256;  // when a request names none
  size_t max_stop_strings = 16;
};

// The prompt in one of three forms.
using PromptInput = std::variant<std::string,                // text, tokenized as is
                                 std::vector<int32_t>,       // token ids
                                 std::vector<ChatMessage>>;  // chat, template applied

struct ServeRequest {
  PromptInput prompt;
  std::optional<int64_t> max_tokens;  // nullopt: limits.default_max_tokens
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  // Updates carry token ids too (RPC's includeTokenIds, HTTP's return_token_ids).
  bool include_token_ids = false;
};

enum class ServeFinish {
  kStop,       // an end-of-generation token or a stop string
  kLength,     // max_tokens
  kCancelled,  // the client cancelled or went away
  kError,      // failed after admission; see RequestUpdate::error
};

std::string_view serve_finish_name(ServeFinish finish);  // "stop", "length", "cancelled", "error"

// Times in seconds; queue = arrival to first compute, ttft = arrival to first
// token, tpot = mean gap between later tokens (0 with fewer than 2), e2e =
// arrival to finish.
struct RequestTimings {
  double queue_s = 0;
  double ttft_s = 0;
  double tpot_s = 0;
  double e2e_s = 0;
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
  int32_t retries = 0;  // re-runs after an instance it was on was lost
};

// New output of one request. The text is safe to show: it is valid UTF-8 and
// holds nothing that could still turn out to start a stop string.
struct RequestUpdate {
  RequestId id;
  std::string text;
  std::vector<int32_t> tokens;  // filled when the request asked for token ids
  bool finished = false;
  ServeFinish finish = ServeFinish::kStop;
  RequestTimings timings;           // complete when finished
  std::optional<ServeError> error;  // with kError
};

// A front's receiver of updates; one per front (not per request).
class UpdateSink {
 public:
  virtual ~UpdateSink() = default;
  // The updates of one instance step for this front's requests, in order.
  // Runs on the instance's event thread, never under the service's lock; must
  // queue or post them to the front's own thread and return (never wait for
  // the network), so a slow or busy front never stalls the engine's steps.
  virtual void deliver(std::vector<RequestUpdate> updates) = 0;
};

// A request validated and tokenized by Service::prepare, not yet admitted.
struct PreparedRequest {
  std::vector<int32_t> prompt;
  int64_t max_tokens = 0;
  SamplingParams sampling;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  bool include_token_ids = false;
  std::chrono::steady_clock::time_point arrival;  // when prepare() began
};

struct Admitted {
  RequestId id;
  int64_t prompt_tokens = 0;
};

struct ModelSummary {
  std::string name;  // the id clients use ("model" in OpenAI requests)
  int64_t n_ctx = 0;
  int64_t n_vocab = 0;
  int64_t kv_capacity_tokens = 0;
  int64_t max_prompt_tokens = 0;
  int64_t max_tokens = 0;
};

struct ServiceStats {
  InstanceStats instance;
  InstanceClient::Health health;
  bool draining = false;         // begin_drain() ran: new requests are refused
  int64_t active_requests = 0;   // started, not finished
  int64_t waiting_requests = 0;  // started, not yet admitted by the instance
  int64_t finished_requests = 0;
  int64_t refused_requests = 0;
};

class Service final {
 public:
  // `instance` and `tokenizer` outlive the service. `model_name` is the id
  // that requests must name (an empty model field is accepted too).
  Service(InstanceClient& instance, const Tokenizer& tokenizer,
          std::optional<ChatTemplateKind> chat_template, std::string model_name,
          ServiceLimits limits);
  ~Service();
  Service(const Service&) = delete;
  Service& operator=(const Service&) = delete;

  // Validates, tokenizes and admits a request, whose updates go to `sink`
  // (which must outlive the request's final update): prepare(), then admit().
  Result<Admitted> start(ServeRequest request, UpdateSink& sink);
  // The costly half of start(): validation and tokenization (a text prompt
  // that cannot fit max_prompt_tokens is refused from its length, before it
  // is tokenized). Holds no lock while it works, so fronts may run it on
  // worker threads. Refusals are counted as start() counts them.
  Result<PreparedRequest> prepare(ServeRequest request);
  // The cheap half: admits a prepared request (or refuses it: overloaded,
  // shutting down) and submits it to the instance.
  Result<Admitted> admit(PreparedRequest request, UpdateSink& sink);
  // Whether admit() would now refuse for a full waiting queue: a hint that
  // lets a front refuse (overloaded) before it reads or parses a request; the
  // answer may change at once, and admit() decides.
  bool waiting_full() const;
  // Ends a request at once and frees its KV; its final update says kCancelled.
  void cancel(RequestId id);
  // Counts a request a front refused before it reached start() (bad JSON,
  // unknown model, wrong API key), so the metrics see every refusal.
  void record_refused(ServeErrorKind kind);
  // Counts a connection a front ("http", "rpc") refused at its max_connections.
  void record_connection_refused(std::string_view front) {
    metrics_.record_connection_refused(front);
  }
  // Counts an instance the rebalancer moved to `role` (coordinator/rebalancer.h).
  void record_rebalance(std::string_view role) { metrics_.record_rebalance(role); }
  // The rebalancer's call on the cluster's size (RebalanceLoop::instances_wanted).
  void set_instances_wanted(int64_t n) { metrics_.set_instances_wanted(n); }
  // Draining: refuses every later start with kUnavailable ("the server is
  // shutting down") and lets the running requests finish as they would.
  void begin_drain();
  // Blocks until no request is running and each one's final update was
  // delivered (true), or until `deadline` or a cut() made while it waits
  // (false, unless idle by then). Any thread but the instance's event thread.
  bool wait_idle(std::chrono::steady_clock::time_point deadline);
  // Ends every running request now with `reason` as its final update's
  // error (kError, kUnavailable), frees its KV, and refuses later starts.
  // Wakes wait_idle(). Idempotent; any thread.
  void cut(std::string reason);

  // Whether `name` names the served model (empty counts as yes).
  bool serves_model(std::string_view name) const;
  const ModelSummary& model() const { return model_; }
  const ServiceLimits& limits() const { return limits_; }
  // The most bytes of text a prompt within max_prompt_tokens can hold (bytes
  // the vocabulary drops aside): max_prompt_tokens times the longest token.
  int64_t max_prompt_bytes() const {
    return model_.max_prompt_tokens * static_cast<int64_t>(tokenizer_.max_token_bytes());
  }
  Result<std::vector<int32_t>> tokenize(std::string_view text, bool add_special) const;
  Result<std::string> detokenize(std::span<const int32_t> ids) const;
  ServiceStats stats() const;
  // Takes new requests: ready(health().state).
  bool healthy() const;
  // ok: serving with every instance (or as many as it started with, losses
  // made up for by instances that joined); degraded: serving with some lost;
  // draining: finishing what runs, refusing new requests (begin_drain);
  // unavailable: shutting down, or no live instance a request needs.
  // Ready for new requests: ok and degraded only.
  enum class HealthState { kOk, kDegraded, kDraining, kUnavailable };
  struct Health {
    HealthState state = HealthState::kOk;
    InstanceClient::Health instances;
  };
  Health health() const;
  // "ok", "degraded", "draining", "unavailable": the word every front uses.
  static std::string_view health_state_name(HealthState state);
  // Whether a service in `state` takes new requests (readiness): ok, degraded.
  static bool ready(HealthState state) {
    return state == HealthState::kOk || state == HealthState::kDegraded;
  }
  // The Prometheus text exposition of every metric.
  std::string metrics_text() const;
  const Metrics& metrics() const { return metrics_; }

 private:
  struct Live;
  using Clock = std::chrono::steady_clock;

  Result<std::vector<int32_t>> prompt_tokens(const PromptInput& prompt) const;
  void on_events(std::span<const InstanceEvent> events);  // the instance's event thread

  InstanceClient& instance_;
  const Tokenizer& tokenizer_;
  const std::optional<ChatTemplateKind> chat_template_;
  const ServiceLimits limits_;
  ModelSummary model_;
  Metrics metrics_;  // thread-safe itself

  mutable std::mutex mutex_;         // guards everything below
  std::condition_variable idle_cv_;  // live_ emptied, deliveries done, or cut()
  bool shut_down_ = false;           // cut(): nothing new starts, health unavailable
  bool draining_ = false;            // begin_drain(): nothing new starts
  int64_t n_cuts_ = 0;               // cut() calls: each ends the wait_idle() under way
  std::string cut_reason_;           // the first cut()'s
  int64_t n_delivering_ = 0;         // on_events calls handing final updates to sinks
  uint64_t next_id_ = 1;
  std::map<RequestId, std::unique_ptr<Live>> live_;
  int64_t n_waiting_ = 0;
  int64_t n_finished_ = 0;
  int64_t n_refused_ = 0;
};

}  // namespace duet

#include "coordinator/service.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "common/error.h"
#include "common/text/incremental_decoder.h"
#include "common/text/unicode.h"

namespace duet {

std::string_view serve_finish_name(ServeFinish finish) {
  switch (finish) {
    case ServeFinish::kStop:
      return "stop";
    case ServeFinish::kLength:
      return "length";
    case ServeFinish::kCancelled:
      return "cancelled";
    case ServeFinish::kError:
      return "error";
  }
  return "error";
}

namespace {

ServeError error(ServeErrorKind kind, std::string message) { return {kind, std::move(message)}; }

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

// One request between start() and its final update. Guarded by Service::mutex_.
struct Service::Live {
  Live(const Tokenizer& tokenizer, std::vector<std::string> stops)
      : decoder(tokenizer, /*skip_special=*/true), stop(std::move(stops)) {}

  UpdateSink* sink = nullptr;
  bool include_token_ids = false;
  IncrementalDecoder decoder;
  StopMatcher stop;
  Clock::time_point arrival;
  Clock::time_point admitted;
  Clock::time_point first_token;
  Clock::time_point last_token;
  bool is_admitted = false;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t completion_tokens = 0;
  int32_t retries = 0;
  bool cut = false;  // Service::cut() cancelled it: it ends kError, not kCancelled

  RequestTimings timings(Clock::time_point now) const {
    RequestTimings t;
    t.prompt_tokens = prompt_tokens;
    t.completion_tokens = completion_tokens;
    t.retries = retries;
    t.cached_tokens = cached_tokens;
    t.queue_s = seconds((is_admitted ? admitted : now) - arrival);
    t.ttft_s = completion_tokens > 0 ? seconds(first_token - arrival) : 0.0;
    t.tpot_s = completion_tokens > 1
                   ? seconds(last_token - first_token) / static_cast<double>(completion_tokens - 1)
                   : 0.0;
    t.e2e_s = seconds(now - arrival);
    return t;
  }
};

Service::Service(InstanceClient& instance, const Tokenizer& tokenizer,
                 std::optional<ChatTemplateKind> chat_template, std::string model_name,
                 ServiceLimits limits)
    : instance_(instance), tokenizer_(tokenizer), chat_template_(chat_template), limits_(limits) {
  const InstanceInfo& info = instance.info();
  model_.name = std::move(model_name);
  model_.n_ctx = info.n_ctx;
  model_.n_vocab = info.n_vocab;
  model_.kv_capacity_tokens = info.kv_capacity_tokens;
  const int64_t room = std::min(info.n_ctx, info.kv_capacity_tokens);
  model_.max_prompt_tokens =
      limits.max_prompt_tokens > 0 ? std::min(limits.max_prompt_tokens, room - 1) : room - 1;
  model_.max_tokens = limits.max_tokens > 0 ? std::min(limits.max_tokens, room - 1) : room - 1;
  DUET_REQUIRE(model_.max_prompt_tokens >= 1,
               "the KV cache ({} tokens) is too small to serve any request", room);
  instance_.set_event_handler([this](std::span<const InstanceEvent> events) { on_events(events); });
}

Service::~Service() { instance_.set_event_handler({}); }

bool Service::serves_model(std::string_view name) const {
  return name.empty() || name == model_.name;
}

Result<std::vector<int32_t>> Service::tokenize(std::string_view text, bool add_special) const {
  if (!is_valid_utf8(text))
    return error(ServeErrorKind::kInvalidArgument, "text is not valid UTF-8");
  return tokenizer_.encode(text, add_special, /*parse_special=*/true);
}

Result<std::string> Service::detokenize(std::span<const int32_t> ids) const {
  for (int32_t id : ids) {
    if (id < 0 || id >= model_.n_vocab)
      return error(
          ServeErrorKind::kInvalidArgument,
          fmt::format("token id {} is outside the vocabulary (0..{})", id, model_.n_vocab - 1));
  }
  return tokenizer_.decode(ids);
}

Result<std::vector<int32_t>> Service::prompt_tokens(const PromptInput& prompt) const {
  if (const auto* ids = std::get_if<std::vector<int32_t>>(&prompt)) {
    for (int32_t id : *ids) {
      if (id < 0 || id >= model_.n_vocab)
        return error(ServeErrorKind::kInvalidArgument,
                     fmt::format("prompt token id {} is outside the vocabulary (0..{})", id,
                                 model_.n_vocab - 1));
    }
    return *ids;
  }
  // A text that cannot fit in max_prompt_tokens is refused before it is
  // tokenized: min_tokens() is a sound lower bound in one cheap pass, so no
  // prompt that would fit is refused here.
  auto too_long = [&](int64_t n_at_least) -> std::optional<ServeError> {
    if (n_at_least <= model_.max_prompt_tokens) return std::nullopt;
    return error(ServeErrorKind::kTooLong,
                 fmt::format("the prompt has at least {} tokens, over the limit of {}", n_at_least,
                             model_.max_prompt_tokens));
  };
  std::string text;
  if (const auto* s = std::get_if<std::string>(&prompt)) {
    if (auto refusal = too_long(tokenizer_.min_tokens(*s))) return *refusal;
    text = *s;
  } else {
    const auto& messages = std::get<std::vector<ChatMessage>>(prompt);
    if (!chat_template_)
      return error(ServeErrorKind::kInvalidArgument, "this model has no chat template");
    if (messages.empty()) return error(ServeErrorKind::kInvalidArgument, "messages is empty");
    int64_t n_at_least = 0;
    for (const ChatMessage& m : messages) n_at_least += tokenizer_.min_tokens(m.content);
    if (auto refusal = too_long(n_at_least)) return *refusal;
    for (const ChatMessage& m : messages) {
      if (m.role != "system" && m.role != "user" && m.role != "assistant")
        return error(ServeErrorKind::kInvalidArgument,
                     fmt::format("unknown message role '{}' (system, user or assistant)",
                                 utf8_sanitize(m.role)));
      if (!is_valid_utf8(m.content))
        return error(ServeErrorKind::kInvalidArgument, "message content is not valid UTF-8");
    }
    // The template's markers are special tokens; message content is text.
    return encode_chat(tokenizer_, *chat_template_, messages);
  }
  if (!is_valid_utf8(text))
    return error(ServeErrorKind::kInvalidArgument, "prompt is not valid UTF-8");
  return tokenizer_.encode(text, /*add_special=*/true, /*parse_special=*/true);
}

Result<PreparedRequest> Service::prepare(ServeRequest request) {
  const Clock::time_point arrival = Clock::now();
  auto refuse = [&](ServeErrorKind kind, std::string message) -> Result<PreparedRequest> {
    metrics_.record_refused(kind);
    std::lock_guard lock(mutex_);
    ++n_refused_;
    return error(kind, std::move(message));
  };
  {
    std::lock_guard lock(mutex_);
    if (shut_down_ || draining_) {
      ++n_refused_;
      metrics_.record_refused(ServeErrorKind::kUnavailable);
      return error(ServeErrorKind::kUnavailable, "the server is shutting down");
    }
  }
  try {
    validate_sampling_params(request.sampling);
  } catch (const Error& e) {
    return refuse(ServeErrorKind::kInvalidArgument, e.what());
  }
  if (request.stop.size() > limits_.max_stop_strings)
    return refuse(ServeErrorKind::kInvalidArgument,
                  fmt::format("at most {} stop strings, got {}", limits_.max_stop_strings,
                              request.stop.size()));
  for (const std::string& s : request.stop) {
    if (s.empty()) return refuse(ServeErrorKind::kInvalidArgument, "a stop string is empty");
    if (!is_valid_utf8(s))
      return refuse(ServeErrorKind::kInvalidArgument, "a stop string is not valid UTF-8");
  }
  if (request.max_tokens && *request.max_tokens < 1)
    return refuse(ServeErrorKind::kInvalidArgument,
                  fmt::format("max_tokens must be at least 1, got {}", *request.max_tokens));
  if (request.max_tokens && *request.max_tokens > model_.max_tokens)
    return refuse(ServeErrorKind::kTooLong,
                  fmt::format("max_tokens {} is over this server's limit of {}",
                              *request.max_tokens, model_.max_tokens));

  Result<std::vector<int32_t>> tokens = error(ServeErrorKind::kInternal, "");
  try {
    tokens = prompt_tokens(request.prompt);
  } catch (const std::exception& e) {
    return refuse(ServeErrorKind::kInternal,
                  fmt::format("cannot tokenize the prompt: {}", e.what()));
  }
  if (auto* e = std::get_if<ServeError>(&tokens)) return refuse(e->kind, std::move(e->message));
  std::vector<int32_t>& prompt = std::get<std::vector<int32_t>>(tokens);
  const auto n_prompt = static_cast<int64_t>(prompt.size());
  if (n_prompt == 0) return refuse(ServeErrorKind::kInvalidArgument, "the prompt is empty");
  if (n_prompt > model_.max_prompt_tokens)
    return refuse(ServeErrorKind::kTooLong,
                  fmt::format("the prompt has {} tokens, over the limit of {}", n_prompt,
                              model_.max_prompt_tokens));
  const int64_t room = std::min(model_.n_ctx, model_.kv_capacity_tokens) - n_prompt;
  int64_t max_tokens = request.max_tokens.value_or(std::min(limits_.default_max_tokens, room));
  if (max_tokens > room)
    return refuse(ServeErrorKind::kTooLong,
                  fmt::format("the prompt ({} tokens) plus max_tokens ({}) is over the {} tokens "
                              "a sequence can hold",
                              n_prompt, max_tokens, n_prompt + room));

  return PreparedRequest{.prompt = std::move(prompt),
                         .max_tokens = max_tokens,
                         .sampling = request.sampling,
                         .stop = std::move(request.stop),
                         .ignore_eos = request.ignore_eos,
                         .include_token_ids = request.include_token_ids,
                         .arrival = arrival};
}

Result<Admitted> Service::start(ServeRequest request, UpdateSink& sink) {
  Result<PreparedRequest> prepared = prepare(std::move(request));
  if (auto* e = std::get_if<ServeError>(&prepared)) return std::move(*e);
  return admit(std::move(std::get<PreparedRequest>(prepared)), sink);
}

Result<Admitted> Service::admit(PreparedRequest request, UpdateSink& sink) {
  const auto n_prompt = static_cast<int64_t>(request.prompt.size());
  RequestId id;
  {
    std::lock_guard lock(mutex_);
    if (shut_down_ || draining_) {  // stopping began since the request was prepared
      ++n_refused_;
      metrics_.record_refused(ServeErrorKind::kUnavailable);
      return error(ServeErrorKind::kUnavailable, "the server is shutting down");
    }
    if (n_waiting_ >= limits_.max_waiting) {
      ++n_refused_;
      metrics_.record_refused(ServeErrorKind::kOverloaded);
      return error(ServeErrorKind::kOverloaded,
                   fmt::format("{} requests are already waiting; retry later", n_waiting_));
    }
    id = RequestId{next_id_++};
    auto live = std::make_unique<Live>(tokenizer_, std::move(request.stop));
    live->sink = &sink;
    live->include_token_ids = request.include_token_ids;
    live->arrival = request.arrival;
    live->prompt_tokens = n_prompt;
    live_.emplace(id, std::move(live));
    ++n_waiting_;
  }
  try {
    instance_.submit(
        {id, std::move(request.prompt), request.max_tokens, request.sampling, request.ignore_eos});
  } catch (const std::exception& e) {
    {
      std::lock_guard lock(mutex_);
      live_.erase(id);
      --n_waiting_;
    }
    record_refused(ServeErrorKind::kUnavailable);
    return error(ServeErrorKind::kUnavailable, fmt::format("the instance refused: {}", e.what()));
  }
  return Admitted{id, n_prompt};
}

bool Service::waiting_full() const {
  std::lock_guard lock(mutex_);
  return n_waiting_ >= limits_.max_waiting;
}

void Service::cancel(RequestId id) { instance_.cancel(id); }

void Service::record_refused(ServeErrorKind kind) {
  metrics_.record_refused(kind);
  std::lock_guard lock(mutex_);
  ++n_refused_;
}

void Service::begin_drain() {
  std::lock_guard lock(mutex_);
  draining_ = true;
}

bool Service::wait_idle(Clock::time_point deadline) {
  std::unique_lock lock(mutex_);
  auto idle = [&] { return live_.empty() && n_delivering_ == 0; };
  const int64_t n_cuts = n_cuts_;  // a cut() from now on ends the wait
  idle_cv_.wait_until(lock, deadline, [&] { return idle() || n_cuts_ != n_cuts; });
  return idle();
}

void Service::cut(std::string reason) {
  std::vector<RequestId> ids;
  {
    std::lock_guard lock(mutex_);
    shut_down_ = true;
    if (n_cuts_ == 0) cut_reason_ = std::move(reason);
    ++n_cuts_;
    for (const auto& [id, live] : live_) {
      live->cut = true;
      ids.push_back(id);
    }
  }
  idle_cv_.notify_all();
  for (RequestId id : ids) instance_.cancel(id);
}

void Service::on_events(std::span<const InstanceEvent> events) {
  const Clock::time_point now = Clock::now();
  std::vector<std::pair<UpdateSink*, std::vector<RequestUpdate>>> out;
  auto updates_for = [&](UpdateSink* sink) -> std::vector<RequestUpdate>& {
    for (auto& [s, updates] : out)
      if (s == sink) return updates;
    return out.emplace_back(sink, std::vector<RequestUpdate>{}).second;
  };
  std::vector<RequestId> to_cancel;  // stop strings matched
  int64_t n_tokens = 0;
  bool delivering = false;
  {
    std::lock_guard lock(mutex_);
    for (const InstanceEvent& event : events) {
      auto it = live_.find(event.id);
      if (it == live_.end()) continue;  // already finished by a stop string
      Live& live = *it->second;
      if (event.admitted && !live.is_admitted) {
        live.is_admitted = true;
        live.admitted = event.admitted_at == Clock::time_point{} ? now : event.admitted_at;
        live.cached_tokens = event.cached_tokens;
        --n_waiting_;
      }
      RequestUpdate update{.id = event.id};
      bool finished = event.finished;
      ServeFinish finish = ServeFinish::kStop;
      if (event.token >= 0) {
        if (live.completion_tokens == 0) live.first_token = now;
        live.last_token = now;
        ++live.completion_tokens;
        ++n_tokens;
        if (live.include_token_ids) update.tokens.push_back(event.token);
        update.text = live.stop.push(live.decoder.push(event.token));
        if (live.stop.stopped() && !finished) {
          finished = true;  // the instance still runs it: cancel, and finish now
          to_cancel.push_back(event.id);
        }
      }
      if (event.finished) {
        live.retries = event.retries;
        switch (event.finish) {
          case InstanceFinish::kEndOfGeneration:
            finish = ServeFinish::kStop;
            break;
          case InstanceFinish::kLength:
            finish = live.stop.stopped() ? ServeFinish::kStop : ServeFinish::kLength;
            break;
          case InstanceFinish::kCancelled:
            finish = ServeFinish::kCancelled;
            if (live.cut) {
              finish = ServeFinish::kError;
              update.error = ServeError{ServeErrorKind::kUnavailable, cut_reason_};
            }
            break;
          case InstanceFinish::kFailed:
            finish = ServeFinish::kError;
            update.error = event.error.value_or(ServeError{ServeErrorKind::kInternal, "failed"});
            break;
        }
      }
      if (finished) {
        if (!live.stop.stopped()) {
          update.text += live.stop.push(live.decoder.flush());
          update.text += live.stop.flush();
        }
        if (!live.is_admitted) --n_waiting_;
        update.finished = true;
        update.finish = finish;
        update.timings = live.timings(now);
        metrics_.record_finished(finish, update.timings);
        ++n_finished_;
      }
      if (!update.finished && update.text.empty() && update.tokens.empty()) continue;
      UpdateSink* sink = live.sink;
      if (update.finished) live_.erase(it);
      updates_for(sink).push_back(std::move(update));
    }
    // wait_idle() counts these final updates until their sinks have them.
    delivering = !out.empty();
    if (delivering) ++n_delivering_;
  }
  if (n_tokens > 0) metrics_.record_tokens(n_tokens, now);
  for (RequestId id : to_cancel) instance_.cancel(id);
  for (auto& [sink, updates] : out) sink->deliver(std::move(updates));
  if (delivering) {
    std::lock_guard lock(mutex_);
    --n_delivering_;
    if (live_.empty() && n_delivering_ == 0) idle_cv_.notify_all();
  }
}

ServiceStats Service::stats() const {
  ServiceStats s;
  s.instance = instance_.stats();
  s.health = instance_.health();
  std::lock_guard lock(mutex_);
  s.active_requests = static_cast<int64_t>(live_.size());
  s.waiting_requests = n_waiting_;
  s.finished_requests = n_finished_;
  s.refused_requests = n_refused_;
  s.draining = draining_;
  return s;
}

bool Service::healthy() const { return ready(health().state); }

std::string_view Service::health_state_name(HealthState state) {
  switch (state) {
    case HealthState::kOk:
      return "ok";
    case HealthState::kDegraded:
      return "degraded";
    case HealthState::kDraining:
      return "draining";
    case HealthState::kUnavailable:
      return "unavailable";
  }
  return "unavailable";
}

Service::Health Service::health() const {
  Health health;
  health.instances = instance_.health();
  bool shut_down = false;
  bool draining = false;
  {
    std::lock_guard lock(mutex_);
    shut_down = shut_down_;
    draining = draining_;
  }
  if (shut_down || !health.instances.serving) {
    health.state = HealthState::kUnavailable;
  } else if (draining) {
    health.state = HealthState::kDraining;
  } else if (health.instances.n_lost > 0 &&
             (health.instances.n_live < 0 ||
              health.instances.n_live < health.instances.n_started)) {
    // Lost instances not yet made up for by instances that joined since.
    health.state = HealthState::kDegraded;
  }
  return health;
}

std::string Service::metrics_text() const { return metrics_.render(stats(), Clock::now()); }

}  // namespace duet

// The OpenAI-compatible API, the response side: the service's updates and
// errors written as OpenAI's JSON bodies and server-sent events.
#include <nlohmann/json.hpp>
#include <utility>

#include "coordinator/http/openai_api.h"

namespace duet::openai {
namespace {

// Insertion-ordered, so responses read in OpenAI's field order (id, object, created, ...).
using json = nlohmann::ordered_json;

std::string dump(const json& value) {
  // Replacing invalid UTF-8 cannot trigger (the service emits valid UTF-8 and
  // request strings were validated); it only rules out an exception here.
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

json usage_json(const RequestTimings& timings) {
  return {{"prompt_tokens", timings.prompt_tokens},
          {"completion_tokens", timings.completion_tokens},
          {"total_tokens", timings.prompt_tokens + timings.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", timings.cached_tokens}}}};
}

// Duet's own per-request timings, in milliseconds.
json timings_json(const RequestTimings& timings) {
  return {
      {"queue_ms", timings.queue_s * 1e3},      {"ttft_ms", timings.ttft_s * 1e3},
      {"tpot_ms", timings.tpot_s * 1e3},        {"e2e_ms", timings.e2e_s * 1e3},
      {"prompt_tokens", timings.prompt_tokens}, {"completion_tokens", timings.completion_tokens},
      {"cached_tokens", timings.cached_tokens}, {"retries", timings.retries}};
}

json model_json(const ModelSummary& model, int64_t created) {
  return {{"id", model.name},
          {"object", "model"},
          {"created", created},
          {"owned_by", "duet"},
          {"max_model_len", model.n_ctx}};
}

json error_json(const ApiError& error) {
  return {{"error",
           {{"message", error.message},
            {"type", error.type},
            {"param", error.param.empty() ? json(nullptr) : json(error.param)},
            {"code", error.code}}}};
}

std::string event(const json& value) { return "data: " + dump(value) + "\n\n"; }

constexpr std::string_view kDone = "data: [DONE]\n\n";

}  // namespace

ApiError api_error(const ServeError& error) {
  ApiError api;
  api.message = error.message;
  api.code = std::string(serve_error_kind_name(error.kind));
  switch (error.kind) {
    case ServeErrorKind::kInvalidArgument:
      api.status = 400;
      api.type = "invalid_request_error";
      break;
    case ServeErrorKind::kTooLong:
      api.status = 400;
      api.type = "invalid_request_error";
      api.code = "context_length_exceeded";  // OpenAI's code for the same refusal
      break;
    case ServeErrorKind::kNotFound:
      api.status = 404;
      api.type = "invalid_request_error";
      break;
    case ServeErrorKind::kUnauthenticated:
      api.status = 401;
      api.type = "authentication_error";
      api.code = "invalid_api_key";
      break;
    case ServeErrorKind::kOverloaded:
      api.status = 429;
      api.type = "rate_limit_error";
      api.retry_after_s = 1;
      break;
    case ServeErrorKind::kUnavailable:
      api.status = 503;
      api.type = "service_unavailable";
      api.retry_after_s = 5;
      break;
    case ServeErrorKind::kInternal:
      api.status = 500;
      api.type = "server_error";
      break;
  }
  return api;
}

ApiError invalid_request(std::string code, std::string param, std::string message) {
  ApiError error;
  error.status = 400;
  error.type = "invalid_request_error";
  error.code = std::move(code);
  error.param = std::move(param);
  error.message = std::move(message);
  return error;
}

std::string error_body(const ApiError& error) { return dump(error_json(error)); }

std::string_view finish_reason(ServeFinish finish) {
  return finish == ServeFinish::kLength ? "length" : "stop";
}

std::optional<ApiError> failure(const RequestUpdate& final_update) {
  if (final_update.finish == ServeFinish::kError) {
    return api_error(final_update.error.value_or(
        ServeError{ServeErrorKind::kInternal, "the request failed for an unknown reason"}));
  }
  if (final_update.finish == ServeFinish::kCancelled) {
    return api_error(ServeError{ServeErrorKind::kUnavailable,
                                "the request was cancelled: the server is shutting down"});
  }
  return std::nullopt;
}

ResponseWriter::ResponseWriter(const CompletionRequest& request, std::string id, int64_t created,
                               std::string model, bool split_reasoning)
    : endpoint_(request.endpoint),
      include_usage_(request.stream && request.include_usage),
      return_token_ids_(request.serve.include_token_ids),
      id_(std::move(id)),
      created_(created),
      model_(std::move(model)),
      split_reasoning_(split_reasoning && request.endpoint == Endpoint::kChatCompletions) {}

ReasoningSplitter::Parts ResponseWriter::split(const RequestUpdate& update) {
  if (!split_reasoning_) return {{}, update.text};
  ReasoningSplitter::Parts parts = splitter_.add(update.text);
  if (update.finished) {
    ReasoningSplitter::Parts rest = splitter_.finish();
    parts.reasoning += rest.reasoning;
    parts.content += rest.content;
  }
  return parts;
}

std::string ResponseWriter::stream_start() {
  if (endpoint_ != Endpoint::kChatCompletions) return {};
  return chunk_event("", {}, nullptr, true);
}

std::string ResponseWriter::stream_update(const RequestUpdate& update) {
  const ReasoningSplitter::Parts parts = split(update);
  // A token that shows no text yet still makes a chunk when its id was asked for.
  const bool has_output =
      !parts.content.empty() || !parts.reasoning.empty() || !update.tokens.empty();
  if (!update.finished) {
    return has_output ? chunk_event(parts.content, update.tokens, nullptr, false, parts.reasoning)
                      : std::string();
  }
  if (std::optional<ApiError> error = failure(update)) {
    std::string events =
        has_output ? chunk_event(parts.content, update.tokens, nullptr, false, parts.reasoning)
                   : std::string();
    return events + stream_error(*error);
  }
  std::string events = chunk_event(parts.content, update.tokens, &update, false, parts.reasoning);
  if (include_usage_) {
    json usage_chunk = {{"id", id_},
                        {"object", endpoint_ == Endpoint::kChatCompletions ? "chat.completion.chunk"
                                                                           : "text_completion"},
                        {"created", created_},
                        {"model", model_},
                        {"choices", json::array()},
                        {"usage", usage_json(update.timings)},
                        {"duet", timings_json(update.timings)}};
    events += event(usage_chunk);
  }
  events += kDone;
  return events;
}

std::string ResponseWriter::stream_error(const ApiError& error) {
  return event(error_json(error)) + std::string(kDone);
}

std::string ResponseWriter::chunk_event(std::string_view text, std::span<const int32_t> tokens,
                                        const RequestUpdate* final_update, bool role,
                                        std::string_view reasoning) {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  json choice = {{"index", 0}};
  if (chat) {
    json delta = json::object();
    if (role) delta["role"] = "assistant";
    if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
    if (role || !text.empty() || (final_update == nullptr && reasoning.empty())) {
      delta["content"] = text;
    }
    choice["delta"] = std::move(delta);
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] =
      final_update != nullptr ? json(finish_reason(final_update->finish)) : json(nullptr);
  if (return_token_ids_) choice["token_ids"] = std::vector<int32_t>(tokens.begin(), tokens.end());
  json chunk = {{"id", id_},
                {"object", chat ? "chat.completion.chunk" : "text_completion"},
                {"created", created_},
                {"model", model_},
                {"choices", json::array({std::move(choice)})}};
  if (include_usage_) chunk["usage"] = nullptr;  // OpenAI: null on every chunk but the last
  if (final_update != nullptr) chunk["duet"] = timings_json(final_update->timings);
  return event(chunk);
}

void ResponseWriter::collect(const RequestUpdate& update) {
  text_ += update.text;
  if (return_token_ids_) tokens_.insert(tokens_.end(), update.tokens.begin(), update.tokens.end());
}

std::string ResponseWriter::full_response(const RequestUpdate& final_update) const {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  json choice = {{"index", 0}};
  if (chat && split_reasoning_) {
    ReasoningSplitter splitter;
    ReasoningSplitter::Parts parts = splitter.add(text_);
    ReasoningSplitter::Parts rest = splitter.finish();
    parts.reasoning += rest.reasoning;
    parts.content += rest.content;
    choice["message"] = {{"role", "assistant"}, {"content", parts.content}};
    if (!parts.reasoning.empty()) choice["message"]["reasoning_content"] = parts.reasoning;
  } else if (chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text_}};
  } else {
    choice["text"] = text_;
  }
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = finish_reason(final_update.finish);
  if (return_token_ids_) choice["token_ids"] = tokens_;
  const json body = {{"id", id_},
                     {"object", chat ? "chat.completion" : "text_completion"},
                     {"created", created_},
                     {"model", model_},
                     {"choices", json::array({std::move(choice)})},
                     {"usage", usage_json(final_update.timings)},
                     {"duet", timings_json(final_update.timings)}};
  return dump(body);
}

std::string models_body(const ModelSummary& model, int64_t created) {
  return dump({{"object", "list"}, {"data", json::array({model_json(model, created)})}});
}

std::string model_body(const ModelSummary& model, int64_t created) {
  return dump(model_json(model, created));
}

std::string tokenize_body(const std::vector<int32_t>& tokens) {
  return nlohmann::json{{"tokens", tokens}}.dump();
}

std::string detokenize_body(std::string_view text) {
  return nlohmann::json{{"content", text}}.dump(-1, ' ', false,
                                                nlohmann::json::error_handler_t::replace);
}

}  // namespace duet::openai

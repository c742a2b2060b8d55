// libFuzzer target for the OpenAI-compatible JSON of the HTTP front
// (coordinator/http/openai_api.h).
//
// Each input is a request body, parsed for both endpoints by parse_completion_request, which must
// never throw and must return a CompletionRequest or an ApiError with a 4xx status and a message.
// Checked against openai_api.h's contract:
// - a body that is not UTF-8 (by an independent check, utf8_reference.h) is refused as
//   invalid_utf8 and only such a body is; one that is not JSON is refused as invalid_json;
// - an error's error_body() and stream_error() are valid JSON holding its fields;
// - an accepted request carries only valid UTF-8 (model, prompt text, chat roles and contents,
//   stop strings), a prompt of the endpoint's form (completions: text or >= 1 token ids, each
//   >= 0; chat: >= 1 messages of role system, user or assistant), non-empty stop strings,
//   sampling that validate_sampling_params accepts, the default seed when the body names none,
//   and max_tokens unset when the body names none and otherwise >= 0 (0 and the upper limit are
//   Service::start's to refuse, as the header says), and token ids asked for exactly when the body
//   says `"return_token_ids": true`;
// - a ResponseWriter for it turns synthetic updates (the prompt's text as the generated text,
//   split in two, and a final update of every finish) into server-sent events and a full body
//   that are valid JSON, carry the text unchanged and end as the header says, and carry the
//   updates' token ids, in order, as the choices' `token_ids` when (and only when) asked.
#include <cstddef>
#include <cstdint>
#include <exception>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/error.h"
#include "common/sampling.h"
#include "coordinator/http/openai_api.h"
#include "coordinator/service.h"
#include "tests/fuzz/fuzz_check.h"
#include "tests/fuzz/utf8_reference.h"

namespace duet::fuzz {
namespace {

using openai::ApiError;
using openai::CompletionRequest;
using openai::Endpoint;
// The same flavour as openai_request.cpp's, so that duplicate keys resolve the same way (the last).
using json = nlohmann::ordered_json;

constexpr uint64_t kDefaultSeed = 0x5eed5eed5eed5eedull;
constexpr int64_t kCreated = 1700000000;

void require_utf8(std::string_view text, const char* what) {
  DUET_FUZZ_CHECK(reference_valid_utf8(text), "an accepted request's %s is not valid UTF-8", what);
}

// Strict parse: nlohmann refuses invalid UTF-8 inside strings, so this also checks the encoding.
json parse_output(std::string_view text, const char* what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    DUET_FUZZ_CHECK(false, "%s is not valid JSON (%s): %.*s", what, e.what(),
                    static_cast<int>(text.size()), text.data());
  }
  return {};
}

// The field `name` of an object, or nullptr when absent or null (the parser's reading).
const json* field(const json& object, const char* name) {
  if (!object.is_object()) return nullptr;
  const auto it = object.find(name);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

// The member `name` of an object, or null when there is none (operator[] of a const json
// must not be given a missing key).
const json& member(const json& object, const char* name) {
  static const json kNull;
  if (!object.is_object()) return kNull;
  const auto it = object.find(name);
  return it == object.end() ? kNull : *it;
}

void check_error_json(const json& body, const ApiError& error) {
  DUET_FUZZ_CHECK(body.is_object() && body.size() == 1 && body.contains("error"),
                  "the error body is not {\"error\": {...}}");
  const json& object = member(body, "error");
  DUET_FUZZ_CHECK(object.is_object(), "\"error\" is not an object");
  DUET_FUZZ_CHECK(object.contains("message") && member(object, "message").is_string(), "message");
  // A message that is not UTF-8 is written with U+FFFD in place of its bad bytes.
  if (reference_valid_utf8(error.message)) {
    DUET_FUZZ_CHECK(member(object, "message") == error.message, "message changed in the body");
  }
  DUET_FUZZ_CHECK(object.contains("type") && member(object, "type") == error.type, "type");
  DUET_FUZZ_CHECK(object.contains("code") && member(object, "code") == error.code, "code");
  DUET_FUZZ_CHECK(object.contains("param"), "param");
  if (error.param.empty()) {
    DUET_FUZZ_CHECK(member(object, "param").is_null(), "an empty param is not null");
  } else if (reference_valid_utf8(error.param)) {
    DUET_FUZZ_CHECK(member(object, "param") == error.param, "param changed in the body");
  }
}

// The events `data: ...\n\n` of a stream, in order.
std::vector<std::string_view> split_events(std::string_view stream) {
  std::vector<std::string_view> events;
  while (!stream.empty()) {
    const size_t end = stream.find("\n\n");
    DUET_FUZZ_CHECK(end != std::string_view::npos, "an event does not end with a blank line");
    std::string_view event = stream.substr(0, end);
    DUET_FUZZ_CHECK(event.starts_with("data: "), "an event does not start with 'data: '");
    event.remove_prefix(6);
    DUET_FUZZ_CHECK(event.find('\n') == std::string_view::npos, "a raw newline inside an event");
    events.push_back(event);
    stream.remove_prefix(end + 2);
  }
  return events;
}

void check_error(const ApiError& error, bool utf8, bool is_json) {
  DUET_FUZZ_CHECK(error.status >= 400 && error.status <= 499, "status %u for a bad request (%s)",
                  error.status, error.message.c_str());
  DUET_FUZZ_CHECK(!error.message.empty(), "an error without a message (code %s)",
                  error.code.c_str());
  DUET_FUZZ_CHECK(!error.type.empty() && !error.code.empty(), "an error without type or code: %s",
                  error.message.c_str());
  // The UTF-8 check of common/text/unicode.cpp against the reference one.
  DUET_FUZZ_CHECK((error.code == "invalid_utf8") == !utf8,
                  "code %s for a body whose UTF-8 is %s: %s", error.code.c_str(),
                  utf8 ? "valid" : "invalid", error.message.c_str());
  if (utf8) {
    DUET_FUZZ_CHECK((error.code == "invalid_json") == !is_json,
                    "code %s for a body that is%s JSON: %s", error.code.c_str(),
                    is_json ? "" : " not", error.message.c_str());
  }
  check_error_json(parse_output(openai::error_body(error), "error_body"), error);
  const std::string stream = openai::ResponseWriter::stream_error(error);
  const std::vector<std::string_view> events = split_events(stream);
  DUET_FUZZ_CHECK(events.size() == 2 && events[1] == "[DONE]", "stream_error's events");
  check_error_json(parse_output(events[0], "stream_error"), error);
}

// The longest prefix of `text` of at most `n` bytes that ends on a code point boundary.
std::string_view utf8_prefix(std::string_view text, size_t n) {
  n = std::min(n, text.size());
  while (n > 0 && n < text.size() && (static_cast<uint8_t>(text[n]) & 0xC0) == 0x80) --n;
  return text.substr(0, n);
}

// Streams `text` as two updates, the second final with `finish`, and checks the events.
void check_stream(const CompletionRequest& request, std::string_view text, ServeFinish finish,
                  const RequestUpdate& final_update) {
  const bool chat = request.endpoint == Endpoint::kChatCompletions;
  const bool include_usage = request.stream && request.include_usage;
  const bool failed = finish == ServeFinish::kError || finish == ServeFinish::kCancelled;
  openai::ResponseWriter writer(request, chat ? "chatcmpl-fuzz" : "cmpl-fuzz", kCreated,
                                request.model);
  RequestUpdate first;
  first.id = final_update.id;
  first.text = std::string(utf8_prefix(text, text.size() / 2));
  RequestUpdate last = final_update;
  last.text = std::string(text.substr(first.text.size()));
  // The service fills ids only for a request that asked for them.
  const bool ids = request.serve.include_token_ids;
  const std::vector<int32_t> all_ids =
      ids ? std::vector<int32_t>{11, 12, 13} : std::vector<int32_t>{};
  if (ids) {
    first.tokens = {11, 12};
    last.tokens = {13};
  }

  const std::string stream =
      writer.stream_start() + writer.stream_update(first) + writer.stream_update(last);
  const std::vector<std::string_view> events = split_events(stream);
  DUET_FUZZ_CHECK(!events.empty() && events.back() == "[DONE]", "the stream does not end [DONE]");
  std::string streamed;
  std::vector<int32_t> streamed_ids;
  int n_finish = 0;
  int n_usage = 0;
  int n_error = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    const json event = parse_output(events[i], "a stream event");
    DUET_FUZZ_CHECK(event.is_object(), "an event is not an object");
    if (event.contains("error")) {
      ++n_error;
      DUET_FUZZ_CHECK(i + 2 == events.size(), "events after the error");
      const std::optional<ApiError> error = openai::failure(last);
      DUET_FUZZ_CHECK(error.has_value(), "an error event for a normal finish");
      check_error_json(event, *error);
      continue;
    }
    DUET_FUZZ_CHECK(member(event, "id") == (chat ? "chatcmpl-fuzz" : "cmpl-fuzz"), "chunk id");
    DUET_FUZZ_CHECK(member(event, "object") == (chat ? "chat.completion.chunk" : "text_completion"),
                    "chunk object");
    DUET_FUZZ_CHECK(member(event, "model") == request.model, "chunk model");
    DUET_FUZZ_CHECK(member(event, "created") == kCreated, "chunk created");
    const json& choices = member(event, "choices");
    DUET_FUZZ_CHECK(choices.is_array() && choices.size() <= 1, "chunk choices");
    if (choices.empty()) {
      ++n_usage;
      DUET_FUZZ_CHECK(member(event, "usage").is_object(), "the usage chunk has no usage");
      DUET_FUZZ_CHECK(member(member(event, "usage"), "completion_tokens") ==
                          final_update.timings.completion_tokens,
                      "usage completion_tokens");
      continue;
    }
    if (include_usage)
      DUET_FUZZ_CHECK(member(event, "usage").is_null(), "usage on a content chunk");
    const json& choice = choices[0];
    DUET_FUZZ_CHECK(choice.contains("token_ids") == ids, "a chunk's token_ids %s",
                    ids ? "missing" : "not asked for");
    if (ids) {
      DUET_FUZZ_CHECK(member(choice, "token_ids").is_array(), "token_ids is not a list");
      for (const json& id : member(choice, "token_ids")) streamed_ids.push_back(id.get<int32_t>());
    }
    if (chat) {
      const json& delta = member(choice, "delta");
      DUET_FUZZ_CHECK(delta.is_object(), "chat chunk without delta");
      if (delta.contains("content")) streamed += member(delta, "content").get<std::string>();
    } else {
      streamed += member(choice, "text").get<std::string>();
    }
    if (!member(choice, "finish_reason").is_null()) {
      ++n_finish;
      DUET_FUZZ_CHECK(member(choice, "finish_reason") == openai::finish_reason(finish),
                      "finish_reason");
    }
  }
  DUET_FUZZ_CHECK(streamed == text, "the streamed text differs from the generated text");
  DUET_FUZZ_CHECK(streamed_ids == all_ids, "the streamed token ids differ from the generated ones");
  DUET_FUZZ_CHECK(n_error == (failed ? 1 : 0), "%d error events", n_error);
  DUET_FUZZ_CHECK(n_finish == (failed ? 0 : 1), "%d chunks with a finish_reason", n_finish);
  DUET_FUZZ_CHECK(n_usage == (!failed && include_usage ? 1 : 0), "%d usage chunks", n_usage);

  if (failed) return;
  openai::ResponseWriter whole(request, chat ? "chatcmpl-fuzz" : "cmpl-fuzz", kCreated,
                               request.model);
  whole.collect(first);
  whole.collect(last);
  const json full = parse_output(whole.full_response(final_update), "full_response");
  DUET_FUZZ_CHECK(member(full, "model") == request.model, "full model");
  const json& choices = member(full, "choices");
  DUET_FUZZ_CHECK(choices.is_array() && choices.size() == 1, "full choices");
  const json& choice = choices[0];
  DUET_FUZZ_CHECK((chat ? member(member(choice, "message"), "content") : member(choice, "text")) ==
                      std::string(text),
                  "the full response's text differs from the generated text");
  DUET_FUZZ_CHECK(member(choice, "finish_reason") == openai::finish_reason(finish),
                  "full finish_reason");
  DUET_FUZZ_CHECK(
      ids ? member(choice, "token_ids") == json(all_ids) : !choice.contains("token_ids"),
      "the full response's token_ids");
  DUET_FUZZ_CHECK(
      member(member(full, "usage"), "prompt_tokens") == final_update.timings.prompt_tokens,
      "full usage");
}

void check_request(Endpoint endpoint, const CompletionRequest& request, const json& body,
                   ServeFinish finish) {
  const bool chat = endpoint == Endpoint::kChatCompletions;
  DUET_FUZZ_CHECK(request.endpoint == endpoint, "endpoint");
  DUET_FUZZ_CHECK(body.is_object(), "accepted a body that is not an object");
  require_utf8(request.model, "model");
  const ServeRequest& serve = request.serve;

  // The text the synthetic updates carry: the prompt's, so that the writer sees the input's bytes.
  std::string text;
  if (chat) {
    const auto* messages = std::get_if<std::vector<ChatMessage>>(&serve.prompt);
    DUET_FUZZ_CHECK(messages != nullptr, "a chat request without messages");
    DUET_FUZZ_CHECK(!messages->empty(), "a chat request with no message");
    for (const ChatMessage& message : *messages) {
      require_utf8(message.role, "role");
      require_utf8(message.content, "message content");
      DUET_FUZZ_CHECK(
          message.role == "system" || message.role == "user" || message.role == "assistant",
          "role '%s'", message.role.c_str());
      text += message.content;
    }
  } else if (const auto* prompt = std::get_if<std::string>(&serve.prompt)) {
    require_utf8(*prompt, "prompt");
    text = *prompt;
  } else {
    const auto* ids = std::get_if<std::vector<int32_t>>(&serve.prompt);
    DUET_FUZZ_CHECK(ids != nullptr, "a completions request with a chat prompt");
    DUET_FUZZ_CHECK(!ids->empty(), "an empty token-id prompt");
    for (const int32_t id : *ids) DUET_FUZZ_CHECK(id >= 0, "token id %d", id);
  }
  for (const std::string& stop : serve.stop) {
    DUET_FUZZ_CHECK(!stop.empty(), "an empty stop string");
    require_utf8(stop, "stop string");
  }

  try {
    validate_sampling_params(serve.sampling);
  } catch (const Error& e) {
    DUET_FUZZ_CHECK(false, "accepted sampling that validate_sampling_params refuses: %s", e.what());
  }
  if (field(body, "seed") == nullptr) {
    DUET_FUZZ_CHECK(serve.sampling.seed == kDefaultSeed, "not the default seed");
  }
  const bool names_max_tokens = field(body, "max_tokens") != nullptr ||
                                (chat && field(body, "max_completion_tokens") != nullptr);
  if (!names_max_tokens) {
    DUET_FUZZ_CHECK(!serve.max_tokens.has_value(), "max_tokens set without a field");
  }
  if (serve.max_tokens) {
    DUET_FUZZ_CHECK(*serve.max_tokens >= 0, "max_tokens %lld",
                    static_cast<long long>(*serve.max_tokens));
  }
  const json* return_token_ids = field(body, "return_token_ids");
  DUET_FUZZ_CHECK(
      serve.include_token_ids == (return_token_ids != nullptr && return_token_ids->get<bool>()),
      "include_token_ids");
  const json* stream = field(body, "stream");
  DUET_FUZZ_CHECK(request.stream == (stream != nullptr && stream->get<bool>()), "stream");
  if (field(body, "stream_options") == nullptr) {
    DUET_FUZZ_CHECK(!request.include_usage, "include_usage without stream_options");
  }
  const json* model = field(body, "model");
  DUET_FUZZ_CHECK(request.model == (model != nullptr ? model->get<std::string>() : ""), "model");

  RequestUpdate final_update;
  final_update.id = RequestId{42};
  final_update.finished = true;
  final_update.finish = finish;
  final_update.timings = {0.25, 0.5, 0.01, 1.5, static_cast<int64_t>(text.size()), 17, 3};
  if (finish == ServeFinish::kError) {
    final_update.error = ServeError{ServeErrorKind::kInternal, "the worker went away"};
  }
  check_stream(request, text, finish, final_update);
}

}  // namespace
}  // namespace duet::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace duet::fuzz;
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  const bool utf8 = reference_valid_utf8(body);
  std::optional<json> parsed;
  if (utf8) {
    try {
      parsed = json::parse(body);
    } catch (const json::exception&) {
    }
  }
  // Which finish the synthetic final update has: from the input, so that every one is reached.
  const auto finish = static_cast<duet::ServeFinish>(size == 0 ? 0 : data[size / 2] % 4);
  for (const Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions}) {
    std::variant<CompletionRequest, ApiError> result;
    try {
      result = duet::openai::parse_completion_request(endpoint, body, kDefaultSeed);
    } catch (const std::exception& e) {
      DUET_FUZZ_CHECK(false, "parse_completion_request threw: %s", e.what());
    } catch (...) {
      DUET_FUZZ_CHECK(false, "parse_completion_request threw a non-std exception");
    }
    if (const auto* error = std::get_if<ApiError>(&result)) {
      check_error(*error, utf8, parsed.has_value());
      continue;
    }
    DUET_FUZZ_CHECK(utf8 && parsed.has_value(), "accepted a body that is not UTF-8 JSON");
    try {
      check_request(endpoint, std::get<CompletionRequest>(result), *parsed, finish);
    } catch (const std::exception& e) {
      DUET_FUZZ_CHECK(false, "checking the accepted request threw: %s", e.what());
    }
  }
  return 0;
}

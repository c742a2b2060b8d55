// The OpenAI-compatible API, the request side: bodies of /v1/completions,
// /v1/chat/completions, /tokenize and /detokenize parsed into the service's
// requests, or the typed 400 that says what is wrong.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "common/error.h"
#include "common/text/unicode.h"
#include "coordinator/http/openai_api.h"

namespace duet::openai {
namespace {

// Insertion-ordered, so responses read in OpenAI's field order (id, object, created, ...).
using json = nlohmann::ordered_json;

// Thrown by the field readers below and caught by parse_completion_request,
// which returns it: it never leaves this file.
struct Refusal {
  ApiError error;
};

[[noreturn]] void refuse(std::string code, std::string param, std::string message) {
  throw Refusal{invalid_request(std::move(code), std::move(param), std::move(message))};
}

[[noreturn]] void refuse_type(const std::string& param, std::string_view expected,
                              const json& value) {
  refuse("invalid_type", param,
         fmt::format("'{}' must be {}, got {}", param, expected, value.type_name()));
}

// The field `name` of `body`, or nullptr when it is absent or null (OpenAI
// treats an explicit null as "not given").
const json* field(const json& body, const char* name) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<bool> read_bool(const json& body, const char* name) {
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_boolean()) refuse_type(name, "a boolean", *value);
  return value->get<bool>();
}

std::optional<double> read_number(const json& body, const char* name) {
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_number()) refuse_type(name, "a number", *value);
  return value->get<double>();
}

// An integer field. A number with no fraction counts ("16.0", "1e3"), as in
// OpenAI's API; values beyond 64 bits saturate, so that a later range check
// refuses them with a message about the limit, not about the type.
std::optional<int64_t> read_integer(const json& body, const char* name) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (value->is_number_unsigned()) {
    const uint64_t v = value->get<uint64_t>();
    return v > static_cast<uint64_t>(kMax) ? kMax : static_cast<int64_t>(v);
  }
  if (value->is_number_integer()) return value->get<int64_t>();
  if (!value->is_number_float()) refuse_type(name, "an integer", *value);
  const double v = value->get<double>();
  if (v != std::floor(v)) {
    refuse("invalid_type", name, fmt::format("'{}' must be an integer, got {}", name, v));
  }
  if (v >= 0x1p63) return kMax;
  if (v < -0x1p63) return kMin;
  return static_cast<int64_t>(v);
}

std::optional<std::string> read_string(const json& body, const char* name) {
  const json* value = field(body, name);
  if (value == nullptr) return std::nullopt;
  if (!value->is_string()) refuse_type(name, "a string", *value);
  return value->get<std::string>();
}

bool is_token_id_list(const json& value) {
  if (!value.is_array() || value.empty()) return false;
  for (const json& item : value) {
    if (!item.is_number_integer()) return false;
  }
  return true;
}

std::vector<int32_t> token_ids(const json& list) {
  std::vector<int32_t> ids;
  ids.reserve(list.size());
  for (const json& item : list) {
    // An unsigned value too large for int64_t reads as -1, refused below.
    const int64_t id =
        item.is_number_unsigned() && item.get<uint64_t>() > INT32_MAX ? -1 : item.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      refuse("invalid_value", "prompt", fmt::format("token id {} is out of range", item.dump()));
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

// `prompt`: a string, a list of token ids, or a list holding exactly one of
// those (several prompts would need n > 1 choices).
PromptInput read_prompt(const json& body) {
  const json* prompt = field(body, "prompt");
  if (prompt == nullptr) refuse("missing_field", "prompt", "'prompt' is required");
  if (prompt->is_string()) return prompt->get<std::string>();
  if (!prompt->is_array()) refuse_type("prompt", "a string or a list of token ids", *prompt);
  if (prompt->empty()) refuse("invalid_value", "prompt", "'prompt' must not be an empty list");
  if (is_token_id_list(*prompt)) return token_ids(*prompt);
  if (prompt->size() > 1) {
    refuse("unsupported_value", "prompt",
           "Duet serves one prompt per request; send several prompts as separate requests");
  }
  const json& only = prompt->front();
  if (only.is_string()) return only.get<std::string>();
  if (is_token_id_list(only)) return token_ids(only);
  refuse_type("prompt", "a string or a list of token ids", only);
}

// A message's content: a string, or a list of text parts whose texts are joined.
std::string read_content(const json& message, size_t index) {
  const std::string param = fmt::format("messages[{}].content", index);
  const json* content = field(message, "content");
  if (content == nullptr) refuse("missing_field", param, fmt::format("'{}' is required", param));
  if (content->is_string()) return content->get<std::string>();
  if (!content->is_array()) refuse_type(param, "a string", *content);
  std::string text;
  for (const json& part : *content) {
    const json* type = part.is_object() ? field(part, "type") : nullptr;
    const json* part_text = part.is_object() ? field(part, "text") : nullptr;
    if (type == nullptr || *type != "text" || part_text == nullptr || !part_text->is_string()) {
      refuse("unsupported_value", param,
             fmt::format("'{}' parts must be {{\"type\": \"text\", \"text\": string}}", param));
    }
    text += part_text->get<std::string>();
  }
  return text;
}

std::vector<ChatMessage> read_messages(const json& body) {
  const json* messages = field(body, "messages");
  if (messages == nullptr) refuse("missing_field", "messages", "'messages' is required");
  if (!messages->is_array()) refuse_type("messages", "an array", *messages);
  if (messages->empty()) refuse("invalid_value", "messages", "'messages' must not be empty");
  std::vector<ChatMessage> chat;
  chat.reserve(messages->size());
  for (size_t i = 0; i < messages->size(); ++i) {
    const json& message = (*messages)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!message.is_object()) refuse_type(param, "an object", message);
    const json* role = field(message, "role");
    const std::string role_param = param + ".role";
    if (role == nullptr)
      refuse("missing_field", role_param, fmt::format("'{}' is required", role_param));
    if (!role->is_string()) refuse_type(role_param, "a string", *role);
    std::string name = role->get<std::string>();
    if (name == "developer") name = "system";  // OpenAI's newer name for the system role
    if (name != "system" && name != "user" && name != "assistant") {
      refuse("invalid_value", role_param,
             fmt::format("'{}' must be \"system\", \"user\" or \"assistant\", got \"{}\"",
                         role_param, name));
    }
    chat.push_back(ChatMessage{std::move(name), read_content(message, i)});
  }
  return chat;
}

std::vector<std::string> read_stop(const json& body) {
  const json* stop = field(body, "stop");
  if (stop == nullptr) return {};
  std::vector<std::string> stops;
  if (stop->is_string()) {
    stops.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (const json& item : *stop) {
      if (!item.is_string()) refuse_type("stop", "a string or a list of strings", item);
      stops.push_back(item.get<std::string>());
    }
  } else {
    refuse_type("stop", "a string or a list of strings", *stop);
  }
  for (const std::string& s : stops) {
    if (s.empty()) refuse("invalid_value", "stop", "stop strings must not be empty");
  }
  return stops;
}

// Refuses the OpenAI features Duet does not implement, rather than silently
// answering without them.
void refuse_unsupported(const json& body) {
  const auto unsupported = [](const char* param, std::string_view what) {
    refuse("unsupported_value", param, fmt::format("Duet does not support {}", what));
  };
  if (const json* logprobs = field(body, "logprobs")) {
    // Chat asks with true, completions with a count; false and 0 ask for nothing.
    const bool asked = !(logprobs->is_boolean() && !logprobs->get<bool>()) &&
                       !(logprobs->is_number() && logprobs->get<double>() == 0);
    if (asked) unsupported("logprobs", "log-probabilities ('logprobs')");
  }
  if (read_bool(body, "echo").value_or(false)) unsupported("echo", "'echo'");
  if (read_integer(body, "best_of").value_or(1) > 1) unsupported("best_of", "'best_of' > 1");
  if (!read_string(body, "suffix").value_or("").empty()) unsupported("suffix", "'suffix'");
  if (const json* tools = field(body, "tools"); tools != nullptr && !tools->empty())
    unsupported("tools", "tools");
}

// The sampling controls; their ranges are validate_sampling_params's.
SamplingParams read_sampling(const json& body, uint64_t default_seed) {
  SamplingParams sampling;
  sampling.temperature = static_cast<float>(read_number(body, "temperature").value_or(1.0));
  sampling.top_p = static_cast<float>(read_number(body, "top_p").value_or(1.0));
  sampling.min_p = static_cast<float>(read_number(body, "min_p").value_or(0.0));
  sampling.frequency_penalty =
      static_cast<float>(read_number(body, "frequency_penalty").value_or(0.0));
  sampling.presence_penalty =
      static_cast<float>(read_number(body, "presence_penalty").value_or(0.0));
  sampling.repetition_penalty =
      static_cast<float>(read_number(body, "repetition_penalty").value_or(1.0));
  const int64_t top_k = read_integer(body, "top_k").value_or(0);
  if (top_k < -1) refuse("invalid_value", "top_k", "'top_k' must be -1 or 0 (off) or positive");
  sampling.top_k = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(top_k, 0), INT32_MAX));
  if (const json* seed = field(body, "seed")) {
    if (!seed->is_number_integer()) refuse_type("seed", "an integer", *seed);
    // Negative seeds wrap: any 64-bit pattern is a seed.
    sampling.seed = seed->is_number_unsigned() ? seed->get<uint64_t>()
                                               : static_cast<uint64_t>(seed->get<int64_t>());
  } else {
    sampling.seed = default_seed;
  }
  try {
    validate_sampling_params(sampling);
  } catch (const Error& e) {
    // The message starts with the field's name: "top_p must be in (0, 1], got 1.5".
    const std::string message = e.what();
    refuse("invalid_value", message.substr(0, message.find(' ')), message);
  }
  return sampling;
}

CompletionRequest read_request(Endpoint endpoint, const json& body, uint64_t default_seed) {
  if (!body.is_object()) refuse_type("body", "a JSON object", body);
  refuse_unsupported(body);
  CompletionRequest request;
  request.endpoint = endpoint;
  request.model = read_string(body, "model").value_or("");
  if (const int64_t n = read_integer(body, "n").value_or(1); n != 1) {
    refuse("unsupported_value", "n",
           fmt::format("'n' must be 1 (Duet generates one choice per request), got {}", n));
  }
  if (endpoint == Endpoint::kChatCompletions) {
    request.serve.prompt = read_messages(body);
  } else {
    request.serve.prompt = read_prompt(body);
  }

  std::optional<int64_t> max_tokens = read_integer(body, "max_tokens");
  const char* max_tokens_name = "max_tokens";
  if (endpoint == Endpoint::kChatCompletions) {
    if (auto completion = read_integer(body, "max_completion_tokens")) {
      max_tokens = completion;
      max_tokens_name = "max_completion_tokens";
    }
  }
  if (max_tokens && *max_tokens < 0) {
    refuse("invalid_value", max_tokens_name,
           fmt::format("'{}' must be >= 0, got {}", max_tokens_name, *max_tokens));
  }
  request.serve.max_tokens = max_tokens;
  request.serve.stop = read_stop(body);
  request.serve.sampling = read_sampling(body, default_seed);
  request.serve.ignore_eos = read_bool(body, "ignore_eos").value_or(false);
  request.serve.include_token_ids = read_bool(body, "return_token_ids").value_or(false);

  request.stream = read_bool(body, "stream").value_or(false);
  if (const json* options = field(body, "stream_options")) {
    if (!options->is_object()) refuse_type("stream_options", "an object", *options);
    request.include_usage = read_bool(*options, "include_usage").value_or(false);
  }
  return request;
}

}  // namespace

std::variant<CompletionRequest, ApiError> parse_completion_request(Endpoint endpoint,
                                                                   std::string_view body,
                                                                   uint64_t default_seed) {
  // Checked on the raw bytes: every string of the parsed body is then valid
  // UTF-8 too (the parser decodes \u escapes to well-formed UTF-8 and refuses
  // unpaired surrogates).
  if (!is_valid_utf8(body)) {
    return invalid_request("invalid_utf8", "", "the request body is not valid UTF-8");
  }
  json parsed;
  try {
    parsed = json::parse(body);
  } catch (const json::exception& e) {
    return invalid_request("invalid_json", "",
                           fmt::format("the request body is not valid JSON: {}", e.what()));
  }
  try {
    return read_request(endpoint, parsed, default_seed);
  } catch (const Refusal& refusal) {
    return refusal.error;
  }
}

namespace {

// The body of /tokenize or /detokenize as a JSON object, or the 400 that says
// why not (the codes of the completions routes).
std::variant<nlohmann::json, openai::ApiError> parse_json_object(std::string_view body) {
  if (!is_valid_utf8(body))
    return openai::invalid_request("invalid_utf8", "", "the request body is not valid UTF-8");
  nlohmann::json parsed = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded())
    return openai::invalid_request("invalid_json", "", "the request body is not valid JSON");
  if (!parsed.is_object())
    return openai::invalid_request("invalid_type", "body", "the request body must be an object");
  return parsed;
}

}  // namespace

std::variant<TokenizeRequest, ApiError> parse_tokenize_request(std::string_view body) {
  auto parsed = parse_json_object(body);
  if (auto* error = std::get_if<ApiError>(&parsed)) return std::move(*error);
  const nlohmann::json& object = std::get<nlohmann::json>(parsed);
  const auto content = object.find("content");
  if (content == object.end())
    return invalid_request("missing_field", "content", "'content' is required");
  if (!content->is_string())
    return invalid_request("invalid_type", "content", "'content' must be a string");
  TokenizeRequest request{content->get<std::string>(), false};
  if (const auto it = object.find("add_special"); it != object.end() && !it->is_null()) {
    if (!it->is_boolean())
      return invalid_request("invalid_type", "add_special", "'add_special' must be a boolean");
    request.add_special = it->get<bool>();
  }
  return request;
}

std::variant<std::vector<int32_t>, ApiError> parse_detokenize_request(std::string_view body) {
  auto parsed = parse_json_object(body);
  if (auto* error = std::get_if<ApiError>(&parsed)) return std::move(*error);
  const nlohmann::json& object = std::get<nlohmann::json>(parsed);
  const auto tokens = object.find("tokens");
  if (tokens == object.end())
    return invalid_request("missing_field", "tokens", "'tokens' is required");
  if (!tokens->is_array())
    return invalid_request("invalid_type", "tokens", "'tokens' must be a list of token ids");
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (const nlohmann::json& id : *tokens) {
    if (!id.is_number_integer())
      return invalid_request("invalid_type", "tokens",
                             "'tokens' must be a list of integer token ids");
    const int64_t value =
        id.is_number_unsigned()
            ? static_cast<int64_t>(std::min<uint64_t>(id.get<uint64_t>(), INT32_MAX + 1ULL))
            : id.get<int64_t>();
    if (value < 0 || value > INT32_MAX)
      return invalid_request("invalid_value", "tokens",
                             fmt::format("token id {} is out of range", value));
    ids.push_back(static_cast<int32_t>(value));
  }
  return ids;
}

}  // namespace duet::openai

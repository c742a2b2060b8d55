// libFuzzer target for the Cap'n Proto requests the RPC front accepts (common/duet.capnp,
// coordinator/rpc/rpc_convert.h).
//
// Each input is a message (a segment table and its segments; a tail short of a word is padded
// with zeros), read with low traversal and nesting limits as a GenerateRequest and converted as
// the RPC front does: the model name first, then to_serve_request. A malformed message throws
// kj::Exception, which is expected; any other exception, a crash or a sanitizer report is a
// finding. An accepted request must mirror the message exactly, read again from a second reader:
// the prompt's form and every byte of its text (embedded NULs too), token ids, chat roles and
// contents, stop strings, sampling fields bit for bit, max_tokens unset for the wire's 0 and
// otherwise the wire's value (so >= 1), the flags. validate_sampling_params, which
// Service::start calls next on these floats, must accept them or throw kInvalidArgument.
//
// UTF-8: the converter does not check it (Cap'n Proto's Text is bytes with a NUL after them) and
// rpc_convert.h promises nothing about it; Service::start refuses prompt text, chat contents and
// stop strings that are not valid UTF-8. So this target checks byte equality, not UTF-8.
#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/duet.capnp.h"
#include "common/error.h"
#include "common/sampling.h"
#include "coordinator/rpc/rpc_convert.h"
#include "coordinator/service.h"
#include "tests/fuzz/fuzz_check.h"

namespace duet::fuzz {
namespace {

// Low limits, so that a hostile message costs little: 64 Ki words (512 KiB) of traversal, 16
// levels of nesting.
capnp::ReaderOptions reader_options() {
  capnp::ReaderOptions options;
  options.traversalLimitInWords = uint64_t{1} << 16;
  options.nestingLimit = 16;
  return options;
}

std::string_view bytes_of(capnp::Text::Reader text) { return {text.begin(), text.size()}; }

bool same_float(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// `serve` against the message, read again from `in` (a second reader over the same words).
void check_mirror(const ServeRequest& serve, rpc::GenerateRequest::Reader in) {
  const auto prompt = in.getPrompt();
  switch (prompt.which()) {
    case rpc::GenerateRequest::Prompt::TEXT: {
      const auto* text = std::get_if<std::string>(&serve.prompt);
      DUET_FUZZ_CHECK(text != nullptr, "a text prompt became another form");
      DUET_FUZZ_CHECK(*text == bytes_of(prompt.getText()), "prompt text differs (%zu bytes)",
                      text->size());
      break;
    }
    case rpc::GenerateRequest::Prompt::TOKENS: {
      const auto* ids = std::get_if<std::vector<int32_t>>(&serve.prompt);
      DUET_FUZZ_CHECK(ids != nullptr, "a token prompt became another form");
      const auto tokens = prompt.getTokens();
      DUET_FUZZ_CHECK(ids->size() == tokens.size(), "%zu token ids, %u on the wire", ids->size(),
                      tokens.size());
      for (unsigned i = 0; i < tokens.size(); ++i) {
        DUET_FUZZ_CHECK((*ids)[i] == tokens[i], "token id %u differs", i);
      }
      break;
    }
    case rpc::GenerateRequest::Prompt::CHAT: {
      const auto* messages = std::get_if<std::vector<ChatMessage>>(&serve.prompt);
      DUET_FUZZ_CHECK(messages != nullptr, "a chat prompt became another form");
      const auto chat = prompt.getChat();
      DUET_FUZZ_CHECK(messages->size() == chat.size(), "%zu messages, %u on the wire",
                      messages->size(), chat.size());
      for (unsigned i = 0; i < chat.size(); ++i) {
        DUET_FUZZ_CHECK((*messages)[i].role == bytes_of(chat[i].getRole()), "role %u differs", i);
        DUET_FUZZ_CHECK((*messages)[i].content == bytes_of(chat[i].getContent()),
                        "content %u differs", i);
      }
      break;
    }
    default:
      DUET_FUZZ_CHECK(false, "accepted an unknown prompt form %u",
                      static_cast<unsigned>(prompt.which()));
  }

  const uint32_t max_tokens = in.getMaxTokens();
  if (max_tokens == 0) {
    DUET_FUZZ_CHECK(!serve.max_tokens.has_value(), "maxTokens 0 did not leave max_tokens unset");
  } else {
    DUET_FUZZ_CHECK(serve.max_tokens == int64_t{max_tokens}, "max_tokens differs from %u",
                    max_tokens);
  }

  const auto sampling = in.getSampling();
  const SamplingParams& s = serve.sampling;
  DUET_FUZZ_CHECK(same_float(s.temperature, sampling.getTemperature()), "temperature");
  DUET_FUZZ_CHECK(s.top_k == sampling.getTopK(), "top_k");
  DUET_FUZZ_CHECK(same_float(s.top_p, sampling.getTopP()), "top_p");
  DUET_FUZZ_CHECK(same_float(s.min_p, sampling.getMinP()), "min_p");
  DUET_FUZZ_CHECK(s.seed == sampling.getSeed(), "seed");
  DUET_FUZZ_CHECK(same_float(s.repetition_penalty, sampling.getRepetitionPenalty()),
                  "repetition_penalty");
  DUET_FUZZ_CHECK(same_float(s.frequency_penalty, sampling.getFrequencyPenalty()),
                  "frequency_penalty");
  DUET_FUZZ_CHECK(same_float(s.presence_penalty, sampling.getPresencePenalty()),
                  "presence_penalty");
  DUET_FUZZ_CHECK(s.penalty_last_n == SamplingParams{}.penalty_last_n,
                  "penalty_last_n is not on the wire but changed");

  const auto stop = in.getStop();
  DUET_FUZZ_CHECK(serve.stop.size() == stop.size(), "%zu stop strings, %u on the wire",
                  serve.stop.size(), stop.size());
  for (unsigned i = 0; i < stop.size(); ++i) {
    DUET_FUZZ_CHECK(serve.stop[i] == bytes_of(stop[i]), "stop string %u differs", i);
  }
  DUET_FUZZ_CHECK(serve.ignore_eos == in.getIgnoreEos(), "ignore_eos");
  DUET_FUZZ_CHECK(serve.include_token_ids == in.getIncludeTokenIds(), "include_token_ids");

  // What Service::start does next with the wire's floats.
  try {
    validate_sampling_params(s);
  } catch (const Error& error) {
    DUET_FUZZ_CHECK(error.kind() == ErrorKind::kInvalidArgument,
                    "validate_sampling_params threw %s: %s", error_kind_name(error.kind()).data(),
                    error.what());
  }
}

void run(const std::vector<capnp::word>& words) {
  const kj::ArrayPtr<const capnp::word> array(words.data(), words.size());
  capnp::FlatArrayMessageReader reader(array, reader_options());
  const auto request = reader.getRoot<rpc::GenerateRequest>();
  // The RPC front reads the model name before it converts the request.
  keep(rpc_convert::to_string(request.getModel()).size());
  Result<ServeRequest> converted = rpc_convert::to_serve_request(request);
  if (const auto* error = std::get_if<ServeError>(&converted)) {
    DUET_FUZZ_CHECK(error->kind == ServeErrorKind::kInvalidArgument && !error->message.empty(),
                    "refused as %s: %s", serve_error_kind_name(error->kind).data(),
                    error->message.c_str());
    const auto which = request.getPrompt().which();
    DUET_FUZZ_CHECK(which != rpc::GenerateRequest::Prompt::TEXT &&
                        which != rpc::GenerateRequest::Prompt::TOKENS &&
                        which != rpc::GenerateRequest::Prompt::CHAT,
                    "refused a known prompt form: %s", error->message.c_str());
    return;
  }
  // A second reader, with its own traversal budget: the first one's is partly spent. The same
  // reads succeeded once, so they must again (a kj::Exception here is a finding).
  capnp::FlatArrayMessageReader again(array, reader_options());
  try {
    check_mirror(std::get<ServeRequest>(converted), again.getRoot<rpc::GenerateRequest>());
  } catch (const kj::Exception& e) {
    DUET_FUZZ_CHECK(false, "re-reading an accepted message threw: %s", e.getDescription().cStr());
  }
}

}  // namespace
}  // namespace duet::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // An aligned, exact-size heap copy (ASan sees a read past the last word).
  std::vector<capnp::word> words((size + sizeof(capnp::word) - 1) / sizeof(capnp::word));
  if (size > 0) std::memcpy(words.data(), data, size);
  try {
    duet::fuzz::run(words);
  } catch (const kj::Exception&) {
    // A malformed message: expected.
  }
  return 0;
}

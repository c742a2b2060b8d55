#include "common/text/tokenizer_gguf.h"

#include <fmt/format.h>

#include "common/error.h"

namespace duet {
namespace {

// As llama.cpp: an id outside the vocabulary (converters write 0xFFFFFFFF for
// "none") leaves the default, which is itself dropped when out of range.
std::optional<TokenId> token_id(const GgufFile& file, const char* key, size_t n_tokens,
                                std::optional<TokenId> fallback = std::nullopt) {
  if (fallback && static_cast<size_t>(*fallback) >= n_tokens) fallback.reset();
  const std::optional<uint32_t> value = file.get_u32(key);
  if (!value || *value >= n_tokens) return fallback;
  return static_cast<TokenId>(*value);
}

}  // namespace

TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& file) {
  TokenizerSpec spec;
  const std::optional<std::string> model = file.get_string("tokenizer.ggml.model");
  if (!model) {
    throw Error(
        ErrorKind::kCorruptFile,
        fmt::format("{}: no tokenizer.ggml.model: the file carries no vocabulary", file.name()));
  }
  spec.model = *model;
  spec.pre = file.get_string("tokenizer.ggml.pre").value_or("default");
  std::optional<std::vector<std::string>> tokens = file.get_string_array("tokenizer.ggml.tokens");
  if (!tokens) {
    throw Error(ErrorKind::kCorruptFile, fmt::format("{}: no tokenizer.ggml.tokens", file.name()));
  }
  spec.tokens = std::move(*tokens);
  if (auto types = file.get_i32_array("tokenizer.ggml.token_type")) {
    spec.token_types.reserve(types->size());
    for (int32_t t : *types) spec.token_types.push_back(static_cast<TokenType>(t));
  }
  if (auto merges = file.get_string_array("tokenizer.ggml.merges"))
    spec.merges = std::move(*merges);
  if (auto scores = file.get_f32_array("tokenizer.ggml.scores")) spec.scores = std::move(*scores);
  // SentencePiece vocabularies default to <unk> 0, <s> 1, </s> 2 (llama.cpp).
  const bool spm = spec.model == "llama";
  const size_t n = spec.tokens.size();
  const auto spm_default = [spm](TokenId id) { return spm ? std::optional(id) : std::nullopt; };
  spec.bos_id = token_id(file, "tokenizer.ggml.bos_token_id", n, spm_default(1));
  spec.eos_id = token_id(file, "tokenizer.ggml.eos_token_id", n, spm_default(2));
  spec.unk_id = token_id(file, "tokenizer.ggml.unknown_token_id", n, spm_default(0));
  spec.pad_id = token_id(file, "tokenizer.ggml.padding_token_id", n);
  spec.eot_id = token_id(file, "tokenizer.ggml.eot_token_id", n);
  spec.eom_id = token_id(file, "tokenizer.ggml.eom_token_id", n);
  spec.add_bos = file.get_bool("tokenizer.ggml.add_bos_token").value_or(spm);
  spec.add_eos = file.get_bool("tokenizer.ggml.add_eos_token").value_or(false);
  spec.add_space_prefix = file.get_bool("tokenizer.ggml.add_space_prefix").value_or(spm);
  return spec;
}

}  // namespace duet

// The merge step of SentencePiece-style vocabularies (GGUF tokenizer.ggml.model
// "llama": Llama 2, TinyLlama, Mistral), token for token as llama.cpp's
// llm_tokenizer_spm: the text is cut into UTF-8 characters, the adjacent pair
// whose concatenation is the highest-scoring token is merged first (the
// leftmost one on equal scores), again and again, and a final symbol that is no
// token falls back to the <0xXX> tokens of its bytes.
//
// Only the merge lives here. Splitting out special tokens, the leading space
// (add_space_prefix), BOS/EOS and decoding belong to the Tokenizer, which owns
// the vocabulary this step reads. Pure functions: thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

// U+2581 LOWER ONE EIGHTH BLOCK, SentencePiece's stand-in for a space.
inline constexpr std::string_view kSpmSpace = "\xE2\x96\x81";

std::string spm_escape_whitespace(std::string_view text);    // every ' ' -> U+2581
std::string spm_unescape_whitespace(std::string_view text);  // every U+2581 -> ' '

// What the merge reads from the vocabulary; non-owning, valid for the call.
struct SpmVocab {
  // The id of the token whose text is exactly `text` (any type), or -1.
  std::function<int32_t(std::string_view)> find;
  std::span<const float> scores;  // one per token id
  // Per byte value: the "<0xXX>" token, else the token whose text is that one
  // byte (llama.cpp's byte_to_token), else -1.
  std::span<const int32_t, 256> byte_tokens;
  int32_t unk_id = -1;  // -1: none
};

// Appends the tokens of `text` to `out`. `text` is one fragment free of
// special tokens, with its spaces already escaped to U+2581 (and the leading
// one added when the caller wants it). It is not required to be valid UTF-8:
// symbols are cut by the lead byte's length as llama.cpp does, and what no
// token covers goes out byte by byte. When some byte of such a symbol has no
// byte token (llama.cpp throws there), the symbol becomes one unk_id, or
// nothing without one.
void spm_tokenize(std::string_view text, const SpmVocab& vocab, std::vector<int32_t>& out);

}  // namespace duet

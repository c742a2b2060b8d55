// The pre-tokenizers of byte-level BPE vocabularies: the regex lists of
// llama.cpp's llm_tokenizer_bpe, by the name a GGUF file gives in
// tokenizer.ggml.pre. The tokenizer (common/text/tokenizer.h) splits text
// with them (RegexSplitter, PCRE2 with Unicode classes) before merging.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

struct PreTokenizerDef {
  std::vector<std::string> patterns;  // applied one after the other
  bool ignore_merges = false;         // a word that is a whole token skips merging
};

// The pre-tokenizer named `name` ("" and "default": llama.cpp's default);
// nullopt for a name llama.cpp does not know.
std::optional<PreTokenizerDef> find_pre_tokenizer(std::string_view name);

}  // namespace duet

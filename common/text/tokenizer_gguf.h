// Builds a tokenizer from a GGUF file's tokenizer.ggml.* metadata.
#pragma once

#include "common/model/gguf.h"
#include "common/text/tokenizer.h"

namespace duet {

TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& file);

inline Tokenizer tokenizer_from_gguf(const GgufFile& file) {
  return Tokenizer(tokenizer_spec_from_gguf(file));
}

}  // namespace duet

// Builds a tokenizer from a GGUF file's tokenizer.ggml.* metadata.
#pragma once

#include "common/gguf.h"
#include "common/tokenizer.h"

namespace duet {

TokenizerSpec tokenizer_spec_from_gguf(const GgufFile& file);

inline Tokenizer tokenizer_from_gguf(const GgufFile& file) {
  return Tokenizer(tokenizer_spec_from_gguf(file));
}

}  // namespace duet

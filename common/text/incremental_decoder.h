// The streaming side of a tokenizer (common/text/tokenizer.h): token ids in,
// complete UTF-8 out, as a server streams generated text.
#pragma once

#include <cstdint>
#include <string>

#include "common/text/tokenizer.h"

namespace duet {

// Streaming detokenizer: feed ids one at a time and get back only complete
// UTF-8; a character split across tokens (or across SentencePiece byte
// tokens) comes out with its last byte, and bytes that can never complete a
// character come out as U+FFFD. flush() returns what is left, a dangling
// partial character replaced by U+FFFD. Streamed text equals decode() of the
// same ids, the space after a leading BOS included. One per stream; not
// thread-safe (owned by the thread that streams).
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special) {}

  std::string push(TokenId id);
  std::string flush();

 private:
  enum class LeadingSpace : uint8_t {
    kUndecided,  // nothing pushed yet
    kStrip,      // the stream began with BOS: drop a space that starts the text
    kKeep,
  };

  const Tokenizer* tokenizer_;  // not owned; must outlive the decoder
  bool skip_special_;
  LeadingSpace leading_space_ = LeadingSpace::kUndecided;
  std::string pending_;  // a well-formed but incomplete UTF-8 prefix, at most 3 bytes
};

}  // namespace duet

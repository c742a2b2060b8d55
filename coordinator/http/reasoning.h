// A chat reply's thinking apart from its answer, as reasoning models write
// them (Qwen3, DeepSeek-R1): a reply that begins with "<think>" holds its
// reasoning up to "</think>", then the answer. The HTTP front returns the two
// as OpenAI-style `reasoning_content` and `content`, as llama-server and vLLM
// do.
//
// The rule (llama-server's for its default reasoning format): when the
// reply's text begins with "<think>", the text after it up to "</think>" is
// the reasoning, without its leading and trailing whitespace; whitespace
// after "</think>" is dropped; the rest is the content. A reply cut off
// before "</think>" is all reasoning; a reply that does not begin with
// "<think>" is all content, tags included.
//
// Incremental: text arrives in pieces (a stream's updates, which may split a
// tag or a UTF-8 sequence's neighbourhood anywhere), and each add() returns
// what can be told so far; a piece that may still turn out to be part of a
// tag or trailing whitespace is held back until it can be told. The pieces
// returned over add() and finish() concatenate to what one add() of the whole
// text and finish() return. A pure value; not thread-safe.
#pragma once

#include <string>
#include <string_view>

namespace duet::openai {

class ReasoningSplitter {
 public:
  struct Parts {
    std::string reasoning;
    std::string content;
  };

  // The parts of `text` (the reply's next piece) that can be told now.
  Parts add(std::string_view text);
  // The reply ended: whatever was held back.
  Parts finish();

 private:
  enum class State {
    kStart,      // the reply so far is a prefix of "<think>"
    kReasoning,  // inside the thinking block
    kAnswerGap,  // after "</think>", before the answer's first non-space
    kContent,    // everything else is content
  };
  State state_ = State::kStart;
  std::string held_;              // text not told yet
  bool reasoning_begun_ = false;  // a non-space of the reasoning went out
};

}  // namespace duet::openai

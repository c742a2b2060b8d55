#include "coordinator/http/reasoning.h"

namespace duet::openai {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";
constexpr std::string_view kSpaces = " \t\n\r\f\v";  // isspace's, as llama.cpp strips

// The length of the longest proper prefix of `tag` that `text` ends with.
size_t partial_tag_at_end(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

// `text` up to its last non-space character.
std::string_view without_trailing_spaces(std::string_view text) {
  const size_t last = text.find_last_not_of(kSpaces);
  return last == std::string_view::npos ? std::string_view() : text.substr(0, last + 1);
}

}  // namespace

ReasoningSplitter::Parts ReasoningSplitter::add(std::string_view text) {
  Parts out;
  held_ += text;
  for (;;) {
    switch (state_) {
      case State::kStart:
        if (held_.starts_with(kOpen)) {
          held_.erase(0, kOpen.size());
          state_ = State::kReasoning;
          continue;
        }
        if (kOpen.starts_with(held_)) return out;  // "<thi": not told yet
        state_ = State::kContent;
        continue;
      case State::kContent:
        out.content += held_;
        held_.clear();
        return out;
      case State::kAnswerGap: {
        const size_t first = held_.find_first_not_of(kSpaces);
        if (first == std::string::npos) {
          held_.clear();
          return out;
        }
        held_.erase(0, first);
        state_ = State::kContent;
        continue;
      }
      case State::kReasoning: {
        if (!reasoning_begun_) {
          const size_t first = held_.find_first_not_of(kSpaces);
          if (first == std::string::npos) {
            held_.clear();
            return out;
          }
          held_.erase(0, first);
          reasoning_begun_ = true;
        }
        if (const size_t close = held_.find(kClose); close != std::string::npos) {
          out.reasoning += without_trailing_spaces(std::string_view(held_).substr(0, close));
          held_.erase(0, close + kClose.size());
          state_ = State::kAnswerGap;
          continue;
        }
        // Hold back what may begin "</think>" and the spaces before it (they
        // go out only if more reasoning follows them).
        const std::string_view open_part =
            std::string_view(held_).substr(0, held_.size() - partial_tag_at_end(held_, kClose));
        const size_t told = without_trailing_spaces(open_part).size();
        out.reasoning += held_.substr(0, told);
        held_.erase(0, told);
        return out;
      }
    }
  }
}

ReasoningSplitter::Parts ReasoningSplitter::finish() {
  Parts out;
  switch (state_) {
    case State::kStart:  // a prefix of "<think>" and nothing more: plain text
    case State::kContent:
      out.content = std::move(held_);
      break;
    case State::kReasoning:  // cut off before "</think>": all of it is reasoning
      out.reasoning = std::string(without_trailing_spaces(held_));
      break;
    case State::kAnswerGap:
      break;
  }
  held_.clear();
  state_ = State::kContent;
  return out;
}

}  // namespace duet::openai

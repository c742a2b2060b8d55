// Stop strings over streamed text.
//
// Generated text arrives in pieces (one detokenized token at a time), and a
// stop string may span several pieces or end inside one. The matcher holds
// back the text that could still become the start of a stop string, releases
// it as soon as it cannot, and on a match releases only the text before the
// stop string: the stop string and everything after it are discarded.
//
// Which match counts is independent of how the text is cut into pieces: the
// stop string that completes first (the smallest end offset; the longest
// among those ending together), as a stream fed byte by byte would see it.
// Matching is on bytes, so it works on any UTF-8 the decoder releases.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

class StopMatcher {
 public:
  // `stops` may be empty (nothing ever matches); each must be non-empty.
  explicit StopMatcher(std::vector<std::string> stops);

  // Feeds the next piece of text; returns the text now safe to emit (it can
  // no longer be part of a stop string). After a match, returns only the text
  // before the stop string, and then nothing for every later piece.
  std::string push(std::string_view piece);

  // The stream has ended: returns the text still held back (none after a match).
  std::string flush();

  bool stopped() const { return matched_ >= 0; }
  // The stop string that matched; nullptr until one has.
  const std::string* matched() const {
    return stopped() ? &stops_[static_cast<size_t>(matched_)] : nullptr;
  }

 private:
  std::vector<std::string> stops_;
  std::string held_;      // a suffix of the stream that is a proper prefix of some stop string
  int64_t matched_ = -1;  // index into stops_; -1: no match yet
};

}  // namespace duet

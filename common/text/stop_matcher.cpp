#include "common/text/stop_matcher.h"

#include <algorithm>
#include <utility>

#include "common/error.h"

namespace duet {

StopMatcher::StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {
  for (size_t i = 0; i < stops_.size(); ++i) {
    DUET_REQUIRE(!stops_[i].empty(), "stop string {} is empty", i);
  }
}

std::string StopMatcher::push(std::string_view piece) {
  if (stopped()) return {};
  std::string text = std::move(held_);
  held_.clear();
  text.append(piece);

  // held_ had no complete stop string, so any match ends in `piece`. The first
  // occurrence of a stop string is also the one that ends first.
  size_t best_end = std::string::npos;
  size_t best_start = 0;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const size_t start = text.find(stops_[i]);
    if (start == std::string::npos) continue;
    const size_t end = start + stops_[i].size();
    if (end < best_end || (end == best_end && start < best_start)) {
      best_end = end;
      best_start = start;
      matched_ = static_cast<int64_t>(i);
    }
  }
  if (stopped()) {
    text.resize(best_start);
    return text;
  }

  // Hold back the longest suffix that a stop string begins with (a proper
  // prefix: a whole one would have matched above).
  size_t n_hold = 0;
  for (const std::string& stop : stops_) {
    for (size_t n = std::min(stop.size() - 1, text.size()); n > n_hold; --n) {
      if (std::string_view(text).substr(text.size() - n) == std::string_view(stop).substr(0, n)) {
        n_hold = n;
        break;
      }
    }
  }
  held_.assign(text, text.size() - n_hold, n_hold);
  text.resize(text.size() - n_hold);
  return text;
}

std::string StopMatcher::flush() {
  std::string rest = std::move(held_);
  held_.clear();
  return rest;
}

}  // namespace duet

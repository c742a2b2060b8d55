#include "common/text/incremental_decoder.h"

#include "common/error.h"

namespace duet {

std::string IncrementalDecoder::push(TokenId id) {
  const Tokenizer& tokenizer = *tokenizer_;
  DUET_REQUIRE(id >= 0 && size_t(id) < tokenizer.vocab_size(),
               "token id {} is out of range [0, {})", id, tokenizer.vocab_size());
  if (leading_space_ == LeadingSpace::kUndecided) {
    leading_space_ = tokenizer.strips_space_after_bos(std::span<const TokenId>(&id, 1))
                         ? LeadingSpace::kStrip
                         : LeadingSpace::kKeep;
  }
  if (skip_special_ && tokenizer.is_special_type(id)) return {};
  std::string_view piece = tokenizer.pieces_[id];
  if (leading_space_ == LeadingSpace::kStrip && !piece.empty()) {  // as Tokenizer::decode
    if (piece.front() == ' ') piece.remove_prefix(1);
    leading_space_ = LeadingSpace::kKeep;
  }
  pending_ += piece;

  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const Utf8Step step = utf8_step(pending_, pos);
    if (step.status == Utf8Status::kIncomplete) break;  // only ever the tail: wait for more
    if (step.status == Utf8Status::kComplete) {
      out.append(pending_, pos, step.length);
    } else {
      utf8_append(out, kReplacementChar);
    }
    pos += step.length;
  }
  pending_.erase(0, pos);
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out = utf8_sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace duet

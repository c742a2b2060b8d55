// Encoding: special tokens cut out of the text, then the byte-level BPE core
// (pre-tokenized words merged by rank, llama.cpp's llm_tokenizer_bpe) or the
// SentencePiece one (common/text/spm_tokenizer.h).
#include <algorithm>

#include "common/text/spm_tokenizer.h"
#include "common/text/tokenizer.h"

namespace duet {

struct Tokenizer::BpeScratch {
  struct Symbol {
    int32_t piece;  // kNoPiece: a text that no token or merge knows
    int32_t prev, next;
    uint32_t begin, end;  // byte range of the word; begin == end once merged away
  };
  struct Bigram {
    int32_t rank;
    int32_t left, right;  // symbol indices
    int32_t left_piece, right_piece;
    int32_t result;
  };
  struct WorseBigram {  // lowest rank first, then leftmost (llama.cpp's order)
    bool operator()(const Bigram& a, const Bigram& b) const {
      return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
    }
  };
  std::vector<Symbol> symbols;
  std::vector<Bigram> heap;
  std::string text;
};

void Tokenizer::encode_word(std::string_view word, BpeScratch& scratch,
                            std::vector<TokenId>& out) const {
  const auto n_tokens = static_cast<int32_t>(tokens_.size());
  if (ignore_merges_) {
    scratch.text.clear();
    for (char c : word) scratch.text.append(byte_to_bpe_char(static_cast<uint8_t>(c)));
    if (auto it = piece_index_.find(std::string_view(scratch.text));
        it != piece_index_.end() && it->second < n_tokens) {
      out.push_back(it->second);
      return;
    }
  }

  auto& symbols = scratch.symbols;
  symbols.clear();
  const auto n = static_cast<int32_t>(word.size());
  for (int32_t i = 0; i < n; ++i) {
    symbols.push_back({byte_piece_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1,
                       uint32_t(i), uint32_t(i + 1)});
  }

  auto& heap = scratch.heap;
  heap.clear();
  const BpeScratch::WorseBigram worse;
  const auto add_bigram = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const int32_t left_piece = symbols[left].piece, right_piece = symbols[right].piece;
    if (left_piece == kNoPiece || right_piece == kNoPiece) return;
    const auto it = merges_.find(merge_key(left_piece, right_piece));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, left, right, left_piece, right_piece, it->second.result});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (int32_t i = 1; i < n; ++i) add_bigram(i - 1, i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const BpeScratch::Bigram bigram = heap.back();
    heap.pop_back();
    auto& left = symbols[bigram.left];
    auto& right = symbols[bigram.right];
    // Stale: one side was merged since this pair was queued.
    if (left.begin == left.end || right.begin == right.end || left.piece != bigram.left_piece ||
        right.piece != bigram.right_piece) {
      continue;
    }
    left.piece = bigram.result;
    left.end = right.end;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    right.begin = right.end;
    add_bigram(left.prev, bigram.left);
    add_bigram(bigram.left, left.next);
  }

  for (int32_t i = 0; i >= 0 && i < n; i = symbols[i].next) {
    const auto& symbol = symbols[i];
    if (symbol.piece >= 0 && symbol.piece < n_tokens) {
      out.push_back(symbol.piece);
      continue;
    }
    // Not a token: llama.cpp falls back to the tokens of the single bytes of
    // the symbol's byte-level text, and drops bytes that have none.
    for (uint32_t k = symbol.begin; k < symbol.end; ++k) {
      for (char c : byte_to_bpe_char(static_cast<uint8_t>(word[k]))) {
        const TokenId id = single_byte_token_[static_cast<uint8_t>(c)];
        if (id >= 0) out.push_back(id);
      }
    }
  }
}

std::vector<Tokenizer::Fragment> Tokenizer::split_special(
    std::string_view text, bool parse_special, std::span<const TextRange> as_text) const {
  // Whether [begin, end) reaches into a range that stays text.
  auto in_text = [&](size_t begin, size_t end) {
    return std::any_of(as_text.begin(), as_text.end(),
                       [&](const TextRange& r) { return begin < r.end && r.begin < end; });
  };
  // Token by token, longest first, every occurrence in every remaining text
  // fragment becomes a token fragment.
  std::vector<Fragment> fragments;
  if (!text.empty()) fragments.push_back({-1, 0, text.size()});
  std::vector<Fragment> next;
  for (const TokenId special : special_tokens_) {
    if (!parse_special && types_[special] != TokenType::kUserDefined) continue;
    const std::string& needle = tokens_[special];
    if (text.find(needle) == std::string_view::npos) continue;
    next.clear();
    for (const Fragment& fragment : fragments) {
      if (fragment.token >= 0) {
        next.push_back(fragment);
        continue;
      }
      const std::string_view scope = text.substr(0, fragment.end);
      const bool control = types_[special] != TokenType::kUserDefined;
      size_t pos = fragment.begin;
      size_t search = fragment.begin;
      for (size_t match = scope.find(needle, search); match != std::string_view::npos;
           match = scope.find(needle, search)) {
        if (control && in_text(match, match + needle.size())) {
          search = match + 1;  // content: the token's text stays text
          continue;
        }
        if (match > pos) next.push_back({-1, pos, match});
        next.push_back({special, match, match + needle.size()});
        pos = search = match + needle.size();
      }
      if (pos < fragment.end) next.push_back({-1, pos, fragment.end});
    }
    fragments.swap(next);
  }
  return fragments;
}

void Tokenizer::encode_bpe(std::string_view text, const std::vector<Fragment>& fragments,
                           std::vector<TokenId>& out) const {
  BpeScratch scratch;
  for (const Fragment& fragment : fragments) {
    if (fragment.token >= 0) {
      out.push_back(fragment.token);
      continue;
    }
    const std::string normalized =
        utf8_normalize_lenient(text.substr(fragment.begin, fragment.end - fragment.begin));
    for (std::string_view word : splitter_.split(normalized)) encode_word(word, scratch, out);
  }
}

void Tokenizer::encode_spm(std::string_view text, const std::vector<Fragment>& fragments,
                           std::vector<TokenId>& out) const {
  const SpmVocab vocab{
      [this](std::string_view piece) { return find_token(piece).value_or(-1); },
      scores_,
      byte_token_,
      unk_id_.value_or(-1),
  };
  // As llama.cpp: a text fragment at the start or right after a special token
  // gets the leading space, whether or not BOS was added.
  bool after_special = true;
  std::string fragment_text;
  for (const Fragment& fragment : fragments) {
    if (fragment.token >= 0) {
      out.push_back(fragment.token);
      after_special = true;
      continue;
    }
    fragment_text.clear();
    if (add_space_prefix_ && after_special) fragment_text.push_back(' ');
    fragment_text.append(text.substr(fragment.begin, fragment.end - fragment.begin));
    spm_tokenize(spm_escape_whitespace(fragment_text), vocab, out);
    after_special = false;
  }
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool add_special,
                                       bool parse_special) const {
  return encode(text, add_special, parse_special, {});
}

std::vector<TokenId> Tokenizer::encode(std::string_view text, bool add_special, bool parse_special,
                                       std::span<const TextRange> as_text) const {
  std::vector<TokenId> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(*bos_id_);
  // Special tokens come out of the text first (llama.cpp's tokenizer_st_partition).
  const std::vector<Fragment> fragments = split_special(text, parse_special, as_text);
  if (sentencepiece_) {
    encode_spm(text, fragments, out);
  } else {
    encode_bpe(text, fragments, out);
  }
  if (add_special && add_eos_) out.push_back(*eos_id_);
  return out;
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view text) const {
  if (sentencepiece_) {  // no pre-tokenizer: one piece
    if (text.empty()) return {};
    return {std::string(text)};
  }
  const std::string normalized = utf8_normalize_lenient(text);
  std::vector<std::string> words;
  for (std::string_view word : splitter_.split(normalized)) words.emplace_back(word);
  return words;
}

}  // namespace duet

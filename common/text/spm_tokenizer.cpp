#include "common/text/spm_tokenizer.h"

#include <algorithm>

namespace duet {

namespace {

std::string replace_all(std::string_view text, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(text.size() + text.size() / 4);
  size_t pos = 0;
  for (size_t match = text.find(from); match != std::string_view::npos;
       match = text.find(from, pos)) {
    out.append(text, pos, match - pos);
    out.append(to);
    pos = match + from.size();
  }
  out.append(text, pos);
  return out;
}

// The sequence length a UTF-8 lead byte announces; 1 for continuation and
// invalid bytes (llama.cpp's unicode_len_utf8).
size_t utf8_length_from_lead(char lead) {
  static constexpr uint8_t kLength[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLength[static_cast<uint8_t>(lead) >> 4];
}

struct Symbol {
  int32_t prev, next;  // neighbours in the chain, -1: none
  size_t begin;        // byte offset in the text
  size_t size;         // bytes; 0 once merged into its left neighbour
};

struct Bigram {
  float score;  // of the token the pair would form
  int32_t left, right;
  size_t size;  // bytes of the pair when it was queued
};

// Highest score first, then leftmost (llama.cpp's llm_bigram_spm order).
struct LowerPriority {
  bool operator()(const Bigram& a, const Bigram& b) const {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  }
};

}  // namespace

std::string spm_escape_whitespace(std::string_view text) {
  return replace_all(text, " ", kSpmSpace);
}

std::string spm_unescape_whitespace(std::string_view text) {
  return replace_all(text, kSpmSpace, " ");
}

void spm_tokenize(std::string_view text, const SpmVocab& vocab, std::vector<int32_t>& out) {
  if (text.empty()) return;

  std::vector<Symbol> symbols;
  symbols.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const size_t size = std::min(utf8_length_from_lead(text[pos]), text.size() - pos);
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({index - 1, pos + size == text.size() ? -1 : index + 1, pos, size});
    pos += size;
  }

  std::vector<Bigram> heap;
  const LowerPriority lower;
  const auto try_add_bigram = [&](int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const size_t size = symbols[left].size + symbols[right].size;
    const int32_t token = vocab.find(text.substr(symbols[left].begin, size));
    if (token < 0) return;
    heap.push_back({vocab.scores[static_cast<size_t>(token)], left, right, size});
    std::push_heap(heap.begin(), heap.end(), lower);
  };
  for (int32_t i = 1; i < static_cast<int32_t>(symbols.size()); ++i) try_add_bigram(i - 1, i);

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), lower);
    const Bigram bigram = heap.back();
    heap.pop_back();
    Symbol& left = symbols[bigram.left];
    Symbol& right = symbols[bigram.right];
    // Stale: a side was merged away, or grew, since the pair was queued. A
    // symbol only grows by absorbing its right neighbour, so equal sizes mean
    // the same two texts.
    if (left.size == 0 || right.size == 0 || left.size + right.size != bigram.size) continue;
    left.size += right.size;
    right.size = 0;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = bigram.left;
    try_add_bigram(left.prev, bigram.left);
    try_add_bigram(bigram.left, left.next);
  }

  // Every merge formed a token, so only unmerged characters can miss the
  // vocabulary (llama.cpp's rev_merge resegmentation never fires for them).
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    const std::string_view piece = text.substr(symbols[i].begin, symbols[i].size);
    if (const int32_t token = vocab.find(piece); token >= 0) {
      out.push_back(token);
      continue;
    }
    const bool bytes_known = std::all_of(piece.begin(), piece.end(), [&](char c) {
      return vocab.byte_tokens[static_cast<uint8_t>(c)] >= 0;
    });
    if (bytes_known) {
      for (const char c : piece) out.push_back(vocab.byte_tokens[static_cast<uint8_t>(c)]);
    } else if (vocab.unk_id >= 0) {
      out.push_back(vocab.unk_id);
    }
  }
}

}  // namespace duet

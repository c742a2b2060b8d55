#include "common/text/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>

#include "common/error.h"
#include "common/text/pre_tokenizers.h"
#include "common/text/spm_tokenizer.h"

namespace duet {

namespace {

// ---------------------------------------------------------------------------
// Tokens llama.cpp recognizes by their text (llama_vocab::impl::load). The
// fullwidth bar is U+FF5C, the low block U+2581.
#define DUET_FW_BAR "\xEF\xBD\x9C"
#define DUET_LOW_BLOCK "\xE2\x96\x81"

constexpr std::string_view kEotTexts[] = {"<|eot_id|>",
                                          "<|im_end|>",
                                          "<|end|>",
                                          "<end_of_turn>",
                                          "<|endoftext|>",
                                          "<|end_of_text|>",
                                          "<EOT>",
                                          "_<EOT>",
                                          "[EOT]",
                                          "<" DUET_FW_BAR "end" DUET_LOW_BLOCK "of" DUET_LOW_BLOCK
                                          "sentence" DUET_FW_BAR ">",
                                          "<end_of_utterance>"};
constexpr std::string_view kEomTexts[] = {"<|eom_id|>"};
constexpr std::string_view kFimPreTexts[] = {
    "<|fim_prefix|>",  "<fim-prefix>",
    "<fim_prefix>",    "<" DUET_FW_BAR "fim" DUET_LOW_BLOCK "begin" DUET_FW_BAR ">",
    "<PRE>",           DUET_LOW_BLOCK "<PRE>",
    "<|code_prefix|>", "<|prefix|>"};
constexpr std::string_view kFimSufTexts[] = {
    "<|fim_suffix|>",  "<fim-suffix>",
    "<fim_suffix>",    "<" DUET_FW_BAR "fim" DUET_LOW_BLOCK "hole" DUET_FW_BAR ">",
    "<SUF>",           DUET_LOW_BLOCK "<SUF>",
    "<|code_suffix|>", "<|suffix|>"};
constexpr std::string_view kFimMidTexts[] = {
    "<|fim_middle|>",  "<fim-middle>",
    "<fim_middle>",    "<" DUET_FW_BAR "fim" DUET_LOW_BLOCK "end" DUET_FW_BAR ">",
    "<MID>",           DUET_LOW_BLOCK "<MID>",
    "<|code_middle|>", "<|middle|>"};
constexpr std::string_view kFimPadTexts[] = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
                                             "[PAD]"};
constexpr std::string_view kFimRepTexts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                             "<REPO>", "<reponame>"};
constexpr std::string_view kFimSepTexts[] = {"<|file_sep|>"};
constexpr std::string_view kEogTexts[] = {"<|eot_id|>",
                                          "<|im_end|>",
                                          "<|end|>",
                                          "<|return|>",
                                          "<|call|>",
                                          "<|flush|>",
                                          "<|calls|>",
                                          "<end_of_turn>",
                                          "<|endoftext|>",
                                          "</s>",
                                          "<|eom_id|>",
                                          "<EOT>",
                                          "_<EOT>",
                                          "[EOT]",
                                          "[EOS]",
                                          "<|end_of_text|>",
                                          "<end_of_utterance>",
                                          "<eos>",
                                          "<turn|>",
                                          "<|tool_response>",
                                          "<" DUET_FW_BAR "end" DUET_LOW_BLOCK "of" DUET_LOW_BLOCK
                                          "sentence" DUET_FW_BAR ">",
                                          "[e~["};
// gpt-oss (harmony) tokens that llama.cpp always renders.
constexpr std::string_view kAlwaysRenderedTexts[] = {"<|channel|>", "<|message|>", "<|start|>",
                                                     "<|constrain|>"};

#undef DUET_FW_BAR
#undef DUET_LOW_BLOCK

template <size_t N>
bool text_in(const std::string& text, const std::string_view (&list)[N]) {
  return std::find(std::begin(list), std::end(list), text) != std::end(list);
}

// "<0xAB>" -> 0xAB
std::optional<uint8_t> parse_byte_token(const std::string& text) {
  if (text.size() != 6 || text.compare(0, 3, "<0x") != 0 || text[5] != '>') return std::nullopt;
  const auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(text[3]), lo = hex(text[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

// A byte-level token's bytes; the text itself when a character falls outside
// the byte alphabet (as HF's ByteLevel decoder does).
std::string byte_level_decode(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const Utf8Step step = utf8_step(text, pos);
    if (step.status != Utf8Status::kComplete) return text;
    const std::optional<uint8_t> byte = bpe_cpt_to_byte(step.cpt);
    if (!byte) return text;
    out.push_back(static_cast<char>(*byte));
    pos += step.length;
  }
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------
// Construction

Tokenizer::Tokenizer(TokenizerSpec spec) : splitter_(std::vector<std::string>{}) {
  if (spec.model == "llama") {
    // llama.cpp reads neither merges nor a pre-tokenizer for SentencePiece.
    model_ = spec.model;
    pre_ = spec.pre.empty() ? "default" : spec.pre;
    sentencepiece_ = true;
    add_space_prefix_ = spec.add_space_prefix;
    validate_and_load(spec);
    if (scores_.empty()) scores_.assign(tokens_.size(), 0.0f);
    build_byte_tokens();
    find_special_tokens();
    build_pieces();
    build_token_bounds();
    return;
  }
  if (spec.model != "gpt2") {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("unsupported tokenizer model '{}' (tokenizer.ggml.model: 'gpt2' "
                            "byte-level BPE or 'llama' SentencePiece)",
                            spec.model));
  }
  std::optional<PreTokenizerDef> pre = find_pre_tokenizer(spec.pre);
  if (!pre) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("unsupported pre-tokenizer '{}' (tokenizer.ggml.pre)", spec.pre));
  }
  model_ = spec.model;
  pre_ = spec.pre.empty() ? "default" : spec.pre;
  ignore_merges_ = pre->ignore_merges;
  splitter_ = RegexSplitter(pre->patterns);

  validate_and_load(spec);
  build_merges(spec.merges);
  find_special_tokens();
  build_pieces();
  build_token_bounds();
}

void Tokenizer::validate_and_load(TokenizerSpec& spec) {
  const size_t n = spec.tokens.size();
  DUET_REQUIRE(n > 0, "tokenizer has no tokens");
  DUET_REQUIRE(n < size_t(INT32_MAX) / 2, "tokenizer has too many tokens: {}", n);
  DUET_REQUIRE(spec.token_types.empty() || spec.token_types.size() == n,
               "{} token types for {} tokens", spec.token_types.size(), n);
  DUET_REQUIRE(spec.scores.empty() || spec.scores.size() == n, "{} scores for {} tokens",
               spec.scores.size(), n);

  tokens_ = std::move(spec.tokens);
  scores_ = std::move(spec.scores);
  types_.assign(n, TokenType::kNormal);
  for (size_t i = 0; i < spec.token_types.size(); ++i) {
    const auto value = static_cast<int32_t>(spec.token_types[i]);
    // llama.cpp reads values outside the enum as undefined.
    const bool known = value >= 0 && value <= static_cast<int32_t>(TokenType::kByte);
    types_[i] = known ? spec.token_types[i] : TokenType::kUndefined;
  }

  piece_index_.reserve(n * 2);
  for (size_t i = 0; i < n; ++i) {
    // llama.cpp names empty tokens so that every token has a distinct text.
    if (tokens_[i].empty()) tokens_[i] = fmt::format("[EMPTY_{}]", i);
    const auto [it, inserted] = piece_index_.emplace(tokens_[i], static_cast<int32_t>(i));
    DUET_REQUIRE(inserted, "duplicate token '{}' has ids {} and {}", tokens_[i], it->second, i);
  }

  const auto check_id = [n](const std::optional<TokenId>& id, const char* what) {
    DUET_REQUIRE(!id || (*id >= 0 && size_t(*id) < n), "{} id {} is out of range [0, {})", what,
                 id.value_or(-1), n);
  };
  check_id(spec.bos_id, "BOS");
  check_id(spec.eos_id, "EOS");
  check_id(spec.unk_id, "UNK");
  check_id(spec.pad_id, "PAD");
  check_id(spec.eot_id, "EOT");
  check_id(spec.eom_id, "EOM");
  DUET_REQUIRE(!spec.add_bos || spec.bos_id, "add_bos is set but there is no BOS token");
  DUET_REQUIRE(!spec.add_eos || spec.eos_id, "add_eos is set but there is no EOS token");
  bos_id_ = spec.bos_id;
  eos_id_ = spec.eos_id;
  unk_id_ = spec.unk_id;
  pad_id_ = spec.pad_id;
  eot_id_ = spec.eot_id;
  eom_id_ = spec.eom_id;
  add_bos_ = spec.add_bos;
  add_eos_ = spec.add_eos;
}

int32_t Tokenizer::intern_piece(std::string_view text) {
  if (auto it = piece_index_.find(text); it != piece_index_.end()) return it->second;
  const auto id = static_cast<int32_t>(tokens_.size() + extra_pieces_.size());
  extra_pieces_.emplace_back(text);
  piece_index_.emplace(std::string(text), id);
  return id;
}

void Tokenizer::build_merges(const std::vector<std::string>& merges) {
  DUET_REQUIRE(merges.size() < size_t(INT32_MAX), "too many merges: {}", merges.size());
  merges_.reserve(merges.size());
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& merge = merges[rank];
    // As llama.cpp: the first space after the first byte separates the halves.
    const size_t space = merge.find(' ', 1);
    DUET_REQUIRE(space != std::string::npos && space + 1 < merge.size(),
                 "malformed merge at rank {}: '{}' (expected \"left right\")", rank, merge);
    const std::string_view left = std::string_view(merge).substr(0, space);
    const std::string_view right = std::string_view(merge).substr(space + 1);
    joined.assign(left);
    joined.append(right);
    const int32_t left_piece = intern_piece(left);
    const int32_t right_piece = intern_piece(right);
    const int32_t result = intern_piece(joined);
    // A repeated pair keeps its first (best) rank, as llama.cpp's emplace does.
    merges_.try_emplace(merge_key(left_piece, right_piece),
                        Merge{static_cast<int32_t>(rank), result});
  }
  for (int b = 0; b < 256; ++b) {
    const auto it = piece_index_.find(byte_to_bpe_char(static_cast<uint8_t>(b)));
    byte_piece_[b] = it != piece_index_.end() ? it->second : kNoPiece;
  }
  build_byte_tokens();
}

void Tokenizer::build_byte_tokens() {
  for (int b = 0; b < 256; ++b) {
    single_byte_token_[b] = find_token(std::string(1, static_cast<char>(b))).value_or(-1);
    // As llama.cpp's byte_to_token: upper-case hex first, then the byte itself.
    byte_token_[b] = find_token(fmt::format("<0x{:02X}>", b)).value_or(single_byte_token_[b]);
  }
}

// llama.cpp decides a token's role partly by its text: the end-of-turn,
// end-of-message and FIM tokens it finds by name are promoted to control
// tokens, and the end-of-generation set is built from names plus eos/eot/eom.
void Tokenizer::find_special_tokens() {
  const auto n = static_cast<TokenId>(tokens_.size());
  const auto promote = [this](TokenId id) { types_[id] = TokenType::kControl; };
  // The first token (lowest id) whose text is in `list`, promoted to control.
  const auto detect = [&](const auto& list) -> std::optional<TokenId> {
    for (TokenId id = 0; id < n; ++id) {
      if (text_in(tokens_[id], list)) {
        promote(id);
        return id;
      }
    }
    return std::nullopt;
  };
  if (!eot_id_) eot_id_ = detect(kEotTexts);
  if (!eom_id_) eom_id_ = detect(kEomTexts);
  detect(kFimPreTexts);
  detect(kFimSufTexts);
  detect(kFimMidTexts);
  const std::optional<TokenId> fim_pad = detect(kFimPadTexts);
  const std::optional<TokenId> fim_rep = detect(kFimRepTexts);
  const std::optional<TokenId> fim_sep = detect(kFimSepTexts);

  std::vector<bool> eog(n, false);
  for (const auto& id : {fim_pad, fim_rep, fim_sep, eos_id_, eot_id_, eom_id_}) {
    if (id) eog[*id] = true;
  }
  for (TokenId id = 0; id < n; ++id) {
    if (text_in(tokens_[id], kEogTexts)) {
      eog[id] = true;
      promote(id);
    }
    if (text_in(tokens_[id], kAlwaysRenderedTexts)) types_[id] = TokenType::kUserDefined;
  }
  // o200k_harmony / solar-open: with <|return|> and <|call|> (or <|calls|> and
  // <|flush|>) present, <|end|> only ends a message, not the generation.
  const auto eog_has = [&](std::string_view text) {
    const std::optional<TokenId> id = find_token(text);
    return id && eog[*id];
  };
  if (eog_has("<|end|>") && ((eog_has("<|return|>") && eog_has("<|call|>")) ||
                             (eog_has("<|calls|>") && eog_has("<|flush|>")))) {
    const TokenId end = *find_token("<|end|>");
    eog[end] = false;
    types_[end] = TokenType::kUserDefined;
  }
  // Gemma 4 / PaddleOCR: </s> is a plain token when <|tool_response> exists.
  if (eog_has("<|tool_response>") && eog_has("</s>")) {
    const TokenId s = *find_token("</s>");
    eog[s] = false;
    types_[s] = TokenType::kNormal;
  }
  for (TokenId id = 0; id < n; ++id) {
    if (eog[id]) eog_ids_.push_back(id);
  }

  for (TokenId id = 0; id < n; ++id) {
    const TokenType type = types_[id];
    if (type == TokenType::kControl || type == TokenType::kUserDefined ||
        type == TokenType::kUnknown) {
      special_tokens_.push_back(id);
    }
  }
  // Longest first, so that a token is never split out of a longer one.
  std::stable_sort(special_tokens_.begin(), special_tokens_.end(),
                   [this](TokenId a, TokenId b) { return tokens_[a].size() > tokens_[b].size(); });
}

void Tokenizer::build_pieces() {
  pieces_.resize(tokens_.size());
  for (size_t id = 0; id < tokens_.size(); ++id) {
    const std::string& text = tokens_[id];
    switch (types_[id]) {
      case TokenType::kNormal:
        pieces_[id] = sentencepiece_ ? spm_unescape_whitespace(text) : byte_level_decode(text);
        break;
      case TokenType::kControl:
      case TokenType::kUnknown:
      case TokenType::kUserDefined:
        pieces_[id] = text;
        break;
      case TokenType::kByte: {
        const std::optional<uint8_t> byte = parse_byte_token(text);
        pieces_[id] = byte ? std::string(1, static_cast<char>(*byte)) : text;
        break;
      }
      case TokenType::kUnused:
      case TokenType::kUndefined:
        break;  // llama.cpp renders these as nothing
    }
  }
}

// ---------------------------------------------------------------------------
// Decoding and lookups

bool Tokenizer::is_special_type(TokenId id) const {
  return types_[id] == TokenType::kControl || types_[id] == TokenType::kUnknown;
}

bool Tokenizer::strips_space_after_bos(std::span<const TokenId> ids) const {
  return sentencepiece_ && add_space_prefix_ && bos_id_ && !ids.empty() && ids.front() == *bos_id_;
}

std::string Tokenizer::decode(std::span<const TokenId> ids, bool skip_special) const {
  std::string out;
  bool strip_space = strips_space_after_bos(ids);
  for (const TokenId id : ids) {
    DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
                 tokens_.size());
    if (skip_special && is_special_type(id)) continue;
    std::string_view piece = pieces_[id];
    // Only a space that starts the decoded text is dropped.
    if (strip_space && !piece.empty()) {
      if (piece.front() == ' ') piece.remove_prefix(1);
      strip_space = false;
    }
    out += piece;
  }
  return out;
}

std::string Tokenizer::token_to_piece(TokenId id) const {
  DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
               tokens_.size());
  return pieces_[id];
}

const std::string& Tokenizer::token_text(TokenId id) const {
  DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
               tokens_.size());
  return tokens_[id];
}

TokenType Tokenizer::token_type(TokenId id) const {
  DUET_REQUIRE(id >= 0 && size_t(id) < tokens_.size(), "token id {} is out of range [0, {})", id,
               tokens_.size());
  return types_[id];
}

void Tokenizer::build_token_bounds() {
  for (const std::string& text : tokens_)
    max_token_bytes_ = std::max(max_token_bytes_, text.size());
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<uint8_t>(b);
    if (sentencepiece_) {
      // A character no token covers becomes byte tokens, else the unknown
      // token, else nothing: with an unknown token every byte is covered;
      // without one, only an ASCII character that is a token or has a byte token.
      byte_always_kept_[b] =
          unk_id_.has_value() ||
          (b < 0x80 && (find_token(std::string(1, static_cast<char>(b))) || byte_token_[b] >= 0));
    } else {
      // Byte-level BPE falls back to the single-byte tokens of the byte's
      // alphabet character and drops the byte when there are none.
      const std::string_view alphabet = byte_to_bpe_char(byte);
      byte_always_kept_[b] = std::any_of(alphabet.begin(), alphabet.end(), [&](char c) {
        return single_byte_token_[static_cast<uint8_t>(c)] >= 0;
      });
    }
  }
}

int64_t Tokenizer::min_tokens(std::string_view text) const {
  int64_t n_kept = 0;
  for (char c : text) n_kept += byte_always_kept_[static_cast<uint8_t>(c)] ? 1 : 0;
  const auto per_token = static_cast<int64_t>(max_token_bytes_);
  return (n_kept + per_token - 1) / per_token;
}

std::optional<TokenId> Tokenizer::find_token(std::string_view text) const {
  const auto it = piece_index_.find(text);
  if (it == piece_index_.end() || size_t(it->second) >= tokens_.size()) return std::nullopt;
  return it->second;
}

bool Tokenizer::is_end_of_generation(TokenId id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

}  // namespace duet

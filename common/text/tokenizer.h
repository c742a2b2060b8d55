// Tokenizers of GGUF vocabularies, token for token as llama.cpp:
// - "gpt2", byte-level BPE (llm_tokenizer_bpe): special tokens are split out of
//   the text first, the fragments between them are pre-tokenized with the regex
//   list of `tokenizer.ggml.pre`, each piece is mapped to the GPT-2 byte
//   alphabet and merged by rank.
// - "llama", SentencePiece-style (llm_tokenizer_spm; Llama 2, TinyLlama,
//   Mistral): special tokens are split out the same way, each text fragment
//   that starts the text or follows a special token gets a leading space
//   (add_space_prefix), spaces become U+2581 and characters are merged by token
//   score (common/text/spm_tokenizer.h), with <0xXX> byte tokens as the fallback.
//
// The tokenizer is built from plain data (TokenizerSpec) as GGUF metadata
// holds it; reading that metadata is someone else's job. A Tokenizer is
// immutable after construction: every method is const and safe to call from
// any number of threads at once.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/text/unicode.h"

namespace duet {

using TokenId = int32_t;

// GGUF tokenizer.ggml.token_type values.
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Plain data, as GGUF metadata holds it.
struct TokenizerSpec {
  // tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece);
  // others -> kUnsupported.
  std::string model;
  std::string pre;  // tokenizer.ggml.pre (BPE only): "smollm", "llama-bpe", ... (empty = "default")
  std::vector<std::string> tokens;
  std::vector<TokenType> token_types;  // empty = all normal
  std::vector<std::string> merges;     // "a b" pairs, rank = index (BPE only)
  std::vector<float> scores;           // empty (all 0) or one per token (SentencePiece only)
  std::optional<TokenId> bos_id, eos_id, unk_id, pad_id, eot_id, eom_id;
  bool add_bos = false, add_eos = false;
  // SentencePiece only (tokenizer.ggml.add_space_prefix): a text fragment at
  // the start or after a special token gets a leading space, and decoding
  // drops the space right after a leading BOS.
  bool add_space_prefix = true;
};

class Tokenizer {
 public:
  // Validates the spec: ids in range, well-formed merges, no duplicate tokens
  // (kInvalidArgument); an unknown `model` or `pre` is kUnsupported, naming it.
  explicit Tokenizer(TokenizerSpec spec);

  Tokenizer(Tokenizer&&) noexcept = default;
  Tokenizer& operator=(Tokenizer&&) noexcept = default;
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // add_special: BOS/EOS as the spec's add_bos/add_eos say.
  // parse_special: control (and unknown) tokens written in the text, like
  // "<|im_start|>", become their ids. As in llama.cpp (and HF), user-defined
  // tokens are split out of the text in either case. Invalid UTF-8 in `text`
  // is tokenized as U+FFFD, byte by byte, like llama.cpp, by BPE; SentencePiece
  // keeps the bytes and falls back to byte tokens. A byte-level BPE
  // vocabulary without a token for some byte value drops that byte, as
  // llama.cpp does (SmolLM2 lacks 21 of them, e.g. 0x06 and 0xF5..0xFF), so
  // decode(encode(text)) can be shorter than text.
  std::vector<TokenId> encode(std::string_view text, bool add_special, bool parse_special) const;
  // The same with special-token text parsed only outside `as_text`: byte
  // ranges [begin, end) of `text` (a chat message's content) in which
  // "<|im_start|>" stays text, so that content cannot forge a turn. Outside
  // them, and for text with no such token inside them, the ids are encode's.
  struct TextRange {
    size_t begin = 0;
    size_t end = 0;
  };
  std::vector<TokenId> encode(std::string_view text, bool add_special, bool parse_special,
                              std::span<const TextRange> as_text) const;

  // Concatenated token_to_piece; skip_special drops control and unknown
  // tokens. No "clean up spaces". SentencePiece with add_space_prefix: when
  // ids[0] is BOS, the space that starts the decoded text is dropped (the one
  // encode added), as llama-cpp-python's detokenize does; with BOS rendered
  // ("<s> Once") there is no such space. An id out of range is kInvalidArgument.
  std::string decode(std::span<const TokenId> ids, bool skip_special = false) const;

  // The bytes this token stands for: byte-level decoded (BPE) or with U+2581
  // turned into spaces (SentencePiece) for normal tokens, the text itself for
  // control, unknown and user-defined tokens, the byte of a "<0xXX>" byte
  // token, nothing for unused/undefined ones. Not always valid UTF-8 on its
  // own (a token may hold part of a character).
  std::string token_to_piece(TokenId id) const;
  const std::string& token_text(TokenId id) const;  // as stored in the vocabulary
  TokenType token_type(TokenId id) const;           // after llama.cpp's promotions (see .cpp)
  std::optional<TokenId> find_token(std::string_view text) const;
  size_t vocab_size() const { return tokens_.size(); }

  std::optional<TokenId> bos_id() const { return bos_id_; }
  std::optional<TokenId> eos_id() const { return eos_id_; }
  std::optional<TokenId> eot_id() const { return eot_id_; }
  std::optional<TokenId> eom_id() const { return eom_id_; }
  std::optional<TokenId> unk_id() const { return unk_id_; }
  std::optional<TokenId> pad_id() const { return pad_id_; }
  bool add_bos() const { return add_bos_; }
  bool add_eos() const { return add_eos_; }
  bool add_space_prefix() const { return add_space_prefix_; }  // false for BPE
  bool is_sentencepiece() const { return sentencepiece_; }
  const std::string& model() const { return model_; }
  const std::string& pre() const { return pre_; }

  // llama.cpp's end-of-generation set: eos, eot, eom, the FIM pad/repo/file
  // separator tokens and every token whose text is one of <|im_end|>,
  // <|endoftext|>, <|eot_id|>, <|end_of_text|>, <|end|>, </s>, ... (see .cpp).
  bool is_end_of_generation(TokenId id) const;
  const std::vector<TokenId>& end_of_generation_ids() const { return eog_ids_; }  // ascending

  // A lower bound of encode(text, ...).size(), whatever the flags, in one pass
  // over the bytes: far cheaper than encode, for refusing a text that cannot
  // fit a token budget before tokenizing it. Each token stands for at most
  // max_token_bytes() bytes of the text (its stored text is at least as long
  // as the bytes it covers: byte-level and U+2581 forms only lengthen them,
  // a byte token's "<0xXX>" covers one byte, an unknown token one character),
  // and bytes the vocabulary may drop (see encode) count for nothing.
  int64_t min_tokens(std::string_view text) const;
  size_t max_token_bytes() const { return max_token_bytes_; }

  // How the pre-tokenizer cuts one text fragment (no special tokens), before
  // the byte mapping: for tests and debugging. SentencePiece has no
  // pre-tokenizer: the whole text is one piece.
  std::vector<std::string> pre_tokenize(std::string_view text) const;

 private:
  friend class IncrementalDecoder;         // reads pieces_ without a copy
  struct BpeScratch;                       // per-call working memory of encode_word
  static constexpr int32_t kNoPiece = -1;  // a text that no token or merge knows
  // A merge's key: its left and right piece ids.
  static uint64_t merge_key(int32_t left, int32_t right) {
    return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  }
  struct Merge {
    int32_t rank;
    int32_t result;  // piece id of the merged text
  };
  struct Fragment {  // of encode's input, after splitting out special tokens
    TokenId token;   // -1: text [begin, end)
    size_t begin, end;
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using StringIndex = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

  void validate_and_load(TokenizerSpec& spec);
  void build_merges(const std::vector<std::string>& merges);
  void build_token_bounds();  // max_token_bytes_, byte_always_kept_
  void find_special_tokens();
  void build_pieces();
  int32_t intern_piece(std::string_view text);
  void build_byte_tokens();
  bool is_special_type(TokenId id) const;
  // Whether decoding drops the space after a leading BOS (see decode()).
  bool strips_space_after_bos(std::span<const TokenId> ids) const;
  // llama.cpp's tokenizer_st_partition: the text cut into special tokens and
  // the text between them.
  std::vector<Fragment> split_special(std::string_view text, bool parse_special,
                                      std::span<const TextRange> as_text = {}) const;
  // Appends the tokens of one pre-tokenized word (raw bytes) to `out`.
  void encode_word(std::string_view word, BpeScratch& scratch, std::vector<TokenId>& out) const;
  void encode_bpe(std::string_view text, const std::vector<Fragment>& fragments,
                  std::vector<TokenId>& out) const;
  void encode_spm(std::string_view text, const std::vector<Fragment>& fragments,
                  std::vector<TokenId>& out) const;

  std::string model_;
  std::string pre_;
  bool sentencepiece_ = false;  // "llama"; else byte-level BPE
  bool add_space_prefix_ = false;
  bool ignore_merges_ = false;  // a word that is a whole token skips merging (llama3 & co.)
  RegexSplitter splitter_;

  std::vector<std::string> tokens_;  // text as stored, by id
  std::vector<TokenType> types_;     // by id, after promotions
  std::vector<std::string> pieces_;  // token_to_piece, by id
  std::vector<float> scores_;        // by id (SentencePiece merge priority; all 0 when absent)

  // Piece ids: a token's id, or vocab_size() + i for extra_pieces_[i], a string
  // that only occurs as a part or result of a merge.
  StringIndex piece_index_;
  std::vector<std::string> extra_pieces_;
  std::unordered_map<uint64_t, Merge> merges_;    // key: (left piece << 32) | right piece
  std::array<int32_t, 256> byte_piece_{};         // piece of each byte's alphabet char, -1: none
  std::array<TokenId, 256> single_byte_token_{};  // token whose text is that one byte, -1: none
  // SentencePiece byte fallback: the "<0xXX>" token of each byte, else
  // single_byte_token_, -1: none.
  std::array<TokenId, 256> byte_token_{};
  // min_tokens(): the longest stored token text (at least 4, one character),
  // and the bytes encode always turns into some token.
  size_t max_token_bytes_ = 4;
  std::array<bool, 256> byte_always_kept_{};

  std::vector<TokenId> special_tokens_;  // split out of the text; longest text first
  std::vector<TokenId> eog_ids_;         // ascending

  std::optional<TokenId> bos_id_, eos_id_, unk_id_, pad_id_, eot_id_, eom_id_;
  bool add_bos_ = false;
  bool add_eos_ = false;
};

}  // namespace duet

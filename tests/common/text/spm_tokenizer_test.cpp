// SentencePiece-style tokenizer (tokenizer.ggml.model "llama"): score-driven
// merging, byte fallback, the leading space, special tokens and decoding on a
// hand-built vocabulary, then stories260K's real one against llama.cpp's ids
// in tests/golden/tokenizer_stories260k.json.
#include "common/text/spm_tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/model/gguf.h"
#include "common/text/incremental_decoder.h"
#include "common/text/tokenizer.h"
#include "common/text/tokenizer_gguf.h"
#include "common/text/unicode.h"
#include "tests/common/text/token_ids.h"
#include "tests/error_kind.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"

namespace duet {
namespace {

using testing::error_kind_of;

// ---------------------------------------------------------------------------
// A hand-built vocabulary: <unk>, <s>, </s>, optionally the 256 byte tokens
// <0x00>..<0xFF>, then the given pieces. Pieces are written with '_' for
// U+2581 ("▁") to stay readable.

constexpr TokenId kUnk = 0;
constexpr TokenId kBos = 1;
constexpr TokenId kEos = 2;
constexpr TokenId kFirstByteToken = 3;

TokenId byte_token(uint8_t b) { return kFirstByteToken + b; }

std::string sp(std::string_view readable) {
  std::string out;
  for (char c : readable) {
    if (c == '_') {
      out.append(kSpmSpace);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

struct Piece {
  std::string text;  // readable form ('_' = U+2581)
  float score;
};

TokenizerSpec spm_spec(const std::vector<Piece>& pieces, bool with_byte_tokens = true) {
  TokenizerSpec spec;
  spec.model = "llama";
  spec.tokens = {"<unk>", "<s>", "</s>"};
  spec.token_types = {TokenType::kUnknown, TokenType::kControl, TokenType::kControl};
  spec.scores = {0.0f, 0.0f, 0.0f};
  if (with_byte_tokens) {
    for (int b = 0; b < 256; ++b) {
      spec.tokens.push_back(fmt::format("<0x{:02X}>", b));
      spec.token_types.push_back(TokenType::kByte);
      spec.scores.push_back(0.0f);
    }
  }
  for (const Piece& piece : pieces) {
    spec.tokens.push_back(sp(piece.text));
    spec.token_types.push_back(TokenType::kNormal);
    spec.scores.push_back(piece.score);
  }
  spec.unk_id = kUnk;
  spec.bos_id = kBos;
  spec.eos_id = kEos;
  spec.add_bos = true;
  spec.add_space_prefix = true;
  return spec;
}

// Token ids of readable pieces.
std::vector<TokenId> ids_of(const Tokenizer& tokenizer, const std::vector<std::string>& pieces) {
  return testing::token_ids(tokenizer, pieces, sp);
}

std::vector<TokenId> concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Streams ids through an IncrementalDecoder; every part must be valid UTF-8.
std::string stream(const Tokenizer& tokenizer, const std::vector<TokenId>& ids, bool skip_special) {
  IncrementalDecoder decoder(tokenizer, skip_special);
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) {
    const std::string part = decoder.push(ids[i]);
    EXPECT_EQ(utf8_sanitize(part), part) << "push(" << ids[i] << ") at " << i;
    out += part;
  }
  const std::string rest = decoder.flush();
  EXPECT_EQ(utf8_sanitize(rest), rest) << "flush()";
  return out + rest;
}

// ---------------------------------------------------------------------------
// Merging

// Merges alone: no leading space (it would come out as byte tokens here).
Tokenizer merge_only(const std::vector<Piece>& pieces) {
  TokenizerSpec spec = spm_spec(pieces);
  spec.add_space_prefix = false;
  return Tokenizer(std::move(spec));
}

TEST(SpmTokenizer, HigherScoreMergesFirst) {
  // "abc": the pairs "ab" and "bc" compete for "b"; the better score wins
  // wherever it sits.
  const Tokenizer right_wins =
      merge_only({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -2}, {"bc", -1}});
  EXPECT_EQ(right_wins.encode("abc", false, false), ids_of(right_wins, {"a", "bc"}));
  const Tokenizer left_wins =
      merge_only({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -1}, {"bc", -2}});
  EXPECT_EQ(left_wins.encode("abc", false, false), ids_of(left_wins, {"ab", "c"}));
}

TEST(SpmTokenizer, EqualScoresMergeLeftmostFirst) {
  const Tokenizer tokenizer =
      merge_only({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -1}, {"bc", -1}});
  EXPECT_EQ(tokenizer.encode("abc", false, false), ids_of(tokenizer, {"ab", "c"}));
  // Without scores every token scores 0: the leftmost pair always goes first.
  TokenizerSpec spec = spm_spec({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -2}, {"bc", -1}});
  spec.add_space_prefix = false;
  spec.scores.clear();
  const Tokenizer unscored(std::move(spec));
  EXPECT_EQ(unscored.encode("abc", false, false), ids_of(unscored, {"ab", "c"}));
}

TEST(SpmTokenizer, MergesChainThroughTokensOnly) {
  // "abc" is reached through "ab" even though it scores worst...
  const Tokenizer chained =
      merge_only({{"a", -10}, {"b", -10}, {"c", -10}, {"ab", -1}, {"abc", -50}});
  EXPECT_EQ(chained.encode("abc", false, false), ids_of(chained, {"abc"}));
  // ...but never without a token for a two-symbol step on the way.
  const Tokenizer unreachable = merge_only({{"a", -10}, {"b", -10}, {"c", -10}, {"abc", 0}});
  EXPECT_EQ(unreachable.encode("abc", false, false), ids_of(unreachable, {"a", "b", "c"}));
}

TEST(SpmTokenizer, SpacesBecomeLowBlocksWithALeadingOne) {
  const std::vector<Piece> pieces = {{"_", -20}, {"a", -10}, {"b", -10},
                                     {"_a", -1}, {"_b", -1}, {"__", -5}};
  const Tokenizer tokenizer(spm_spec(pieces));
  EXPECT_EQ(tokenizer.encode("a b", false, false), ids_of(tokenizer, {"_a", "_b"}));
  EXPECT_EQ(tokenizer.encode("a b", true, false), concat({kBos}, ids_of(tokenizer, {"_a", "_b"})));
  // The leading space comes before spaces of the text itself.
  // "_a" outscores "__", so it takes the second low block.
  EXPECT_EQ(tokenizer.encode(" a", false, false), ids_of(tokenizer, {"_", "_a"}));
  EXPECT_EQ(tokenizer.encode("", true, false), std::vector<TokenId>{kBos});
  EXPECT_EQ(tokenizer.encode("", false, false), std::vector<TokenId>{});
  EXPECT_TRUE(tokenizer.is_sentencepiece());
  EXPECT_TRUE(tokenizer.add_space_prefix());

  TokenizerSpec spec = spm_spec(pieces);
  spec.add_space_prefix = false;
  const Tokenizer without_prefix(std::move(spec));
  EXPECT_EQ(without_prefix.encode("a b", false, false), ids_of(without_prefix, {"a", "_b"}));
  EXPECT_FALSE(without_prefix.add_space_prefix());
}

// ---------------------------------------------------------------------------
// Byte fallback

TEST(SpmTokenizer, UnknownCharactersFallBackToByteTokens) {
  const Tokenizer tokenizer(spm_spec({{"_", -20}, {"a", -10}, {"_a", -1}}));
  // U+20AC is not in the vocabulary: its three UTF-8 bytes come out.
  EXPECT_EQ(
      tokenizer.encode("a\xE2\x82\xAC", false, false),
      concat(ids_of(tokenizer, {"_a"}), {byte_token(0xE2), byte_token(0x82), byte_token(0xAC)}));
  // Invalid UTF-8 is not replaced. A stray continuation byte is a symbol of
  // its own; a lead byte takes the bytes its length announces, whatever they
  // are (llama.cpp's unicode_len_utf8): "\xFF" claims the "a" after it.
  EXPECT_EQ(tokenizer.encode("\x80"
                             "a",
                             false, false),
            concat(ids_of(tokenizer, {"_"}), concat({byte_token(0x80)}, ids_of(tokenizer, {"a"}))));
  EXPECT_EQ(tokenizer.encode("\xFF"
                             "a",
                             false, false),
            concat(ids_of(tokenizer, {"_"}), {byte_token(0xFF), byte_token('a')}));
  // A truncated sequence at the end keeps its bytes.
  EXPECT_EQ(tokenizer.encode("a\xE2\x82", false, false),
            concat(ids_of(tokenizer, {"_a"}), {byte_token(0xE2), byte_token(0x82)}));
}

TEST(SpmTokenizer, ByteFallbackPrefersHexTokensThenTheByteItself) {
  // No <0xXX> tokens, but tokens whose text is one raw byte.
  const Tokenizer tokenizer(
      spm_spec({{"_", -20}, {"a", -10}, {"\xE2", -10}, {"\x82", -10}, {"\xAC", -10}},
               /*with_byte_tokens=*/false));
  EXPECT_EQ(tokenizer.encode("\xE2\x82\xAC", false, false),
            ids_of(tokenizer, {"_", "\xE2", "\x82", "\xAC"}));
  // "?" has no token at all: <unk> (llama.cpp would throw).
  EXPECT_EQ(tokenizer.encode("a?", false, false), concat(ids_of(tokenizer, {"_", "a"}), {kUnk}));
  // A character with an uncovered byte becomes one <unk>, not one per byte.
  EXPECT_EQ(tokenizer.encode("\xE2\x82\xAD", false, false),
            concat(ids_of(tokenizer, {"_"}), {kUnk}));
}

// ---------------------------------------------------------------------------
// Special tokens, BOS/EOS

TEST(SpmTokenizer, SpecialTokensAndTheSpaceAfterThem) {
  const Tokenizer tokenizer(spm_spec({{"_", -20},
                                      {"a", -10},
                                      {"b", -10},
                                      {"<", -10},
                                      {"s", -10},
                                      {">", -10},
                                      {"/", -10},
                                      {"_a", -1},
                                      {"_b", -1}}));
  // As llama.cpp: the text after any special token gets a leading space too.
  EXPECT_EQ(
      tokenizer.encode("<s>a</s>b", false, true),
      concat({kBos}, concat(ids_of(tokenizer, {"_a"}), concat({kEos}, ids_of(tokenizer, {"_b"})))));
  EXPECT_EQ(tokenizer.encode("a</s>", true, true),
            concat({kBos}, concat(ids_of(tokenizer, {"_a"}), {kEos})));
  // Without parse_special the text is text.
  EXPECT_EQ(tokenizer.encode("<s>", false, false), ids_of(tokenizer, {"_", "<", "s", ">"}));

  TokenizerSpec spec = spm_spec({{"_", -20}, {"a", -10}, {"_a", -1}});
  spec.add_eos = true;
  const Tokenizer with_eos(std::move(spec));
  EXPECT_EQ(with_eos.encode("a", true, false),
            concat({kBos}, concat(ids_of(with_eos, {"_a"}), {kEos})));
  EXPECT_EQ(with_eos.encode("", true, false), (std::vector<TokenId>{kBos, kEos}));
}

TEST(SpmTokenizer, UserDefinedTokensAreSplitOutAlways) {
  TokenizerSpec spec = spm_spec({{"_", -20}, {"a", -10}, {"_a", -1}});
  spec.tokens.push_back("<tool>");
  spec.token_types.push_back(TokenType::kUserDefined);
  spec.scores.push_back(0.0f);
  const Tokenizer tokenizer(std::move(spec));
  const TokenId tool = static_cast<TokenId>(tokenizer.vocab_size() - 1);
  EXPECT_EQ(tokenizer.encode("<tool>a", false, false), concat({tool}, ids_of(tokenizer, {"_a"})));
}

// ---------------------------------------------------------------------------
// Decoding

TEST(SpmTokenizer, PiecesTurnLowBlocksIntoSpacesAndByteTokensIntoBytes) {
  const Tokenizer tokenizer(spm_spec({{"_", -20}, {"a", -10}, {"_a", -1}, {"a_a", -1}}));
  EXPECT_EQ(tokenizer.token_to_piece(*tokenizer.find_token(sp("_a"))), " a");
  EXPECT_EQ(tokenizer.token_to_piece(*tokenizer.find_token(sp("a_a"))), "a a");
  EXPECT_EQ(tokenizer.token_to_piece(byte_token(0x41)), "A");
  EXPECT_EQ(tokenizer.token_to_piece(byte_token(0xE2)), "\xE2");
  EXPECT_EQ(tokenizer.token_to_piece(kBos), "<s>");
  EXPECT_EQ(tokenizer.token_text(*tokenizer.find_token(sp("_a"))), sp("_a"));
}

TEST(SpmTokenizer, DecodeDropsTheSpaceAfterALeadingBos) {
  const Tokenizer tokenizer(spm_spec({{"_", -20}, {"a", -10}, {"b", -10}, {"_a", -1}, {"_b", -1}}));
  const std::vector<TokenId> with_bos = tokenizer.encode("a b", true, true);
  ASSERT_EQ(with_bos.front(), kBos);
  EXPECT_EQ(tokenizer.decode(with_bos, /*skip_special=*/true), "a b");
  // With BOS rendered the text does not start with the space: it stays.
  EXPECT_EQ(tokenizer.decode(with_bos), "<s> a b");
  // Without a leading BOS nothing is dropped (a generated continuation).
  const std::vector<TokenId> without_bos = tokenizer.encode("a b", false, true);
  EXPECT_EQ(tokenizer.decode(without_bos), " a b");
  // Only one space, and only one that starts the text.
  EXPECT_EQ(tokenizer.decode(tokenizer.encode("  a", true, true), true), "  a");
  EXPECT_EQ(tokenizer.decode(std::vector<TokenId>{kBos, kBos, byte_token(' ')}, true), "");
  EXPECT_EQ(tokenizer.decode(std::vector<TokenId>{kBos, byte_token('x'), byte_token(' ')}, true),
            "x ");

  TokenizerSpec spec = spm_spec({{"_", -20}, {"a", -10}, {"_a", -1}});
  spec.add_space_prefix = false;
  const Tokenizer without_prefix(std::move(spec));
  EXPECT_EQ(
      without_prefix.decode(std::vector<TokenId>{kBos, *without_prefix.find_token(sp("_a"))}, true),
      " a");
}

TEST(SpmTokenizer, IncrementalDecoderJoinsByteTokensIntoCharacters) {
  const Tokenizer tokenizer(spm_spec({{"_", -20}, {"a", -10}, {"_a", -1}}));
  IncrementalDecoder decoder(tokenizer, /*skip_special=*/true);
  EXPECT_EQ(decoder.push(kBos), "");
  EXPECT_EQ(decoder.push(*tokenizer.find_token(sp("_a"))), "a");  // the space after BOS dropped
  EXPECT_EQ(decoder.push(byte_token(0xE2)), "");
  EXPECT_EQ(decoder.push(byte_token(0x82)), "");
  EXPECT_EQ(decoder.push(byte_token(0xAC)), "\xE2\x82\xAC");
  EXPECT_EQ(decoder.push(byte_token(0xF0)), "");
  EXPECT_EQ(decoder.push(byte_token('x')), "\xEF\xBF\xBDx");  // can never complete
  EXPECT_EQ(decoder.push(byte_token(0xC3)), "");
  EXPECT_EQ(decoder.flush(), "\xEF\xBF\xBD");  // dangling

  for (const std::string text : {"a a\xE2\x82\xAC a", "  \xF0\x9F\x98\x80", "", " "}) {
    for (const bool add_special : {true, false}) {
      const std::vector<TokenId> ids = tokenizer.encode(text, add_special, true);
      for (const bool skip : {true, false}) {
        EXPECT_EQ(stream(tokenizer, ids, skip), tokenizer.decode(ids, skip))
            << "'" << text << "' add_special " << add_special << " skip " << skip;
      }
    }
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(text, true, true), true), text);
  }
}

TEST(SpmTokenizer, RejectsBadSpecs) {
  const auto kind_for = [](auto edit) {
    TokenizerSpec spec = spm_spec({{"_", -20}, {"a", -10}});
    edit(spec);
    return error_kind_of([&] { Tokenizer tokenizer(std::move(spec)); });
  };
  EXPECT_EQ(kind_for([](TokenizerSpec& s) { s.scores.pop_back(); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(kind_for([](TokenizerSpec& s) { s.bos_id.reset(); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(kind_for([](TokenizerSpec& s) { s.unk_id = 100000; }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(kind_for([](TokenizerSpec& s) { s.tokens.back() = sp("_"); }),
            ErrorKind::kInvalidArgument);  // a duplicate
  EXPECT_EQ(kind_for([](TokenizerSpec& s) { s.model = "t5"; }), ErrorKind::kUnsupported);
  // A SentencePiece vocabulary has no pre-tokenizer: `pre` is not checked.
  TokenizerSpec spec = spm_spec({{"_", -20}});
  spec.pre = "no-such-pre";
  EXPECT_NO_THROW(Tokenizer{std::move(spec)});
}

// ---------------------------------------------------------------------------
// stories260K (../shared/models, never copied into the repository)

const Tokenizer* stories_tokenizer() {
  static const std::optional<Tokenizer> tokenizer = []() -> std::optional<Tokenizer> {
    const std::optional<std::filesystem::path> path =
        testing::shared_model_path("stories260K.gguf");
    if (!path) return std::nullopt;
    return tokenizer_from_gguf(GgufFile::open(*path));
  }();
  return tokenizer ? &*tokenizer : nullptr;
}

#define DUET_SKIP_WITHOUT_STORIES(var)        \
  const Tokenizer* var = stories_tokenizer(); \
  if (!var)                                   \
  GTEST_SKIP() << "../shared/models/stories260K.gguf not present (not part of the repository)"

struct GoldenCase {
  std::string name, text;
  std::vector<TokenId> ids, ids_unparsed;
  std::string detokenized, detokenized_special;
};

// tests/golden/tokenizer_stories260k.json, made by
// tests/golden/make_spm_tokenizer_golden.py from llama-cpp-python.
std::vector<GoldenCase> golden_cases(const Tokenizer& tokenizer) {
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/tokenizer_stories260k.json"));
  EXPECT_EQ(golden.at("n_vocab").get<size_t>(), tokenizer.vocab_size())
      << "the golden file was made for another model";
  EXPECT_TRUE(golden.at("add_bos").get<bool>());
  EXPECT_EQ(golden.at("bos_id").get<TokenId>(), tokenizer.bos_id().value_or(-1));
  std::vector<GoldenCase> cases;
  for (const nlohmann::json& c : golden.at("cases")) {
    cases.push_back(
        {c.at("name").get<std::string>(), c.at("text").get<std::string>(),
         c.at("ids").get<std::vector<TokenId>>(), c.at("ids_unparsed").get<std::vector<TokenId>>(),
         c.at("detokenized").get<std::string>(), c.at("detokenized_special").get<std::string>()});
  }
  EXPECT_EQ(cases.size(), 42u);
  return cases;
}

TEST(Stories260KVocab, MetadataReadsAsSentencePiece) {
  const std::optional<std::filesystem::path> path = testing::shared_model_path("stories260K.gguf");
  if (!path)
    GTEST_SKIP() << "../shared/models/stories260K.gguf not present (not part of the repository)";
  const TokenizerSpec spec = tokenizer_spec_from_gguf(GgufFile::open(*path));
  EXPECT_EQ(spec.model, "llama");
  EXPECT_EQ(spec.tokens.size(), 512u);
  EXPECT_EQ(spec.scores.size(), 512u);
  EXPECT_TRUE(spec.add_bos);
  EXPECT_FALSE(spec.add_eos);
  EXPECT_TRUE(spec.add_space_prefix);  // no key: llama.cpp's default for SentencePiece
  EXPECT_EQ(spec.unk_id, 0);
  EXPECT_EQ(spec.bos_id, 1);
  EXPECT_EQ(spec.eos_id, 2);
  EXPECT_FALSE(spec.pad_id.has_value());  // stored as 0xFFFFFFFF
}

TEST(Stories260KVocab, PromptOfTheModelReadme) {
  DUET_SKIP_WITHOUT_STORIES(tokenizer);
  EXPECT_TRUE(tokenizer->is_sentencepiece());
  EXPECT_EQ(tokenizer->vocab_size(), 512u);
  const std::vector<TokenId> ids = tokenizer->encode("Once upon a time", true, false);
  EXPECT_EQ(ids, (std::vector<TokenId>{1, 403, 407, 261, 378}));
  EXPECT_EQ(tokenizer->decode(ids, /*skip_special=*/true), "Once upon a time");
  EXPECT_EQ(tokenizer->end_of_generation_ids(), std::vector<TokenId>{2});  // </s>
  EXPECT_EQ(tokenizer->token_type(0), TokenType::kUnknown);
  EXPECT_EQ(tokenizer->token_type(3), TokenType::kByte);
}

TEST(Stories260KVocab, InvalidUtf8LikeLlamaCpp) {
  DUET_SKIP_WITHOUT_STORIES(tokenizer);
  // llama-cpp-python 0.3.36, tokenize(text, add_bos=False, special=True); the
  // golden file is JSON and cannot hold these texts.
  const std::vector<std::pair<std::string, std::vector<TokenId>>> cases = {
      {"\xFF"
       "a",
       {410, 258, 100}},
      {"\x80"
       "a",
       {410, 131, 412}},
      {"a\xE2\x82", {261, 229, 133}},
      {"\xE2\x82\xAC", {410, 503}},
      {"\xC3(", {410, 198, 43}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(tokenizer->encode(text, false, true), ids);
    EXPECT_EQ(tokenizer->decode(ids), " " + text) << "bytes come back unchanged";
  }
}

TEST(Stories260KVocab, EncodesEveryGoldenCaseLikeLlamaCpp) {
  DUET_SKIP_WITHOUT_STORIES(tokenizer);
  for (const GoldenCase& c : golden_cases(*tokenizer)) {
    SCOPED_TRACE("golden case '" + c.name + "'");
    EXPECT_EQ(tokenizer->encode(c.text, /*add_special=*/true, /*parse_special=*/true), c.ids);
    EXPECT_EQ(tokenizer->encode(c.text, /*add_special=*/true, /*parse_special=*/false),
              c.ids_unparsed);
    // add_special=false drops exactly the BOS.
    EXPECT_EQ(tokenizer->encode(c.text, false, true),
              std::vector<TokenId>(c.ids.begin() + 1, c.ids.end()));
  }
}

TEST(Stories260KVocab, DecodesEveryGoldenCaseLikeLlamaCpp) {
  DUET_SKIP_WITHOUT_STORIES(tokenizer);
  int round_trips = 0;
  for (const GoldenCase& c : golden_cases(*tokenizer)) {
    SCOPED_TRACE("golden case '" + c.name + "'");
    EXPECT_EQ(tokenizer->decode(c.ids, /*skip_special=*/true), c.detokenized);
    EXPECT_EQ(tokenizer->decode(c.ids, /*skip_special=*/false), c.detokenized_special);
    if (c.text.find(kSpmSpace) == std::string::npos) {  // U+2581 decodes as a space
      EXPECT_EQ(tokenizer->decode(c.ids_unparsed, /*skip_special=*/true), c.text)
          << "text with special tokens left unparsed round-trips";
    }
    EXPECT_EQ(stream(*tokenizer, c.ids, /*skip_special=*/true), c.detokenized);
    EXPECT_EQ(stream(*tokenizer, c.ids, /*skip_special=*/false), c.detokenized_special);
    if (c.detokenized == c.text) ++round_trips;
  }
  // All but the cases whose special tokens (or U+2581 text) decode differently.
  EXPECT_EQ(round_trips, 34);
}

TEST(Stories260KVocab, EncodesTwoThousandWordsQuickly) {
  DUET_SKIP_WITHOUT_STORIES(tokenizer);
  const std::vector<std::string> words = {"Once", "upon",   "a",     "time,", "there",
                                          "was",  "little", "Lily.", "She\n", "park"};
  std::string text;
  for (int i = 0; i < 2000; ++i) text += words[(i * 7) % words.size()] + " ";
  const auto start = std::chrono::steady_clock::now();
  const std::vector<TokenId> ids = tokenizer->encode(text, true, false);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(tokenizer->decode(ids, true), text);
  EXPECT_LT(ms, 100.0) << ids.size() << " tokens";
}

}  // namespace
}  // namespace duet

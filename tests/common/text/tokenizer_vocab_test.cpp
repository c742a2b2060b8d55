// The tokenizer on real vocabularies read from their GGUF files: the default
// model's (SmolLM2's byte-level BPE) checked against llama.cpp's ids in
// tests/golden/tokenizer_smollm2.json, and a SentencePiece one (stories260K).
// Without the models these tests skip. The mechanics on a tiny hand-built
// vocabulary: tokenizer_test.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/model/gguf.h"
#include "common/text/incremental_decoder.h"
#include "common/text/tokenizer.h"
#include "common/text/tokenizer_gguf.h"
#include "tests/golden_file.h"
#include "tests/test_paths.h"

namespace duet {
namespace {

// ---------------------------------------------------------------------------
// The default model's vocabulary, read from models/SmolLM2-135M-Instruct.Q4_1.gguf
// (or $DUET_MODEL) through the GGUF reader. Without the model these tests skip.

// Loaded once per process (the model is 98 MB; only its metadata is read).
// nullptr when the default model is absent.
const Tokenizer* default_model_tokenizer() {
  static const std::optional<Tokenizer> tokenizer = []() -> std::optional<Tokenizer> {
    const std::optional<std::filesystem::path> path = testing::default_model_path();
    if (!path) return std::nullopt;
    return tokenizer_from_gguf(GgufFile::open(*path));
  }();
  return tokenizer ? &*tokenizer : nullptr;
}

#define DUET_SKIP_WITHOUT_DEFAULT_TOKENIZER(var)    \
  const Tokenizer* var = default_model_tokenizer(); \
  if (!var) GTEST_SKIP() << "default model not found: run launch/setup.sh to fetch it"

// Strict UTF-8 validity, written out independently of common/text/unicode: no
// overlong forms, no surrogates, nothing above U+10FFFF, no truncated tail.
bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<uint8_t>(s[i]);
    size_t n;
    uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b0 < 0x80) {
      ++i;
      continue;
    } else if (b0 >= 0xC2 && b0 <= 0xDF) {
      n = 2;
    } else if (b0 >= 0xE0 && b0 <= 0xEF) {
      n = 3;
      if (b0 == 0xE0) lo = 0xA0;  // overlong
      if (b0 == 0xED) hi = 0x9F;  // surrogates
    } else if (b0 >= 0xF0 && b0 <= 0xF4) {
      n = 4;
      if (b0 == 0xF0) lo = 0x90;  // overlong
      if (b0 == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return false;  // continuation byte, C0/C1 or F5..FF
    }
    if (i + n > s.size()) return false;
    const auto b1 = static_cast<uint8_t>(s[i + 1]);
    if (b1 < lo || b1 > hi) return false;
    for (size_t k = 2; k < n; ++k) {
      const auto b = static_cast<uint8_t>(s[i + k]);
      if (b < 0x80 || b > 0xBF) return false;
    }
    i += n;
  }
  return true;
}

TEST(Utf8Checker, AcceptsValidAndRejectsInvalid) {
  EXPECT_TRUE(is_valid_utf8(""));
  EXPECT_TRUE(is_valid_utf8("a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80\xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(is_valid_utf8("\x80"));
  EXPECT_FALSE(is_valid_utf8("\xC0\x80"));          // overlong
  EXPECT_FALSE(is_valid_utf8("\xE0\x80\x80"));      // overlong
  EXPECT_FALSE(is_valid_utf8("\xED\xA0\x80"));      // surrogate
  EXPECT_FALSE(is_valid_utf8("\xF4\x90\x80\x80"));  // above U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xF0\x9F\x98"));      // truncated
  EXPECT_FALSE(
      is_valid_utf8("\xF0\x9F"
                    "A"));
  EXPECT_FALSE(is_valid_utf8("\xFF"));
}

struct GoldenCase {
  std::string name;
  std::string text;
  std::vector<TokenId> ids;
};

// tests/golden/tokenizer_smollm2.json: llama.cpp's ids for the default model
// (add_bos=False, special=True), made by tests/golden/make_tokenizer_golden.py.
std::vector<GoldenCase> golden_cases(const Tokenizer& tokenizer) {
  const nlohmann::json golden =
      testing::read_golden(testing::fixture_path("golden/tokenizer_smollm2.json"));
  EXPECT_EQ(golden.at("n_vocab").get<size_t>(), tokenizer.vocab_size())
      << "the golden file was made for another model";
  std::vector<GoldenCase> cases;
  for (const nlohmann::json& c : golden.at("cases")) {
    cases.push_back({c.at("name").get<std::string>(), c.at("text").get<std::string>(),
                     c.at("ids").get<std::vector<TokenId>>()});
  }
  EXPECT_EQ(cases.size(), 41u);
  return cases;
}

TEST(SmolLM2Vocab, MatchesLlamaCpp) {
  DUET_SKIP_WITHOUT_DEFAULT_TOKENIZER(tokenizer);
  EXPECT_EQ(tokenizer->model(), "gpt2");
  EXPECT_EQ(tokenizer->pre(), "smollm");
  EXPECT_EQ(tokenizer->vocab_size(), 49152u);
  // Ids from llama.cpp (llama-cpp-python 0.3.36, special=True, add_bos=False).
  const std::vector<std::pair<std::string, std::vector<TokenId>>> cases = {
      {"Hello world", {19556, 905}},
      {"12345", {33, 34, 35, 36, 37}},
      {"<|im_start|>user\nHi<|im_end|>", {1, 4093, 198, 26843, 2}},
      {"   x", {256, 1792}},
      {"\n\n\n", {16506}},
      {"def f(x):\n    return x * 2\n",
       {1604, 275, 24, 104, 727, 472, 1003, 1792, 1672, 216, 34, 198}},
      {"\xE6\x88\x91\xE5\x96\x9C\xE6\xAC\xA2\xE8\x87\xAA\xE7\x84\xB6\xE8\xAF\xAD\xE8\xA8\x80"
       "\xE5\xA4\x84\xE7\x90\x86\xE3\x80\x82",  // 我喜欢自然语言处理。
       {19805, 235, 176,   240, 246,   177, 122,   112, 44974, 120,  178,
        222,   131, 16313, 251, 48001, 218, 18614, 222, 45201, 19076}},
      {"emoji \xF0\x9F\x98\x80\xF0\x9F\x8E\x89", {391, 33777, 40303, 218, 10813, 232, 227}},
      {"It's 3.14, isn't it?", {1589, 506, 216, 35, 30, 33, 36, 28, 3247, 982, 357, 47}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(tokenizer->encode(text, false, true), ids) << text;
    EXPECT_EQ(tokenizer->decode(ids), text);
  }
  EXPECT_EQ(tokenizer->encode("<|im_start|>user\nHi<|im_end|>", false, false).front(), 44);
}

TEST(SmolLM2Vocab, EncodesEveryGoldenCaseLikeLlamaCpp) {
  DUET_SKIP_WITHOUT_DEFAULT_TOKENIZER(tokenizer);
  // The golden ids come from add_bos=False. The model adds neither BOS nor EOS,
  // so add_special=true (following the file's flags) gives the same ids; both
  // are checked.
  EXPECT_FALSE(tokenizer->add_bos());
  EXPECT_FALSE(tokenizer->add_eos());
  int valid_utf8_cases = 0;
  for (const GoldenCase& c : golden_cases(*tokenizer)) {
    SCOPED_TRACE("golden case '" + c.name + "'");
    EXPECT_EQ(tokenizer->encode(c.text, /*add_special=*/true, /*parse_special=*/true), c.ids)
        << "case " << c.name;
    EXPECT_EQ(tokenizer->encode(c.text, /*add_special=*/false, /*parse_special=*/true), c.ids)
        << "case " << c.name;
    if (is_valid_utf8(c.text)) {
      ++valid_utf8_cases;
      EXPECT_EQ(tokenizer->decode(c.ids), c.text) << "case " << c.name << ": decode round trip";
    }
  }
  // JSON strings are Unicode, so every golden text is valid UTF-8.
  EXPECT_EQ(valid_utf8_cases, 41);
}

TEST(SmolLM2Vocab, EndOfGenerationAndStreamingDecode) {
  DUET_SKIP_WITHOUT_DEFAULT_TOKENIZER(tokenizer);
  // <|endoftext|>, <|im_end|> and <reponame>, which llama.cpp takes as the
  // FIM repo-name token and counts as end of generation.
  EXPECT_EQ(tokenizer->end_of_generation_ids(), (std::vector<TokenId>{0, 2, 4}));
  for (TokenId id : {0, 2, 4}) EXPECT_TRUE(tokenizer->is_end_of_generation(id)) << id;
  EXPECT_FALSE(tokenizer->is_end_of_generation(1));  // <|im_start|>

  for (const GoldenCase& c : golden_cases(*tokenizer)) {
    SCOPED_TRACE("golden case '" + c.name + "'");
    IncrementalDecoder decoder(*tokenizer);
    std::string streamed;
    for (size_t i = 0; i < c.ids.size(); ++i) {
      const std::string part = decoder.push(c.ids[i]);
      EXPECT_TRUE(is_valid_utf8(part)) << "case " << c.name << ": push(" << c.ids[i]
                                       << ") at position " << i << " emitted invalid UTF-8";
      streamed += part;
    }
    const std::string rest = decoder.flush();
    EXPECT_TRUE(is_valid_utf8(rest)) << "case " << c.name << ": flush() emitted invalid UTF-8";
    streamed += rest;
    EXPECT_EQ(streamed, tokenizer->decode(c.ids)) << "case " << c.name;
  }
}

TEST(SmolLM2Vocab, EncodesTwoThousandWordsQuickly) {
  DUET_SKIP_WITHOUT_DEFAULT_TOKENIZER(tokenizer);
  const std::vector<std::string> words = {"the", "model",    "serves", "tokens,",   "and",
                                          "12",  "requests", "per",    "second.\n", "Hello"};
  std::string text;
  for (int i = 0; i < 2000; ++i) text += words[(i * 7) % words.size()] + " ";
  const auto start = std::chrono::steady_clock::now();
  const std::vector<TokenId> ids = tokenizer->encode(text, false, true);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(tokenizer->decode(ids), text);
  EXPECT_LT(ms, 50.0) << ids.size() << " tokens";
}

// min_tokens() is a lower bound of the token count, whatever the text: plain
// words, the vocabulary's longest tokens back to back, whitespace runs,
// special tokens written as text, and bytes the vocabulary drops.
void expect_min_tokens_is_a_lower_bound(const Tokenizer& tokenizer) {
  size_t longest = 0;
  for (TokenId id = 0; id < static_cast<TokenId>(tokenizer.vocab_size()); ++id) {
    if (tokenizer.token_text(id).size() > tokenizer.token_text(longest).size()) longest = id;
  }
  EXPECT_GE(tokenizer.max_token_bytes(),
            tokenizer.token_text(static_cast<TokenId>(longest)).size());
  std::string longest_pieces;
  for (int i = 0; i < 20; ++i)
    longest_pieces += tokenizer.token_to_piece(static_cast<TokenId>(longest));
  std::vector<std::string> texts = {
      "",
      "The quick brown fox jumps over the lazy dog.",
      longest_pieces,
      std::string(5000, ' '),
      std::string(3000, '\n') + "a" + std::string(3000, '\t'),
      "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\n",
      std::string(4000, '\x06') + "hi" + std::string(4000, '\x06'),
      "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 na\xc3\xafve",
  };
  std::string every_ascii;
  for (int b = 1; b < 0x80; ++b) every_ascii += static_cast<char>(b);
  texts.push_back(every_ascii);
  for (const std::string& text : texts) {
    for (const bool parse_special : {false, true}) {
      const auto n = static_cast<int64_t>(tokenizer.encode(text, false, parse_special).size());
      EXPECT_LE(tokenizer.min_tokens(text), n)
          << "text of " << text.size() << " bytes, parse_special " << parse_special;
    }
  }
  // Not vacuous: a long plain text needs tokens, and the bound says so.
  EXPECT_GT(tokenizer.min_tokens(std::string(100000, 'a')), 0);
}

TEST(SmolLM2Vocab, MinTokensIsALowerBound) {
  DUET_SKIP_WITHOUT_DEFAULT_TOKENIZER(tokenizer);
  expect_min_tokens_is_a_lower_bound(*tokenizer);
  // SmolLM2 has no token for 0x06: a run of it costs nothing, and counts nothing.
  EXPECT_EQ(tokenizer->min_tokens(std::string(100000, '\x06')), 0);
}

TEST(Stories260KVocab, MinTokensIsALowerBound) {
  const std::optional<std::filesystem::path> path = testing::shared_model_path("stories260K.gguf");
  if (!path) GTEST_SKIP() << "../shared/models/stories260K.gguf not present";
  expect_min_tokens_is_a_lower_bound(tokenizer_from_gguf(GgufFile::open(*path)));
}

// ---------------------------------------------------------------------------
// A SentencePiece vocabulary (tokenizer.ggml.model "llama") builds from the
// same GGUF metadata; tests/common/text/spm_tokenizer_test.cpp checks it against
// llama.cpp in depth.

TEST(Stories260KVocab, SentencePieceBuildsFromGguf) {
  const std::optional<std::filesystem::path> path = testing::shared_model_path("stories260K.gguf");
  if (!path) GTEST_SKIP() << "../shared/models/stories260K.gguf not present";
  const GgufFile file = GgufFile::open(*path);

  const TokenizerSpec spec = tokenizer_spec_from_gguf(file);
  EXPECT_EQ(spec.model, "llama");
  EXPECT_EQ(spec.tokens.size(), 512u);
  EXPECT_EQ(spec.scores.size(), 512u);
  EXPECT_TRUE(spec.add_bos);
  EXPECT_TRUE(spec.add_space_prefix);

  const Tokenizer tokenizer = tokenizer_from_gguf(file);
  EXPECT_EQ(tokenizer.model(), "llama");
  EXPECT_TRUE(tokenizer.is_sentencepiece());
  EXPECT_EQ(tokenizer.vocab_size(), 512u);
  // llama.cpp's prompt ids for the model README's example.
  const std::vector<TokenId> ids = tokenizer.encode("Once upon a time", true, false);
  EXPECT_EQ(ids, (std::vector<TokenId>{1, 403, 407, 261, 378}));
  EXPECT_EQ(tokenizer.decode(ids, /*skip_special=*/true), "Once upon a time");
}

}  // namespace
}  // namespace duet

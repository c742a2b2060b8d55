// libFuzzer target for the tokenizer (common/text/tokenizer.h) with the default model's vocabulary.
//
// The tokenizer is built once, from models/SmolLM2-135M-Instruct.Q4_1.gguf (or $DUET_FUZZ_MODEL);
// without the model the fuzzer exits 77 (ctest's "skipped"). Each input is used twice:
// - as text: encoded with parse_special false and true, and decoded again. decode(encode(text))
//   must give the text back when it is valid UTF-8 (less the bytes the vocabulary has no token
//   for, see check_text) and, for any bytes, what tokenizer.h documents encode to do with
//   invalid UTF-8 (llama.cpp's lenient decoding, see lenient_utf8 below);
//   IncrementalDecoder fed the ids one by one must give decode(ids), with ill-formed UTF-8
//   replaced by U+FFFD as its contract says (nothing is replaced for valid text);
// - as token ids (2 bytes each, and 4 bytes each for extreme values): decode and the per-token
//   lookups must throw duet::Error(kInvalidArgument) for an id out of range and work otherwise,
//   and IncrementalDecoder must reject such an id without losing what it holds.
// The UTF-8 helpers here are written from the Unicode standard and the header comments, not from
// common/text/unicode.cpp, so that they are an independent reference.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/model/gguf.h"
#include "common/text/incremental_decoder.h"
#include "common/text/tokenizer.h"
#include "common/text/tokenizer_gguf.h"
#include "tests/fuzz/fuzz_check.h"

namespace duet::fuzz {
namespace {

constexpr size_t kMaxIds = 4096;  // ids per sequence, to keep one run in milliseconds
constexpr const char* kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// ---------------------------------------------------------------------------
// Reference UTF-8 (Unicode 15, §3.9 and Table 3-7)

uint8_t byte_at(std::string_view s, size_t i) { return static_cast<uint8_t>(s[i]); }

// Bytes of the well-formed prefix of the sequence at `pos` (Table 3-7): the whole sequence's
// length when it is complete and well-formed. Sets `complete` accordingly. A byte that cannot
// start a sequence has a prefix of 0 bytes.
size_t well_formed_prefix(std::string_view s, size_t pos, bool& complete) {
  const uint8_t b0 = byte_at(s, pos);
  complete = false;
  if (b0 <= 0x7F) {
    complete = true;
    return 1;
  }
  size_t length;
  uint8_t second_lo = 0x80, second_hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2;
  } else if (b0 == 0xE0) {
    length = 3, second_lo = 0xA0;
  } else if ((b0 >= 0xE1 && b0 <= 0xEC) || b0 == 0xEE || b0 == 0xEF) {
    length = 3;
  } else if (b0 == 0xED) {
    length = 3, second_hi = 0x9F;
  } else if (b0 == 0xF0) {
    length = 4, second_lo = 0x90;
  } else if (b0 >= 0xF1 && b0 <= 0xF3) {
    length = 4;
  } else if (b0 == 0xF4) {
    length = 4, second_hi = 0x8F;
  } else {
    return 0;  // C0, C1, F5..FF, or a continuation byte
  }
  size_t i = 1;
  for (; i < length && pos + i < s.size(); ++i) {
    const uint8_t b = byte_at(s, pos + i);
    const uint8_t lo = i == 1 ? second_lo : 0x80, hi = i == 1 ? second_hi : 0xBF;
    if (b < lo || b > hi) break;
  }
  complete = i == length;
  return i;
}

bool is_valid_utf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    bool complete = false;
    const size_t n = well_formed_prefix(s, pos, complete);
    if (!complete) return false;
    pos += n;
  }
  return true;
}

// `s` with every maximal ill-formed subpart (an incomplete tail included) replaced by one U+FFFD
// (the "U+FFFD substitution of maximal subparts" practice of §3.9).
std::string replace_ill_formed(std::string_view s) {
  std::string out;
  for (size_t pos = 0; pos < s.size();) {
    bool complete = false;
    const size_t n = well_formed_prefix(s, pos, complete);
    if (complete) {
      out.append(s.substr(pos, n));
    } else {
      out += kReplacement;
    }
    pos += n == 0 ? 1 : n;
  }
  return out;
}

void append_utf8(std::string& out, uint32_t cpt) {  // any cpt <= 0x10FFFF, surrogates too
  if (cpt < 0x80) {
    out += static_cast<char>(cpt);
  } else if (cpt < 0x800) {
    out += static_cast<char>(0xC0 | (cpt >> 6));
    out += static_cast<char>(0x80 | (cpt & 0x3F));
  } else if (cpt < 0x10000) {
    out += static_cast<char>(0xE0 | (cpt >> 12));
    out += static_cast<char>(0x80 | ((cpt >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cpt & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cpt >> 18));
    out += static_cast<char>(0x80 | ((cpt >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cpt >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cpt & 0x3F));
  }
}

// What encode documents to do with text before tokenizing it ("Invalid UTF-8 in `text` is
// tokenized as U+FFFD, byte by byte, like llama.cpp"; unicode.h, utf8_normalize_lenient): a lead
// byte 0xxxxxxx, 110xxxxx, 1110xxxx or 11110xxx followed by enough 10xxxxxx bytes is decoded by
// its bit pattern alone (so overlong forms shrink and surrogates pass), a code point above
// U+10FFFF becomes U+FFFD, and any other byte becomes U+FFFD on its own. Identity on valid UTF-8.
std::string lenient_utf8(std::string_view s) {
  std::string out;
  const auto continuation = [&](size_t i) {
    return i < s.size() && (byte_at(s, i) & 0xC0) == 0x80;
  };
  for (size_t pos = 0; pos < s.size();) {
    const uint8_t b0 = byte_at(s, pos);
    size_t n = 0;
    uint32_t cpt = 0;
    if (b0 < 0x80) {
      n = 1, cpt = b0;
    } else if ((b0 & 0xE0) == 0xC0) {
      n = 2, cpt = b0 & 0x1F;
    } else if ((b0 & 0xF0) == 0xE0) {
      n = 3, cpt = b0 & 0x0F;
    } else if ((b0 & 0xF8) == 0xF0) {
      n = 4, cpt = b0 & 0x07;
    }
    for (size_t i = 1; i < n; ++i) {
      if (!continuation(pos + i)) {
        n = 0;
        break;
      }
      cpt = (cpt << 6) | (byte_at(s, pos + i) & 0x3F);
    }
    if (n == 0) {
      out += kReplacement;
      pos += 1;
      continue;
    }
    append_utf8(out, cpt > 0x10FFFF ? 0xFFFD : cpt);
    pos += n;
  }
  return out;
}

// The GPT-2 byte alphabet (HF bytes_to_unicode): printable Latin-1 bytes stand for themselves,
// the other 68 for U+0100 + n in byte order. Returns the UTF-8 of byte b's character.
std::string gpt2_byte_char(uint8_t b) {
  const auto printable = [](unsigned c) {
    return (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
  };
  uint32_t cpt = b;
  if (!printable(b)) {
    uint32_t n = 0;
    for (unsigned c = 0; c < b; ++c) n += !printable(c);
    cpt = 0x100 + n;
  }
  std::string out;
  append_utf8(out, cpt);
  return out;
}

// ---------------------------------------------------------------------------
// The tokenizer under test

struct Vocabulary {
  Tokenizer tokenizer;
  // Bytes whose byte-level character is a token. Not all are: SmolLM2 has no token for 21 of
  // the 256 (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, 0xF5..0xFF).
  std::array<bool, 256> has_byte_token{};
};

const Vocabulary& vocabulary() {
  // Built once (loading the vocabulary and merges takes seconds under ASan) and immutable after:
  // every Tokenizer method is const. libFuzzer runs inputs on one thread.
  static const Vocabulary vocab = [] {
    std::filesystem::path path = DUET_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (const char* env = std::getenv("DUET_FUZZ_MODEL")) path = env;
    if (!std::filesystem::exists(path)) {
      std::fprintf(stderr,
                   "tokenizer_fuzz: model %s not found: run launch/setup.sh or set "
                   "DUET_FUZZ_MODEL to a GGUF file with a gpt2 tokenizer\n",
                   path.c_str());
      std::exit(77);  // ctest's SKIP_RETURN_CODE
    }
    Vocabulary v{tokenizer_from_gguf(GgufFile::open(path))};
    if (v.tokenizer.model() != "gpt2") {
      // The properties below (lenient UTF-8, byte-level pieces) are those of byte-level BPE.
      std::fprintf(stderr, "tokenizer_fuzz: %s has a '%s' tokenizer; this fuzzer checks 'gpt2'\n",
                   path.c_str(), v.tokenizer.model().c_str());
      std::exit(1);
    }
    for (int b = 0; b < 256; ++b) {
      v.has_byte_token[b] =
          v.tokenizer.find_token(gpt2_byte_char(static_cast<uint8_t>(b))).has_value();
    }
    return v;
  }();
  return vocab;
}

bool in_range(const Tokenizer& tok, TokenId id) { return id >= 0 && size_t(id) < tok.vocab_size(); }

bool is_special(const Tokenizer& tok, TokenId id) {
  const TokenType type = tok.token_type(id);
  return type == TokenType::kControl || type == TokenType::kUnknown;
}

// IncrementalDecoder over `ids`, all in range, must give decode(ids) with ill-formed UTF-8
// replaced by U+FFFD.
void check_incremental(const Tokenizer& tok, const std::vector<TokenId>& ids, bool skip_special) {
  IncrementalDecoder decoder(tok, skip_special);
  std::string streamed;
  for (TokenId id : ids) {
    const std::string part = decoder.push(id);
    DUET_FUZZ_CHECK(is_valid_utf8(part), "push(%d) returned invalid UTF-8", id);
    streamed += part;
  }
  streamed += decoder.flush();
  const std::string expected = replace_ill_formed(tok.decode(ids, skip_special));
  DUET_FUZZ_CHECK(streamed == expected,
                  "IncrementalDecoder (skip_special %d) gave %zu bytes, decode %zu bytes",
                  skip_special, streamed.size(), expected.size());
}

void check_text(const Vocabulary& vocab, std::string_view text) {
  const Tokenizer& tok = vocab.tokenizer;
  const bool valid = is_valid_utf8(text);
  const std::string normalized = lenient_utf8(text);
  DUET_FUZZ_CHECK(!valid || normalized == text,
                  "the reference lenient decoding changed valid text");

  // What decode(encode(text)) gives back. For valid UTF-8 `normalized` is the text itself;
  // invalid bytes come back as encode documents it handles them (U+FFFD for each undecodable
  // byte, see lenient_utf8). One more, documented, loss: a byte whose byte-level character is
  // no token and takes part in no merge is dropped ("llama.cpp falls back to the tokens of the
  // single bytes of the symbol's byte-level text, and drops bytes that have none", tokenizer.cpp
  // encode_word). With SmolLM2 that drops the controls U+0004, U+0006, U+0013, U+0014, U+0016 and
  // U+001D, and the lead bytes F1 and F2 of U+40000..U+BFFFF (leaving their continuation bytes),
  // even from valid UTF-8; the round trip is checked up to that.
  // Special tokens are split out of the raw text before the normalization, per fragment; that
  // matches normalizing the whole text because every special token of this vocabulary is ASCII
  // starting with '<', so no fragment boundary falls inside a lenient sequence.
  std::string round_trip;
  bool lossless = true;
  for (const char c : normalized) {
    if (vocab.has_byte_token[static_cast<uint8_t>(c)]) {
      round_trip += c;
    } else {
      lossless = false;
    }
  }

  // The pre-tokenizer's pieces cover the normalized text exactly, none empty.
  std::string joined;
  for (const std::string& piece : tok.pre_tokenize(text)) {
    DUET_FUZZ_CHECK(!piece.empty(), "pre_tokenize returned an empty piece");
    joined += piece;
  }
  DUET_FUZZ_CHECK(joined == normalized, "pre_tokenize pieces do not cover the text");

  for (const bool parse_special : {false, true}) {
    const std::vector<TokenId> ids = tok.encode(text, /*add_special=*/false, parse_special);
    for (TokenId id : ids) {
      DUET_FUZZ_CHECK(in_range(tok, id), "encode returned id %d of %zu", id, tok.vocab_size());
      // Without parse_special, text that looks like a control token is plain text.
      DUET_FUZZ_CHECK(parse_special || !is_special(tok, id),
                      "encode without parse_special returned control token %d", id);
    }
    if (text.empty()) DUET_FUZZ_CHECK(ids.empty(), "empty text gave tokens");

    // The round trip: exact for valid UTF-8 made of bytes the vocabulary has.
    const std::string decoded = tok.decode(ids);
    DUET_FUZZ_CHECK(decoded == round_trip,
                    "decode(encode(text)) (parse_special %d) differs from the text: %zu bytes "
                    "back for %zu (valid UTF-8: %d, every byte has a token: %d)",
                    parse_special, decoded.size(), round_trip.size(), valid, lossless);
    if (valid && lossless) DUET_FUZZ_CHECK(decoded == text, "round trip of valid UTF-8");

    // add_special only adds BOS/EOS around the same tokens.
    std::vector<TokenId> with_special;
    if (tok.add_bos()) with_special.push_back(*tok.bos_id());
    with_special.insert(with_special.end(), ids.begin(), ids.end());
    if (tok.add_eos()) with_special.push_back(*tok.eos_id());
    DUET_FUZZ_CHECK(tok.encode(text, /*add_special=*/true, parse_special) == with_special,
                    "add_special changed more than BOS/EOS");

    // skip_special drops exactly the control and unknown tokens.
    std::string without_special;
    for (TokenId id : ids) {
      if (!is_special(tok, id)) without_special += tok.token_to_piece(id);
    }
    DUET_FUZZ_CHECK(tok.decode(ids, /*skip_special=*/true) == without_special, "skip_special");

    check_incremental(tok, ids, /*skip_special=*/false);
    check_incremental(tok, ids, /*skip_special=*/true);
  }
}

// Decodes `ids`, taken from the input and possibly out of range.
void check_ids(const Tokenizer& tok, const std::vector<TokenId>& ids) {
  bool any_out = false;
  std::vector<TokenId> valid_ids;
  for (TokenId id : ids) {
    keep(tok.is_end_of_generation(id));
    if (!in_range(tok, id)) {
      any_out = true;
      expect_error(ErrorKind::kInvalidArgument, "token_to_piece",
                   [&] { keep(tok.token_to_piece(id)); });
      expect_error(ErrorKind::kInvalidArgument, "token_text", [&] { keep(tok.token_text(id)); });
      expect_error(ErrorKind::kInvalidArgument, "token_type", [&] { keep(tok.token_type(id)); });
      continue;
    }
    valid_ids.push_back(id);
    const std::string piece = tok.token_to_piece(id);
    DUET_FUZZ_CHECK(tok.decode(std::vector<TokenId>{id}) == piece, "decode({%d})", id);
    DUET_FUZZ_CHECK(tok.find_token(tok.token_text(id)) == id, "find_token(token_text(%d))", id);
    keep(tok.token_type(id));
  }
  for (const bool skip : {false, true}) {
    if (any_out) {
      expect_error(ErrorKind::kInvalidArgument, "decode with an id out of range",
                   [&] { keep(tok.decode(ids, skip)); });
    } else {
      keep(tok.decode(ids, skip));
    }
    // Out-of-range ids are rejected one by one and leave the decoder as it was.
    IncrementalDecoder decoder(tok, skip);
    std::string streamed;
    for (TokenId id : ids) {
      if (in_range(tok, id)) {
        streamed += decoder.push(id);
      } else {
        expect_error(ErrorKind::kInvalidArgument, "IncrementalDecoder::push out of range",
                     [&] { keep(decoder.push(id)); });
      }
    }
    streamed += decoder.flush();
    DUET_FUZZ_CHECK(streamed == replace_ill_formed(tok.decode(valid_ids, skip)),
                    "IncrementalDecoder over arbitrary ids (skip_special %d)", skip);
  }
}

}  // namespace
}  // namespace duet::fuzz

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  duet::fuzz::vocabulary();  // load now, not during the first input
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace duet::fuzz;
  const Vocabulary& vocab = vocabulary();
  const duet::Tokenizer& tok = vocab.tokenizer;
  // An exact-size heap copy, so that ASan catches a read one byte past the end.
  const std::string text(reinterpret_cast<const char*>(data), size);
  check_text(vocab, text);

  // 2 bytes per id, shifted so that negative, in-range and too-large ids all occur.
  std::vector<duet::TokenId> ids;
  for (size_t i = 0; i + 2 <= size && ids.size() < kMaxIds; i += 2) {
    ids.push_back(static_cast<duet::TokenId>(data[i] | (data[i + 1] << 8)) - 1024);
  }
  check_ids(tok, ids);
  // 4 bytes per id: the extremes (INT32_MIN, INT32_MAX, vocab_size() itself...).
  ids.clear();
  for (size_t i = 0; i + 4 <= size && ids.size() < kMaxIds; i += 4) {
    uint32_t raw;
    std::memcpy(&raw, data + i, 4);
    ids.push_back(static_cast<duet::TokenId>(raw));
  }
  check_ids(tok, ids);
  return 0;
}

#include "common/text/unicode.h"

#include <fmt/format.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <array>

#include "common/error.h"

namespace duet {

// ---------------------------------------------------------------------------
// UTF-8

void utf8_append(std::string& out, char32_t cpt) {
  DUET_ASSERT(cpt <= 0x10FFFF, "code point {}", fmt::format("{:#x}", static_cast<uint32_t>(cpt)));
  if (cpt < 0x80) {
    out.push_back(static_cast<char>(cpt));
  } else if (cpt < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cpt >> 6)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else if (cpt < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cpt >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cpt >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cpt >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cpt & 0x3F)));
  }
}

Utf8Step utf8_step(std::string_view text, size_t pos) {
  DUET_ASSERT(pos < text.size());
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const uint8_t b0 = byte_at(pos);
  if (b0 < 0x80) return {Utf8Status::kComplete, 1, b0};

  // Table 3-7 of the Unicode standard: the length and the range of the second byte.
  size_t n = 0;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {Utf8Status::kInvalid, 1, 0};
  }

  char32_t cpt = b0 & (0xFF >> (n + 1));
  for (size_t i = 1; i < n; ++i) {
    if (pos + i >= text.size()) return {Utf8Status::kIncomplete, i, 0};
    const uint8_t b = byte_at(pos + i);
    const uint8_t min = i == 1 ? lo : 0x80;
    const uint8_t max = i == 1 ? hi : 0xBF;
    if (b < min || b > max) return {Utf8Status::kInvalid, i, 0};
    cpt = (cpt << 6) | (b & 0x3F);
  }
  return {Utf8Status::kComplete, n, cpt};
}

bool is_valid_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Step step = utf8_step(text, pos);
    if (step.status != Utf8Status::kComplete) return false;
    pos += step.length;
  }
  return true;
}

std::string utf8_sanitize(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const Utf8Step step = utf8_step(text, pos);
    if (step.status == Utf8Status::kComplete) {
      out.append(text.substr(pos, step.length));
    } else {
      utf8_append(out, kReplacementChar);
    }
    pos += step.length;
  }
  return out;
}

std::string utf8_normalize_lenient(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const auto byte_at = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const auto is_continuation = [&](size_t i) {
    return i < text.size() && (byte_at(i) & 0xC0) == 0x80;
  };
  size_t pos = 0;
  while (pos < text.size()) {
    const uint8_t b0 = byte_at(pos);
    size_t n = 0;  // 0: not decodable
    char32_t cpt = 0;
    if (!(b0 & 0x80)) {
      n = 1;
      cpt = b0;
    } else if (!(b0 & 0x40)) {
      n = 0;  // a stray continuation byte
    } else if (!(b0 & 0x20)) {
      if (is_continuation(pos + 1)) {
        n = 2;
        cpt = (char32_t(b0 & 0x1F) << 6) | (byte_at(pos + 1) & 0x3F);
      }
    } else if (!(b0 & 0x10)) {
      if (is_continuation(pos + 1) && is_continuation(pos + 2)) {
        n = 3;
        cpt = (char32_t(b0 & 0x0F) << 12) | (char32_t(byte_at(pos + 1) & 0x3F) << 6) |
              (byte_at(pos + 2) & 0x3F);
      }
    } else if (!(b0 & 0x08)) {
      if (is_continuation(pos + 1) && is_continuation(pos + 2) && is_continuation(pos + 3)) {
        n = 4;
        cpt = (char32_t(b0 & 0x07) << 18) | (char32_t(byte_at(pos + 1) & 0x3F) << 12) |
              (char32_t(byte_at(pos + 2) & 0x3F) << 6) | (byte_at(pos + 3) & 0x3F);
        // llama.cpp cannot re-encode these and throws; we substitute.
        if (cpt > 0x10FFFF) cpt = kReplacementChar;
      }
    }
    if (n == 0) {
      utf8_append(out, kReplacementChar);
      pos += 1;
    } else {
      utf8_append(out, cpt);
      pos += n;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// GPT-2 byte alphabet

namespace {

constexpr size_t kMaxBpeCpt = 0x100 + 68;  // the last remapped byte lands below this

struct ByteAlphabet {
  std::array<char32_t, 256> cpt{};
  std::array<std::array<char, 2>, 256> utf8{};
  std::array<uint8_t, 256> utf8_len{};
  std::array<int16_t, kMaxBpeCpt> byte_of{};  // -1: not in the alphabet
};

constexpr bool is_printable_byte(unsigned b) {
  return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

constexpr ByteAlphabet make_byte_alphabet() {
  ByteAlphabet a;
  for (auto& b : a.byte_of) b = -1;
  unsigned n = 0;
  for (unsigned b = 0; b < 256; ++b) {
    const char32_t cpt = is_printable_byte(b) ? char32_t(b) : char32_t(0x100 + n++);
    a.cpt[b] = cpt;
    a.byte_of[cpt] = static_cast<int16_t>(b);
    if (cpt < 0x80) {
      a.utf8[b] = {static_cast<char>(cpt), 0};
      a.utf8_len[b] = 1;
    } else {
      a.utf8[b] = {static_cast<char>(0xC0 | (cpt >> 6)), static_cast<char>(0x80 | (cpt & 0x3F))};
      a.utf8_len[b] = 2;
    }
  }
  return a;
}

constexpr ByteAlphabet kByteAlphabet = make_byte_alphabet();
static_assert(kByteAlphabet.cpt[' '] == 0x120);   // 'Ġ'
static_assert(kByteAlphabet.cpt['\n'] == 0x10A);  // 'Ċ'

}  // namespace

char32_t byte_to_bpe_cpt(uint8_t byte) { return kByteAlphabet.cpt[byte]; }

std::string_view byte_to_bpe_char(uint8_t byte) {
  return {kByteAlphabet.utf8[byte].data(), kByteAlphabet.utf8_len[byte]};
}

std::optional<uint8_t> bpe_cpt_to_byte(char32_t cpt) {
  if (cpt >= kMaxBpeCpt || kByteAlphabet.byte_of[cpt] < 0) return std::nullopt;
  return static_cast<uint8_t>(kByteAlphabet.byte_of[cpt]);
}

// ---------------------------------------------------------------------------
// Regex splitting

struct RegexSplitter::Pattern {
  pcre2_code* code = nullptr;
  ~Pattern() { pcre2_code_free(code); }
};

RegexSplitter::RegexSplitter(const std::vector<std::string>& patterns) {
  for (const std::string& source : patterns) {
    int error = 0;
    PCRE2_SIZE error_offset = 0;
    // DOLLAR_ENDONLY: `$` means the end of the piece, as in ECMAScript (llama.cpp's std::regex).
    // MATCH_INVALID_UTF: lenient input may hold surrogates; they simply never match.
    const uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY | PCRE2_MATCH_INVALID_UTF;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(),
                                     options, &error, &error_offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      throw Error(ErrorKind::kInternal,
                  fmt::format("pre-tokenizer regex '{}' does not compile at offset {}: {}", source,
                              error_offset, reinterpret_cast<const char*>(message)));
    }
    auto pattern = std::make_unique<Pattern>();
    pattern->code = code;
    // Without JIT support pcre2_match interprets the pattern: slower, same result.
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
    patterns_.push_back(std::move(pattern));
  }
}

RegexSplitter::~RegexSplitter() = default;
RegexSplitter::RegexSplitter(RegexSplitter&&) noexcept = default;
RegexSplitter& RegexSplitter::operator=(RegexSplitter&&) noexcept = default;

namespace {

struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

// Finds the first match in `piece` at or after `start`; false when there is none.
bool find_match(const pcre2_code* code, std::string_view piece, size_t start,
                pcre2_match_data* data, size_t& match_begin, size_t& match_end) {
  const auto subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  int rc = pcre2_match(code, subject, piece.size(), start, 0, data, nullptr);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    // The JIT's default 32 KiB stack ran out; the interpreter keeps its frames on the heap.
    rc = pcre2_match(code, subject, piece.size(), start, PCRE2_NO_JIT, data, nullptr);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(rc, message, sizeof(message));
    throw Error(ErrorKind::kInternal, fmt::format("pre-tokenizer regex match failed: {}",
                                                  reinterpret_cast<const char*>(message)));
  }
  // rc == 0 only says the ovector is too small for the capture groups; group 0 is there.
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data);
  match_begin = ovector[0];
  match_end = ovector[1];
  return true;
}

}  // namespace

std::vector<std::string_view> RegexSplitter::split(std::string_view text) const {
  std::vector<std::string_view> pieces;
  if (text.empty()) return pieces;
  pieces.push_back(text);

  // Per call, so that concurrent callers never share match state.
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(pcre2_match_data_create(1, nullptr));
  DUET_ASSERT(data != nullptr);

  std::vector<std::string_view> next;
  for (const auto& pattern : patterns_) {
    next.clear();
    next.reserve(pieces.size() * 2);
    for (std::string_view piece : pieces) {
      size_t emitted = 0;  // end of what `next` already covers
      size_t start = 0;    // where the next search begins
      size_t match_begin = 0, match_end = 0;
      while (start < piece.size() &&
             find_match(pattern->code, piece, start, data.get(), match_begin, match_end)) {
        if (match_end == match_begin) {
          // An empty match cuts nothing; step over one character and search on.
          start = match_begin + 1;
          while (start < piece.size() && (static_cast<uint8_t>(piece[start]) & 0xC0) == 0x80) {
            ++start;
          }
          continue;
        }
        if (match_begin > emitted) next.push_back(piece.substr(emitted, match_begin - emitted));
        next.push_back(piece.substr(match_begin, match_end - match_begin));
        emitted = start = match_end;
      }
      if (emitted < piece.size()) next.push_back(piece.substr(emitted));
    }
    pieces.swap(next);
  }
  return pieces;
}

}  // namespace duet

// UTF-8 helpers, the GPT-2 byte-level alphabet and regex splitting for the
// tokenizer's pre-tokenizers.
//
// Regexes run on PCRE2 (UTF + UCP + JIT): \p{L}, \p{N}, \s and lookahead have
// their Unicode meaning without hand-written tables. PCRE2 stays out of this
// header. Everything here is immutable after construction and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

inline constexpr char32_t kReplacementChar = 0xFFFD;  // U+FFFD, "\xEF\xBF\xBD" in UTF-8

// Appends the UTF-8 encoding of `cpt` (must be <= 0x10FFFF).
void utf8_append(std::string& out, char32_t cpt);

enum class Utf8Status {
  kComplete,    // a well-formed sequence of `length` bytes encoding `cpt`
  kIncomplete,  // a well-formed prefix that ran into the end of the input
  kInvalid,     // an ill-formed maximal subpart of `length` bytes (Unicode §3.9)
};

struct Utf8Step {
  Utf8Status status;
  size_t length;  // bytes consumed; >= 1 unless the input at `pos` is empty
  char32_t cpt;   // only for kComplete
};

// Strict decoding of the sequence starting at `text[pos]` (pos < size): no
// overlong forms, no surrogates, nothing above U+10FFFF.
Utf8Step utf8_step(std::string_view text, size_t pos);

// Whether `text` is well-formed UTF-8 from start to end (strict, as utf8_step).
bool is_valid_utf8(std::string_view text);

// `text` with every ill-formed subpart (an incomplete tail included) replaced
// by one U+FFFD: always valid UTF-8.
std::string utf8_sanitize(std::string_view text);

// The lenient decoding llama.cpp applies before pre-tokenizing
// (unicode_cpts_from_utf8 + unicode_cpt_to_utf8): every byte that does not
// start a decodable sequence becomes U+FFFD, decodable sequences are
// re-encoded (which shortens overlong forms). Surrogates pass through, so the
// result is not always strictly valid; the regex splitter accepts that.
std::string utf8_normalize_lenient(std::string_view text);

// The GPT-2 byte-level alphabet (HF `bytes_to_unicode`): every byte maps to a
// printable code point; printable Latin-1 bytes map to themselves, the other
// 68 to U+0100 + n in byte order.
char32_t byte_to_bpe_cpt(uint8_t byte);
// The UTF-8 text of byte_to_bpe_cpt(byte) (1 or 2 bytes).
std::string_view byte_to_bpe_char(uint8_t byte);
// The byte that the code point stands for, or nullopt when it is outside the alphabet.
std::optional<uint8_t> bpe_cpt_to_byte(char32_t cpt);

// Splits text by a list of regexes the way llama.cpp's unicode_regex_split
// does: the first regex cuts the text into its matches and the unmatched gaps
// between them, each following regex cuts every piece the same way again. A
// piece is matched on its own, so lookahead never sees past its end.
class RegexSplitter {
 public:
  // Throws duet::Error(kInternal) when a pattern does not compile (patterns are ours).
  explicit RegexSplitter(const std::vector<std::string>& patterns);
  ~RegexSplitter();
  RegexSplitter(RegexSplitter&&) noexcept;
  RegexSplitter& operator=(RegexSplitter&&) noexcept;
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // The pieces of `text` in order; they are views into `text` and together
  // cover it exactly. Never returns empty pieces.
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  struct Pattern;  // a compiled PCRE2 pattern (immutable, shared by all threads)
  std::vector<std::unique_ptr<Pattern>> patterns_;
};

}  // namespace duet

// A reference UTF-8 validity check for the fuzz targets, written from the Unicode Standard's
// Table 3-7 ("Well-Formed UTF-8 Byte Sequences") and independent of common/text/unicode.cpp, so
// that a fuzzer can check the code under test against it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace duet::fuzz {

// Whether `text` is a sequence of the well-formed byte sequences of Table 3-7:
//
//   code points          first    second   third    fourth
//   U+0000..U+007F       00..7F
//   U+0080..U+07FF       C2..DF   80..BF
//   U+0800..U+0FFF       E0       A0..BF   80..BF
//   U+1000..U+CFFF       E1..EC   80..BF   80..BF
//   U+D000..U+D7FF       ED       80..9F   80..BF
//   U+E000..U+FFFF       EE..EF   80..BF   80..BF
//   U+10000..U+3FFFF     F0       90..BF   80..BF   80..BF
//   U+40000..U+FFFFF     F1..F3   80..BF   80..BF   80..BF
//   U+100000..U+10FFFF   F4       80..8F   80..BF   80..BF
inline bool reference_valid_utf8(std::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(text[i]); };
  const auto in = [](uint8_t b, uint8_t lo, uint8_t hi) { return b >= lo && b <= hi; };
  size_t i = 0;
  while (i < text.size()) {
    const uint8_t b0 = byte(i);
    size_t n = 0;       // bytes in the sequence
    uint8_t lo = 0x80;  // the range of the second byte
    uint8_t hi = 0xBF;
    if (b0 <= 0x7F) {
      n = 1;
    } else if (in(b0, 0xC2, 0xDF)) {
      n = 2;
    } else if (b0 == 0xE0) {
      n = 3;
      lo = 0xA0;
    } else if (in(b0, 0xE1, 0xEC) || in(b0, 0xEE, 0xEF)) {
      n = 3;
    } else if (b0 == 0xED) {
      n = 3;
      hi = 0x9F;
    } else if (b0 == 0xF0) {
      n = 4;
      lo = 0x90;
    } else if (in(b0, 0xF1, 0xF3)) {
      n = 4;
    } else if (b0 == 0xF4) {
      n = 4;
      hi = 0x8F;
    } else {
      return false;  // 80..C1, F5..FF never start a sequence
    }
    if (text.size() - i < n) return false;
    if (n >= 2 && !in(byte(i + 1), lo, hi)) return false;
    for (size_t k = 2; k < n; ++k) {
      if (!in(byte(i + k), 0x80, 0xBF)) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace duet::fuzz

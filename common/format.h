// duet::format: "{}" placeholders filled in order, for error messages in the
// code that also builds where only a compiler and CUDA are installed (the
// core of common/, kernels/ and the model: the GPU checks' build). Values are
// written as a std::ostream writes them, floating point in its shortest
// round-trip form (as fmt does), paths as plain strings. "{{"
// and "}}" are literal braces. A placeholder without a value stays "{}"; a
// value without a placeholder is appended, so a mismatch shows instead of
// throwing.
#pragma once

#include <charconv>
#include <filesystem>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

namespace duet {
namespace format_detail {

// Writes the shortest round-trip digits of a number, given in scientific form
// ("-1.2345e+06", "inf"), as fmt's "{}" writes them: fixed notation for
// exponents in [-4, 16) ("-1234500", "0.0001"), scientific otherwise ("1e+16").
inline void write_shortest(std::ostringstream& out, std::string_view scientific) {
  const size_t e = scientific.find('e');
  if (e == std::string_view::npos) {  // inf, nan
    out << scientific;
    return;
  }
  int exponent = 0;
  const char* first = scientific.data() + e + 1;
  if (*first == '+') ++first;
  std::from_chars(first, scientific.data() + scientific.size(), exponent);
  if (exponent < -4 || exponent >= 16) {
    out << scientific;
    return;
  }
  std::string_view mantissa = scientific.substr(0, e);
  if (mantissa.front() == '-') {
    out << '-';
    mantissa.remove_prefix(1);
  }
  std::string digits(mantissa.substr(0, 1));
  if (mantissa.size() > 2) digits += mantissa.substr(2);  // after the point
  if (exponent < 0) {
    out << "0." << std::string(static_cast<size_t>(-exponent - 1), '0') << digits;
    return;
  }
  const auto n_int = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= n_int) {
    out << digits << std::string(n_int - digits.size(), '0');
  } else {
    out << std::string_view(digits).substr(0, n_int) << '.'
        << std::string_view(digits).substr(n_int);
  }
}

template <typename T>
void write(std::ostringstream& out, const T& value) {
  if constexpr (std::is_same_v<T, std::filesystem::path>) {
    out << value.string();
  } else if constexpr (std::is_same_v<T, bool>) {
    out << (value ? "true" : "false");
  } else if constexpr (std::is_same_v<T, char> || std::is_same_v<T, signed char> ||
                       std::is_same_v<T, unsigned char>) {
    if constexpr (std::is_same_v<T, char>) {
      out << value;
    } else {
      out << static_cast<int>(value);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    char text[64];
    const auto written =
        std::to_chars(text, text + sizeof(text), value, std::chars_format::scientific);
    write_shortest(out, std::string_view(text, static_cast<size_t>(written.ptr - text)));
  } else if constexpr (std::is_enum_v<T>) {
    out << static_cast<std::underlying_type_t<T>>(value);
  } else {
    out << value;
  }
}

// Copies pattern up to its next placeholder into out and consumes both.
inline bool next_placeholder(std::ostringstream& out, std::string_view& pattern) {
  while (!pattern.empty()) {
    const size_t brace = pattern.find_first_of("{}");
    if (brace == std::string_view::npos) break;
    out << pattern.substr(0, brace);
    const bool doubled = brace + 1 < pattern.size() && pattern[brace + 1] == pattern[brace];
    if (doubled) {
      out << pattern[brace];
      pattern.remove_prefix(brace + 2);
      continue;
    }
    if (pattern[brace] == '{' && brace + 1 < pattern.size() && pattern[brace + 1] == '}') {
      pattern.remove_prefix(brace + 2);
      return true;
    }
    out << pattern[brace];
    pattern.remove_prefix(brace + 1);
  }
  out << pattern;
  pattern = {};
  return false;
}

}  // namespace format_detail

template <typename... Args>
std::string format(std::string_view pattern, const Args&... args) {
  std::ostringstream out;
  [[maybe_unused]] auto one = [&](const auto& value) {
    if (!format_detail::next_placeholder(out, pattern)) out << ' ';
    format_detail::write(out, value);
  };
  (one(args), ...);
  while (format_detail::next_placeholder(out, pattern)) out << "{}";
  return out.str();
}

// The items of a range, each written as format writes it, between separators
// (what fmt::join did): join(shape, "x") gives "896x49152".
template <typename Range>
std::string join(const Range& items, std::string_view separator) {
  std::ostringstream out;
  bool first = true;
  for (const auto& item : items) {
    if (!first) out << separator;
    first = false;
    format_detail::write(out, item);
  }
  return out.str();
}

}  // namespace duet

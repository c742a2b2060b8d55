// Bytes written as text and back, for the tests of the cluster key and its
// handshake (cluster_key_test.cpp, cluster_auth_test.cpp).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace duet {

inline std::vector<std::byte> bytes_of(std::string_view text) {
  const auto bytes = std::as_bytes(std::span(text.data(), text.size()));
  return {bytes.begin(), bytes.end()};
}

inline std::string text_of(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

inline std::string hex_of(std::span<const std::byte> bytes) {
  constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  for (std::byte b : bytes) {
    hex += kHex[static_cast<unsigned>(b) >> 4];
    hex += kHex[static_cast<unsigned>(b) & 0xf];
  }
  return hex;
}

}  // namespace duet

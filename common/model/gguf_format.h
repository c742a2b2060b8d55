// The bytes of GGUF values, as both halves of the reader see them: the
// parser (gguf_parser.cpp, the file's binary layout) and the values and file
// (gguf.cpp, typed access). Internal to common/model/; users include gguf.h.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <string>
#include <string_view>

#include "common/model/gguf.h"

namespace duet::gguf_detail {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader copies little-endian values as they are");

// Bytes of one scalar of `type`; 0 for strings and arrays.
inline uint64_t scalar_size(GgufType type) {
  constexpr uint8_t kSizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};  // by GgufType
  const auto raw = static_cast<uint32_t>(type);
  return raw < std::size(kSizes) ? kSizes[raw] : 0;
}

template <typename T>
T load(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

// A scalar's bits as GgufValue keeps them: signed integers sign-extended, the rest zero-extended.
inline uint64_t load_scalar_bits(GgufType type, const uint8_t* p) {
  switch (type) {
    case GgufType::kI8:
      return static_cast<uint64_t>(static_cast<int64_t>(load<int8_t>(p)));
    case GgufType::kI16:
      return static_cast<uint64_t>(static_cast<int64_t>(load<int16_t>(p)));
    case GgufType::kI32:
      return static_cast<uint64_t>(static_cast<int64_t>(load<int32_t>(p)));
    default: {
      uint64_t bits = 0;
      std::memcpy(&bits, p, scalar_size(type));
      return bits;
    }
  }
}

// A key or name as messages show it: quoted, odd bytes escaped, long ones cut short.
std::string shown(std::string_view s);

// A value as messages show it: "i8 -100", "string", "array of 3 u32".
std::string describe(const GgufValue& value);

}  // namespace duet::gguf_detail

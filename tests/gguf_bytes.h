// GGUF's little-endian encoding, appended to a byte vector: what the tests
// that write GGUF files (tests/common/model/gguf_builder.h, tests/f32_twin.h)
// share. Free of GoogleTest, so the GPU checks can use it too.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/model/gguf.h"

namespace duet::testing {

struct GgufBytes {
  std::vector<uint8_t> bytes;

  template <typename T>
  void pod(T value) {
    const auto* p = reinterpret_cast<const uint8_t*>(&value);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void str(std::string_view s) {
    pod<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  void type(GgufType t) { pod(static_cast<uint32_t>(t)); }
  // Zeros up to the next multiple of `alignment`.
  void pad_to(uint64_t alignment) {
    bytes.resize((bytes.size() + alignment - 1) / alignment * alignment, 0);
  }
};

}  // namespace duet::testing

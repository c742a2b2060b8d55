// GGUF files written byte by byte for the reader's tests (gguf_test.cpp,
// gguf_corrupt_test.cpp): a builder of well-formed files to round-trip or to
// corrupt, and checks of the errors the reader throws.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/model/dtype.h"
#include "common/model/gguf.h"
#include "tests/gguf_bytes.h"

namespace duet::gguf_testing {

using Bytes = std::vector<uint8_t>;

// Appends little-endian values as GGUF lays them out.
using ByteWriter = ::duet::testing::GgufBytes;

struct TensorSpec {
  std::string name;
  uint32_t raw_type = 0;
  std::vector<uint64_t> ne;
  Bytes data;  // placed at `offset`, or the next aligned offset
  std::optional<uint64_t> offset;
};

// Builds a GGUF file: header, key-value pairs as added, tensor infos, padding, tensor data.
// The file ends where the last tensor's data ends.
class GgufBuilder {
 public:
  explicit GgufBuilder(uint32_t version = 3) : version_(version) {}

  // One pair; `body` writes the value after its type.
  GgufBuilder& kv(std::string_view key, GgufType type,
                  const std::function<void(ByteWriter&)>& body) {
    kvs_.str(key);
    kvs_.type(type);
    body(kvs_);
    ++n_kv_;
    return *this;
  }
  template <typename T>
  GgufBuilder& scalar(std::string_view key, GgufType type, T value) {
    return kv(key, type, [&](ByteWriter& w) { w.pod(value); });
  }
  GgufBuilder& string(std::string_view key, std::string_view value) {
    return kv(key, GgufType::kString, [&](ByteWriter& w) { w.str(value); });
  }
  template <typename T>
  GgufBuilder& array(std::string_view key, GgufType element, const std::vector<T>& values) {
    return kv(key, GgufType::kArray, [&](ByteWriter& w) {
      w.type(element);
      w.pod<uint64_t>(values.size());
      for (const T& v : values) w.pod(v);
    });
  }
  GgufBuilder& string_array(std::string_view key, const std::vector<std::string>& values) {
    return kv(key, GgufType::kArray, [&](ByteWriter& w) {
      w.type(GgufType::kString);
      w.pod<uint64_t>(values.size());
      for (const auto& v : values) w.str(v);
    });
  }
  GgufBuilder& alignment(uint32_t alignment) {
    alignment_ = alignment;
    return scalar("general.alignment", GgufType::kU32, alignment);
  }
  GgufBuilder& tensor(TensorSpec spec) {
    tensors_.push_back(std::move(spec));
    return *this;
  }

  Bytes build() const {
    ByteWriter w;
    w.bytes = {'G', 'G', 'U', 'F'};
    w.pod(version_);
    w.pod<uint64_t>(tensors_.size());
    w.pod<uint64_t>(n_kv_);
    w.bytes.insert(w.bytes.end(), kvs_.bytes.begin(), kvs_.bytes.end());
    std::vector<uint64_t> offsets;
    uint64_t data_end = 0;
    for (const auto& t : tensors_) {
      const uint64_t offset = t.offset.value_or(align(data_end));
      offsets.push_back(offset);
      data_end = std::max(data_end, offset + t.data.size());
    }
    for (size_t i = 0; i < tensors_.size(); ++i) {
      w.str(tensors_[i].name);
      w.pod<uint32_t>(tensors_[i].ne.size());
      for (uint64_t ne : tensors_[i].ne) w.pod(ne);
      w.pod(tensors_[i].raw_type);
      w.pod(offsets[i]);
    }
    if (tensors_.empty()) return w.bytes;
    const size_t data_start = align(w.bytes.size());
    w.bytes.resize(data_start + data_end);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      std::copy(tensors_[i].data.begin(), tensors_[i].data.end(),
                w.bytes.begin() + data_start + offsets[i]);
    }
    return w.bytes;
  }

 private:
  uint64_t align(uint64_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  uint32_t version_;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t n_kv_ = 0;
  ByteWriter kvs_;
  std::vector<TensorSpec> tensors_;
};

inline Bytes pattern(size_t n, uint8_t seed) {
  Bytes out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(seed + i * 7);
  return out;
}

inline TensorSpec spec(std::string name, DType type, std::vector<uint64_t> ne, uint8_t seed) {
  int64_t n = 1;
  for (uint64_t d : ne) n *= static_cast<int64_t>(d);
  const DTypeTraits traits = dtype_traits(type);
  const auto n_bytes = static_cast<size_t>(n / traits.block_size * traits.type_size);
  return {std::move(name), static_cast<uint32_t>(type), std::move(ne), pattern(n_bytes, seed), {}};
}

inline GgufFile parse(const Bytes& bytes) { return GgufFile::from_bytes("test.gguf", bytes); }

// The duet::Error that `fn` throws (a test failure when it throws none).
inline Error error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no error";
  return Error(ErrorKind::kInternal, "no error");
}

inline Error parse_error(const Bytes& bytes) {
  return error_of([&] { parse(bytes); });
}

inline void expect_error(const Bytes& bytes, ErrorKind kind, uint64_t offset,
                         std::string_view detail) {
  const Error e = parse_error(bytes);
  const std::string message = e.what();
  EXPECT_EQ(e.kind(), kind) << message;
  EXPECT_NE(message.find(fmt::format("test.gguf: offset {}: ", offset)), std::string::npos)
      << message;
  EXPECT_NE(message.find(detail), std::string::npos) << message;
}

inline void patch_u64(Bytes& bytes, size_t at, uint64_t value) {
  std::memcpy(bytes.data() + at, &value, 8);
}

}  // namespace duet::gguf_testing

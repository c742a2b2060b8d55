// A model's F32 twin: the same GGUF file (every key-value pair, every tensor
// in the same order) with each tensor dequantized to F32, general.file_type
// set to ALL_F32. The twin holds exactly the values the quantized weights
// stand for, and the CPU multiplies F32 weights by F32 activations, so its
// forward pass on the twin is the quantized model's without the 8-bit
// rounding of activations that the quantized dot products take (llama.cpp's
// vec_dot_type). The GPU checks use it as the reference both devices are
// measured against: each device's own rounding then shows as its distance
// from the twin, rather than as a distance between the two devices.
//
// Header-only and free of GoogleTest, so the GPU checks (plain executables)
// and the CPU tests share it.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/format.h"
#include "common/model/dtype.h"
#include "common/model/gguf.h"
#include "kernels/cpu/quantize.h"
#include "tests/gguf_bytes.h"

namespace duet::testing {

namespace f32_twin_detail {

inline constexpr uint32_t kAllF32FileType = 0;  // llama.cpp's LLAMA_FTYPE_ALL_F32

struct Writer : GgufBytes {
  // A value as GGUF stores it after its type: scalars by their width,
  // strings by length, arrays by element type, count and elements.
  void value(const GgufValue& v) {
    switch (v.type()) {
      case GgufType::kU8:
        return pod(v.as_u8());
      case GgufType::kI8:
        return pod(v.as_i8());
      case GgufType::kU16:
        return pod(v.as_u16());
      case GgufType::kI16:
        return pod(v.as_i16());
      case GgufType::kU32:
        return pod(v.as_u32());
      case GgufType::kI32:
        return pod(v.as_i32());
      case GgufType::kF32:
        return pod(v.as_f32());
      case GgufType::kBool:
        return pod<uint8_t>(v.as_bool() ? 1 : 0);
      case GgufType::kString:
        return str(v.as_string());
      case GgufType::kU64:
        return pod(v.as_u64());
      case GgufType::kI64:
        return pod(v.as_i64());
      case GgufType::kF64:
        return pod(v.as_f64());
      case GgufType::kArray:
        break;
    }
    type(v.element_type());
    pod<uint64_t>(v.size());
    if (v.element_type() == GgufType::kString) {
      for (const std::string& s : v.strings()) str(s);
    } else if (v.element_type() == GgufType::kArray) {
      for (const GgufValue& a : v.arrays()) value(a);
    } else {
      const std::span<const uint8_t> b = v.element_bytes();
      bytes.insert(bytes.end(), b.begin(), b.end());
    }
  }
};

}  // namespace f32_twin_detail

// Writes `source`'s F32 twin to `out`. Throws duet::Error: kUnsupported for a
// tensor type the CPU cannot dequantize, kInvalidArgument when `out` cannot be
// written.
inline void write_f32_twin(const GgufFile& source, const std::filesystem::path& out) {
  f32_twin_detail::Writer w;
  w.bytes = {'G', 'G', 'U', 'F'};
  w.pod<uint32_t>(3);
  w.pod<uint64_t>(source.tensors().size());
  w.pod<uint64_t>(source.metadata().size());
  for (const GgufKeyValue& kv : source.metadata()) {
    w.str(kv.key);
    if (kv.key == "general.file_type") {
      w.type(GgufType::kU32);
      w.pod(f32_twin_detail::kAllF32FileType);
      continue;
    }
    w.type(kv.value.type());
    w.value(kv.value);
  }
  const uint64_t alignment = source.alignment();
  uint64_t offset = 0;
  for (const GgufTensorInfo& t : source.tensors()) {
    w.str(t.name);
    w.pod<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) w.pod(static_cast<uint64_t>(d));
    w.pod(static_cast<uint32_t>(DType::kF32));
    w.pod(offset);
    offset += (static_cast<uint64_t>(t.n_elements()) * sizeof(float) + alignment - 1) / alignment *
              alignment;
  }
  w.pad_to(alignment);
  for (const GgufTensorInfo& t : source.tensors()) {
    std::vector<float> values(static_cast<size_t>(t.n_elements()));
    cpu::dequantize_row(t.type, t.data, values.data(), t.n_elements());
    const auto* p = reinterpret_cast<const uint8_t*>(values.data());
    w.bytes.insert(w.bytes.end(), p, p + values.size() * sizeof(float));
    w.pad_to(alignment);
  }
  std::ofstream file(out, std::ios::binary | std::ios::trunc);
  file.write(reinterpret_cast<const char*>(w.bytes.data()),
             static_cast<std::streamsize>(w.bytes.size()));
  if (!file.flush())
    throw Error(ErrorKind::kInvalidArgument, format("cannot write the F32 twin {}", out.string()));
}

// A twin in the temporary folder, removed when this goes out of scope.
class F32Twin {
 public:
  explicit F32Twin(const GgufFile& source)
      : path_(std::filesystem::temp_directory_path() /
              format("duet-f32-twin-{}-{}", ::getpid(), source.path().filename().string())) {
    write_f32_twin(source, path_);
  }
  F32Twin(const F32Twin&) = delete;
  F32Twin& operator=(const F32Twin&) = delete;
  ~F32Twin() {
    std::error_code ignored;
    std::filesystem::remove(path_, ignored);
  }

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace duet::testing

// Reader for GGUF model files, versions 2 and 3 (little-endian): "GGUF", u32 version, u64 tensor
// count, u64 metadata count, the metadata pairs, the tensor infos, zero padding up to
// `general.alignment` (default 32), then the data section, where tensor offsets start.
//
// - GgufFile::open maps the file read-only (mmap, MAP_PRIVATE) and parses the header, metadata
//   and tensor infos eagerly. Afterwards a GgufFile is immutable: every accessor is a const
//   lookup, safe to call from any thread.
// - Every read is bounds-checked. A truncated, corrupt or hostile file throws
//   duet::Error(kCorruptFile) naming the file, the byte offset and what is wrong; a well-formed
//   file Duet cannot read (version 1 or > 3, big-endian) kUnsupported; a missing file kNotFound.
//   Parsing allocates at most a small multiple of the file's size; arrays nest at most
//   kGgufMaxArrayDepth deep. Keys and tensor names are unique (any bytes); bools are 0 or 1.
// - Every tensor has 1..4 dimensions, each 0..INT64_MAX with a product that fits int64, a known
//   ggml type, ne[0] a multiple of the type's block size, an offset aligned to alignment(), and
//   all its bytes inside the file. Tensor bytes are not inspected, nor checked for overlap.
#pragma once

#include <bit>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/model/dtype.h"

namespace duet {

// Metadata value types, numbered as in the file.
enum class GgufType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

inline constexpr uint32_t kGgufDefaultAlignment = 32;
inline constexpr int kGgufMaxArrayDepth = 8;  // an array of arrays has depth 2
inline constexpr int kGgufMaxDims = 4;        // GGML_MAX_DIMS

// "u8", "i32", "f32", "bool", "string", "array", ...; "unknown type" for a number GGUF lacks.
std::string_view gguf_type_name(GgufType type);
bool gguf_type_is_integer(GgufType type);

// One metadata value: a scalar, a string, or an array of any of these (arrays may nest).
// A copyable value with no ties to the file it came from.
class GgufValue {
 public:
  GgufType type() const { return type_; }
  bool is_array() const { return type_ == GgufType::kArray; }
  bool is_integer() const { return gguf_type_is_integer(type_); }

  // Scalars of exactly this type; asking for another type is the caller's fault and throws
  // kInvalidArgument (check type() first, or use integer_as / GgufFile's get_*).
  uint8_t as_u8() const { return static_cast<uint8_t>(scalar_bits(GgufType::kU8)); }
  int8_t as_i8() const { return static_cast<int8_t>(scalar_bits(GgufType::kI8)); }
  uint16_t as_u16() const { return static_cast<uint16_t>(scalar_bits(GgufType::kU16)); }
  int16_t as_i16() const { return static_cast<int16_t>(scalar_bits(GgufType::kI16)); }
  uint32_t as_u32() const { return static_cast<uint32_t>(scalar_bits(GgufType::kU32)); }
  int32_t as_i32() const { return static_cast<int32_t>(scalar_bits(GgufType::kI32)); }
  uint64_t as_u64() const { return scalar_bits(GgufType::kU64); }
  int64_t as_i64() const { return static_cast<int64_t>(scalar_bits(GgufType::kI64)); }
  float as_f32() const {
    return std::bit_cast<float>(static_cast<uint32_t>(scalar_bits(GgufType::kF32)));
  }
  double as_f64() const { return std::bit_cast<double>(scalar_bits(GgufType::kF64)); }
  bool as_bool() const { return scalar_bits(GgufType::kBool) != 0; }
  const std::string& as_string() const;

  // Any integer scalar converted to T when its value fits in T; nullopt for a value out of
  // T's range or a value that is not an integer.
  template <typename T>
  std::optional<T> integer_as() const {
    return integer_from_bits<T>(type_, bits_);
  }

  // Arrays (each requires is_array()). size() counts elements of any element type.
  GgufType element_type() const;
  size_t size() const;
  // Element i as a value of its own (a copy; a nested array is copied whole).
  GgufValue element(size_t i) const;
  // The elements of an array of strings / of arrays, without copying.
  const std::vector<std::string>& strings() const;
  const std::vector<GgufValue>& arrays() const;
  // The packed little-endian elements of an array of numbers or bools
  // (size() * element size bytes).
  std::span<const uint8_t> element_bytes() const;

 private:
  friend class GgufParser;
  friend class GgufFile;

  // `bits` holds a numeric or bool scalar of type `type`: unsigned types zero-extended, signed
  // types sign-extended, floats as their IEEE bits.
  template <typename T>
  static std::optional<T> integer_from_bits(GgufType type, uint64_t bits) {
    static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
    switch (type) {
      case GgufType::kU8:
      case GgufType::kU16:
      case GgufType::kU32:
      case GgufType::kU64:
        if (std::in_range<T>(bits)) return static_cast<T>(bits);
        return std::nullopt;
      case GgufType::kI8:
      case GgufType::kI16:
      case GgufType::kI32:
      case GgufType::kI64:
        if (std::in_range<T>(static_cast<int64_t>(bits)))
          return static_cast<T>(static_cast<int64_t>(bits));
        return std::nullopt;
      default:
        return std::nullopt;
    }
  }
  uint64_t scalar_bits(GgufType expected) const;
  void require_array(GgufType expected_element) const;

  GgufType type_ = GgufType::kU8;
  GgufType element_type_ = GgufType::kU8;  // arrays only
  uint64_t bits_ = 0;                      // numeric and bool scalars, as above
  std::string string_;                     // kString
  std::vector<uint8_t> element_bytes_;     // arrays of numbers or bools
  std::vector<std::string> strings_;       // arrays of strings
  std::vector<GgufValue> arrays_;          // arrays of arrays
};

struct GgufKeyValue {
  std::string key;
  GgufValue value;
  uint64_t offset = 0;  // where the pair starts in the file (for messages)
};

struct GgufTensorInfo {
  std::string name;
  DType type = DType::kF32;
  std::vector<int64_t> ne;  // 1..4 dims; ne[0] is the row (input) length, contiguous in memory
  uint64_t offset = 0;      // from the start of the data section; a multiple of the alignment
  uint64_t n_bytes = 0;
  // n_bytes bytes in the mapping (or from_bytes's buffer), owned by the GgufFile and valid
  // for its lifetime, across moves.
  const uint8_t* data = nullptr;

  int64_t n_elements() const {
    int64_t n = 1;
    for (int64_t d : ne) n *= d;  // the parser checked that this cannot overflow
    return n;
  }
};

// A parsed GGUF file that owns its bytes (a read-only mapping or a buffer). Move-only.
class GgufFile {
 public:
  // Maps and parses `path`. Throws kNotFound when it does not exist.
  static GgufFile open(const std::filesystem::path& path);
  // Parses an in-memory file (tests, fuzzing); `name` stands for the path in messages.
  static GgufFile from_bytes(std::string name, std::vector<uint8_t> bytes);

  GgufFile(GgufFile&& other) noexcept;
  GgufFile& operator=(GgufFile&& other) noexcept;
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;
  ~GgufFile();

  const std::filesystem::path& path() const { return path_; }
  const std::string& name() const { return name_; }  // the path as messages show it
  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // start of the data section
  uint64_t file_size() const { return size_; }

  // Every key-value pair, in file order.
  const std::vector<GgufKeyValue>& metadata() const { return metadata_; }
  const GgufValue* find(std::string_view key) const;

  // Typed lookups: nullopt when the key is absent; kCorruptFile when it is present with a
  // type (or a value) that does not fit.
  std::optional<uint32_t> get_u32(std::string_view key) const;  // any integer in range
  std::optional<uint64_t> get_u64(std::string_view key) const;  // any integer in range
  std::optional<float> get_f32(std::string_view key) const;     // f32 or f64
  std::optional<bool> get_bool(std::string_view key) const;
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<std::vector<std::string>> get_string_array(std::string_view key) const;
  std::optional<std::vector<int32_t>> get_i32_array(std::string_view key) const;  // any ints
  std::optional<std::vector<float>> get_f32_array(std::string_view key) const;    // f32, f64

  // Gives back the memory of the whole pages of a mapped file within
  // [data, data + bytes) once nothing reads them any more (a copy replaced
  // them); reading them again maps them again. No effect on in-memory files.
  void drop_pages(const void* data, size_t bytes) const;

  // Tensor infos in file order.
  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find_tensor(std::string_view name) const;
  // Throws kNotFound naming the file and the tensor.
  const GgufTensorInfo& tensor(std::string_view name) const;

 private:
  friend class GgufParser;

  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  using IndexMap = std::unordered_map<std::string, size_t, StringHash, std::equal_to<>>;

  GgufFile() = default;
  void parse();
  void release() noexcept;
  const GgufKeyValue* find_entry(std::string_view key) const;
  [[noreturn]] void fail_type(const GgufKeyValue& entry, std::string_view expected) const;

  std::filesystem::path path_;
  std::string name_;
  void* mapping_ = nullptr;  // owned: munmap'd by release()
  size_t mapping_size_ = 0;
  std::vector<uint8_t> owned_;  // from_bytes's buffer (moves keep its address)
  const uint8_t* bytes_ = nullptr;
  uint64_t size_ = 0;

  uint32_t version_ = 0;
  uint32_t alignment_ = kGgufDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::vector<GgufKeyValue> metadata_;
  IndexMap key_index_;
  std::vector<GgufTensorInfo> tensors_;
  IndexMap tensor_index_;
};

}  // namespace duet

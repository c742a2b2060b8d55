// libFuzzer target for the GGUF reader (common/model/gguf.h).
//
// Each input is a whole file: GgufFile::from_bytes either throws duet::Error (kCorruptFile or
// kUnsupported, naming the file) or returns a file whose every metadata value and tensor info is
// then read through the public API, typed getters included, and checked against gguf.h's
// contract: accessors of the right type succeed and the others throw the documented error,
// tensors have 1..4 dims, a known type, an aligned offset and all their bytes inside the file
// (every byte is read, so that ASan sees any that is not).
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/model/dtype.h"
#include "common/model/gguf.h"
#include "tests/fuzz/fuzz_check.h"

namespace duet::fuzz {
namespace {

constexpr const char* kName = "fuzz.gguf";
constexpr std::string_view kAbsentKey = "\x01no such key";

// Bytes of a scalar, by GgufType number (0 for strings and arrays), written out independently
// of gguf.cpp's table.
uint64_t scalar_bytes(GgufType type) {
  switch (type) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kBool:
      return 1;
    case GgufType::kU16:
    case GgufType::kI16:
      return 2;
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kF32:
      return 4;
    case GgufType::kU64:
    case GgufType::kI64:
    case GgufType::kF64:
      return 8;
    case GgufType::kString:
    case GgufType::kArray:
      return 0;
  }
  DUET_FUZZ_CHECK(false, "unknown GgufType %u in a parsed file", static_cast<unsigned>(type));
  return 0;
}

bool is_integer_type(GgufType type) {
  switch (type) {
    case GgufType::kU8:
    case GgufType::kI8:
    case GgufType::kU16:
    case GgufType::kI16:
    case GgufType::kU32:
    case GgufType::kI32:
    case GgufType::kU64:
    case GgufType::kI64:
      return true;
    default:
      return false;
  }
}

// Calls the accessor, which must succeed when `ok` and throw kInvalidArgument otherwise.
template <typename Fn>
void accessor(bool ok, const char* what, Fn&& fn) {
  if (ok) {
    keep(fn());
  } else {
    expect_error(ErrorKind::kInvalidArgument, what, [&] { keep(fn()); });
  }
}

// integer_as<T> for one T: a value exactly when the value is an integer that fits in T.
template <typename T>
void check_integer_as(const GgufValue& value, std::optional<__int128> exact) {
  const std::optional<T> v = value.integer_as<T>();
  const bool fits =
      exact && *exact >= std::numeric_limits<T>::min() && *exact <= std::numeric_limits<T>::max();
  DUET_FUZZ_CHECK(v.has_value() == fits, "integer_as: has_value %d, expected %d", v.has_value(),
                  fits);
  if (v) DUET_FUZZ_CHECK(static_cast<__int128>(*v) == *exact, "integer_as value");
}

// Reads everything in `value` through its public API; `depth` counts the arrays around it.
void touch_value(const GgufValue& value, int depth) {
  DUET_FUZZ_CHECK(depth <= kGgufMaxArrayDepth, "arrays nest %d deep", depth);
  const GgufType type = value.type();
  DUET_FUZZ_CHECK(static_cast<uint32_t>(type) <= static_cast<uint32_t>(GgufType::kF64),
                  "value type %u", static_cast<unsigned>(type));
  DUET_FUZZ_CHECK(gguf_type_name(type) != "unknown type", "known type without a name");
  DUET_FUZZ_CHECK(value.is_array() == (type == GgufType::kArray), "is_array");
  DUET_FUZZ_CHECK(value.is_integer() == is_integer_type(type), "is_integer");
  DUET_FUZZ_CHECK(gguf_type_is_integer(type) == is_integer_type(type), "gguf_type_is_integer");

  accessor(type == GgufType::kU8, "as_u8", [&] { return value.as_u8(); });
  accessor(type == GgufType::kI8, "as_i8", [&] { return value.as_i8(); });
  accessor(type == GgufType::kU16, "as_u16", [&] { return value.as_u16(); });
  accessor(type == GgufType::kI16, "as_i16", [&] { return value.as_i16(); });
  accessor(type == GgufType::kU32, "as_u32", [&] { return value.as_u32(); });
  accessor(type == GgufType::kI32, "as_i32", [&] { return value.as_i32(); });
  accessor(type == GgufType::kU64, "as_u64", [&] { return value.as_u64(); });
  accessor(type == GgufType::kI64, "as_i64", [&] { return value.as_i64(); });
  accessor(type == GgufType::kF32, "as_f32", [&] { return value.as_f32(); });
  accessor(type == GgufType::kF64, "as_f64", [&] { return value.as_f64(); });
  accessor(type == GgufType::kBool, "as_bool", [&] { return value.as_bool(); });
  accessor(type == GgufType::kString, "as_string", [&] { return value.as_string().size(); });

  // The exact integer, from the typed accessor, to check integer_as against.
  std::optional<__int128> exact;
  switch (type) {
    case GgufType::kU8:
      exact = value.as_u8();
      break;
    case GgufType::kI8:
      exact = value.as_i8();
      break;
    case GgufType::kU16:
      exact = value.as_u16();
      break;
    case GgufType::kI16:
      exact = value.as_i16();
      break;
    case GgufType::kU32:
      exact = value.as_u32();
      break;
    case GgufType::kI32:
      exact = value.as_i32();
      break;
    case GgufType::kU64:
      exact = value.as_u64();
      break;
    case GgufType::kI64:
      exact = value.as_i64();
      break;
    default:
      break;
  }
  check_integer_as<int8_t>(value, exact);
  check_integer_as<uint8_t>(value, exact);
  check_integer_as<int16_t>(value, exact);
  check_integer_as<uint16_t>(value, exact);
  check_integer_as<int32_t>(value, exact);
  check_integer_as<uint32_t>(value, exact);
  check_integer_as<int64_t>(value, exact);
  check_integer_as<uint64_t>(value, exact);

  if (!value.is_array()) {
    expect_error(ErrorKind::kInvalidArgument, "element_type of a scalar",
                 [&] { keep(value.element_type()); });
    expect_error(ErrorKind::kInvalidArgument, "size of a scalar", [&] { keep(value.size()); });
    expect_error(ErrorKind::kInvalidArgument, "element of a scalar",
                 [&] { keep(value.element(0).type()); });
    expect_error(ErrorKind::kInvalidArgument, "strings of a scalar",
                 [&] { keep(value.strings().size()); });
    expect_error(ErrorKind::kInvalidArgument, "arrays of a scalar",
                 [&] { keep(value.arrays().size()); });
    expect_error(ErrorKind::kInvalidArgument, "element_bytes of a scalar",
                 [&] { keep(value.element_bytes().size()); });
    return;
  }

  const GgufType element = value.element_type();
  DUET_FUZZ_CHECK(static_cast<uint32_t>(element) <= static_cast<uint32_t>(GgufType::kF64),
                  "element type %u", static_cast<unsigned>(element));
  const size_t n = value.size();
  const uint64_t element_size = scalar_bytes(element);
  accessor(element == GgufType::kString, "strings", [&] { return value.strings().size(); });
  accessor(element == GgufType::kArray, "arrays", [&] { return value.arrays().size(); });
  accessor(element_size > 0, "element_bytes", [&] { return value.element_bytes().size(); });
  if (element == GgufType::kString) {
    DUET_FUZZ_CHECK(value.strings().size() == n, "strings().size() %zu != size() %zu",
                    value.strings().size(), n);
  } else if (element == GgufType::kArray) {
    DUET_FUZZ_CHECK(value.arrays().size() == n, "arrays().size() != size()");
  } else {
    const std::span<const uint8_t> bytes = value.element_bytes();
    DUET_FUZZ_CHECK(bytes.size() == n * element_size, "element_bytes %zu for %zu elements",
                    bytes.size(), n);
    uint8_t sum = 0;
    for (uint8_t b : bytes) sum += b;
    keep(sum);
  }
  for (size_t i = 0; i < n; ++i) {
    const GgufValue item = value.element(i);
    DUET_FUZZ_CHECK(item.type() == element, "element %zu has type %u, array of %u", i,
                    static_cast<unsigned>(item.type()), static_cast<unsigned>(element));
    if (element == GgufType::kString) {
      DUET_FUZZ_CHECK(item.as_string() == value.strings()[i], "element %zu string", i);
    } else if (element_size > 0) {
      // The element's bytes, loaded independently, must be its scalar's bytes.
      const uint8_t* p = value.element_bytes().data() + i * element_size;
      uint64_t raw = 0;
      std::memcpy(&raw, p, element_size);
      uint64_t got = 0;
      switch (element) {
        case GgufType::kU8:
          got = item.as_u8();
          break;
        case GgufType::kI8:
          got = static_cast<uint8_t>(item.as_i8());
          break;
        case GgufType::kU16:
          got = item.as_u16();
          break;
        case GgufType::kI16:
          got = static_cast<uint16_t>(item.as_i16());
          break;
        case GgufType::kU32:
          got = item.as_u32();
          break;
        case GgufType::kI32:
          got = static_cast<uint32_t>(item.as_i32());
          break;
        case GgufType::kF32:
          got = std::bit_cast<uint32_t>(item.as_f32());
          break;
        case GgufType::kBool:
          got = item.as_bool();
          break;
        case GgufType::kU64:
          got = item.as_u64();
          break;
        case GgufType::kI64:
          got = static_cast<uint64_t>(item.as_i64());
          break;
        case GgufType::kF64:
          got = std::bit_cast<uint64_t>(item.as_f64());
          break;
        default:
          break;
      }
      DUET_FUZZ_CHECK(got == raw, "element %zu: %llx, bytes say %llx", i,
                      static_cast<unsigned long long>(got), static_cast<unsigned long long>(raw));
    }
    touch_value(item, element == GgufType::kArray ? depth + 1 : depth);
  }
  expect_error(ErrorKind::kInvalidArgument, "element(size())",
               [&] { keep(value.element(n).type()); });
}

// A typed getter: nullopt for an absent key; for a present one, a value when `ok`, else
// kCorruptFile.
template <typename Fn>
auto getter(bool present, bool ok, const char* what, Fn&& fn) {
  using Result = decltype(fn());
  if (!present) {
    const Result result = fn();
    DUET_FUZZ_CHECK(!result.has_value(), "%s of an absent key gave a value", what);
    return result;
  }
  if (ok) {
    Result result = fn();
    DUET_FUZZ_CHECK(result.has_value(), "%s gave nullopt for a present key", what);
    return result;
  }
  expect_error(ErrorKind::kCorruptFile, what, [&] { keep(fn().has_value()); });
  return Result{};
}

void touch_getters(const GgufFile& file, std::string_view key) {
  const GgufValue* value = file.find(key);
  const bool present = value != nullptr;
  const GgufType type = present ? value->type() : GgufType::kU8;
  const bool is_array = present && value->is_array();
  const GgufType element = is_array ? value->element_type() : GgufType::kU8;

  const auto u32 = getter(present, present && value->integer_as<uint32_t>().has_value(), "get_u32",
                          [&] { return file.get_u32(key); });
  if (u32) DUET_FUZZ_CHECK(*u32 == *value->integer_as<uint32_t>(), "get_u32 value");
  const auto u64 = getter(present, present && value->integer_as<uint64_t>().has_value(), "get_u64",
                          [&] { return file.get_u64(key); });
  if (u64) DUET_FUZZ_CHECK(*u64 == *value->integer_as<uint64_t>(), "get_u64 value");
  const auto f32 = getter(present, type == GgufType::kF32 || type == GgufType::kF64, "get_f32",
                          [&] { return file.get_f32(key); });
  keep(f32);
  const auto b =
      getter(present, type == GgufType::kBool, "get_bool", [&] { return file.get_bool(key); });
  if (b) DUET_FUZZ_CHECK(*b == value->as_bool(), "get_bool value");
  const auto s = getter(present, type == GgufType::kString, "get_string",
                        [&] { return file.get_string(key); });
  if (s) DUET_FUZZ_CHECK(*s == value->as_string(), "get_string value");
  const auto strings = getter(present, is_array && element == GgufType::kString, "get_string_array",
                              [&] { return file.get_string_array(key); });
  if (strings) DUET_FUZZ_CHECK(*strings == value->strings(), "get_string_array value");

  // get_i32_array: every element an integer that fits in i32.
  bool i32_ok = is_array && is_integer_type(element);
  if (i32_ok) {
    for (size_t i = 0; i < value->size() && i32_ok; ++i) {
      i32_ok = value->element(i).integer_as<int32_t>().has_value();
    }
  }
  const auto ints =
      getter(present, i32_ok, "get_i32_array", [&] { return file.get_i32_array(key); });
  if (ints) {
    DUET_FUZZ_CHECK(ints->size() == value->size(), "get_i32_array size");
    for (size_t i = 0; i < ints->size(); ++i) {
      DUET_FUZZ_CHECK((*ints)[i] == *value->element(i).integer_as<int32_t>(),
                      "get_i32_array element %zu", i);
    }
  }
  const auto floats =
      getter(present, is_array && (element == GgufType::kF32 || element == GgufType::kF64),
             "get_f32_array", [&] { return file.get_f32_array(key); });
  if (floats) DUET_FUZZ_CHECK(floats->size() == value->size(), "get_f32_array size");
}

void touch_tensor(const GgufFile& file, const GgufTensorInfo& tensor) {
  DUET_FUZZ_CHECK(file.find_tensor(tensor.name) == &tensor, "find_tensor");
  DUET_FUZZ_CHECK(&file.tensor(tensor.name) == &tensor, "tensor()");
  DUET_FUZZ_CHECK(!tensor.ne.empty() && tensor.ne.size() <= size_t(kGgufMaxDims), "%zu dims",
                  tensor.ne.size());
  int64_t n_elements = 1;
  for (int64_t d : tensor.ne) {
    DUET_FUZZ_CHECK(d >= 0, "negative dimension");
    DUET_FUZZ_CHECK(!__builtin_mul_overflow(n_elements, d, &n_elements), "n_elements overflows");
  }
  DUET_FUZZ_CHECK(tensor.n_elements() == n_elements, "n_elements()");
  const std::optional<DTypeTraits> traits = dtype_traits(static_cast<uint32_t>(tensor.type));
  DUET_FUZZ_CHECK(traits.has_value(), "unknown tensor type %u", static_cast<unsigned>(tensor.type));
  keep(dtype_name(tensor.type).size());
  DUET_FUZZ_CHECK(tensor.ne[0] % traits->block_size == 0, "ne[0] not a multiple of the block");
  DUET_FUZZ_CHECK(tensor.n_bytes == static_cast<uint64_t>(n_elements / traits->block_size) *
                                        static_cast<uint64_t>(traits->type_size),
                  "n_bytes %llu", static_cast<unsigned long long>(tensor.n_bytes));
  if (n_elements > 0) {
    DUET_FUZZ_CHECK(
        dtype_row_bytes(tensor.type, tensor.ne[0]) * (n_elements / tensor.ne[0]) == tensor.n_bytes,
        "dtype_row_bytes disagrees with n_bytes");
  }
  DUET_FUZZ_CHECK(tensor.offset % file.alignment() == 0, "unaligned offset");
  DUET_FUZZ_CHECK(tensor.data != nullptr, "null data");
  DUET_FUZZ_CHECK(file.data_offset() <= file.file_size() &&
                      tensor.offset <= file.file_size() - file.data_offset() &&
                      tensor.n_bytes <= file.file_size() - file.data_offset() - tensor.offset,
                  "tensor bytes past the end of the file");
  // Every byte: ASan reports any outside from_bytes's buffer.
  uint8_t sum = 0;
  for (uint64_t i = 0; i < tensor.n_bytes; ++i) sum += tensor.data[i];
  keep(sum);
}

void touch_file(const GgufFile& file, size_t size) {
  DUET_FUZZ_CHECK(file.name() == kName, "name");
  DUET_FUZZ_CHECK(file.version() == 2 || file.version() == 3, "version %u", file.version());
  DUET_FUZZ_CHECK(file.file_size() == size, "file_size");
  const uint32_t alignment = file.alignment();
  DUET_FUZZ_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, "alignment %u", alignment);
  DUET_FUZZ_CHECK(file.data_offset() % alignment == 0, "data_offset unaligned");

  for (const GgufKeyValue& entry : file.metadata()) {
    DUET_FUZZ_CHECK(file.find(entry.key) == &entry.value, "find() of a key in metadata()");
    DUET_FUZZ_CHECK(entry.offset < size, "entry offset past the end");
    touch_value(entry.value, 0);
    touch_getters(file, entry.key);
  }
  if (const GgufValue* value = file.find("general.alignment")) {
    DUET_FUZZ_CHECK(value->integer_as<uint32_t>() == alignment, "general.alignment");
  } else {
    DUET_FUZZ_CHECK(alignment == kGgufDefaultAlignment, "default alignment");
  }
  if (file.find(kAbsentKey) == nullptr) touch_getters(file, kAbsentKey);

  for (const GgufTensorInfo& tensor : file.tensors()) touch_tensor(file, tensor);
  if (file.find_tensor(kAbsentKey) == nullptr) {
    expect_error(ErrorKind::kNotFound, "tensor() of an absent name",
                 [&] { keep(&file.tensor(kAbsentKey)); });
  }
}

}  // namespace
}  // namespace duet::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace duet::fuzz;
  // An exact-size heap buffer, so that ASan catches a read one byte past the end.
  std::vector<uint8_t> bytes(data, data + size);
  std::optional<duet::GgufFile> file;
  try {
    file.emplace(duet::GgufFile::from_bytes(kName, std::move(bytes)));
  } catch (const duet::Error& error) {
    require_not_internal(error);
    DUET_FUZZ_CHECK(error.kind() == duet::ErrorKind::kCorruptFile ||
                        error.kind() == duet::ErrorKind::kUnsupported,
                    "from_bytes threw %s: %s", duet::error_kind_name(error.kind()).data(),
                    error.what());
    DUET_FUZZ_CHECK(std::string_view(error.what()).starts_with(kName),
                    "the message does not name the file: %s", error.what());
    return 0;
  }
  // Tensor data pointers stay valid across moves (gguf.h's contract): move, then read it all.
  std::vector<const uint8_t*> pointers;
  for (const auto& tensor : file->tensors()) pointers.push_back(tensor.data);
  const duet::GgufFile moved = std::move(*file);
  file.reset();
  for (size_t i = 0; i < pointers.size(); ++i) {
    DUET_FUZZ_CHECK(moved.tensors()[i].data == pointers[i], "a move changed tensor data");
  }
  touch_file(moved, size);
  return 0;
}

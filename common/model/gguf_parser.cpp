// GGUF's binary layout, read front to back into a GgufFile
// (common/model/gguf.h): the header, the metadata, the tensor table, each
// count and length checked against the bytes left before anything is
// allocated.
#include <algorithm>
#include <limits>
#include <utility>

#include "common/error.h"
#include "common/model/gguf.h"
#include "common/model/gguf_format.h"

namespace duet {
namespace {

using gguf_detail::describe;
using gguf_detail::load;
using gguf_detail::load_scalar_bits;
using gguf_detail::scalar_size;
using gguf_detail::shown;

// The fewest bytes each item can take, to cap counts by the bytes left before allocating.
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;            // key length, type, one u8
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, ne, type, off
constexpr uint64_t kMinStringBytes = 8;                      // length
constexpr uint64_t kMinNestedArrayBytes = 4 + 8;             // element type, length
// Counts are checked against the bytes left, but an entry in memory can be several times its
// size in the file: reserve at most this many up front and let a longer list grow as it parses.
constexpr uint64_t kMaxReserve = 1 << 16;

bool is_known_type(uint32_t raw) { return raw <= static_cast<uint32_t>(GgufType::kF64); }

// Reads front to back. Every read checks the bytes left first; a failure throws kCorruptFile
// naming the file, the offset and the current context ("metadata key 'x'", "tensor 'y'").
class Cursor {
 public:
  Cursor(const uint8_t* data, uint64_t size, const std::string& name)
      : data_(data), size_(size), name_(name) {}

  uint64_t offset() const { return pos_; }
  uint64_t left() const { return size_ - pos_; }
  void set_context(std::string context) { context_ = std::move(context); }

  // `what` names the field in messages; a literal, so that the hot path formats nothing.
  const uint8_t* take(uint64_t n, const char* what) {
    if (n > left()) fail(pos_, "need {} bytes for {}, but only {} are left", n, what, left());
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }

  template <typename T>
  T read(const char* what) {
    return load<T>(take(sizeof(T), what));
  }

  std::string read_string(const char* what) {
    const uint64_t at = pos_;
    const uint64_t length = read<uint64_t>("a string length");
    if (length > left()) fail(at, "{} length {} exceeds the {} bytes left", what, length, left());
    const auto* p = reinterpret_cast<const char*>(take(length, what));
    return std::string(p, length);
  }

  template <typename... Args>
  [[noreturn]] void fail(uint64_t at, std::string_view pattern, const Args&... args) const {
    fail_as(ErrorKind::kCorruptFile, at, duet::format(pattern, args...));
  }

  [[noreturn]] void fail_as(ErrorKind kind, uint64_t at, const std::string& what) const {
    std::string message = duet::format("{}: offset {}: ", name_, at);
    if (!context_.empty()) message += context_ + ": ";
    throw Error(kind, message + what);
  }

 private:
  const uint8_t* data_;
  uint64_t size_;
  uint64_t pos_ = 0;
  const std::string& name_;
  std::string context_;
};

}  // namespace

// Fills a GgufFile from its bytes (file_.bytes_, file_.size_), or throws.
class GgufParser {
 public:
  explicit GgufParser(GgufFile& file) : file_(file), cursor_(file.bytes_, file.size_, file.name_) {}

  void parse() {
    Cursor& c = cursor_;
    if (c.left() < 4) c.fail(0, "the file is {} bytes, too short for a GGUF header", c.left());
    const uint8_t* magic = c.take(4, "the magic");
    if (std::memcmp(magic, "GGUF", 4) != 0) {
      c.fail(0, "not a GGUF file (magic {}, expected 'GGUF')",
             shown({reinterpret_cast<const char*>(magic), 4}));
    }
    file_.version_ = c.read<uint32_t>("the version");
    check_version(file_.version_);
    const uint64_t n_tensors = c.read<uint64_t>("the tensor count");
    const uint64_t n_kv = c.read<uint64_t>("the metadata count");
    if (n_tensors > c.left() / kMinTensorInfoBytes) {
      c.fail(8, "tensor count {} cannot fit in the {} bytes left ({} bytes per tensor at least)",
             n_tensors, c.left(), kMinTensorInfoBytes);
    }
    if (n_kv > c.left() / kMinKeyValueBytes) {
      c.fail(16, "metadata count {} cannot fit in the {} bytes left ({} bytes per pair at least)",
             n_kv, c.left(), kMinKeyValueBytes);
    }
    for (uint64_t i = 0; i < n_kv; ++i) parse_key_value(i);
    c.set_context("");
    read_alignment();

    std::vector<uint64_t> offset_fields;  // where each tensor's offset is, for messages
    offset_fields.reserve(std::min(n_tensors, kMaxReserve));
    file_.tensors_.reserve(std::min(n_tensors, kMaxReserve));
    for (uint64_t i = 0; i < n_tensors; ++i) parse_tensor_info(i, offset_fields);
    c.set_context("");
    place_tensors(offset_fields);
  }

 private:
  void check_version(uint32_t version) const {
    if (version == 2 || version == 3) return;
    if (version == 1) {
      cursor_.fail_as(ErrorKind::kUnsupported, 4,
                      "GGUF version 1 (32-bit counts) is obsolete and not supported; "
                      "re-convert the model with a current llama.cpp");
    }
    const uint32_t swapped = __builtin_bswap32(version);
    if (swapped == 2 || swapped == 3) {
      cursor_.fail_as(ErrorKind::kUnsupported, 4,
                      duet::format("a big-endian GGUF file (version {} byte-swapped); Duet reads "
                                   "little-endian files only",
                                   swapped));
    }
    cursor_.fail_as(
        ErrorKind::kUnsupported, 4,
        duet::format("GGUF version {} is not supported (Duet reads versions 2 and 3)", version));
  }

  void parse_key_value(uint64_t index) {
    Cursor& c = cursor_;
    const uint64_t at = c.offset();
    c.set_context(duet::format("metadata pair #{}", index));
    std::string key = c.read_string("key");
    c.set_context(duet::format("metadata key {}", shown(key)));
    const uint64_t type_at = c.offset();
    const uint32_t raw_type = c.read<uint32_t>("the value type");
    if (!is_known_type(raw_type)) c.fail(type_at, "unknown value type {}", raw_type);
    GgufValue value = parse_value(static_cast<GgufType>(raw_type), 0);
    const auto [it, inserted] = file_.key_index_.try_emplace(key, file_.metadata_.size());
    if (!inserted) {
      c.fail(at, "duplicate key (first at offset {})", file_.metadata_[it->second].offset);
    }
    file_.metadata_.push_back(GgufKeyValue{std::move(key), std::move(value), at});
  }

  // `depth` counts the arrays around this value.
  GgufValue parse_value(GgufType type, int depth) {
    Cursor& c = cursor_;
    GgufValue value;
    value.type_ = type;
    if (type == GgufType::kString) {
      value.string_ = c.read_string("string");
    } else if (type == GgufType::kArray) {
      parse_array(value, depth + 1);
    } else {
      const uint64_t at = c.offset();
      const uint8_t* p = c.take(scalar_size(type), "the value");
      if (type == GgufType::kBool && *p > 1) c.fail(at, "bool value {} is not 0 or 1", *p);
      value.bits_ = load_scalar_bits(type, p);
    }
    return value;
  }

  // Reads element type, length and elements into `array` (type_ already kArray).
  void parse_array(GgufValue& array, int depth) {
    Cursor& c = cursor_;
    if (depth > kGgufMaxArrayDepth) {
      c.fail(c.offset(), "arrays nest deeper than {} levels", kGgufMaxArrayDepth);
    }
    const uint64_t type_at = c.offset();
    const uint32_t raw_type = c.read<uint32_t>("the array element type");
    if (!is_known_type(raw_type)) c.fail(type_at, "unknown array element type {}", raw_type);
    const auto element = static_cast<GgufType>(raw_type);
    const uint64_t count_at = c.offset();
    const uint64_t count = c.read<uint64_t>("the array length");
    const uint64_t min_size = element == GgufType::kString  ? kMinStringBytes
                              : element == GgufType::kArray ? kMinNestedArrayBytes
                                                            : scalar_size(element);
    if (count > c.left() / min_size) {
      c.fail(count_at,
             "array length {} exceeds what the {} bytes left can hold ({} bytes per {} "
             "at least)",
             count, c.left(), min_size, gguf_type_name(element));
    }
    array.element_type_ = element;
    if (element == GgufType::kString) {
      array.strings_.reserve(std::min(count, kMaxReserve));
      for (uint64_t i = 0; i < count; ++i) array.strings_.push_back(c.read_string("string"));
    } else if (element == GgufType::kArray) {
      array.arrays_.reserve(std::min(count, kMaxReserve));
      for (uint64_t i = 0; i < count; ++i) {
        GgufValue nested;
        nested.type_ = GgufType::kArray;
        parse_array(nested, depth + 1);
        array.arrays_.push_back(std::move(nested));
      }
    } else {
      const uint64_t n_bytes = count * min_size;  // cannot overflow: checked against left()
      const uint64_t at = c.offset();
      const uint8_t* p = c.take(n_bytes, "the array elements");
      if (element == GgufType::kBool) {
        for (uint64_t i = 0; i < count; ++i) {
          if (p[i] > 1) c.fail(at + i, "bool array element {} is {}, not 0 or 1", i, p[i]);
        }
      }
      array.element_bytes_.assign(p, p + n_bytes);
    }
  }

  void read_alignment() {
    const GgufKeyValue* entry = file_.find_entry("general.alignment");
    if (entry == nullptr) return;
    const std::optional<uint32_t> alignment = entry->value.integer_as<uint32_t>();
    if (!alignment) {
      cursor_.fail(entry->offset, "general.alignment is {}, expected a u32",
                   describe(entry->value));
    }
    if (*alignment == 0 || !std::has_single_bit(*alignment)) {
      cursor_.fail(entry->offset, "general.alignment {} is not a power of two", *alignment);
    }
    file_.alignment_ = *alignment;
  }

  void parse_tensor_info(uint64_t index, std::vector<uint64_t>& offset_fields) {
    Cursor& c = cursor_;
    c.set_context(duet::format("tensor info #{}", index));
    const uint64_t name_at = c.offset();
    GgufTensorInfo tensor;
    tensor.name = c.read_string("tensor name");
    c.set_context(duet::format("tensor {}", shown(tensor.name)));
    const uint64_t dims_at = c.offset();
    const uint32_t n_dims = c.read<uint32_t>("the dimension count");
    if (n_dims == 0 || n_dims > kGgufMaxDims) {
      c.fail(dims_at, "{} dimensions, expected 1 to {}", n_dims, kGgufMaxDims);
    }
    int64_t n_elements = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne_at = c.offset();
      const uint64_t ne = c.read<uint64_t>("a dimension");
      if (ne > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        c.fail(ne_at, "ne[{}] is {}, negative as int64", d, static_cast<int64_t>(ne));
      }
      if (__builtin_mul_overflow(n_elements, static_cast<int64_t>(ne), &n_elements)) {
        c.fail(ne_at, "the element count overflows int64 at ne[{}] = {}", d, ne);
      }
      tensor.ne.push_back(static_cast<int64_t>(ne));
    }
    const uint64_t type_at = c.offset();
    const uint32_t raw_type = c.read<uint32_t>("the tensor type");
    const std::optional<DTypeTraits> traits = dtype_traits(raw_type);
    if (!traits) c.fail(type_at, "unknown ggml type {}", raw_type);
    tensor.type = static_cast<DType>(raw_type);
    if (tensor.ne[0] % traits->block_size != 0) {
      c.fail(type_at, "ne[0] = {} is not a multiple of the {} block size {}", tensor.ne[0],
             traits->name, traits->block_size);
    }
    const auto n_blocks = static_cast<uint64_t>(n_elements / traits->block_size);
    if (__builtin_mul_overflow(n_blocks, static_cast<uint64_t>(traits->type_size),
                               &tensor.n_bytes)) {
      c.fail(type_at, "the byte size of {} {} blocks overflows", n_blocks, traits->name);
    }
    offset_fields.push_back(c.offset());
    tensor.offset = c.read<uint64_t>("the data offset");
    const auto [it, inserted] = file_.tensor_index_.try_emplace(tensor.name, file_.tensors_.size());
    if (!inserted) c.fail(name_at, "duplicate tensor name (first is tensor #{})", it->second);
    file_.tensors_.push_back(std::move(tensor));
  }

  // Aligns the data section and points each tensor into it.
  void place_tensors(const std::vector<uint64_t>& offset_fields) {
    Cursor& c = cursor_;
    const uint64_t infos_end = c.offset();
    const uint64_t alignment = file_.alignment_;
    file_.data_offset_ = infos_end + (alignment - infos_end % alignment) % alignment;
    if (file_.tensors_.empty()) return;
    if (file_.data_offset_ > file_.size_) {
      c.fail(infos_end,
             "the data section would start at offset {} (aligned to {}), past the end "
             "of the {}-byte file",
             file_.data_offset_, alignment, file_.size_);
    }
    const uint64_t data_size = file_.size_ - file_.data_offset_;
    for (size_t i = 0; i < file_.tensors_.size(); ++i) {
      GgufTensorInfo& tensor = file_.tensors_[i];
      c.set_context(duet::format("tensor {}", shown(tensor.name)));
      if (tensor.offset % alignment != 0) {
        c.fail(offset_fields[i], "data offset {} is not a multiple of the alignment {}",
               tensor.offset, alignment);
      }
      if (tensor.offset > data_size || tensor.n_bytes > data_size - tensor.offset) {
        c.fail(offset_fields[i],
               "{} bytes at data offset {} run past the end of the {}-byte data "
               "section (truncated file?)",
               tensor.n_bytes, tensor.offset, data_size);
      }
      tensor.data = file_.bytes_ + file_.data_offset_ + tensor.offset;
    }
  }

  GgufFile& file_;
  Cursor cursor_;
};

void GgufFile::parse() { GgufParser(*this).parse(); }

}  // namespace duet

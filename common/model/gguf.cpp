#include "common/model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <system_error>

#include "common/error.h"

namespace duet {

static_assert(std::endian::native == std::endian::little,
              "the GGUF reader copies little-endian values as they are");

namespace {

// The fewest bytes each item can take, to cap counts by the bytes left before allocating.
constexpr uint64_t kMinKeyValueBytes = 8 + 4 + 1;            // key length, type, one u8
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;  // name length, n_dims, ne, type, off
constexpr uint64_t kMinStringBytes = 8;                      // length
constexpr uint64_t kMinNestedArrayBytes = 4 + 8;             // element type, length
// Counts are checked against the bytes left, but an entry in memory can be several times its
// size in the file: reserve at most this many up front and let a longer list grow as it parses.
constexpr uint64_t kMaxReserve = 1 << 16;

bool is_known_type(uint32_t raw) { return raw <= static_cast<uint32_t>(GgufType::kF64); }

// Bytes of one scalar of `type`; 0 for strings and arrays.
uint64_t scalar_size(GgufType type) {
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
uint64_t load_scalar_bits(GgufType type, const uint8_t* p) {
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
std::string shown(std::string_view s) {
  constexpr size_t kMaxShown = 80;
  std::string out = "'";
  for (size_t i = 0; i < s.size() && i < kMaxShown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    }
  }
  out += "'";
  if (s.size() > kMaxShown) out += duet::format(" (cut from {} bytes)", s.size());
  return out;
}

// A value as messages show it: "i8 -100", "string", "array of 3 u32".
std::string describe(const GgufValue& value) {
  const std::string_view name = gguf_type_name(value.type());
  if (value.is_array()) {
    return duet::format("array of {} {}", value.size(), gguf_type_name(value.element_type()));
  }
  if (auto v = value.integer_as<int64_t>()) return duet::format("{} {}", name, *v);
  if (auto v = value.integer_as<uint64_t>()) return duet::format("{} {}", name, *v);
  if (value.type() == GgufType::kF32) return duet::format("f32 {}", value.as_f32());
  if (value.type() == GgufType::kF64) return duet::format("f64 {}", value.as_f64());
  if (value.type() == GgufType::kBool) return duet::format("bool {}", value.as_bool());
  return std::string(name);
}

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

std::string_view gguf_type_name(GgufType type) {
  constexpr std::string_view kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                         "bool", "string", "array", "u64", "i64", "f64"};
  const auto raw = static_cast<uint32_t>(type);
  return raw < std::size(kNames) ? kNames[raw] : "unknown type";
}

bool gguf_type_is_integer(GgufType type) {
  return scalar_size(type) > 0 && type != GgufType::kBool && type != GgufType::kF32 &&
         type != GgufType::kF64;
}

uint64_t GgufValue::scalar_bits(GgufType expected) const {
  DUET_REQUIRE(type_ == expected, "GGUF value is {}, not {}", gguf_type_name(type_),
               gguf_type_name(expected));
  return bits_;
}

const std::string& GgufValue::as_string() const {
  DUET_REQUIRE(type_ == GgufType::kString, "GGUF value is {}, not string", gguf_type_name(type_));
  return string_;
}

GgufType GgufValue::element_type() const {
  DUET_REQUIRE(is_array(), "GGUF value is {}, not an array", gguf_type_name(type_));
  return element_type_;
}

size_t GgufValue::size() const {
  switch (element_type()) {
    case GgufType::kString:
      return strings_.size();
    case GgufType::kArray:
      return arrays_.size();
    default:
      return element_bytes_.size() / scalar_size(element_type_);
  }
}

GgufValue GgufValue::element(size_t i) const {
  const size_t n = size();
  DUET_REQUIRE(i < n, "index {} is out of range for an array of {} elements", i, n);
  if (element_type_ == GgufType::kArray) return arrays_[i];
  GgufValue value;
  value.type_ = element_type_;
  if (element_type_ == GgufType::kString) {
    value.string_ = strings_[i];
  } else {
    value.bits_ =
        load_scalar_bits(element_type_, element_bytes_.data() + i * scalar_size(element_type_));
  }
  return value;
}

void GgufValue::require_array(GgufType expected_element) const {
  DUET_REQUIRE(is_array() && element_type_ == expected_element,
               "GGUF value is {}, not an array of {}", describe(*this),
               gguf_type_name(expected_element));
}

const std::vector<std::string>& GgufValue::strings() const {
  require_array(GgufType::kString);
  return strings_;
}

const std::vector<GgufValue>& GgufValue::arrays() const {
  require_array(GgufType::kArray);
  return arrays_;
}

std::span<const uint8_t> GgufValue::element_bytes() const {
  DUET_REQUIRE(is_array() && scalar_size(element_type_) > 0,
               "GGUF value is {}, not an array of numbers or bools", describe(*this));
  return element_bytes_;
}

GgufFile GgufFile::open(const std::filesystem::path& path) {
  GgufFile file;
  file.path_ = path;
  file.name_ = path.string();
  const auto fail = [&](ErrorKind kind, std::string_view what) {
    throw Error(kind, duet::format("{}: {}", file.name_, what));
  };
  const auto system_message = [](int err) { return std::generic_category().message(err); };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT || errno == ENOTDIR) fail(ErrorKind::kNotFound, "no such file");
    fail(ErrorKind::kInvalidArgument, "cannot open: " + system_message(errno));
  }
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0)
    fail(ErrorKind::kInvalidArgument, "cannot stat: " + system_message(errno));
  if (!S_ISREG(st.st_mode)) fail(ErrorKind::kInvalidArgument, "not a regular file");
  file.size_ = static_cast<uint64_t>(st.st_size);
  if (file.size_ > 0) {  // mmap rejects length 0; an empty file fails parsing below
    void* mapping = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) {
      fail(ErrorKind::kInvalidArgument,
           duet::format("cannot map {} bytes: {}", file.size_, system_message(errno)));
    }
    file.mapping_ = mapping;
    file.mapping_size_ = file.size_;
    file.bytes_ = static_cast<const uint8_t*>(mapping);
  }
  file.parse();
  return file;
}

GgufFile GgufFile::from_bytes(std::string name, std::vector<uint8_t> bytes) {
  GgufFile file;
  file.path_ = name;
  file.name_ = std::move(name);
  file.owned_ = std::move(bytes);
  file.bytes_ = file.owned_.data();
  file.size_ = file.owned_.size();
  file.parse();
  return file;
}

void GgufFile::parse() { GgufParser(*this).parse(); }

GgufFile::GgufFile(GgufFile&& other) noexcept { *this = std::move(other); }

GgufFile& GgufFile::operator=(GgufFile&& other) noexcept {
  if (this == &other) return *this;
  release();
  path_ = std::move(other.path_);
  name_ = std::move(other.name_);
  mapping_ = std::exchange(other.mapping_, nullptr);
  mapping_size_ = std::exchange(other.mapping_size_, 0);
  owned_ = std::move(other.owned_);  // steals the buffer: tensor data pointers stay valid
  bytes_ = std::exchange(other.bytes_, nullptr);
  size_ = std::exchange(other.size_, 0);
  version_ = other.version_;
  alignment_ = other.alignment_;
  data_offset_ = other.data_offset_;
  metadata_ = std::move(other.metadata_);
  key_index_ = std::move(other.key_index_);
  tensors_ = std::move(other.tensors_);
  tensor_index_ = std::move(other.tensor_index_);
  return *this;
}

GgufFile::~GgufFile() { release(); }

void GgufFile::release() noexcept {
  if (mapping_ != nullptr) ::munmap(mapping_, mapping_size_);
  mapping_ = nullptr;
  mapping_size_ = 0;
}

const GgufKeyValue* GgufFile::find_entry(std::string_view key) const {
  const auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &metadata_[it->second];
}

const GgufValue* GgufFile::find(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  return entry == nullptr ? nullptr : &entry->value;
}

void GgufFile::fail_type(const GgufKeyValue& entry, std::string_view expected) const {
  throw Error(ErrorKind::kCorruptFile,
              duet::format("{}: offset {}: metadata key {} is {}, expected {}", name_, entry.offset,
                           shown(entry.key), describe(entry.value), expected));
}

std::optional<uint32_t> GgufFile::get_u32(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  if (auto value = entry->value.integer_as<uint32_t>()) return value;
  fail_type(*entry, "an integer that fits in u32");
}

std::optional<uint64_t> GgufFile::get_u64(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  if (auto value = entry->value.integer_as<uint64_t>()) return value;
  fail_type(*entry, "an integer that fits in u64");
}

std::optional<float> GgufFile::get_f32(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  if (entry->value.type() == GgufType::kF32) return entry->value.as_f32();
  if (entry->value.type() == GgufType::kF64) return static_cast<float>(entry->value.as_f64());
  fail_type(*entry, "f32 or f64");
}

std::optional<bool> GgufFile::get_bool(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  if (entry->value.type() == GgufType::kBool) return entry->value.as_bool();
  fail_type(*entry, "bool");
}

std::optional<std::string> GgufFile::get_string(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  if (entry->value.type() == GgufType::kString) return entry->value.as_string();
  fail_type(*entry, "string");
}

std::optional<std::vector<std::string>> GgufFile::get_string_array(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  const GgufValue& value = entry->value;
  if (value.is_array() && value.element_type() == GgufType::kString) return value.strings();
  fail_type(*entry, "an array of strings");
}

std::optional<std::vector<int32_t>> GgufFile::get_i32_array(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  const GgufValue& value = entry->value;
  if (!value.is_array() || !gguf_type_is_integer(value.element_type())) {
    fail_type(*entry, "an array of integers");
  }
  const GgufType element = value.element_type();
  const uint64_t element_size = scalar_size(element);
  const std::span<const uint8_t> bytes = value.element_bytes();
  std::vector<int32_t> out(value.size());
  for (size_t i = 0; i < out.size(); ++i) {
    const uint64_t bits = load_scalar_bits(element, bytes.data() + i * element_size);
    const std::optional<int32_t> v = GgufValue::integer_from_bits<int32_t>(element, bits);
    if (!v) fail_type(*entry, duet::format("integers that fit in i32 (element {} does not)", i));
    out[i] = *v;
  }
  return out;
}

std::optional<std::vector<float>> GgufFile::get_f32_array(std::string_view key) const {
  const GgufKeyValue* entry = find_entry(key);
  if (entry == nullptr) return std::nullopt;
  const GgufValue& value = entry->value;
  const GgufType element = value.is_array() ? value.element_type() : GgufType::kU8;
  if (!value.is_array() || (element != GgufType::kF32 && element != GgufType::kF64)) {
    fail_type(*entry, "an array of f32 or f64");
  }
  const std::span<const uint8_t> bytes = value.element_bytes();
  std::vector<float> out(value.size());
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = element == GgufType::kF32 ? load<float>(bytes.data() + i * 4)
                                       : static_cast<float>(load<double>(bytes.data() + i * 8));
  }
  return out;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensorInfo& GgufFile::tensor(std::string_view name) const {
  const GgufTensorInfo* info = find_tensor(name);
  if (info == nullptr) {
    throw Error(ErrorKind::kNotFound, duet::format("{}: no tensor named {}", name_, shown(name)));
  }
  return *info;
}

}  // namespace duet

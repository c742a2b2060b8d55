#include "common/model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "common/error.h"
#include "common/model/gguf_format.h"

namespace duet {
namespace gguf_detail {

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

}  // namespace gguf_detail

using gguf_detail::describe;
using gguf_detail::load;
using gguf_detail::load_scalar_bits;
using gguf_detail::scalar_size;
using gguf_detail::shown;

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

void GgufFile::drop_pages(const void* data, size_t bytes) const {
  if (mapping_ == nullptr) return;
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + bytes) / page * page;
  if (first >= last) return;
  // Advice only: a failure leaves the pages where they are, which is harmless.
  ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
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

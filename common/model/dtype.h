// Element types of tensors as GGUF files store them (ggml's numbering).
//
// A block-quantized type packs `block_size` consecutive elements of a row into
// `type_size` bytes; plain types have block_size 1. A row of `n` elements of
// type `t` therefore takes n / block_size * type_size bytes, and n must be a
// multiple of block_size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace duet {

enum class DType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kIQ2_XXS = 16,
  kIQ2_XS = 17,
  kIQ3_XXS = 18,
  kIQ1_S = 19,
  kIQ4_NL = 20,
  kIQ3_S = 21,
  kIQ2_S = 22,
  kIQ4_XS = 23,
  kI8 = 24,
  kI16 = 25,
  kI32 = 26,
  kI64 = 27,
  kF64 = 28,
  kIQ1_M = 29,
  kBF16 = 30,
  kTQ1_0 = 34,
  kTQ2_0 = 35,
};

struct DTypeTraits {
  std::string_view name;
  int64_t block_size;  // elements per block
  int64_t type_size;   // bytes per block
};

// Traits of every type ggml defines, or nullopt for a number it does not.
std::optional<DTypeTraits> dtype_traits(uint32_t raw_type);
DTypeTraits dtype_traits(DType type);
std::string_view dtype_name(DType type);

// Bytes of one row of `n_elements`; requires n_elements % block_size == 0.
size_t dtype_row_bytes(DType type, int64_t n_elements);

// The weight types Duet's kernels compute with.
bool dtype_is_supported_weight(DType type);

}  // namespace duet

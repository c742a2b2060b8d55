#include "common/model/dtype.h"

#include "common/error.h"

namespace duet {

std::optional<DTypeTraits> dtype_traits(uint32_t raw_type) {
  switch (static_cast<DType>(raw_type)) {
    case DType::kF32:
      return DTypeTraits{"F32", 1, 4};
    case DType::kF16:
      return DTypeTraits{"F16", 1, 2};
    case DType::kQ4_0:
      return DTypeTraits{"Q4_0", 32, 18};
    case DType::kQ4_1:
      return DTypeTraits{"Q4_1", 32, 20};
    case DType::kQ5_0:
      return DTypeTraits{"Q5_0", 32, 22};
    case DType::kQ5_1:
      return DTypeTraits{"Q5_1", 32, 24};
    case DType::kQ8_0:
      return DTypeTraits{"Q8_0", 32, 34};
    case DType::kQ8_1:
      return DTypeTraits{"Q8_1", 32, 36};
    case DType::kQ2_K:
      return DTypeTraits{"Q2_K", 256, 84};
    case DType::kQ3_K:
      return DTypeTraits{"Q3_K", 256, 110};
    case DType::kQ4_K:
      return DTypeTraits{"Q4_K", 256, 144};
    case DType::kQ5_K:
      return DTypeTraits{"Q5_K", 256, 176};
    case DType::kQ6_K:
      return DTypeTraits{"Q6_K", 256, 210};
    case DType::kQ8_K:
      return DTypeTraits{"Q8_K", 256, 292};
    case DType::kIQ2_XXS:
      return DTypeTraits{"IQ2_XXS", 256, 66};
    case DType::kIQ2_XS:
      return DTypeTraits{"IQ2_XS", 256, 74};
    case DType::kIQ3_XXS:
      return DTypeTraits{"IQ3_XXS", 256, 98};
    case DType::kIQ1_S:
      return DTypeTraits{"IQ1_S", 256, 50};
    case DType::kIQ4_NL:
      return DTypeTraits{"IQ4_NL", 32, 18};
    case DType::kIQ3_S:
      return DTypeTraits{"IQ3_S", 256, 110};
    case DType::kIQ2_S:
      return DTypeTraits{"IQ2_S", 256, 82};
    case DType::kIQ4_XS:
      return DTypeTraits{"IQ4_XS", 256, 136};
    case DType::kI8:
      return DTypeTraits{"I8", 1, 1};
    case DType::kI16:
      return DTypeTraits{"I16", 1, 2};
    case DType::kI32:
      return DTypeTraits{"I32", 1, 4};
    case DType::kI64:
      return DTypeTraits{"I64", 1, 8};
    case DType::kF64:
      return DTypeTraits{"F64", 1, 8};
    case DType::kIQ1_M:
      return DTypeTraits{"IQ1_M", 256, 56};
    case DType::kBF16:
      return DTypeTraits{"BF16", 1, 2};
    case DType::kTQ1_0:
      return DTypeTraits{"TQ1_0", 256, 54};
    case DType::kTQ2_0:
      return DTypeTraits{"TQ2_0", 256, 66};
  }
  return std::nullopt;
}

DTypeTraits dtype_traits(DType type) {
  auto traits = dtype_traits(static_cast<uint32_t>(type));
  DUET_ASSERT(traits.has_value(), "unknown dtype {}", static_cast<uint32_t>(type));
  return *traits;
}

std::string_view dtype_name(DType type) { return dtype_traits(type).name; }

size_t dtype_row_bytes(DType type, int64_t n_elements) {
  const DTypeTraits traits = dtype_traits(type);
  DUET_ASSERT(n_elements % traits.block_size == 0, "{} elements is not a whole number of {} blocks",
              n_elements, traits.name);
  return static_cast<size_t>(n_elements / traits.block_size * traits.type_size);
}

bool dtype_is_supported_weight(DType type) {
  switch (type) {
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16:
    case DType::kQ4_0:
    case DType::kQ4_1:
    case DType::kQ5_0:
    case DType::kQ8_0:
    case DType::kQ4_K:
    case DType::kQ5_K:
    case DType::kQ6_K:
      return true;
    default:
      return false;
  }
}

}  // namespace duet

// Instruction-set paths of the CPU kernels, chosen once at start-up.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace duet::cpu {

enum class Isa { kScalar, kAvx2, kAvx512 };

std::string_view isa_name(Isa isa);
std::optional<Isa> parse_isa(std::string_view name);

// Whether this CPU can run `isa` (kAvx2: AVX2+FMA+F16C; kAvx512: F/BW/VL/DQ/VNNI).
bool cpu_supports(Isa isa);

// Every path this CPU can run, narrowest first.
std::vector<Isa> supported_isas();

// The size of one core's L2 cache as the CPU reports it (512 KiB when it
// reports none). The batched kernels size their blocking from it.
int64_t l2_cache_bytes();

// The best path this CPU supports.
Isa best_isa();

// $DUET_ISA (scalar|avx2|avx512) when set, else best_isa(). Throws a clear
// error when the variable names an unknown path or one this CPU cannot run.
Isa isa_from_environment();

}  // namespace duet::cpu

#include "kernels/cpu/kernel_table.h"

#include "common/error.h"

namespace duet::cpu {

const KernelTable& kernel_table(Isa isa) {
  DUET_REQUIRE(cpu_supports(isa), "this CPU cannot run the {} kernels", isa_name(isa));
  switch (isa) {
    case Isa::kScalar:
      return scalar_kernel_table();
    case Isa::kAvx2:
      return avx2_kernel_table();
    case Isa::kAvx512:
      return avx512_kernel_table();
  }
  return scalar_kernel_table();
}

}  // namespace duet::cpu

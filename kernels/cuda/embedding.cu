#include <cuda_fp16.h>

#include "common/model/quant_blocks.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/ops.h"

namespace duet::cuda {
namespace {

__device__ __forceinline__ float half_bits(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// One thread block per token, threads over the row's elements.
__global__ void embed_kernel(DType type, const uint8_t* __restrict__ quants,
                             const uint16_t* __restrict__ scales, const uint16_t* __restrict__ mins,
                             int64_t k, int64_t first_row, int64_t n_rows,
                             const int32_t* __restrict__ tokens, float* __restrict__ out) {
  const int64_t row = tokens[blockIdx.x] - first_row;
  float* o = out + static_cast<int64_t>(blockIdx.x) * k;
  if (row < 0 || row >= n_rows) {  // another rank's vocabulary slice
    for (int64_t e = threadIdx.x; e < k; e += blockDim.x) o[e] = 0.0f;
    return;
  }
  for (int64_t e = threadIdx.x; e < k; e += blockDim.x) {
    const int64_t index = row * k + e;
    const int64_t b = index / kQuantBlock, j = index % kQuantBlock;
    float value;
    switch (type) {
      case DType::kQ8_0:
        value = static_cast<float>(static_cast<int8_t>(quants[index])) * half_bits(scales[b]);
        break;
      case DType::kQ4_0:
      case DType::kQ4_1: {
        const uint8_t byte = quants[b * (kQuantBlock / 2) + (j % 16)];
        const float q = static_cast<float>(j < 16 ? (byte & 0xf) : (byte >> 4));
        // __fmul_rn: no fused multiply-add, so q * d + m rounds twice, as the
        // CPU's dequantize_row does, and rows match it bit for bit.
        value = type == DType::kQ4_1 ? __fmul_rn(q, half_bits(scales[b])) + half_bits(mins[b])
                                     : (q - 8.0f) * half_bits(scales[b]);
        break;
      }
      default:  // F16
        value = half_bits(reinterpret_cast<const uint16_t*>(quants)[index]);
        break;
    }
    o[e] = value;
  }
}

}  // namespace

void embed_rows(const DeviceWeight& table, const int32_t* tokens, int64_t n, float* out,
                CudaBackend& backend, int64_t first_row) {
  if (n == 0) return;
  embed_kernel<<<static_cast<unsigned>(n), 256, 0, static_cast<cudaStream_t>(backend.stream())>>>(
      table.type, table.quants, table.scales, table.mins, table.k, first_row, table.n_out, tokens,
      out);
  DUET_CUDA_CHECK(cudaGetLastError());
}

}  // namespace duet::cuda

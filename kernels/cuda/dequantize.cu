#include <cuda_fp16.h>

#include "common/quant_blocks.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/dequantize.h"
#include "kernels/cuda/device.h"

namespace duet::cuda {
namespace {

__device__ float half_bits_to_float(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

// One thread per output element; element e of a block sits in the low nibble
// of byte e (e < 16) or the high nibble of byte e - 16.
__global__ void dequantize_kernel(int type, const uint8_t* rows, size_t row_bytes, int64_t n_rows,
                                  int64_t k, float* out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n_rows * k) return;
  const int64_t row = i / k, e = i % k;
  const uint8_t* r = rows + row * row_bytes;
  const int64_t b = e / kQuantBlock, j = e % kQuantBlock;
  float value = 0.0f;
  switch (static_cast<DType>(type)) {
    case DType::kF32:
      value = reinterpret_cast<const float*>(r)[e];
      break;
    case DType::kF16:
      value = half_bits_to_float(reinterpret_cast<const uint16_t*>(r)[e]);
      break;
    case DType::kQ8_0: {
      const BlockQ8_0& blk = reinterpret_cast<const BlockQ8_0*>(r)[b];
      value = blk.qs[j] * half_bits_to_float(blk.d);
      break;
    }
    case DType::kQ4_0: {
      const BlockQ4_0& blk = reinterpret_cast<const BlockQ4_0*>(r)[b];
      const int q = j < 16 ? (blk.qs[j] & 0x0f) : (blk.qs[j - 16] >> 4);
      value = (q - 8) * half_bits_to_float(blk.d);
      break;
    }
    case DType::kQ4_1: {
      const BlockQ4_1& blk = reinterpret_cast<const BlockQ4_1*>(r)[b];
      const int q = j < 16 ? (blk.qs[j] & 0x0f) : (blk.qs[j - 16] >> 4);
      value = q * half_bits_to_float(blk.d) + half_bits_to_float(blk.m);
      break;
    }
    default:
      break;
  }
  out[i] = value;
}

}  // namespace

void dequantize_rows(DType type, const void* host_rows, int64_t n_rows, int64_t k,
                     float* host_out) {
  if (list_devices().empty()) {
    throw Error(ErrorKind::kUnsupported, "no CUDA device is available");
  }
  const bool implemented = type == DType::kF32 || type == DType::kF16 || type == DType::kQ8_0 ||
                           type == DType::kQ4_0 || type == DType::kQ4_1;
  if (!implemented) {
    throw Error(ErrorKind::kUnsupported,
                fmt::format("cannot dequantize {} on the GPU", dtype_name(type)));
  }
  const size_t row_bytes = dtype_row_bytes(type, k);
  const size_t in_bytes = row_bytes * static_cast<size_t>(n_rows);
  const size_t out_bytes = sizeof(float) * static_cast<size_t>(n_rows * k);
  uint8_t* d_rows = nullptr;
  float* d_out = nullptr;
  DUET_CUDA_CHECK(cudaMalloc(&d_rows, in_bytes));
  DUET_CUDA_CHECK(cudaMalloc(&d_out, out_bytes));
  try {
    DUET_CUDA_CHECK(cudaMemcpy(d_rows, host_rows, in_bytes, cudaMemcpyHostToDevice));
    const int64_t n = n_rows * k;
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>((n + threads - 1) / threads);
    dequantize_kernel<<<blocks, threads>>>(static_cast<int>(type), d_rows, row_bytes, n_rows, k,
                                           d_out);
    DUET_CUDA_CHECK(cudaGetLastError());
    DUET_CUDA_CHECK(cudaMemcpy(host_out, d_out, out_bytes, cudaMemcpyDeviceToHost));
  } catch (...) {
    cudaFree(d_rows);
    cudaFree(d_out);
    throw;
  }
  DUET_CUDA_CHECK(cudaFree(d_rows));
  DUET_CUDA_CHECK(cudaFree(d_out));
}

}  // namespace duet::cuda

#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/model/quant_blocks.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/matmul.h"

namespace duet::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kGemvWarps = 4;  // warps per GEMV thread block
// Dequantized tile of the GEMM path: 8M F16 elements (16 MiB), small enough
// to be written and read back from the L2 of a Hopper or Ampere GPU.
constexpr int64_t kTileElements = int64_t{8} << 20;

enum class Kind { kQ4_0, kQ4_1, kQ8_0, kF16 };

Kind kind_of(DType type) {
  switch (type) {
    case DType::kQ4_0:
      return Kind::kQ4_0;
    case DType::kQ4_1:
      return Kind::kQ4_1;
    case DType::kQ8_0:
      return Kind::kQ8_0;
    case DType::kF16:
      return Kind::kF16;
    default:
      throw Error(ErrorKind::kInternal, format("no GPU matmul for {} weights", dtype_name(type)));
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float half_bits(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}

// A lane's 32 activations of one quantization block (or 8 consecutive
// activations, F16), loaded once and used for every output row of the warp.
template <int kFloat4s>
struct XSlice {
  float4 v[kFloat4s];

  __device__ __forceinline__ void load(const float* x) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
#pragma unroll
    for (int i = 0; i < kFloat4s; ++i) v[i] = __ldg(x4 + i);
  }
};

// Σ_j q_j x_j over one 32-element block of 4-bit quants: element j < 16 is
// the low nibble of byte j, element 16 + j its high nibble.
__device__ __forceinline__ float dot_q4(const uint4& q, const XSlice<8>& x) {
  const uint32_t words[4] = {q.x, q.y, q.z, q.w};
  float qx = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 lo = x.v[w];      // elements 4w .. 4w+3
    const float4 hi = x.v[4 + w];  // elements 16+4w .. 16+4w+3
    const uint32_t b = words[w];
    qx += static_cast<float>(b & 0xf) * lo.x + static_cast<float>((b >> 8) & 0xf) * lo.y +
          static_cast<float>((b >> 16) & 0xf) * lo.z + static_cast<float>((b >> 24) & 0xf) * lo.w;
    qx += static_cast<float>((b >> 4) & 0xf) * hi.x + static_cast<float>((b >> 12) & 0xf) * hi.y +
          static_cast<float>((b >> 20) & 0xf) * hi.z + static_cast<float>((b >> 28) & 0xf) * hi.w;
  }
  return qx;
}

// Σ_j x_j over one block, in the order dot_q4 visits the elements.
__device__ __forceinline__ float sum_block(const XSlice<8>& x) {
  float sx = 0.0f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 lo = x.v[w], hi = x.v[4 + w];
    sx += lo.x + lo.y + lo.z + lo.w + hi.x + hi.y + hi.z + hi.w;
  }
  return sx;
}

// Σ_j q_j x_j over one 32-element Q8_0 block (two 16-byte loads of int8).
__device__ __forceinline__ float dot_q8(const uint4& q0, const uint4& q1, const XSlice<8>& x) {
  const uint32_t words[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
  float qx = 0.0f;
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    const float4 v = x.v[w];
    const uint32_t b = words[w];
    qx += static_cast<float>(static_cast<int8_t>(b & 0xff)) * v.x +
          static_cast<float>(static_cast<int8_t>((b >> 8) & 0xff)) * v.y +
          static_cast<float>(static_cast<int8_t>((b >> 16) & 0xff)) * v.z +
          static_cast<float>(static_cast<int8_t>(b >> 24)) * v.w;
  }
  return qx;
}

// Σ_j w_j x_j over 8 F16 weights.
__device__ __forceinline__ float dot_f16(const uint4& packed, const XSlice<2>& x) {
  const __half2* h = reinterpret_cast<const __half2*>(&packed);
  float w[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __half22float2(h[j]);
    w[2 * j] = f.x;
    w[2 * j + 1] = f.y;
  }
  const float4 a = x.v[0], b = x.v[1];
  return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z +
         w[7] * b.w;
}

// One warp per kOut consecutive output rows, all kRows activation rows at
// once: every lane walks the rows' blocks lane, lane + 32, ... with 16-byte
// loads, and each activation block it loads serves all kOut rows (a Q4 block
// is 16 bytes of weights against 128 of F32 activations, so the activation
// loads, not the weights, bound a one-row warp). Each output element is the
// same sequence of operations whatever kRows and kOut: lane sums in block
// order, then the warp's butterfly. Rows past n_out read the last row and
// write nothing.
template <Kind kKind, int kRows, int kOut>
__global__ void __launch_bounds__(kWarp* kGemvWarps)
    gemv_kernel(const uint8_t* __restrict__ quants, const uint16_t* __restrict__ scales,
                const uint16_t* __restrict__ mins, int64_t k, int64_t n_out,
                const float* __restrict__ x, float* __restrict__ y, int64_t ldy) {
  const int lane = threadIdx.x % kWarp;
  const int64_t row0 = (static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / kWarp) * kOut;
  if (row0 >= n_out) return;
  int64_t rows[kOut];
#pragma unroll
  for (int o = 0; o < kOut; ++o) rows[o] = min(row0 + o, n_out - 1);
  float acc[kOut][kRows];
#pragma unroll
  for (int o = 0; o < kOut; ++o)
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[o][r] = 0.0f;

  if constexpr (kKind == Kind::kF16) {
    const auto* w = reinterpret_cast<const uint16_t*>(quants);
#pragma unroll(kOut == 1 ? 4 : 2)
    for (int64_t i = static_cast<int64_t>(lane) * 8; i < k; i += kWarp * 8) {
      uint4 packed[kOut];
#pragma unroll
      for (int o = 0; o < kOut; ++o)
        packed[o] = __ldg(reinterpret_cast<const uint4*>(w + rows[o] * k + i));
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        XSlice<2> xs;
        xs.load(x + r * k + i);
#pragma unroll
        for (int o = 0; o < kOut; ++o) acc[o][r] += dot_f16(packed[o], xs);
      }
    }
  } else {
    const int64_t n_blocks = k / kQuantBlock;
    constexpr int kQuantWords = kKind == Kind::kQ8_0 ? 2 : 1;  // uint4s of quants per block
#pragma unroll(kOut == 1 ? 4 : 2)
    for (int64_t b = lane; b < n_blocks; b += kWarp) {
      uint4 q[kOut][kQuantWords];
      float d[kOut], m[kOut];
#pragma unroll
      for (int o = 0; o < kOut; ++o) {
        const int64_t i = rows[o] * n_blocks + b;
        d[o] = half_bits(__ldg(scales + i));
        m[o] = kKind == Kind::kQ4_1 ? half_bits(__ldg(mins + i)) : 0.0f;
#pragma unroll
        for (int h = 0; h < kQuantWords; ++h)
          q[o][h] = __ldg(reinterpret_cast<const uint4*>(quants) + kQuantWords * i + h);
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        XSlice<8> xs;
        xs.load(x + r * k + b * kQuantBlock);
        if constexpr (kKind == Kind::kQ8_0) {
#pragma unroll
          for (int o = 0; o < kOut; ++o) acc[o][r] += d[o] * dot_q8(q[o][0], q[o][1], xs);
        } else {
          const float sum_x = sum_block(xs);
#pragma unroll
          for (int o = 0; o < kOut; ++o) {
            const float sum_qx = dot_q4(q[o][0], xs);
            // Q4_0: (q - 8) * d; Q4_1: q * d + m.
            acc[o][r] += kKind == Kind::kQ4_1 ? d[o] * sum_qx + m[o] * sum_x
                                              : d[o] * (sum_qx - 8.0f * sum_x);
          }
        }
      }
    }
  }
#pragma unroll
  for (int o = 0; o < kOut; ++o) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float total = warp_sum(acc[o][r]);
      if (lane == 0 && row0 + o < n_out) y[r * ldy + row0 + o] = total;
    }
  }
}

// Output rows per warp: as many as keep at least kGemvMinWarps warps busy
// (the rows of small matrices, K and V, stay one per warp).
constexpr int64_t kGemvMinWarps = 2048;

template <Kind kKind, int kRows>
void launch_rows(const DeviceWeight& w, const float* x, float* y, int64_t ldy,
                 cudaStream_t stream) {
  auto run = [&](auto out) {
    constexpr int kOut = decltype(out)::value;
    const int64_t warps = (w.n_out + kOut - 1) / kOut;
    const auto blocks = static_cast<unsigned>((warps + kGemvWarps - 1) / kGemvWarps);
    gemv_kernel<kKind, kRows, kOut><<<blocks, kWarp * kGemvWarps, 0, stream>>>(
        w.quants, w.scales, w.mins, w.k, w.n_out, x, y, ldy);
  };
  if (w.n_out >= 4 * kGemvMinWarps) {
    run(std::integral_constant<int, 4>{});
  } else if (w.n_out >= 2 * kGemvMinWarps) {
    run(std::integral_constant<int, 2>{});
  } else {
    run(std::integral_constant<int, 1>{});
  }
}

template <Kind kKind>
void launch_gemv(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
                 cudaStream_t stream) {
  switch (n_x) {
    case 1:
      launch_rows<kKind, 1>(w, x, y, ldy, stream);
      break;
    case 2:
      launch_rows<kKind, 2>(w, x, y, ldy, stream);
      break;
    case 3:
      launch_rows<kKind, 3>(w, x, y, ldy, stream);
      break;
    case 4:
      launch_rows<kKind, 4>(w, x, y, ldy, stream);
      break;
    case 5:
      launch_rows<kKind, 5>(w, x, y, ldy, stream);
      break;
    case 6:
      launch_rows<kKind, 6>(w, x, y, ldy, stream);
      break;
    case 7:
      launch_rows<kKind, 7>(w, x, y, ldy, stream);
      break;
    default:
      launch_rows<kKind, 8>(w, x, y, ldy, stream);
      break;
  }
  DUET_CUDA_CHECK(cudaGetLastError());
}

// Two F16 values as one 32-bit word, `lo` in the low half (the lower address).
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16;
}

// Elements index .. index + 7 of the whole weight (index a multiple of 8, so
// all in one block) as 8 F16 values.
__device__ __forceinline__ uint4 dequantize8(Kind kind, const uint8_t* __restrict__ quants,
                                             const uint16_t* __restrict__ scales,
                                             const uint16_t* __restrict__ mins, int64_t index) {
  if (kind == Kind::kF16) return *reinterpret_cast<const uint4*>(quants + index * 2);
  const int64_t b = index / kQuantBlock;
  const int j0 = static_cast<int>(index % kQuantBlock);
  const float d = half_bits(scales[b]);
  float v[8];
  if (kind == Kind::kQ8_0) {
    const uint2 q = *reinterpret_cast<const uint2*>(quants + index);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const uint32_t word = t < 4 ? q.x : q.y;
      v[t] = static_cast<float>(static_cast<int8_t>((word >> (8 * (t % 4))) & 0xff)) * d;
    }
  } else {
    // Elements j0 .. j0 + 7: the low nibbles of bytes j0 .. j0 + 7 (j0 < 16)
    // or the high nibbles of bytes j0 - 16 .. j0 - 9.
    const uint2 q = *reinterpret_cast<const uint2*>(quants + b * (kQuantBlock / 2) + j0 % 16);
    const int shift = j0 < 16 ? 0 : 4;
    const float m = kind == Kind::kQ4_1 ? half_bits(mins[b]) : 0.0f;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const uint32_t word = t < 4 ? q.x : q.y;
      const float nibble = static_cast<float>((word >> (8 * (t % 4) + shift)) & 0xf);
      v[t] = kind == Kind::kQ4_1 ? nibble * d + m : (nibble - 8.0f) * d;
    }
  }
  return make_uint4(pack_half2(v[0], v[1]), pack_half2(v[2], v[3]), pack_half2(v[4], v[5]),
                    pack_half2(v[6], v[7]));
}

// One thread per 8 consecutive elements of rows [row0, row0 + n_rows) (k is
// a multiple of 32, so they never straddle a block), one 16-byte store each.
__global__ void dequantize_f16_kernel(int kind, const uint8_t* __restrict__ quants,
                                      const uint16_t* __restrict__ scales,
                                      const uint16_t* __restrict__ mins, int64_t k, int64_t row0,
                                      int64_t n_rows, uint4* __restrict__ out) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= n_rows * k / 8) return;
  out[g] = dequantize8(static_cast<Kind>(kind), quants, scales, mins, row0 * k + g * 8);
}

__global__ void to_f16_kernel(const float* __restrict__ x, int64_t n, __half* __restrict__ out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2half_rn(x[i]);
}

unsigned blocks_for(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

void dequantize_f16(const DeviceWeight& w, int64_t row0, int64_t n_rows, uint16_t* out,
                    CudaBackend& backend) {
  DUET_ASSERT(row0 >= 0 && n_rows >= 0 && row0 + n_rows <= w.n_out);
  DUET_ASSERT(reinterpret_cast<uintptr_t>(out) % 16 == 0, "dequantize_f16 writes 16-byte stores");
  if (n_rows * w.k == 0) return;
  const int threads = 256;
  dequantize_f16_kernel<<<blocks_for(n_rows * w.k / 8, threads), threads, 0,
                          static_cast<cudaStream_t>(backend.stream())>>>(
      static_cast<int>(kind_of(w.type)), w.quants, w.scales, w.mins, w.k, row0, n_rows,
      reinterpret_cast<uint4*>(out));
  DUET_CUDA_CHECK(cudaGetLastError());
}

void matmul_gemv(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
                 CudaBackend& backend) {
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  // Batches above kGemvMaxRows run in passes of kGemvMaxRows rows.
  for (int64_t r0 = 0; r0 < n_x; r0 += kGemvMaxRows) {
    const int64_t rows = std::min(kGemvMaxRows, n_x - r0);
    const float* xr = x + r0 * w.k;
    float* yr = y + r0 * ldy;
    switch (kind_of(w.type)) {
      case Kind::kQ4_0:
        launch_gemv<Kind::kQ4_0>(w, xr, rows, yr, ldy, stream);
        break;
      case Kind::kQ4_1:
        launch_gemv<Kind::kQ4_1>(w, xr, rows, yr, ldy, stream);
        break;
      case Kind::kQ8_0:
        launch_gemv<Kind::kQ8_0>(w, xr, rows, yr, ldy, stream);
        break;
      case Kind::kF16:
        launch_gemv<Kind::kF16>(w, xr, rows, yr, ldy, stream);
        break;
    }
  }
}

size_t gemm_scratch_bound(int64_t k, int64_t n_out, int64_t n_x) {
  // As matmul_gemm lays it out: a tile of max(1, min(n_out', kTileElements /
  // k')) rows of k' is at most max(k', min(n_out' * k', kTileElements)) elements.
  const size_t x_bytes = (static_cast<size_t>(n_x * k) * sizeof(__half) + 255) / 256 * 256;
  const int64_t tile = std::max(k, std::min(n_out * k, kTileElements));
  return x_bytes + static_cast<size_t>(tile) * sizeof(__half);
}

void matmul_gemm(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
                 CudaBackend& backend) {
  const int64_t k = w.k;
  // F16 weights multiply as stored, in one product; the others tile by tile.
  const bool f16 = w.type == DType::kF16;
  const int64_t tile_rows =
      f16 ? w.n_out : std::max<int64_t>(1, std::min(w.n_out, kTileElements / k));
  // Scratch: the activations in F16, then (quantized weights) one dequantized tile.
  const size_t x_bytes = (static_cast<size_t>(n_x * k) * sizeof(__half) + 255) / 256 * 256;
  const size_t tile_bytes = f16 ? 0 : static_cast<size_t>(tile_rows * k) * sizeof(__half);
  auto* scratch = static_cast<uint8_t*>(backend.scratch(x_bytes + tile_bytes));
  auto* x_half = reinterpret_cast<__half*>(scratch);
  auto* tile = reinterpret_cast<__half*>(scratch + x_bytes);
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  const int threads = 256;
  to_f16_kernel<<<blocks_for(n_x * k, threads), threads, 0, stream>>>(x, n_x * k, x_half);
  DUET_CUDA_CHECK(cudaGetLastError());
  const auto handle = static_cast<cublasHandle_t>(backend.cublas());
  const float alpha = 1.0f, beta = 0.0f;
  for (int64_t row0 = 0; row0 < w.n_out; row0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, w.n_out - row0);
    const __half* a = tile;
    if (f16) {
      a = reinterpret_cast<const __half*>(w.quants) + row0 * k;
    } else {
      dequantize_f16(w, row0, rows, reinterpret_cast<uint16_t*>(tile), backend);
    }
    // Column-major: y^T[row0 .. row0 + rows) (rows x n_x, ld ldy) = a^T . x^T,
    // a being (rows x k) row-major, i.e. (k x rows) column-major.
    DUET_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows),
                                   static_cast<int>(n_x), static_cast<int>(k), &alpha, a,
                                   CUDA_R_16F, static_cast<int>(k), x_half, CUDA_R_16F,
                                   static_cast<int>(k), &beta, y + row0, CUDA_R_32F,
                                   static_cast<int>(ldy), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
}

void matmul(const DeviceWeight& w, const float* x, int64_t n_x, float* y, int64_t ldy,
            CudaBackend& backend) {
  if (n_x <= 0) return;
  if (n_x <= kGemvMaxRows) {
    matmul_gemv(w, x, n_x, y, ldy, backend);
  } else {
    matmul_gemm(w, x, n_x, y, ldy, backend);
  }
}

}  // namespace duet::cuda

#include <cstring>
#include <vector>

#include "common/model/fp16.h"
#include "common/model/quant_blocks.h"
#include "kernels/cpu/quantize.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/weights.h"

namespace duet::cuda {
namespace {

// Bytes of quants per 32-element block on the device.
size_t quant_bytes(DType type) {
  switch (type) {
    case DType::kQ4_0:
    case DType::kQ4_1:
      return kQuantBlock / 2;
    case DType::kQ8_0:
      return kQuantBlock;
    default:
      return 0;
  }
}

// Rounds up to a multiple of 256 bytes (keeps every array 16-byte aligned).
size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

DeviceWeight upload_weight(const cpu::WeightMatrix& weight, CudaBackend& backend) {
  const int64_t k = weight.k, n_out = weight.n_out;
  DUET_ASSERT(weight.layout == cpu::WeightLayout::kRows,
              "the GPU reads weights in the file's rows (load the model without CPU kernels)");
  if (k % kQuantBlock != 0) {
    throw Error(
        ErrorKind::kUnsupported,
        format("the GPU needs weight rows of a multiple of {} elements, got {}", kQuantBlock, k));
  }
  const bool quantized =
      weight.type == DType::kQ4_0 || weight.type == DType::kQ4_1 || weight.type == DType::kQ8_0;
  DeviceWeight out;
  out.k = k;
  out.n_out = n_out;
  out.type = quantized ? weight.type : DType::kF16;
  const int64_t n_blocks = n_out * (k / kQuantBlock);
  std::vector<uint8_t> host;
  size_t quants_size = 0, scales_size = 0, mins_size = 0;
  if (quantized) {
    const size_t qb = quant_bytes(weight.type);
    quants_size = aligned(static_cast<size_t>(n_blocks) * qb);
    scales_size = aligned(static_cast<size_t>(n_blocks) * sizeof(uint16_t));
    mins_size = weight.type == DType::kQ4_1 ? scales_size : 0;
    host.resize(quants_size + scales_size + mins_size);
    uint8_t* quants = host.data();
    auto* scales = reinterpret_cast<uint16_t*>(host.data() + quants_size);
    auto* mins = reinterpret_cast<uint16_t*>(host.data() + quants_size + scales_size);
    for (int64_t r = 0; r < n_out; ++r) {
      const uint8_t* row = weight.data + static_cast<size_t>(r) * weight.row_bytes;
      for (int64_t b = 0; b < k / kQuantBlock; ++b) {
        const int64_t i = r * (k / kQuantBlock) + b;
        switch (weight.type) {
          case DType::kQ4_0: {
            const auto& blk = reinterpret_cast<const BlockQ4_0*>(row)[b];
            std::memcpy(quants + i * qb, blk.qs, qb);
            scales[i] = blk.d;
            break;
          }
          case DType::kQ4_1: {
            const auto& blk = reinterpret_cast<const BlockQ4_1*>(row)[b];
            std::memcpy(quants + i * qb, blk.qs, qb);
            scales[i] = blk.d;
            mins[i] = blk.m;
            break;
          }
          default: {
            const auto& blk = reinterpret_cast<const BlockQ8_0*>(row)[b];
            std::memcpy(quants + i * qb, blk.qs, qb);
            scales[i] = blk.d;
            break;
          }
        }
      }
    }
  } else if (weight.type == DType::kF16) {
    quants_size = aligned(static_cast<size_t>(n_out * k) * sizeof(uint16_t));
    host.resize(quants_size);
    for (int64_t r = 0; r < n_out; ++r) {
      std::memcpy(host.data() + static_cast<size_t>(r * k) * sizeof(uint16_t),
                  weight.data + static_cast<size_t>(r) * weight.row_bytes,
                  static_cast<size_t>(k) * sizeof(uint16_t));
    }
  } else {
    // Any other type: dequantized on the host, stored as F16.
    quants_size = aligned(static_cast<size_t>(n_out * k) * sizeof(uint16_t));
    host.resize(quants_size);
    std::vector<float> row(static_cast<size_t>(k));
    auto* values = reinterpret_cast<uint16_t*>(host.data());
    for (int64_t r = 0; r < n_out; ++r) {
      cpu::dequantize_row(weight.type, weight.data + static_cast<size_t>(r) * weight.row_bytes,
                          row.data(), k);
      for (int64_t i = 0; i < k; ++i) values[r * k + i] = fp32_to_fp16(row[static_cast<size_t>(i)]);
    }
  }
  out.storage = DeviceBuffer(host.size());
  backend.upload(out.storage.data(), host.data(), host.size());
  backend.synchronize();  // `host` goes away
  out.quants = out.storage.as<uint8_t>();
  if (quantized) {
    out.scales = reinterpret_cast<const uint16_t*>(out.quants + quants_size);
    if (mins_size != 0)
      out.mins = reinterpret_cast<const uint16_t*>(out.quants + quants_size + scales_size);
  }
  return out;
}

DeviceBuffer upload_floats(const float* values, int64_t n, CudaBackend& backend) {
  DeviceBuffer buffer(static_cast<size_t>(n) * sizeof(float));
  backend.upload(buffer.data(), values, buffer.bytes());
  backend.synchronize();
  return buffer;
}

}  // namespace duet::cuda

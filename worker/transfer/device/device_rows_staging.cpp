#include "worker/transfer/device/device_rows_staging.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/kv_rows.h"

namespace duet {

DeviceStaging::DeviceStaging(size_t bytes) : memory_(bytes), ring_(bytes) {}

TableStaging::TableStaging(size_t n_entries)
    : host_(n_entries * sizeof(int32_t)),
      device_(n_entries * sizeof(int32_t)),
      ring_(n_entries * sizeof(int32_t), 16) {}

std::optional<TableStaging::Slot> TableStaging::upload(std::span<const int32_t> table,
                                                       void* stream) {
  const size_t bytes = std::max<size_t>(table.size_bytes(), sizeof(int32_t));
  const std::optional<size_t> offset = ring_.acquire(bytes);
  if (!offset) return std::nullopt;
  auto* host = host_.as<std::byte>() + *offset;
  auto* device = device_.as<std::byte>() + *offset;
  if (!table.empty()) {
    std::memcpy(host, table.data(), table.size_bytes());
    DUET_CUDA_CHECK(cudaMemcpyAsync(device, host, table.size_bytes(), cudaMemcpyHostToDevice,
                                    static_cast<cudaStream_t>(stream)));
  }
  return Slot{*offset, reinterpret_cast<const int32_t*>(device)};
}

void pack_into_staging(DeviceStaging& staging, size_t offset, TableStaging& tables,
                       const KvLayout& layout, const DeviceKv& kv, int64_t layer,
                       std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvHeads heads,
                       const std::function<void()>& after) {
  const CoveringBlocks covering = covering_blocks(block_table, layout.block_size, pos0, n);
  const std::optional<TableStaging::Slot> table = tables.upload(covering.table, kv.stream);
  DUET_ASSERT(table.has_value(), "a block table of {} entries does not fit the table staging",
              covering.table.size());
  try {
    cuda::pack_kv_rows(layout, kv.data, layer, table->device, covering.pos0, n, heads.first,
                       heads.count, staging.at(offset), kv.stream);
    if (after) after();
    DUET_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(kv.stream)));
  } catch (...) {
    cudaStreamSynchronize(static_cast<cudaStream_t>(kv.stream));
    tables.release(table->offset);
    throw;
  }
  tables.release(table->offset);
}

DeviceEvent::DeviceEvent() {
  cudaEvent_t event = nullptr;
  DUET_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  event_ = event;
}

DeviceEvent::~DeviceEvent() {
  if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

DeviceEvent::DeviceEvent(DeviceEvent&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)) {}

DeviceEvent& DeviceEvent::operator=(DeviceEvent&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
    event_ = std::exchange(other.event_, nullptr);
  }
  return *this;
}

void DeviceEvent::record(void* stream) {
  DUET_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event_), static_cast<cudaStream_t>(stream)));
}

bool DeviceEvent::done() const {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (status == cudaErrorNotReady) return false;
  DUET_CUDA_CHECK(status);
  return true;
}

DeviceStream::DeviceStream() {
  cudaStream_t stream = nullptr;
  DUET_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
}

DeviceStream::~DeviceStream() {
  if (stream_ == nullptr) return;
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void DeviceStream::synchronize() {
  DUET_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
}

}  // namespace duet

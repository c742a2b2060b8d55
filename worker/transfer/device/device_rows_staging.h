// The device memory the GPU device transfers (worker/transfer/device/device_kv_link.h) stage
// rows payloads in, and the device copies of the block tables their pack and
// unpack kernels read: each a StagingRing over one allocation made once.
// Plain C++ (the CUDA calls are in the .cpp); built with the CUDA backend.
//
// Not thread-safe: each device transfer guards its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "common/error.h"
#include "common/model/kv_layout.h"
#include "kernels/cuda/backend.h"
#include "worker/kv/kv_cache.h"
#include "worker/kv/kv_rows.h"
#include "worker/transfer/device/staging_ring.h"

namespace duet {

// The entries of `block_table` that hold positions [pos0, pos0 + n), and
// pos0 counted from the first of them: all a pack or unpack kernel reads
// (the packed rows do not depend on where the range starts).
struct CoveringBlocks {
  std::span<const int32_t> table;
  int64_t pos0 = 0;
};
inline CoveringBlocks covering_blocks(std::span<const int32_t> block_table, int64_t block_size,
                                      int64_t pos0, int64_t n) {
  if (n <= 0) return {{}, 0};
  const int64_t first = pos0 / block_size;
  const int64_t end = (pos0 + n - 1) / block_size + 1;
  DUET_ASSERT(end <= static_cast<int64_t>(block_table.size()),
              "positions [{}, {}) beyond a table of {} blocks", pos0, pos0 + n, block_table.size());
  return {block_table.subspan(static_cast<size_t>(first), static_cast<size_t>(end - first)),
          pos0 - first * block_size};
}

// Payload space: `bytes` of device memory on the current device.
class DeviceStaging {
 public:
  explicit DeviceStaging(size_t bytes);

  std::optional<size_t> acquire(size_t bytes) { return ring_.acquire(bytes); }
  void release(size_t offset) { ring_.release(offset); }
  bool empty() const { return ring_.empty(); }

  KvElement* at(size_t offset) const {
    return reinterpret_cast<KvElement*>(memory_.as<std::byte>() + offset);
  }
  void* data() const { return memory_.data(); }
  size_t capacity() const { return ring_.capacity(); }

 private:
  cuda::DeviceBuffer memory_;
  StagingRing ring_;
};

// Block tables on their way to a kernel: pinned host memory and its device
// twin, region for region.
class TableStaging {
 public:
  // Room for `n_entries` int32 entries in flight at once.
  explicit TableStaging(size_t n_entries);

  struct Slot {
    size_t offset = 0;
    const int32_t* device = nullptr;  // the table on the device, once the copy ran
  };
  // Copies `table` into pinned memory and queues its upload on `stream`
  // (cudaStream_t); nullopt while the ring is full. Release the slot only
  // after the work on `stream` that reads it has finished.
  std::optional<Slot> upload(std::span<const int32_t> table, void* stream);
  void release(size_t offset) { ring_.release(offset); }
  // The device table of the slot at `offset`.
  const int32_t* device_at(size_t offset) const {
    return reinterpret_cast<const int32_t*>(device_.as<std::byte>() + offset);
  }

 private:
  cuda::PinnedBuffer host_;
  cuda::DeviceBuffer device_;
  StagingRing ring_;
};

// Bytes of the packed rows of n positions of `heads`.
inline size_t payload_bytes(const KvLayout& layout, int64_t n, KvHeads heads) {
  return static_cast<size_t>(packed_kv_elems(layout, n, heads)) * sizeof(KvElement);
}

// The sending half both device transfer share: packs rows [pos0, pos0 + n)
// of `layer` (`heads`) of `kv` into `staging` at `offset`, queued on
// kv.stream behind the work that wrote the blocks, and waits for it (so the
// table slot it takes is free again when it returns, and the blocks may be
// reused). `after` runs on kv.stream's host side right after the packing is
// queued (a CUDA IPC transfer records its interprocess event there).
void pack_into_staging(DeviceStaging& staging, size_t offset, TableStaging& tables,
                       const KvLayout& layout, const DeviceKv& kv, int64_t layer,
                       std::span<const int32_t> block_table, int64_t pos0, int64_t n, KvHeads heads,
                       const std::function<void()>& after = {});

// A CUDA event (timing off) recorded on a stream, queried without waiting.
class DeviceEvent {
 public:
  DeviceEvent();
  ~DeviceEvent();
  DeviceEvent(DeviceEvent&& other) noexcept;
  DeviceEvent& operator=(DeviceEvent&& other) noexcept;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;

  void record(void* stream);  // cudaStream_t
  bool done() const;          // the work before the record has finished

 private:
  void* event_ = nullptr;  // cudaEvent_t
};

// A stream of its own (non-blocking), synchronized and destroyed with the object.
class DeviceStream {
 public:
  DeviceStream();
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;

  void* get() const { return stream_; }  // cudaStream_t
  void synchronize();

 private:
  void* stream_ = nullptr;
};

}  // namespace duet

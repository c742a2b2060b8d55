// Storage of a paged KV cache laid out by KvLayout (common/model/kv_layout.h).
// It owns the memory only; which blocks a sequence uses is its block table,
// kept by whoever allocates blocks.
//
// On a GPU engine the KV lives in device memory (the GPU forward owns it)
// and this host cache is the staging copy of the MPI transfer; the device
// pool's address is its device_copy(), where KV transfers between GPUs read and
// write rows directly.
#pragma once

#include <cstdint>

#include "common/huge_pages.h"
#include "common/model/kv_layout.h"
#include "common/model/model_config.h"

namespace duet {

KvLayout make_kv_layout(const ModelConfig& config, int64_t n_blocks,
                        int64_t block_size = KvLayout::kDefaultBlockSize);

// A KV pool in device memory, laid out as its host KvCache.
struct DeviceKv {
  KvElement* data = nullptr;  // device pointer; null: the KV is on the host
  int device = -1;            // the CUDA device index
  void* stream = nullptr;     // cudaStream_t of the compute that writes it

  bool valid() const { return data != nullptr; }
};

// Whether a KvCache holds its memory: kNone for an engine that only
// schedules (a step-time model's, worker/model/step_time_forward.h), whose
// KV is never written or read.
enum class KvMemory { kHost, kNone };

class KvCache final {
 public:
  explicit KvCache(const KvLayout& layout, KvMemory memory = KvMemory::kHost);
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvLayout& layout() const { return layout_; }
  // Null for KvMemory::kNone. Zeroed at first, on huge pages where the
  // kernel has them (common/huge_pages.h).
  KvElement* data() { return reinterpret_cast<KvElement*>(storage_.data()); }
  const KvElement* data() const { return reinterpret_cast<const KvElement*>(storage_.data()); }

  // The device pool of a GPU engine (set once by the engine), else invalid.
  const DeviceKv& device_copy() const { return device_copy_; }
  void set_device_copy(const DeviceKv& device_copy) { device_copy_ = device_copy; }

 private:
  KvLayout layout_;
  HugePageMemory storage_;
  DeviceKv device_copy_;
};

}  // namespace duet

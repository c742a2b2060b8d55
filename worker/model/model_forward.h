// The forward pass as the engine sees it, whatever runs it: CpuForward on
// the CPU, CudaForward on an NVIDIA GPU (worker/model/cuda_forward.h, in CUDA
// builds). make_forward picks one for a device.
//
// The engine owns a host KvCache of the pool's layout. The CPU forward keeps
// the KV there; a GPU forward keeps it in device memory and uses the host
// cache as the staging area of the KV transfer: kv_to_host before exported
// rows are read, kv_from_host after imported rows are written.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string_view>

#include "kernels/cpu/kernel_table.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/op_params.h"
#include "worker/kv/kv_cache.h"
#include "worker/model/llama_model.h"
#include "worker/parallel/collective.h"
#include "worker/parallel/device_collective.h"

namespace duet {

// One sequence's rows in a forward batch.
struct ForwardSequence {
  std::span<const int32_t> block_table;  // physical blocks of positions [0, pos0 + n_tokens)
  int64_t pos0 = 0;                      // position of its first row in this batch
  int64_t n_tokens = 0;                  // its rows, consecutive in the batch, in order
  // Rows at positions >= this are computed in llama.cpp's one-token order,
  // the rest in its multi-token order (the engine's rule, common/model/token_order.h;
  // the CPU forward only).
  int64_t one_token_from = kNoOneTokenRows;
};

// One logit row's draw, for sampling on the device (no penalties, no min-p).
struct DeviceSampling {
  float temperature = 0.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  double uniform = 0.0;  // uniform_at(seed, position)
};

class ModelForward {
 public:
  virtual ~ModelForward() = default;

  // Called with a layer's index as soon as the K/V of every row of that
  // layer is stored, while the layers above still run (on the calling thread).
  using LayerStored = std::function<void(int64_t layer)>;

  // tokens: all rows of the batch, sequence after sequence. Stores K/V of
  // every row, and writes the logits of the rows in `logit_rows` into logits
  // (logit_rows.size(), n_vocab); a device forward may be passed a null
  // `logits` and keep them for sample().
  virtual void run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
                   KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
                   const LayerStored& layer_stored = {}) = 0;

  // Whether sample() works (a device forward's logits stay on the device).
  virtual bool samples_on_device() const { return false; }
  // The tokens of the last run's logit rows, one DeviceSampling each.
  virtual void sample(std::span<const DeviceSampling> rows, std::span<int32_t> tokens);

  // Device KV only (no-ops on the CPU): copies the rows [pos0, pos0 + n) of
  // `layer` (every layer when layer < 0) of the sequence with `block_table`
  // from the device to `cache`, or from `cache` to the device. Whole blocks
  // move, so rows [pos0, pos0 + n) must own their blocks from pos0's block on.
  virtual void kv_to_host(int64_t layer, std::span<const int32_t> block_table, int64_t pos0,
                          int64_t n, KvCache& cache);
  // The device pool laid out as `layout` (allocated now, kept for the
  // forward's life); invalid on the CPU.
  virtual DeviceKv device_kv(const KvLayout& layout);
  virtual void kv_from_host(std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                            const KvCache& cache);
};

// Where a forward runs: the CPU (device -1) or CUDA device `device`.
struct ForwardPlacement {
  int device = -1;
  // Tensor parallelism: the instance's ranks (a CPU shard's collectives go
  // through `collective`), and on a GPU their device collective (NCCL) too.
  Collective* collective = nullptr;
  DeviceCollective* device_collective = nullptr;
};

// "cpu" -> -1, "cuda" -> 0, "cuda:N" -> N; throws kInvalidArgument otherwise.
int parse_device(std::string_view device);

// Throws duet::Error (kUnsupported) when a forward cannot run on `device`:
// a CUDA device in a build without the CUDA backend or on a machine without
// that GPU. Cheap, so that commands check it before loading a model.
void require_device(int device);

// The device collective of a tensor-parallel instance whose ranks run on
// GPUs, one per rank (`device` is this rank's): an NCCL communicator of the
// instance's ranks, its id made by the leader and broadcast over `instance`.
// Null for a CPU instance (device < 0) or one of one rank. Collective over
// `instance`: every rank calls it, with its own device, and returns once all
// have joined. Throws as require_device does (every rank alike, for a build
// without CUDA), kInternal when NCCL fails: every rank when the leader
// cannot make the id; a rank whose ncclCommInitRank fails leaves the others
// waiting in theirs (the job ends when it reports its instance failed).
std::unique_ptr<DeviceCollective> join_device_collective(Collective& instance, int device);

// Throws as require_device does.
std::unique_ptr<ModelForward> make_forward(const LlamaModel& model, const cpu::KernelTable& kernels,
                                           cpu::ThreadPool& pool,
                                           const ForwardPlacement& placement);

}  // namespace duet

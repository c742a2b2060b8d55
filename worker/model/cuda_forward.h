// The Llama forward pass on an NVIDIA GPU: the forward plan
// (worker/model/forward_plan.h) run with kernels/cuda/'s ops, the twins of
// CpuForward's, with the weights, the KV cache and every activation in device
// memory. Built only with the CUDA backend (DUET_HAVE_CUDA); plain C++ over
// kernels/cuda/'s plain headers.
//
// Decode steps (one row per sequence, every row sampled, nothing exported) are
// captured as a CUDA graph per batch size on their second occurrence and replayed
// from then on (not for a mixture of experts, whose grouping by expert is the host's); their inputs
// (tokens, positions, block tables) are uploaded to fixed device buffers before the launch.
// Numerics: activations in F32, products with F32 accumulation (F16 inputs on the cuBLAS path), the
// KV cache in F16. Not batch-invariant (the GEMV and cuBLAS paths round differently), so tokens may
// differ from the CPU's, and between batch shapes, where two logits are within
// rounding. Tensor parallelism: a shard (worker/model/tp_shard.h; no element is a
// sum over ranks) and the instance's DeviceCollective (NCCL, one GPU per rank) on
// the compute stream, in the decode graphs too. NCCL needs every rank to capture at
// the same steps: capture or replay depends only on the batch, never on a rank's shapes.
#pragma once

#include <map>
#include <memory>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/weights.h"
#include "worker/model/forward_plan.h"
#include "worker/model/model_forward.h"
#include "worker/parallel/device_collective.h"

namespace duet {

class CudaForward final : public ModelForward {
 public:
  // Uploads the model's weights (a shard's: its own) to CUDA device
  // `device`. Throws kUnsupported without such a GPU, or for heads of other
  // than 64, 128 or 256 dimensions (what the attention kernel runs). The
  // device KV cache takes the layout of the host cache the calls pass
  // (allocated on first use, grown when a larger one comes; a new layout
  // starts empty). `collective`: the instance's ranks on their GPUs when the
  // model is a shard (its rank and size; outlives this object), else null.
  CudaForward(const LlamaModel& model, int device, DeviceCollective* collective = nullptr);
  ~CudaForward() override;

  void run(std::span<const int32_t> tokens, std::span<const ForwardSequence> sequences,
           KvCache& cache, std::span<const int64_t> logit_rows, float* logits,
           const LayerStored& layer_stored = {}) override;
  bool samples_on_device() const override { return true; }
  void sample(std::span<const DeviceSampling> rows, std::span<int32_t> tokens) override;
  void kv_to_host(int64_t layer, std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                  KvCache& cache) override;
  void kv_from_host(std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                    const KvCache& cache) override;
  DeviceKv device_kv(const KvLayout& layout) override;

  cuda::CudaBackend& backend() { return *backend_; }
  // Device bytes of the weights and of the KV cache.
  size_t weight_bytes() const { return weight_bytes_; }
  size_t kv_bytes() const { return kv_.bytes(); }
  // Decode graphs: how many batch sizes are captured, and replays so far.
  int64_t n_graphs() const { return static_cast<int64_t>(graphs_.size()); }
  int64_t graph_launches() const { return graph_launches_; }
  // Off: every step runs its kernels one by one (for the benchmark's comparison).
  void set_use_graphs(bool use) { use_graphs_ = use; }

 private:
  // One layer's weights, named as LlamaLayerWeights names them (the plan
  // reads both alike); an empty bias when the model has none.
  struct Layer {
    cuda::DeviceBuffer attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm, attn_post_norm,
        ffn_post_norm;
    cuda::DeviceWeight wq, wk, wv, wo, w_gate, w_up, w_down;
    // A mixture of experts' (ExpertWeights's twin).
    struct Expert {
      cuda::DeviceWeight gate, up, down;
    };
    cuda::DeviceWeight router;
    std::vector<Expert> experts;
  };
  class Ops;  // the plan's ops on this GPU (cuda_forward.cpp)

  // The plan on the staged step, its kernels queued on the stream.
  void compute(const LayerStored& layer_stored);
  void reserve(int64_t n_rows, int64_t n_out);
  // Lays the device cache out as the host cache `layout` (see the constructor).
  void use_layout(const KvLayout& layout);
  // Copies whole blocks of rows [pos0, pos0 + n) between the device cache and
  // the host one, in runs of consecutive block ids.
  void copy_blocks(int64_t layer, std::span<const int32_t> block_table, int64_t pos0, int64_t n,
                   KvElement* host, bool to_host);

  const LlamaModel& model_;
  DeviceCollective* const collective_;  // null for a whole model
  std::unique_ptr<cuda::CudaBackend> backend_;
  KvLayout layout_;
  cuda::DeviceBuffer kv_;
  cuda::DeviceWeight token_embd_, output_;
  cuda::DeviceBuffer output_norm_, rope_freqs_;
  std::vector<Layer> layers_;
  size_t weight_bytes_ = 0;

  ForwardPlan plan_;
  // The plan's named tensors sized for capacity_ rows and out_capacity_ logit
  // rows (ForwardPlan::floats), and the logits (out_capacity_, n_vocab).
  int64_t capacity_ = 0, out_capacity_ = 0;
  ForwardTensors<cuda::DeviceBuffer> tensors_;
  cuda::DeviceBuffer logits_;
  // Step inputs: tokens (n), positions (n), logit rows (n_out), staged in
  // pinned memory and uploaded in one copy.
  cuda::PinnedBuffer inputs_host_;
  cuda::DeviceBuffer inputs_;
  cuda::AttentionBatch batch_;
  cuda::PinnedBuffer sampling_host_;
  cuda::DeviceBuffer sampling_, sampled_;
  // A mixture of experts': the router's picks on the device and on the host, and an expert's
  // rows or slots (capacity_ * n_experts_used each).
  cuda::DeviceBuffer picked_, expert_index_;
  std::vector<int32_t> picked_host_;
  int64_t last_n_out_ = 0;

  // Decode graphs by batch size, and the buffers they were captured with.
  bool use_graphs_ = true;
  std::map<int64_t, cuda::Graph> graphs_;
  std::map<int64_t, int> seen_;  // decode steps run per batch size (capture on the second)
  const void* graph_batch_storage_ = nullptr;
  int64_t graph_scratch_generation_ = 0;
  int64_t graph_launches_ = 0;
};

}  // namespace duet
